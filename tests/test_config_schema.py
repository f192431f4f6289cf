"""The runner's config vocabulary: every algorithm has a schema, configs validate, typos and
wrong types are refused with a suggestion naming the key (issue 13, item 1)."""

import dataclasses
import pathlib
import re

import jax
import pytest

from dpsco_jax.config import schema as cs
from dpsco_jax import runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted([*(ROOT / "configs").glob("*.yaml"),
                  *(ROOT / "experiments" / "configs_eval").glob("*.yaml")])


@pytest.fixture(scope="module")
def registry():
  return runner.registry()


def test_every_registered_algorithm_and_problem_has_a_schema(registry):
  """Algorithms name their schema where they register (tests/test_registry.py); problems are
  mapped in config_families.PROBLEM_SCHEMAS."""
  algorithms, problems = registry
  assert set(algorithms) == set(cs.ALGORITHM_SCHEMAS)
  assert set(problems) == set(cs.PROBLEM_SCHEMAS)


def test_schemas_are_frozen_documented_and_describable():
  for schema in {*cs.ALGORITHM_SCHEMAS.values(), *cs.PROBLEM_SCHEMAS.values()}:
    assert dataclasses.is_dataclass(schema) and schema.__dataclass_params__.frozen, schema
    for f in dataclasses.fields(schema):
      assert f.metadata.get("doc"), f"{schema.__name__}.{f.name} has no doc"
  for alg in cs.ALGORITHM_SCHEMAS:
    text = cs.describe(alg, "logistic")  # every annotation is one the validator reads
    assert "epsilon" in text or alg in ("nonprivate_sgd", "minibatch_sgd", "resque_parallel_sco",
                                        "nonprivate_penalty")


def test_every_key_a_driver_reads_is_in_a_schema():
  """Static check: a key added to a driver (cfg.get / cfg[...] / cfg_get / _cfg / "k" in cfg)
  without a schema entry fails here. A driver that reads its typed config (``Schema.of``,
  ``cfg.name``) is checked by the instance itself (an undeclared name raises when read);
  those reads count only towards the non-vacuity bound
  (``cfg`` also names other config objects in those files, e.g. resque's ERM schedule)."""
  patterns = [r'\bcfg\.get\(\s*"(\w+)"', r'\bcfg\[\s*"(\w+)"\s*\]',
              r'\b(?:cfg_get|_cfg)\(\s*cfg,\s*"(\w+)"', r'"(\w+)"\s+in\s+cfg\b']
  read, view_reads = set(), set()
  for path in [*(ROOT / "dpsco_jax" / "algorithms").rglob("*.py"),
               *(ROOT / "dpsco_jax" / "problems").rglob("*.py")]:
    src = path.read_text()
    for p in patterns:
      read.update(re.findall(p, src))
    read.update(re.findall(r'(?<![.\w])get\("(\w+)"', src))  # a local get(name, default)
    if re.search(r"config_view|\.of\(cfg\)", src):
      view_reads.update(re.findall(r'\bcfg\.([A-Za-z]\w*)\b(?!\s*\()', src))
  from dpsco_jax.problems import PROBLEM_KEYS
  read.update(PROBLEM_KEYS)
  known = {f.name for s in {*cs.ALGORITHM_SCHEMAS.values(), *cs.PROBLEM_SCHEMAS.values(),
                            cs.RunnerKeys} for f in dataclasses.fields(s)}
  assert len(read | (view_reads & known)) > 60
  assert read <= known, f"read by a driver but in no schema: {sorted(read - known)}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_validates(path, registry):
  algorithms, problems = registry
  runs = runner.expand(runner.load_config(str(path)))
  assert runs
  for cfg in runs:
    runner._checked(cfg, algorithms, problems)


DPSGD = {"algorithm": "dp_sgd_user", "problem": "logistic", "n_users": 100, "m": 2, "d": 3,
         "epsilon": 1.0, "delta": 1e-5}
SRGD = {"algorithm": "accelerated_dp_srgd", "problem": "least_squares", "n_users": 100, "m": 1,
        "d": 3, "epsilon": 1.0, "delta": 1e-6}
FILTER = {"algorithm": "user_level_accelerated_erm", "problem": "logistic", "n_users": 100,
          "m": 4, "d": 3, "epsilon": 1.0, "delta": 1e-6}
