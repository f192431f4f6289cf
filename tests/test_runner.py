"""Runner: sweeps, records, JSON output, CLI."""

import json

import pytest

from dpsco_jax import runner
from dpsco_jax.config.schema import keys_of


def _key(*names: str) -> str:
  """The spelling of one idea that dp_sgd_user reads (config keys are being renamed)."""
  allowed = keys_of("dp_sgd_user", "least_squares")
  return next(n for n in names if n in allowed)


STEPS, BATCH = _key("num_steps", "steps"), _key("batch_size", "batch_users")
CLIP = _key("clip_norm", "clip")

REQUIRED = ("algorithm", "problem", "n_users", "m", "d", "epsilon", "delta", "provenance",
            "excess_risk", "gradient_evaluations", "wall_time_s", "seed")


def test_expand_sweeps_cartesian_product_and_experiments():
  cfg = {"problem": "logistic", "epsilon": [1, 2], "seed": [0, 1, 2],
         "experiments": [{"algorithm": "a"}, {"algorithm": "b", "lr": [0.1, 0.2]}]}
  runs = runner.expand(cfg)
  assert len(runs) == 2 * 3 + 2 * 3 * 2
  assert {r["algorithm"] for r in runs} == {"a", "b"}
  assert runner.swept_fields(cfg) == ["algorithm", "epsilon", "lr"]
  # a single value that differs between experiments entries is swept too
  cfg2 = {"seed": [0, 1], "experiments": [{"problem": "a"}, {"problem": "b"}]}
  assert runner.swept_fields(cfg2) == ["problem"]


def test_cli_runs_config_and_writes_records(tmp_path, dpsco):
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(
      "problem: least_squares\nn_users: 40\nm: 2\nd: 3\nseed: [0, 1]\n"
      f"{STEPS}: 5\n{BATCH}: 10\nexperiments:\n  - {{algorithm: nonprivate_sgd}}\n"
      f"  - {{algorithm: dp_sgd_user, epsilon: 2.0, delta: 1e-5, {CLIP}: 1.0}}\n")
  out = tmp_path / "res.json"
  proc = dpsco("run", cfg, "--out", out, "--quiet")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "excess_risk_mean" in proc.stdout and "dp_sgd_user" in proc.stdout
  records = json.loads(out.read_text())["results"]
  assert len(records) == 4
  for r in records:
    for field in REQUIRED:
      assert field in r, field
  assert all(r["lipschitz"] > 0 and r["smoothness"] == 1.0 and r["radius"] > 0 for r in records)
  dp = [r for r in records if r["algorithm"] == "dp_sgd_user"]
  assert all(r["provenance"] == "accountant" and abs(r["epsilon"] - 2.0) < 1e-2 for r in dp)
  assert {r["seed"] for r in dp} == {0, 1}


def test_unknown_names_raise():
  algorithms, problems = runner.registry()
  assert "dp_sgd_user" in algorithms and "logistic" in problems
  with pytest.raises(ValueError, match="algorithm"):
    runner.run_one({"algorithm": "nope", "problem": "logistic"}, algorithms=algorithms,
                   problems=problems)
  with pytest.raises(ValueError, match="problem"):
    runner.run_one({"algorithm": "dp_sgd_user"}, algorithms=algorithms, problems=problems)


