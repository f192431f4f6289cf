"""Issue 25: sensitivity travels with the stage; the noise std is formed in one place.

Every Gaussian noise stage of a driver is a :class:`~dpsco_jax.privacy.sensitivity.GaussianStage`
(its multiplier and the sensitivity of what it perturbs), and its std is
:func:`~dpsco_jax.privacy.sensitivity.gaussian_noise_std`:

* statically: no module under ``dpsco_jax/algorithms``, ``dpsco_jax/flax``,
  ``dpsco_jax/transforms`` or the package's top level multiplies a noise multiplier by a clip / sensitivity / denominator, or doubles a clip or a
  sensitivity by hand (the replace-one factor is ``gaussian_sensitivity_factor``'s). The same
  check finds the sites the code had before the stages (``BEFORE``), so it is not vacuous;
* behaviourally: for every registered algorithm, under every relation its plan honours
  (add_remove and replace_one among them), the std of each noise stage is the multiplier times
  the stage's declared sensitivity in the accountant's unit, i.e. ``z * s_rel /
  factor(rel)`` for both relations, and the std the plan reports is that stage's. Algorithms
  whose noise is not ``z`` times a sensitivity say why (``NOT_Z_TIMES_SENSITIVITY``).
"""

import ast
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.planners import PLANNED
from dpsco_jax.privacy import gaussian_sensitivity_factor
from dpsco_jax.privacy.sensitivity import (GaussianStage, Sensitivity, clipped_mean_sensitivity,
                                           gaussian_noise_std, noise_multiplier_for_std)
from dpsco_jax.transforms.clipping import aggregation_sensitivity

import test_plan_invariance as tpi

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dpsco_jax"
#: the drivers and plans, the Flax trainer and fast clip, the transforms and the entry points
#: (not ``audit/``: an audit re-derives the std on purpose, independently of the drivers)
SCANNED = sorted([*(ROOT / "algorithms").rglob("*.py"), *(ROOT / "flax").glob("*.py"),
                  *(ROOT / "transforms").glob("*.py"), *ROOT.glob("*.py")])

MULTIPLIER = {"noise_multiplier", "outer_noise_multiplier", "z", "calibrated", "z_out"}
SENSITIVE = ("clip", "sens", "denom")   # clip_norm, sens, sensitivity, denominator (and C, Delta)
ALLOWED_CALLS = {"gaussian_sensitivity_factor"}   # the one place the relation's factor lives


def _names(node: ast.AST) -> set[str]:
  """Identifiers of ``node``: names, and of an attribute only its own name (``cfg.clip_norm``
  is ``clip_norm``, ``c.l0g`` is not ``c``); an allowed call counts as ``<factor>``."""
  if isinstance(node, ast.Call):
    f = node.func
    if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in ALLOWED_CALLS:
      return {"<factor>"}
  if isinstance(node, ast.Name):
    return {node.id}
  if isinstance(node, ast.Attribute):
    return {node.attr} | (set() if isinstance(node.value, ast.Name) else _names(node.value))
  out = set()
  for child in ast.iter_child_nodes(node):
    out |= _names(child)
  return out


def _sensitive(names: set[str]) -> bool:
  return any(n in ("C", "c", "Delta") or n.lower().startswith(SENSITIVE) for n in names)