PHASED = dict(FILTER, algorithm="user_level_phased_sgd")
BILEVEL = {"algorithm": "dp_bilevel", "problem": "ridge_tuning", "epsilon": 1.0, "delta": 1e-6}
PENALTY = {"algorithm": "nonprivate_penalty", "problem": "ridge_tuning"}
MINIBATCH = {"algorithm": "minibatch_sgd", "problem": "absolute", "n_users": 10, "m": 1, "d": 2}
LOCGD = {"algorithm": "dp_loc_gd", "problem": "logistic", "n_users": 10, "m": 1, "d": 2,
         "epsilon": 1.0, "delta": 1e-6, "mu": 0.1}

# (config, retired name, the vocabulary's name for that algorithm): issue 13's one vocabulary
RETIRED_CASES = [
    (DPSGD, "clip", "clip_norm"), (DPSGD, "lr", "learning_rate"), (DPSGD, "eta", "learning_rate"),
    (DPSGD, "batch_users", "batch_size"), (DPSGD, "batch", "batch_size"),
    (DPSGD, "steps", "num_steps"), (DPSGD, "T", "num_steps"), (DPSGD, "adjacency", "relation"),
    (SRGD, "clip", "clip_norm"), (SRGD, "lr", "learning_rate"), (SRGD, "steps", "num_steps"),
    (SRGD, "batch_users", "batch_size"), (SRGD, "adjacency", "relation"),
    (FILTER, "clip", "clip_norm"), (FILTER, "batch_users", "batch_size"),
    (PHASED, "eta", "learning_rate"),
    (MINIBATCH, "lr", "learning_rate"), (MINIBATCH, "batch", "batch_size"),
    (MINIBATCH, "steps", "num_steps"),
    (LOCGD, "steps", "num_steps"),
    (BILEVEL, "eta", "learning_rate"), (BILEVEL, "T", "num_steps"),
    (BILEVEL, "clip_in", "inner_clip_norm"), (BILEVEL, "clip_out", "outer_clip_norm"),
    (BILEVEL, "clip_in_lam", "inner_clip_norm_lam"), (BILEVEL, "batch_in", "inner_batch_size"),
    (BILEVEL, "batch_out", "outer_batch_size"), (BILEVEL, "inner_steps", "inner_num_steps"),
    (BILEVEL, "clip", "clip_norm"),  # the ridge_tuning problem's clip of its data terms
    (PENALTY, "eta", "learning_rate"), (PENALTY, "T", "num_steps"),
    (DPSGD, "eps", "epsilon"),
]


@pytest.mark.parametrize("base,old,new", RETIRED_CASES,
                         ids=lambda x: x["algorithm"] if isinstance(x, dict) else x)
def test_retired_names_are_refused_with_the_new_name(base, old, new):
  assert new in cs.keys_of(base["algorithm"], base["problem"])
  with pytest.raises(cs.ConfigError,
                     match=rf"unknown key '{old}' .*\(did you mean '{new}'\?\)"):
    cs.validate({**base, old: 1})


def test_every_retired_name_is_tested_and_in_no_schema():
  assert cs.RETIRED == {old for _, old, _ in RETIRED_CASES}
  for schema in {*cs.ALGORITHM_SCHEMAS.values(), *cs.PROBLEM_SCHEMAS.values(), cs.RunnerKeys}:
    names = {f.name for f in dataclasses.fields(schema)}
    assert not names & cs.RETIRED, (schema.__name__, names & cs.RETIRED)
  for group in cs.ALIASES:  # the vocabulary's name is read by some schema
    assert any(group[0] in {f.name for f in dataclasses.fields(s)}
               for s in {*cs.ALGORITHM_SCHEMAS.values(), *cs.PROBLEM_SCHEMAS.values()}), group


PRIVATE = sorted(n for n, s in cs.ALGORITHM_SCHEMAS.items()
                 if "delta" in {f.name for f in dataclasses.fields(s)})


def _minimal(algorithm: str) -> dict:
  """A valid config of ``algorithm`` except for ``delta``: every required key filled in."""
  problem = ("ridge_tuning" if algorithm.startswith("dp_bilevel") else "l2_logistic"
             if "output_pert" in algorithm else "logistic")
  cfg = {"algorithm": algorithm, "problem": problem}
  for name, spec in cs.keys_of(algorithm, problem).items():
    if (spec.required or name == "epsilon") and name not in cfg and name != "delta":
      cfg[name] = 1.0 if name == "epsilon" else 0.5 if spec.type is float else 20
  return cfg