def test_aggregate_and_plot(tmp_path):
  records = [{"algorithm": "a", "target_epsilon": e, "excess_risk": e * (1 + 0.1 * s),
              "epsilon": e, "provenance": "accountant", "gradient_evaluations": 10,
              "wall_time_s": 0.1, "seed": s} for e in (1.0, 2.0) for s in range(3)]
  rows = runner.aggregate(records, ["algorithm", "target_epsilon"])
  assert len(rows) == 2 and all(r["seeds"] == 3 for r in rows)
  row = [r for r in rows if r["target_epsilon"] == 2.0][0]
  assert abs(row["excess_risk_mean"] - 2.2) < 1e-9 and row["excess_risk_std"] > 0
  table = runner.format_table(rows, ["algorithm", "target_epsilon"])
  assert "excess_risk_mean" in table.splitlines()[0]
  pytest.importorskip("matplotlib")
  png = runner.plot(records, "target_epsilon", ["algorithm", "target_epsilon"],
                    str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000 and png.endswith(".png")


def test_registry_lists_every_module_including_localized_gd():
  algorithms, _ = runner.registry()
  assert {"dp_loc_gd", "dp_loc_sgd", "accelerated_dp_srgd", "dp_bilevel"} <= set(algorithms)


@pytest.mark.parametrize("field,value,match", [
    ("epsilon", "1.0", "epsilon must be a number"), ("epsilon", True, "epsilon must be a number"),
    (STEPS, "3", f"{STEPS} must be an integer"), ("seed", 1.7, "seed must be an integer"),
    ("debug", "false", "debug must be true or false")])
def test_strict_types_name_the_field(field, value, match):
  algorithms, problems = runner.registry()
  cfg = {"algorithm": "dp_sgd_user", "problem": "logistic", field: value}
  with pytest.raises(runner.ConfigError, match=match):
    runner.run_one(cfg, algorithms=algorithms, problems=problems)


def test_empty_sweep_and_typo_suggestion():
  with pytest.raises(runner.ConfigError, match="empty list"):
    runner.expand({"algorithm": "nonprivate_sgd", "epsilon": []})
  algorithms, problems = runner.registry()
  with pytest.raises(runner.ConfigError, match="did you mean 'dp_sgd_user'"):
    runner.run_one({"algorithm": "dp_sgd_usr", "problem": "logistic"}, algorithms=algorithms,
                   problems=problems)


def test_sweep_survives_a_failed_run_and_cli_exits_nonzero(tmp_path, dpsco):
  cfg = tmp_path / "bad.yaml"
  # the second experiment fails while it runs (its steps diverge: the released params are not
  # finite); the first completes. (A batch larger than n is refused before any run: below.)
  cfg.write_text(
      f"problem: least_squares\nn_users: 20\nm: 2\nd: 3\nseed: 0\n{STEPS}: 3\n"
      f"experiments:\n  - {{algorithm: nonprivate_sgd, {BATCH}: 5}}\n"
      f"  - {{algorithm: nonprivate_sgd, {BATCH}: 5, learning_rate: 1.0e+38, radius: 1.0e+30}}\n")
  out = tmp_path / "res.json"
  proc = dpsco("run", cfg, "--out", out, "--quiet")
  assert proc.returncode == 1, proc.stderr[-2000:]
  records = json.loads(out.read_text())["results"]
  assert [r["status"] for r in records] == ["ok", "failed"]
  assert "not finite" in records[1]["error"] and "FAILED" in proc.stdout
  # a plan the config makes impossible is the config's error: exit 2, one line, nothing run
  cfg.write_text(
      f"problem: least_squares\nn_users: 20\nm: 2\nd: 3\nseed: 0\n{STEPS}: 3\n"
      f"experiments:\n  - {{algorithm: nonprivate_sgd, {BATCH}: 5}}\n"
      f"  - {{algorithm: nonprivate_sgd, {BATCH}: 50}}\n")
  out.unlink()
  proc = dpsco("run", cfg, "--out", out, "--quiet")
  assert proc.returncode == 2 and not out.exists(), proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "dpsco: error: nonprivate_sgd: batch_size (50) must be <= n_users (20)"]


def test_cli_user_error_is_one_line(tmp_path, dpsco):
  cfg = tmp_path / "typo.yaml"
  cfg.write_text("problem: logistic\nalgorithm: nonprivate_sgd\nseed: 1.5\n")
  proc = dpsco("run", cfg, "--quiet")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == ["dpsco: error: seed must be an integer, got 1.5 "
                                              "(float); write a whole number, e.g. seed: 1"]


def test_a_failed_record_groups_with_its_requested_epsilon_and_label():
  cfg = {"algorithm": "dp_sgd_user", "problem": "logistic", "epsilon": 2.0, "seed": 1,
         "label": "dp", "delta": 1e-5}
  record = runner._failed_record(cfg, ValueError("bad"))
  assert record["target_epsilon"] == 2.0 and record["label"] == "dp"
  assert record["config"] == {"epsilon": 2.0, "delta": 1e-5}
  assert record["status"] == "failed" and record["error"] == "ValueError: bad"


