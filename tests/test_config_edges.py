"""Config edges (issue 46, "Smaller"): every top-level key of a YAML config, misplaced or of the
wrong type, is one ConfigError naming it before anything runs (never a TypeError, KeyError or
AttributeError, never silently dropped); a Plan runs only on data of its spec's shapes and only
as it was planned."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import dpsco_jax
from dpsco_jax import runner
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.data import UserData

PROBLEM = {"name": "least_squares", "n_users": 16, "m": 1, "d": 2}
ALGORITHM = {"name": "dp_sgd_user", "epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0,
             "num_steps": 2, "batch_size": 4}
PHASES = {"tuning_seeds": [0], "eval_seeds": [1], "select": {"over": ["learning_rate"]}}
#: every top-level key a config may hold (sections, runner keys, the row label)
TOP_LEVEL = ("problem", "data", "algorithm", "experiments", "compare", "select", "tuning_seeds",
             "eval_seeds", "batch_seeds", "devices", "name", "description", "seed", "label",
             "debug")


@pytest.fixture
def refuse(tmp_path, monkeypatch):
  """``refuse(config)``: the ConfigError that ``dpsco run`` raises on ``config`` (as YAML),
  before any run starts."""
  def ran(*args, **kwargs):
    raise AssertionError("a run started: the config was accepted")
  monkeypatch.setattr(runner, "execute", ran)

  def refuse(config: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as err:
      runner.main_run(str(path), progress=False)
    return str(err.value)
  return refuse


def _base(**changes) -> dict:
  return {"problem": dict(PROBLEM), "algorithm": dict(ALGORITHM), **changes}


def test_every_top_level_key_is_covered():
  """The fuzz below names every key the runner reads at the top level."""
  from dpsco_jax.runner.config import RUNNER_ONLY, SECTIONS
  from dpsco_jax.config.families import RunnerKeys
  known = set(RUNNER_ONLY) | set(SECTIONS) | {f.name for f in dataclasses.fields(RunnerKeys)}
  assert known | {"label"} == set(TOP_LEVEL)


# ------------------------------------------------------------------------------- misplaced


@pytest.mark.parametrize("section", ["algorithm", "problem"])
@pytest.mark.parametrize("key", [k for k in TOP_LEVEL if k not in ("problem", "data",
                                                                   "algorithm", "name")])
def test_a_top_level_key_inside_a_section_names_it(refuse, section, key):
  """``label`` (and the runner's blocks) inside a section were flattened and dropped: the run
  went on without them."""
  value = {"compare": {"baseline": "dp_sgd_user"}, "select": {"over": ["epsilon"]},
           "experiments": [{}], "label": "dp", "description": "x"}.get(key, 1)
  config = _base()
  config[section] = {**config[section], key: value}
  msg = refuse(config)
  assert msg.startswith(f"{section}.{key}: '{key}' "), msg
  assert f"not a key of the {section} section" in msg or "runner key" in msg, msg


def test_a_label_inside_an_experiments_entrys_section_says_where_it_belongs(refuse):
  msg = refuse({"problem": PROBLEM, "experiments": [{"algorithm": {**ALGORITHM,
                                                                   "label": "dp"}}]})
  assert msg == ("experiments[0].algorithm.label: 'label' names a row, not a key of the "
                 "algorithm section: write label: beside algorithm: (at the top level or in "
                 "its experiments entry)")


@pytest.mark.parametrize("section,key,value,match", [
    ("algorithm", "n_users", 16, r"algorithm.n_users: 'n_users' is given twice"),
    ("algorithm", "radius", 1.0, r"algorithm.radius: 'radius' is a key of the problem"),
    ("problem", "sampling", "poisson", r"problem.sampling: 'sampling' is a key of the algorithm"),
    ("problem", "debug", True, r"problem.debug: 'debug' is a runner key"),
    ("compare", "epsilon", 1.0, r"compare: unknown key\(s\) epsilon"),
    ("select", "epsilon", 1.0, r"select: unknown key\(s\) epsilon"),
])
def test_a_key_in_another_section_names_the_key(refuse, section, key, value, match):
  config = _base(compare={"baseline": "dp_sgd_user"}, **PHASES)
  config["algorithm"]["learning_rate"] = [0.1, 0.2]
  config[section] = {**config[section], key: value}
  import re
  assert re.search(match, refuse(config))


# ------------------------------------------------------------------------------- wrong types

WRONG = [5, 1.5, True, "x", [1], {"a": 1}, None, [], {}, 0, False, ""]


def _accepted(key: str, value) -> bool:
  """The values of :data:`WRONG` that are a right spelling of ``key`` (the fuzz skips those):
  null is an absent key where the key is optional, one seed is a list of one."""
  if value is None and key in ("name", "description", "compare", "tuning_seeds", "eval_seeds",
                               "devices"):
    return True
  if isinstance(value, bool):
    return key in ("batch_seeds", "debug")
  if key in ("name", "description", "label"):
    return isinstance(value, str)
  return key in ("seed", "eval_seeds") and value in (5, 0, [1])


@pytest.mark.parametrize("key", TOP_LEVEL)
def test_a_wrong_typed_top_level_value_is_one_config_error_naming_it(refuse, key):
  for value in WRONG:
    if _accepted(key, value):
      continue
    config = _base(**{key: value})
    if key == "data":
      config.pop("problem")
    msg = refuse(config)
    assert key in msg, (key, value, msg)


@pytest.mark.parametrize("value", [5, 1.5, True, None, 0, False, "", "x", {}, [], {"a": 1}])
@pytest.mark.parametrize("phases", [False, True], ids=["seed", "tuning"])
def test_experiments_must_be_a_list_of_mappings(refuse, value, phases):
  """``experiments: 5`` raised ``TypeError: 'int' object is not iterable`` (in the tuning
  parser with tuning seeds); ``experiments: []`` / ``null`` / ``0`` ran the top level alone."""
  config = _base(experiments=value, **(PHASES if phases else {}))
  assert refuse(config) == (f"experiments must be a non-empty list of mappings (one per group "
                            f"of rows), got {value!r} ({type(value).__name__})")


def test_an_experiments_entry_that_is_not_a_mapping_is_named_by_index(refuse):
  assert refuse(_base(experiments=[{"label": "a"}, 3])) == (
      "experiments[1] must be a mapping (an experiments entry), got 3 (int)")


@pytest.mark.parametrize("section,key,value,match", [
    ("algorithm", "epsilon", "1.0", "epsilon must be a number"),
    ("algorithm", "epsilon", True, "epsilon must be a number"),
    ("algorithm", "num_steps", {"a": 1}, "num_steps must be an integer"),
    ("algorithm", "num_steps", "2", "num_steps must be an integer"),
    ("problem", "n_users", "16", "n_users must be an integer"),
    ("problem", "n_users", 1.5, "n_users must be an integer"),
    ("problem", "noise", False, "noise must be a number"),
    ("compare", "resamples", "100", "compare.resamples must be an integer"),
    ("compare", "metric", 5, "compare.metric must be a record field name"),
    ("select", "over", 5, "select.over must name the swept field"),
    ("select", "rule", True, "select.rule must be one of"),
])
def test_a_wrong_typed_value_inside_a_section_names_its_key(refuse, section, key, value, match):
  config = _base(compare={"baseline": "dp_sgd_user"}, **PHASES)
  config["algorithm"]["learning_rate"] = [0.1, 0.2]
  config[section] = {**config[section], key: value}
  assert match in refuse(config)


# ------------------------------------------------------------------------------- plans

D = 3
PARAMS = {"w": jnp.zeros(D)}
CONFIG = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
          "num_steps": 3, "batch_size": 8, "relation": "zero_out", "sampling": "fixed"}


def _data(width: int = D, dtype=np.float32) -> UserData:
  rng = np.random.default_rng(0)
  users = np.repeat(np.arange(16), 2)
  x = rng.normal(size=(users.size, width)).astype(dtype)
  return UserData.from_arrays({"x": x}, users, max_items_per_user=2)


def loss(params, ex):   # reads the first D features: runs on wider items too
  return jnp.square(jnp.dot(params["w"], ex["x"][:D]) - 1.0)


def _plan(data: UserData):
  return dpsco_jax.plan("dp_sgd_user", CONFIG, data.spec, num_params=D)


@pytest.mark.parametrize("width,dtype,got", [(D + 1, np.float32, "{['x']: (4,) float32}"),
                                             (D, np.float64, "{['x']: (3,) float64}")])
def test_run_refuses_data_of_other_item_shapes_naming_both(width, dtype, got):
  data = _data()
  p = _plan(data)
  with pytest.raises(ValueError) as err:
    dpsco_jax.run(p, loss, PARAMS, _data(width, dtype), jax.random.key(0))
  assert str(err.value) == (f"the plan was made for items {{['x']: (3,) float32}}, the data's "
                            f"items are {got}: plan again with its spec")
  # a DataSpec that states no shapes (a declaration of the counts) plans for any items
  declared = dpsco_jax.plan("dp_sgd_user", CONFIG, dpsco_jax.data.DataSpec(16, 2),
                            num_params=D)
  assert declared.spec.item_shapes == ()
  dpsco_jax.api._check_data_for_plan(declared, _data(width, dtype), "the data")


def test_a_plan_changed_after_planning_refuses_to_run():
  data = _data()
  p = _plan(data)
  edited = dataclasses.replace(p, config=dataclasses.replace(p.config, num_steps=300))
  with pytest.raises(ValueError, match="plan was changed after it was planned"):
    dpsco_jax.run(edited, loss, PARAMS, data, jax.random.key(0))
  with pytest.raises(ValueError, match="plan was changed after it was planned"):
    dpsco_jax.run(dataclasses.replace(p, spec=dpsco_jax.data.DataSpec(16, 2)), loss, PARAMS,
                  data, jax.random.key(0))
  p.schedule["num_steps"] = 300   # a mutable field edited in place
  with pytest.raises(ValueError, match="plan was changed after it was planned"):
    dpsco_jax.run(p, loss, PARAMS, data, jax.random.key(0))
  again = _plan(data)   # planned again: runs, and the digest is stable across plannings
  assert again.planned == _plan(data).planned
  assert dpsco_jax.run(again, loss, PARAMS, data, jax.random.key(0)).privacy == again.privacy