def test_every_private_algorithm_has_a_required_delta():
  assert len(PRIVATE) >= 20, PRIVATE
  for name in PRIVATE:
    schema = cs.ALGORITHM_SCHEMAS[name]
    field = {f.name: f for f in dataclasses.fields(schema)}["delta"]
    # paper 003's drivers also run non-private (no epsilon, no noise_multiplier): there delta
    # is required for every private run (private_requires), and a typed config checks it
    assert field.metadata["required"] or "delta" in schema.private_requires, name


@pytest.mark.parametrize("algorithm", PRIVATE)
def test_a_missing_delta_is_refused_by_validation_naming_it(algorithm):
  cfg = _minimal(algorithm)
  with pytest.raises(cs.ConfigError, match=rf"algorithm '{algorithm}' .* needs delta"):
    cs.validate(cfg)
  assert cs.validate(dict(cfg, delta=1e-6))["delta"] == 1e-6


@pytest.mark.parametrize("base,extra,match", [
    (DPSGD, {"epsilonn": 1.0}, r"unknown key 'epsilonn'.*did you mean 'epsilon'\?"),
    (DPSGD, {"deltaa": 1e-6}, r"unknown key 'deltaa'.*did you mean 'delta'\?"),
    (DPSGD, {"lr": 0.1}, r"unknown key 'lr' for algorithm 'dp_sgd_user' on problem 'logistic' "
                         r"\(did you mean 'learning_rate'\?\)"),
    (SRGD, {"relation": "zero_out", "adjacency": "replace_one"},
     r"unknown key 'adjacency'.*did you mean 'relation'\?"),
    ({k: v for k, v in SRGD.items() if k != "delta"}, {}, r"needs delta"),
    ({k: v for k, v in DPSGD.items() if k != "delta"}, {}, r"needs delta"),
    (DPSGD, {"epsilon": "1.0"}, r"epsilon must be a number, got '1.0' \(str\); write it "
                                r"without quotes: epsilon: 1.0"),
    (DPSGD, {"epsilon": True}, r"epsilon must be a number, got True \(bool\); YAML reads yes"),
    (DPSGD, {"num_steps": "3"}, r"num_steps must be an integer, got '3' \(str\); write it "
                                r"without"),
    (DPSGD, {"seed": 1.7}, r"seed must be an integer, got 1.7 \(float\); write a whole number"),
    (DPSGD, {"debug": "false"}, r"debug must be true or false"),
    (DPSGD, {"sampling": "poison"}, r"sampling must be one of 'poisson', 'fixed', 'full'"),
    (DPSGD, {"epsilon": None}, r"needs one of epsilon, noise_multiplier"),
    (FILTER, {"epsilon": None}, r"epsilon must be a number, got None.*omit the key"),
    (FILTER, {"privacy_noise": 0.0}, r"privacy_noise must be true or false, got 0.0"),
    (FILTER, {"noise": False}, r"unknown key 'noise'"),  # logistic has no label noise
    (dict(FILTER, algorithm="user_level_phased_sgd"), {"lam": 1.0}, r"unknown key 'lam'"),
    (BILEVEL, {"shares": 0.5},
     r"shares must be a list of 3 numbers, got 0.5.*list inside a list"),
    ({"algorithm": "resque_private_sco", "problem": "absolute", "n_users": 10, "m": 1, "d": 2,
      "delta": 1e-5}, {}, r"needs epsilon"),
    (dict(LOCGD, algorithm="dp_loc_sgd"), {}, r"needs batch_size"),
    ({"algorithm": "nonprivate_sgd", "problem": "logistic", "n_users": 10, "m": 1, "d": 2},
     {"epsilon": 1.0}, r"unknown key 'epsilon' for algorithm 'nonprivate_sgd'"),
    (DPSGD, {"zzz_unrelated": 1}, r"unknown key 'zzz_unrelated'[^(]*; it reads: "),
    (dict(DPSGD, problem="logistc"), {}, r"unknown problem 'logistc' \(did you mean 'logistic'"),
])
def test_bad_configs_raise_naming_the_key(base, extra, match):
  with pytest.raises(cs.ConfigError, match=match):
    cs.validate({**base, **extra})


