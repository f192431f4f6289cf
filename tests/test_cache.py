"""The one cache (issue 25: compiled code is cached one way, bounded, keyed so that a
neighbouring dataset never reuses another's closure): :mod:`dpsco_jax.cache`."""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import cache
from dpsco_jax.data import UserData
from dpsco_jax.data.user_data import weighted_loss

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dpsco_jax"


def test_every_memoized_factory_goes_through_the_one_bounded_cache():
  offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "cache.py" and re.search(r"lru_cache|functools\.cache\b|@cache\b",
                                                     p.read_text())]
  assert offenders == []
  stats = cache.stats()
  # the compiled loops of the drivers and the loss wrappers are registered, all bounded
  for name in ("dpsco_jax.algorithms.common._compiled_loop",
               "dpsco_jax.data.user_data.weighted_loss",
               "dpsco_jax.algorithms.resque.solvers._alg4_compiled"):
    assert name in stats, sorted(stats)
  assert all(s["maxsize"] is not None and s["maxsize"] >= 1 for s in stats.values())
  with pytest.raises(ValueError, match="maxsize must be a positive int"):
    cache.bounded_cache(None)
  with pytest.raises(ValueError, match="maxsize must be a positive int"):
    cache.bounded_cache(True)



#: Module-level dicts that functions write into but that are not caches, each with why (a
#: name here must still be such a dict: the list cannot go stale silently).
NOT_CACHES = {
    ("algorithms/registration.py", "_REGISTRY"): "the algorithm registry, filled by @register",
    ("algorithms/common.py", "_PROGRESS"): "the progress callbacks of the runs in flight, "
                                           "each removed when its run ends",
    ("flax/fast_clip_taps.py", "_TAPPED"): "one tapping subclass per class of the finite "
                                           "KINDS (classes only: no data, no closure)",
}
_DICT_MAKERS = {"dict", "OrderedDict", "defaultdict"}
_DICT_WRITERS = {"setdefault", "update", "__setitem__"}


def _is_dict(value: ast.AST | None) -> bool:
  if isinstance(value, (ast.Dict, ast.DictComp)):
    return True
  fn = value.func if isinstance(value, ast.Call) else None
  return (isinstance(fn, ast.Name) and fn.id in _DICT_MAKERS
          or isinstance(fn, ast.Attribute) and fn.attr in _DICT_MAKERS)


def _module_dicts(tree: ast.Module) -> set[str]:
  """Names a module binds at its top level to a dict / OrderedDict / defaultdict."""
  out = set()
  for node in tree.body:
    if isinstance(node, ast.Assign) and _is_dict(node.value):
      out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
          and _is_dict(node.value)):
      out.add(node.target.id)
  return out