def test_problem_cache_is_bounded_and_shared_across_rows():
  """Rows with the same problem and seed share one problem instance, but the sweep keeps at
  most ``ProblemCache.maxsize`` problems alive: a problem holds its drivers' executables, and an
  unbounded cache (one problem per seed for the whole sweep) ran a 200-run bilevel sweep out of
  memory maps."""
  import gc
  import weakref
  algorithms, problems = runner.registry()
  built = []

  def counting(cfg, key):
    p = problems["least_squares"](cfg, key)
    built.append(weakref.ref(p))
    return p
  probs = dict(problems, least_squares=counting)
  seeds = list(range(20))
  runs = runner.expand({"problem": "least_squares", "n_users": 8, "m": 1, "d": 2,
                        "seed": [0, 1], STEPS: 2, BATCH: 4,
                        "experiments": [{"algorithm": "nonprivate_sgd"},
                                        {"algorithm": "nonprivate_sgd", "learning_rate": 0.1}]})
  runs = [runner._checked(r, algorithms, probs) for r in runs]
  records = runner.execute(runs, algorithms=algorithms, problems=probs, progress=False)
  assert all(r["status"] == "ok" for r in records) and len(built) == 2   # shared by both rows
  built.clear()
  runs = [runner._checked(dict(r, seed=s), algorithms, probs) for s in seeds for r in runs[:1]]
  alive = []

  def count(_records):  # during the sweep, not after execute() has dropped its cache
    alive.append(sum(ref() is not None for ref in built))
  # With the cyclic collector off, an evicted problem must be freed by reference counting
  # alone (what ProblemCache relies on). This used to gc.collect() on every record instead:
  # a weaker check (a cycle would pass) and ~5 s per call in a late pytest-xdist worker's heap
  # (119 s for this test in the full suite, 11 s alone).
  gc.disable()
  try:
    runner.execute(runs, algorithms=algorithms, problems=probs, progress=False,
                   on_record=count)
  finally:
    gc.enable()
  assert len(built) == len(seeds)
  assert max(alive) <= runner.ProblemCache().maxsize < len(seeds)


def test_problem_cache_is_bounded_in_bytes_and_keeps_the_newest():
  """Ten problems of 1e6 users held 16 GB in a seed-by-seed cell and the kernel killed it:
  the cache also bounds the problems' array bytes, evicting the oldest, never the newest."""
  import numpy as np

  class P:   # a problem holding ``mb`` MiB of data
    def __init__(self, mb):
      self.data = {"x": np.zeros(mb << 18, np.float32)}
      self.loss_fn = len
  cache = runner.ProblemCache(maxsize=16, max_bytes=3 << 20)
  assert runner.problem_bytes(P(1)) == 1 << 20
  for k in range(4):
    cache[k] = P(1)
  assert list(cache) == [1, 2, 3]            # 3 MiB: the oldest went
  cache["big"] = P(5)                        # over the bound alone: kept, the rest evicted
  assert list(cache) == ["big"]
  cache["small"] = P(1)
  assert list(cache) == ["small"]
  assert runner.ProblemCache().max_bytes > 0 and runner.ProblemCache(max_bytes=7).max_bytes == 7


def test_a_problem_factory_gets_its_own_keys_and_an_epsilon_sweep_shares_it():
  """A problem's data cannot depend on the algorithm: its factory is given only its schema's
  keys (and ``problem`` / ``seed``), so a sweep over ``epsilon`` or ``delta`` builds the problem
  once per seed. Before, ``logistic_corrupted`` was keyed on every key but the algorithm's name
  and was rebuilt for each epsilon of a sweep (and saw epsilon)."""
  algorithms, problems = runner.registry()
  seen = []

  def counting(cfg, key):
    seen.append(dict(cfg))
    return problems["logistic_corrupted"](cfg, key)
  probs = dict(problems, logistic_corrupted=counting)
  runs = runner.expand({"problem": "logistic_corrupted", "n_users": 16, "m": 2, "d": 2,
                        "corruption": 0.1, "seed": [0, 1],
                        "experiments": [{"algorithm": "dp_sgd_user", "epsilon": [1.0, 4.0],
                                         "delta": [1e-5, 1e-6], STEPS: 2, BATCH: 4}]})
  runs = [runner._checked(r, algorithms, probs) for r in runs]
  records = runner.execute(runs, algorithms=algorithms, problems=probs, progress=False)
  assert len(records) == 8 and all(r["status"] == "ok" for r in records)
  assert len(seen) == 2                                        # one problem per seed
  assert sorted(c["seed"] for c in seen) == [0, 1]
  for cfg in seen:
    assert set(cfg) <= {"problem", "seed", "n_users", "m", "d", "corruption",
                        "corruption_mode", "radius", "heterogeneity", "n_eval"}, cfg
    assert not {"epsilon", "delta", "algorithm", STEPS, BATCH} & set(cfg)
  # the records still hold the swept privacy keys: the record's config is the run's
  assert sorted({r["target_epsilon"] for r in records}) == [1.0, 4.0]