def _factors(node: ast.AST) -> list[ast.AST]:
  """The operands of a product/quotient chain ``a * b / c * d``."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
    return _factors(node.left) + _factors(node.right)
  return [node]


def std_formations(source: str) -> list[tuple[int, str]]:
  """``(line, text)`` of every product that forms a noise std or a replace-one doubling by
  hand: a noise multiplier times a clip / sensitivity / denominator, or the literal 2 times a
  clip or a sensitivity."""
  tree = ast.parse(source)
  hits = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
      continue
    parts = _factors(node)
    names = [_names(p) for p in parts]
    mult = any(n & MULTIPLIER for n in names)
    two = any(isinstance(p, ast.Constant) and p.value in (2, 2.0) for p in parts)
    sens = any(_sensitive(n - MULTIPLIER) for n in names)
    if (mult or two) and sens:
      hits.append((node.lineno, ast.get_source_segment(source, node)))
  return hits


def _scan(paths) -> dict:
  out = {}
  for path in paths:
    hits = std_formations(path.read_text())
    if hits:
      out[str(path.relative_to(ROOT.parent))] = hits
  return out


#: The std / doubling sites the drivers had before the stages (issue 25's inventory), as
#: source: the check must flag each of them.
BEFORE = {
    "dpsgd plan": "noise_std = z * clip / denominator",
    "srgd plan": "noise_std = z * C / B",
    "srgd plan sens": "sensitivity = gaussian_sensitivity_factor(relation) * C / B + 2 * C / B",
    "srgd privatizer": "std = check_nonnegative(noise_multiplier, 'z') * aggregation_sensitivity("
                       "clip_norm, mode='mean', denominator=batch_size)",
    "DP-Loc-GD": "s = cfg.noise_multiplier * cfg.clip_norm / _denominator(cfg, n)",
    "DP-Loc-GD paper": "sens = 2.0 * cfg.clip_norm / denom",
    "bilevel outer": "s = bcfg.outer_noise_multiplier * bcfg.clip_out / denom",
    "bilevel lemma 2.2": "e = _lemma22_eps(2 * icfg.clip_norm / denom, s, ds)",
    "FILTER": "sigma = calibrated * sens / 2.0",
    "FILTER _noise": "c = sens / 2.0\nsigma = z * c",
    "naive output perturbation": "sigma = z * sens / 2.0",
    "DPTrainer": "self.noise_stddev = self.noise_multiplier * self.sensitivity",
}


@pytest.mark.parametrize("what", sorted(BEFORE))
def test_the_check_flags_every_std_the_drivers_formed_before(what):
  assert std_formations(BEFORE[what]), what


def test_no_driver_forms_a_noise_std_or_doubles_a_sensitivity_by_hand():
  assert len(SCANNED) > 20
  assert _scan(SCANNED) == {}


def test_the_one_place():
  s = clipped_mean_sensitivity(3.0, 7)
  assert gaussian_noise_std(1.3, s) == 1.3 * 3.0 / 7        # the drivers' own arithmetic
  assert s.under("add_remove") == s.under("zero_out") == 3.0 / 7
  assert s.under("replace_one") == 2 * 3.0 / 7
  assert s.value == pytest.approx(aggregation_sensitivity(3.0, mode="mean", denominator=7,
                                                          relation="add_remove"), rel=1e-15)
  assert s.under("replace_one") == pytest.approx(aggregation_sensitivity(
      3.0, mode="mean", denominator=7, relation="replace_one"), rel=1e-15)
  d = Sensitivity.from_replace_one(0.3)          # a paper's replace-one shift Delta
  assert d.under("replace_one") == 0.3 and gaussian_noise_std(2.0, d) == 2.0 * 0.3 / 2.0
  assert noise_multiplier_for_std(gaussian_noise_std(2.5, s), s) == pytest.approx(2.5)
  assert GaussianStage(0.0, s).std == 0.0
  with pytest.raises(TypeError, match="Sensitivity"):
    gaussian_noise_std(1.0, 0.5)                  # a bare number carries no sensitivity
  with pytest.raises(ValueError):
    Sensitivity(-1.0)
  with pytest.raises(ValueError):
    s.under("replace_none")


# ------------------------------------------------------------------------------- behaviour

#: Registered algorithms whose noise is not a multiplier times a declared sensitivity.
NOT_Z_TIMES_SENSITIVITY = {
    "nonprivate_sgd": "no noise",
    "nonprivate_penalty": "no noise (exact inner solves)",
    # DelOutputPert: sigma is the closed-form Gaussian calibration of the chain distance
    # 8 kappa Delta (privacy.discrete_laplace.sigma), one (eps, delta) block per call
    **{n: "closed-form sigma of 8 kappa Delta (privacy.discrete_laplace.sigma)" for n in (
        "sc_output_pert", "sc_erm_output_pert", "sc_sco_output_pert",
        "phased_erm_output_pert", "phased_sco_output_pert")},
    # ReSQue: sigma_i = L eta_i / beta is the paper's schedule; its privacy is Lemma 7's RDP of
    # a high-probability sensitivity (sqrt(1500) b_i eta_i L), not z times a sensitivity
    **{n: "ReSQue schedule sigma_i = L eta_i / beta (Lemma 7 RDP)" for n in (
        "resque_private_sco", "resque_parallel_sco", "minibatch_sgd")},
}
BILEVEL = ("dp_bilevel", "dp_bilevel_minibatch", "dp_bilevel_population")


def stages_of(detail) -> list[GaussianStage]:
  """The noise stages of a planned run (its family's plan object)."""
  if hasattr(detail, "phases") and hasattr(detail, "schedule"):     # FILTER (paper 000)
    return [ph.stage for ph in detail.phases if ph.stage is not None]
  if hasattr(detail, "config") and hasattr(detail.config, "clip_norm"):   # DP-Loc-(S)GD
    from dpsco_jax.algorithms.bilevel.localized_gd_plan import loc_gd_stage
    return [loc_gd_stage(detail.config, detail.n)]
  return [detail.stage]                     # DP-SGD, paper 003, naive output perturbation


def _check_stage(stage: GaussianStage, relation: str):
  z, s = stage.noise_multiplier, stage.sensitivity
  assert isinstance(s, Sensitivity), stage
  assert stage.std == gaussian_noise_std(z, s)
  # the std is z times the declared sensitivity in the accountant's unit, whatever the relation
  for rel in ("add_remove", "replace_one", relation):
    assert stage.std == pytest.approx(z * s.under(rel) / gaussian_sensitivity_factor(rel),
                                      rel=1e-14), (stage, rel)
  assert s.under("replace_one") == pytest.approx(2.0 * s.under("add_remove"), rel=1e-15)


def test_every_registered_algorithm_is_covered():
  covered = set(PLANNED) | set(BILEVEL) | set(NOT_Z_TIMES_SENSITIVITY)
  assert set(algorithms()) <= covered, set(algorithms()) - covered


@pytest.mark.parametrize("name", sorted(set(PLANNED) - set(NOT_Z_TIMES_SENSITIVITY)))
def test_each_stage_std_is_the_multiplier_times_its_declared_sensitivity(name):
  n, m, cfg = tpi.CASES[name]
  relations = set()
  for rel, _, p in tpi._supported(name, cfg, n, m):
    relations.add(rel)
    stages = stages_of(p.detail)
    assert stages, name
    for stage in stages:
      _check_stage(stage, rel)
    assert p.noise_multiplier == stages[0].noise_multiplier
    # what the plan reports (and the driver reads) is the stage's std, bit for bit
    reported = p.schedule.get("noise_std", p.schedule.get("sigma"))
    if reported is None and "phases" in p.schedule:
      reported = p.schedule["phases"][0].get("sigma")
    if reported is not None:
      assert reported == stages[0].std, (name, rel)
  # the planners of DP-SGD and paper 003 honour both add_remove (or zero_out) and replace_one
  if name.startswith("dp_sgd"):
    assert {"add_remove", "replace_one"} <= relations


@pytest.mark.parametrize("name", BILEVEL)
def test_bilevel_stages(name):
  from dpsco_jax.algorithms.bilevel.localized_gd_plan import loc_gd_stage
  from dpsco_jax.algorithms.bilevel.plan import bilevel_config, outer_stage
  import test_bilevel as tb
  prob, _ = tb._quadratic_problem(jnp.float32, n=16)   # x-dependent data: outer noise on
  extra = {"dp_bilevel_minibatch": {"outer_batch_size": 4, "inner_batch_size": 4}}.get(name, {})
  cfg = {"epsilon": 4.0, "delta": 1e-5, "num_steps": 3, "inner_num_steps": 10,
         "inner_rounds": 2, "lam": 5.0, "learning_rate": 0.5, **extra}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bcfg, _ = bilevel_config(prob, cfg)
  n = 16
  stages = [outer_stage(bcfg, n), loc_gd_stage(bcfg.inner_y, n), loc_gd_stage(bcfg.inner_lam, n)]
  assert stages[0].noise_multiplier > 0
  for stage in stages:
    _check_stage(stage, "replace_one")


def test_dp_trainer_stage():
  import test_flax_trainer as tft
  tr = tft._trainer()
  assert isinstance(tr.stage, GaussianStage)
  # the DP-SGD plan's stage (z * C / D in privacy/'s float order), z times the C / D it reports
  assert tr.noise_stddev == tr.stage.std == gaussian_noise_std(
      1.2, clipped_mean_sensitivity(tr.clip_norm, tr.denominator))
  assert tr.noise_stddev == pytest.approx(1.2 * tr.sensitivity, rel=1e-15)
  _check_stage(tr.stage, tr.relation)


def test_the_driver_adds_the_stage_std():
  """The DP-SGD step's released noise has the stage's std (a zero loss: the update is the
  noise alone); under replace-one the same std as under add/remove (the ledger doubles)."""
  from dpsco_jax import api
  import test_api_planners as tap
  cfg = {**tpi.DPSGD, "num_steps": 1, "learning_rate": 1.0, "batch_size": 60,
         "clip_norm": 1.0}
  params = {"w": jnp.zeros(4000)}
  zero = lambda p, ex: 0.0 * jnp.sum(p["w"]) * jnp.sum(ex["x"])
  data = tap._users(120, 2)
  for rel in ("add_remove", "replace_one"):
    c = {**cfg, "relation": rel, **({"n_users": 120} if rel == "add_remove" else {})}
    p = api.plan("dp_sgd_user", {**c, "averaging": "none"}, data.spec, num_params=4000,
                 constants=tpi.CONSTANTS)
    res = api.run(p, zero, params, data, jax.random.key(3))
    got = float(jnp.std(res.params["w"]))
    stage = p.detail.stage
    assert got == pytest.approx(stage.std, rel=0.05), rel     # 4000 draws: ~1.1% std error
    assert stage.std == pytest.approx(p.noise_multiplier * stage.sensitivity.under(
        "add_remove"), rel=1e-15)                            # not 2 z C / D under replace-one


def test_srgd_privatizer_adds_its_plans_std_bit_for_bit(monkeypatch):
  """SRGD's privatizer forms its std from the plan's own stage (``clipped_mean_sensitivity(C,
  B)``), so the std it adds is ``SRGDPlan.noise_std`` exactly. It used to wrap the quotient
  ``C / B`` as a bound over 1, ``z * (C / B)`` against the plan's ``(z * C) / B``: 1 ulp apart
  on some of these draws (the last assertion shows the old form would fail here)."""
  from dpsco_jax.algorithms.srgd import driver as srgd_driver
  from dpsco_jax.privacy.sensitivity import clipped_mean_sensitivity
  seen = []
  monkeypatch.setattr(srgd_driver, "prefix_sum_noise",
                      lambda std, *a, **k: seen.append(std) or optax.identity())
  rng = np.random.default_rng(0)
  old_differs = 0
  for _ in range(200):
    z, c, b = float(rng.uniform(0.3, 5)), float(rng.uniform(0.1, 10)), int(rng.integers(2, 999))
    srgd_driver.srgd_privatizer(clip_norm=c, batch_size=b, noise_multiplier=z, num_steps=4,
                                key=jax.random.key(0))
    assert seen[-1] == GaussianStage(z, clipped_mean_sensitivity(c, b)).std == z * c / b
    old_differs += (z * (c / b)) != seen[-1]
  assert old_differs > 0