def _written_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
  """Those of ``names`` that some function writes into (``d[k] = v``, ``d[k] += v``,
  ``d.setdefault`` / ``d.update``): a memo, where a constant table is never written."""
  hit = set()
  for fn in ast.walk(tree):
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    for node in ast.walk(fn):
      targets = (node.targets if isinstance(node, ast.Assign)
                 else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
      hit |= {t.value.id for t in targets if isinstance(t, ast.Subscript)
              and isinstance(t.value, ast.Name) and t.value.id in names}
      call = node.func if isinstance(node, ast.Call) else None
      if (isinstance(call, ast.Attribute) and call.attr in _DICT_WRITERS
          and isinstance(call.value, ast.Name) and call.value.id in names):
        hit.add(call.value.id)
  return hit


def module_dict_caches(package: pathlib.Path) -> set[tuple[str, str]]:
  """``(module path, name)`` of every module-level dict written into inside a function,
  outside :mod:`dpsco_jax.cache` (whose registry of caches is the one allowed)."""
  found = set()
  for path in package.rglob("*.py"):
    if path.name == "cache.py" and path.parent == package:
      continue
    tree = ast.parse(path.read_text())
    rel = str(path.relative_to(package))
    found |= {(rel, n) for n in _written_in_functions(tree, _module_dicts(tree))}
  return found


def test_no_module_level_dict_is_a_cache_outside_the_one_cache(tmp_path):
  """Every memo goes through :func:`dpsco_jax.cache.bounded_cache` (bounded, cleared by
  ``cache.clear``): a module-level dict that a function writes into is a second, unbounded
  cache that ``cache.stats`` and ``cache.clear`` do not see (srgd's ``_RUNNERS`` was one)."""
  found = module_dict_caches(PACKAGE)
  assert found - set(NOT_CACHES) == set(), sorted(found - set(NOT_CACHES))
  assert set(NOT_CACHES) <= found, sorted(set(NOT_CACHES) - found)   # no stale exemption
  # the scan's power: the shape srgd/driver.py had (an annotated dict memo) is found, and a
  # constant table read by functions is not
  (tmp_path / "memo.py").write_text(
      "_RUNNERS: dict = {}\nTABLE = dict(a=1)\n\n"
      "def make(key):\n  if key in _RUNNERS:\n    return _RUNNERS[key]\n"
      "  _RUNNERS[key] = TABLE[\"a\"]\n  return _RUNNERS[key]\n")
  assert module_dict_caches(tmp_path) == {("memo.py", "_RUNNERS")}
  assert "dpsco_jax.algorithms.srgd.driver._compiled_runner" in cache.stats()

def test_a_sweep_of_fresh_closures_stays_within_the_bound_and_clear_empties_it():
  bound = cache.stats()["dpsco_jax.data.user_data.weighted_loss"]["maxsize"]
  for i in range(bound + 25):  # a fresh loss closure per "run", as a notebook sweep makes
    weighted_loss(lambda p, ex, i=i: i * jnp.sum(p * ex["x"]))
  assert cache.stats()["dpsco_jax.data.user_data.weighted_loss"]["size"] == bound
  cache.clear()
  assert all(s["size"] == 0 for s in cache.stats().values())


def test_data_is_an_argument_of_the_compiled_program_not_part_of_its_key():
  """Two neighbouring datasets through one compiled loop: the second run reuses the program
  (a cache hit, no new entry) and still sees its own data (different params)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(120, 3)).astype(np.float32)
  y = (rng.random(120) < 0.5).astype(np.float32)
  ids = np.repeat(np.arange(40), 3)

  def loss(p, ex):
    z = ex["x"] @ p["w"]
    return jax.nn.softplus(z) - ex["y"] * z

  cfg = {"epsilon": 1e6, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
         "num_steps": 5, "sampling": "full", "relation": "zero_out"}
  params = {"w": jnp.zeros(3)}
  a = UserData.from_arrays({"x": x, "y": y}, ids)
  y2 = y.copy()
  y2[:3] = 1.0 - y2[:3]                       # user 0 replaced: a neighbouring dataset
  b = UserData.from_arrays({"x": x, "y": y2}, ids)
  ra = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, a, jax.random.key(0))
  before = cache.stats()["dpsco_jax.algorithms.common._compiled_loop"]
  rb = dpsco_jax.fit("dp_sgd_user", cfg, loss, params, b, jax.random.key(0))
  after = cache.stats()["dpsco_jax.algorithms.common._compiled_loop"]
  assert after["misses"] == before["misses"] and after["hits"] > before["hits"]
  assert not np.allclose(np.asarray(ra.params["w"]), np.asarray(rb.params["w"]))


def test_dp_sgd_calibration_is_memoized_on_the_public_schedule():
  """A second plan of one config reuses its calibrated z (a hit, the same z bit for bit); a
  schedule that differs in a public number (one row more under replace-one moves q) does not."""
  from dpsco_jax import api
  from dpsco_jax.data import DataSpec
  from dpsco_jax.privacy import calibrate
  # DP-SGD calibrates through the calibrator's memo, keyed on its public schedule
  name = "dpsco_jax.privacy.calibrate._keyed_calibration"
  calibrate._keyed_calibration.cache_clear()
  cfg = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
         "num_steps": 4, "batch_size": 10, "sampling": "poisson", "relation": "replace_one"}
  first = api.plan("dp_sgd_user", cfg, DataSpec(100, 1), num_params=3)
  assert cache.stats()[name] == {"hits": 0, "misses": 1, "size": 1, "maxsize": 64}
  again = api.plan("dp_sgd_user", cfg, DataSpec(100, 1), num_params=3)
  assert cache.stats()[name]["hits"] == 1 and again.noise_multiplier == first.noise_multiplier
  other = api.plan("dp_sgd_user", cfg, DataSpec(101, 1), num_params=3)
  assert cache.stats()[name]["misses"] == 2
  assert other.noise_multiplier != first.noise_multiplier


def test_poisson_sgd_calibration_is_the_calibrators_and_memoized():
  """``calibrate_poisson_sgd`` (DPTrainer's calibration) is ``calibrate_noise_multiplier`` of
  the same event, bit for bit, and a second call with the same public numbers is a hit."""
  import dp_accounting
  from dpsco_jax.privacy import calibrate_noise_multiplier, calibrate_poisson_sgd
  name = "dpsco_jax.privacy.calibrate.calibrate_poisson_sgd"
  calibrate_poisson_sgd.cache_clear()
  z = calibrate_poisson_sgd(0.1, 6, epsilon=2.0, delta=1e-5)
  direct = calibrate_noise_multiplier(
      lambda s: dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(s)), 6),
      epsilon=2.0, delta=1e-5)
  assert z == direct
  assert calibrate_poisson_sgd(0.1, 6, epsilon=2.0, delta=1e-5) == z
  assert cache.stats()[name]["hits"] == 1
  assert calibrate_poisson_sgd(0.1, 7, epsilon=2.0, delta=1e-5) > z   # one step more
