"""Runner config sections: ``problem:`` / ``data:`` / ``algorithm:`` flattened to the flat
form, keys checked against their section, sweeps inside sections, row labels."""

import json

import pytest

from dpsco_jax import runner
from dpsco_jax.config.schema import keys_of

QUICKSTART = {
    "name": "quickstart", "seed": [0, 1, 2],
    "problem": {"name": "logistic", "n_users": 1000, "m": 8, "d": 10},
    "experiments": [
        {"algorithm": {"name": "nonprivate_sgd"}},
        {"algorithm": {"name": "dp_sgd_user", "epsilon": [0.5, 2.0], "delta": 1.0e-6}}]}
FLAT = {
    "name": "quickstart", "seed": [0, 1, 2], "problem": "logistic", "n_users": 1000, "m": 8,
    "d": 10, "experiments": [
        {"algorithm": "nonprivate_sgd"},
        {"algorithm": "dp_sgd_user", "epsilon": [0.5, 2.0], "delta": 1.0e-6}]}


def _key(algorithm: str, *names: str) -> str:
  """The spelling of one idea that ``algorithm`` reads (config keys are being renamed)."""
  allowed = keys_of(algorithm, "least_squares")
  return next(n for n in names if n in allowed)


def test_sections_expand_like_the_flat_form_and_sweep_inside():
  runs = runner.expand(QUICKSTART)
  assert runs == runner.expand(FLAT)
  assert len(runs) == 3 + 2 * 3
  assert {r["epsilon"] for r in runs if r["algorithm"] == "dp_sgd_user"} == {0.5, 2.0}
  assert runner.swept_fields(QUICKSTART) == runner.swept_fields(FLAT) == [
      "algorithm", "epsilon"]
  # every expanded run validates as the flat one does
  algorithms, problems = runner.registry()
  for cfg in runs:
    runner._checked(cfg, algorithms, problems)


def test_data_is_the_problem_section_and_entries_merge_key_by_key():
  cfg = {"seed": 0, "data": {"name": "logistic", "n_users": 100, "m": 2, "d": 3},
         "algorithm": {"name": "nonprivate_sgd", "epochs": 2.0},
         "experiments": [{"data": {"n_users": 50}}, {"algorithm": {"name": ["nonprivate_sgd"]}}]}
  first, second = runner.expand(cfg)
  assert first == {"seed": 0, "problem": "logistic", "n_users": 50, "m": 2, "d": 3,
                   "algorithm": "nonprivate_sgd", "epochs": 2.0}
  assert second["n_users"] == 100 and second["algorithm"] == "nonprivate_sgd"
  # the flat form and sections mix
  mixed = {"problem": {"name": "logistic", "d": 3}, "n_users": 10, "m": 1,
           "algorithm": "nonprivate_sgd"}
  assert runner.expand(mixed) == [{"problem": "logistic", "d": 3, "n_users": 10, "m": 1,
                                   "algorithm": "nonprivate_sgd"}]


@pytest.mark.parametrize("cfg,match", [
    ({"problem": {"name": "logistic", "epsilon": 1.0}, "algorithm": "dp_sgd_user"},
     r"problem.epsilon: 'epsilon' is a key of the algorithm.*move it to the algorithm: section"),
    ({"problem": "logistic", "algorithm": {"name": "dp_sgd_user", "n_users": 10}},
     r"algorithm.n_users: 'n_users' is a key of the problem.*problem: \(or data:\) section"),
    ({"problem": "logistic", "experiments": [{"algorithm": {"name": "nonprivate_sgd",
                                                            "seed": 1}}]},
     r"experiments\[0\].algorithm.seed: 'seed' is a runner key"),
    ({"data": {"name": "logistic", "d": 3}, "problem": {"m": 2}}, "same section"),
    ({"problem": {"name": "logistic", "d": 3}, "d": 4}, "'d' is given twice"),
    ({"problem": "logistic", "algorithm": {"name": "nonprivate_sgd"}, "label": 3},
     "label must be a string"),
    ({"data": "logistic"}, "data: must be a mapping"),
    ({"problem": "logistic", "algorithm": [{"name": "a"}, {"name": "b"}]},
     "one experiments entry per section"),
])
def test_a_key_in_the_wrong_section_names_its_section(cfg, match):
  with pytest.raises(runner.ConfigError, match=match):
    runner.expand(cfg)


def test_wrong_section_is_checked_for_every_swept_name_and_against_the_top_level():
  # epsilon is an algorithm key of dp_sgd_user: in the top-level problem section it is refused
  # for the experiment that runs dp_sgd_user
  cfg = {"problem": {"name": "logistic", "epsilon": 1.0},
         "experiments": [{"algorithm": ["nonprivate_sgd", "dp_sgd_user"]}]}
  with pytest.raises(runner.ConfigError, match=r"experiments\[0\].problem.epsilon"):
    runner.expand(cfg)
  # an unknown key inside a section is left to validate, which suggests a spelling
  cfg = {"problem": "logistic", "n_users": 10, "m": 1, "d": 2,
         "algorithm": {"name": "dp_sgd_user", "epsilonn": 1.0, "delta": 1e-5}}
  (run,) = runner.expand(cfg)
  algorithms, problems = runner.registry()
  with pytest.raises(runner.ConfigError, match="did you mean 'epsilon'"):
    runner._checked(run, algorithms, problems)


def test_cli_sections_labels_and_paired_comparison(tmp_path, dpsco):
  lr = _key("nonprivate_sgd", "learning_rate", "lr")
  cfg = tmp_path / "sections.yaml"
  cfg.write_text(
      "name: sections\nseed: [0, 1, 2]\n"
      "problem: {name: least_squares, n_users: 40, m: 2, d: 3}\n"
      "compare: {baseline: slow, resamples: 500}\n"
      "experiments:\n"
      f"  - {{label: slow, algorithm: {{name: nonprivate_sgd, epochs: 1, {lr}: 0.001}}}}\n"
      f"  - {{label: fast, algorithm: {{name: nonprivate_sgd, epochs: 1, {lr}: 0.5}}}}\n")
  out = tmp_path / "res.json"
  proc = dpsco("run", str(cfg), "--out", str(out), "--quiet")
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads(out.read_text())
  records = data["results"]
  assert len(records) == 6 and {r["label"] for r in records} == {"slow", "fast"}
  assert all(r["problem"] == "least_squares" and r["n_users"] == 40 for r in records)
  slow, fast = data["summary"]
  assert slow["label"] == "slow" and slow["compare_role"] == "baseline"
  assert fast["compare_baseline"] == "slow" and fast["paired_seeds"] == 3
  assert fast["ratio"] < 1.0 and fast["ratio_ci95_hi"] < 1.0  # lr 0.001 barely moves
  assert fast["wins"] == 3 and fast["win_rate"] == 1.0
  assert "ratio[boot95]" in proc.stdout and "bootstrap" in proc.stdout and "3/3" in proc.stdout


def test_a_baseline_matching_no_run_is_refused_before_running(tmp_path, dpsco):
  cfg = tmp_path / "c.yaml"
  cfg.write_text("problem: {name: least_squares, n_users: 20, m: 2, d: 2}\n"
                 "algorithm: nonprivate_sgd\ncompare: {baseline: dp_sgd_user}\n")
  proc = dpsco("run", str(cfg), "--quiet")
  assert proc.returncode == 2
  assert "compare.baseline 'dp_sgd_user' matches no run" in proc.stderr