@pytest.mark.parametrize("cfg", [
    DPSGD, dict(DPSGD, epsilon=None, noise_multiplier=1.0),
    dict(SRGD, epsilon=None, noise_multiplier=0.0),
    dict(SRGD, relation="replace_one"), dict(FILTER, privacy_noise=False),
    dict(FILTER, problem="least_squares", noise=0.0),
    dict(FILTER, clip_norm=True), dict(FILTER, clip_norm=2.0),
    dict(BILEVEL, shares=[0.5, 0.3, 0.2], outer_noise="auto", omega_bounds=[0.1, 2.0],
         inner_clip_norm=1.0, outer_clip_norm=2.0, inner_num_steps=10, clip_norm=3.0),
    dict(PENALTY, learning_rate=0.5, num_steps=3),
])
def test_good_configs_pass(cfg):
  assert cs.validate(cfg)["algorithm"] == cfg["algorithm"]


def test_integral_floats_become_ints_and_typed_view_is_frozen():
  out = cs.validate(dict(DPSGD, n_users=1e3, num_steps=20.0, seed=3.0))
  assert out["n_users"] == 1000 and type(out["n_users"]) is int
  assert type(out["num_steps"]) is int
  alg, prob = cs.typed(dict(DPSGD, clip_norm=0.5))
  assert (alg.clip_norm, alg.epsilon, prob.n_users) == (0.5, 1.0, 100)
  with pytest.raises(dataclasses.FrozenInstanceError):
    alg.clip_norm = 2.0


def test_a_bad_run_anywhere_in_a_sweep_stops_it_before_any_run(monkeypatch):
  ran = []
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: ran.append(1))
  config = {"problem": "logistic", "n_users": 50, "m": 2, "d": 2, "seed": [0, 1],
            "experiments": [{"algorithm": "nonprivate_sgd"},
                            {"algorithm": "dp_sgd_user", "epsilon": 1.0, "deltaa": 1e-5}]}
  with pytest.raises(cs.ConfigError, match="did you mean 'delta'"):
    runner.run_config(config, progress=False)
  assert ran == []


def test_load_config_reads_scientific_notation_without_a_dot_as_float(tmp_path):
  p = tmp_path / "c.yaml"
  # (1_000 is refused since issue 23: tests/test_bad_input_fuzz.py)
  p.write_text("a: 1e-5\nb: 2E+3\nc: -1e5\nd: 1.0e-5\ne: '1e-5'\nf: 1000\ng: 1e\nh: yes\n"
               "i: 7\n")
  c = runner.load_config(str(p))
  assert c["a"] == 1e-5 and isinstance(c["a"], float)
  assert c["b"] == 2000.0 and c["c"] == -1e5 and c["d"] == 1e-5
  assert c["e"] == "1e-5" and c["f"] == 1000 and c["g"] == "1e" and c["h"] is True
  assert c["i"] == 7 and type(c["i"]) is int
  import yaml
  assert yaml.safe_load("a: 1e-5")["a"] == "1e-5"  # the global loader is left alone


def test_cli_prints_one_line_and_exits_2(tmp_path, dpsco):
  cfg = tmp_path / "typo.yaml"
  cfg.write_text("problem: logistic\nn_users: 50\nm: 2\nd: 2\nalgorithm: dp_sgd_user\n"
                 "epsilonn: 1\ndelta: 1e-5\n")
  proc = dpsco("run", str(cfg), "--quiet")
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("dpsco: error: unknown key 'epsilonn'")
  assert "did you mean 'epsilon'" in lines[0] and proc.stdout == ""


@pytest.fixture(scope="module")
def small_problems(registry):
  _, problems = registry
  sizes = {"n_users": 20, "m": 2, "d": 2, "n_eval": 500, "n_train": 20, "n_val": 20}
  return {name: problems[name]({**sizes, "problem": name}, jax.random.key(0))
          for name in ("logistic", "l2_logistic", "ridge_tuning")}


@pytest.mark.parametrize("algorithm", PRIVATE)
def test_every_private_driver_refuses_a_missing_delta(algorithm, registry, small_problems):
  """Planned directly (no runner validation), every private algorithm refuses a config
  without delta with a ConfigError naming it, before anything runs (no silent 1/n^2 or
  1e-6): its typed config's, or ``required_delta``'s."""
  from dpsco_jax import api
  cfg = _minimal(algorithm)
  cfg.update({"n_users": 20, "m": 2, "d": 2, "batch_size": 5} if "batch_size" in cfg else
             {"n_users": 20, "m": 2, "d": 2})
  schema = api.algorithms()[algorithm].config
  with pytest.raises(cs.ConfigError, match=r"^delta is required"):
    api.plan_problem(algorithm, schema.of(cfg), small_problems[cfg["problem"]])
