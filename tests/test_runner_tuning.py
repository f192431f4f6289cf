"""Runner tuning / evaluation seeds: the grid on tuning seeds, a selection per group, the
selected configs on disjoint evaluation seeds."""

import json
import statistics

import pytest

from dpsco_jax import runner
from dpsco_jax.runner import tuning as tuning
from dpsco_jax.config.schema import keys_of

LR = next(n for n in ("learning_rate", "lr") if n in keys_of("nonprivate_sgd", "least_squares"))
PROBLEM = {"name": "least_squares", "n_users": 40, "m": 2, "d": 3}


@pytest.mark.parametrize("cfg,match", [
    ({"tuning_seeds": [0, 1], "eval_seeds": [1, 2], "select": {"over": [LR]}},
     "disjoint; both list 1"),
    ({"seed": 0, "eval_seeds": [1, 2]}, "not both"),
    ({"tuning_seeds": [0], "eval_seeds": [1], "select": {"over": [LR]},
      "experiments": [{"seed": 3}]}, "not both"),
    ({"select": {"over": [LR]}, "seed": [0, 1]}, "select needs tuning_seeds"),
    ({"tuning_seeds": [0, 1], "eval_seeds": [2]}, "tuning_seeds without select"),
    ({"tuning_seeds": [0, 1], "select": {"over": [LR]}}, "needs both"),
    ({"tuning_seeds": [0, 0], "eval_seeds": [2], "select": {"over": [LR]}}, "twice"),
    ({"tuning_seeds": [0.5], "eval_seeds": [2], "select": {"over": [LR]}}, "list of integers"),
    ({"tuning_seeds": [0], "eval_seeds": [2], "select": {"over": []}}, "select.over"),
    ({"tuning_seeds": [0], "eval_seeds": [2], "select": {"over": ["seed"]}}, "seed cannot"),
    ({"tuning_seeds": [0], "eval_seeds": [2], "select": {"over": [LR], "rule": "median"}},
     "select.rule"),
    ({"tuning_seeds": [0], "eval_seeds": [2], "select": {"over": [LR], "by": "x"}},
     "unknown key"),
])
def test_phase_keys_are_checked(cfg, match):
  with pytest.raises(runner.ConfigError, match=match):
    tuning.parse_phases(cfg)


def test_eval_seeds_alone_mean_seed():
  phases = tuning.parse_phases({"problem": "logistic", "eval_seeds": [5, 6]})
  assert phases.select is None and phases.config == {"problem": "logistic", "seed": [5, 6]}


def test_choose_picks_the_best_mean_per_group_and_skips_failed_candidates():
  runs, records = [], []
  # group eps=1: lr 0.1 -> mean 2, lr 1.0 -> mean 1 (selected); group eps=4: lr 1.0 has a
  # failed run, so lr 0.1 is selected although lr 1.0's other run is lower
  table = {(1.0, 0.1): [1.0, 3.0], (1.0, 1.0): [0.5, 1.5], (4.0, 0.1): [2.0, 2.0],
           (4.0, 1.0): [0.1, None]}
  for (eps, lr), values in table.items():
    for seed, v in zip((0, 1), values):
      runs.append({"algorithm": "a", "epsilon": eps, LR: lr, "seed": seed})
      records.append({"seed": seed, "status": "ok" if v is not None else "failed",
                      **({"excess_risk": v} if v is not None else {})})
  spec = tuning.SelectSpec(over=(LR,))
  fields = tuning.group_fields(spec, ["epsilon", LR])
  assert fields == ["algorithm", "epsilon"]
  chosen, report = tuning.choose(runs, records, spec, fields)
  assert [g["selected"] for g in report] == [{LR: 1.0}, {LR: 0.1}]
  assert report[0]["tuning_mean"] == 1.0 and report[1]["candidates"][1]["failed"] == 1
  assert tuning.is_selected({**runs[2], "seed": 9}, chosen, spec, fields)
  assert not tuning.is_selected({**runs[0], "seed": 9}, chosen, spec, fields)
  chosen, report = tuning.choose(runs, records, tuning.SelectSpec((LR,), rule="max_mean"),
                                 fields)
  assert report[0]["selected"] == {LR: 0.1}


def test_select_over_an_unswept_field_is_refused_before_any_run(monkeypatch):
  ran = []
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: ran.append(1))
  cfg = {"problem": PROBLEM, "algorithm": {"name": "nonprivate_sgd", LR: 0.1},
         "tuning_seeds": [0], "eval_seeds": [1], "select": {"over": [LR]}}
  with pytest.raises(runner.ConfigError, match="is not swept"):
    runner.run_phases(tuning.parse_phases(cfg), progress=False)
  assert ran == []


def test_tuning_then_eval_on_disjoint_seeds(tmp_path, capsys):
  cfg = tmp_path / "tune.yaml"
  cfg.write_text(
      "name: tune\ntuning_seeds: [0, 1]\neval_seeds: [7, 8, 9]\n"
      f"select: {{metric: excess_risk, over: [{LR}], rule: min_mean}}\n"
      "problem: {name: least_squares, n_users: 40, m: 2, d: 3}\n"
      f"algorithm: {{name: nonprivate_sgd, epochs: 1, {LR}: [0.001, 0.5]}}\n")
  out = tmp_path / "res.json"
  records = runner.main_run(str(cfg), out=str(out), progress=False)
  printed = capsys.readouterr().out
  tuned = [r for r in records if r["phase"] == "tuning"]
  evals = [r for r in records if r["phase"] == "eval"]
  assert len(tuned) == 4 and {r["seed"] for r in tuned} == {0, 1}
  assert len(evals) == 3 and sorted(r["seed"] for r in evals) == [7, 8, 9]
  # the selection is the argmin of the tuning means, computed from tuning records only
  def lr_of(r):
    return r.get(LR, r["config"].get(LR))
  means = {lr: statistics.fmean(r["excess_risk"] for r in tuned if lr_of(r) == lr)
           for lr in (0.001, 0.5)}
  best = min(means, key=means.get)
  assert {lr_of(r) for r in evals} == {best}
  data = json.loads(out.read_text())
  assert len(data["results"]) == 7
  (group,) = data["selection"]["groups"]
  assert group["selected"] == {LR: best} and group["tuning_mean"] == pytest.approx(means[best])
  assert all(c["seeds"] == [0, 1] for c in group["candidates"])
  assert data["selection"]["tuning_runs"] == 4 and data["selection"]["eval_seeds"] == [7, 8, 9]
  (row,) = data["summary"]
  assert row["seeds"] == 3 and row[LR] == best
  assert len(data["tuning_summary"]) == 2
  assert "4 tuning runs" in printed and "not covered by the privacy guarantee" in printed
  assert f"{LR}={best}" in printed


def test_overlapping_seeds_are_refused_by_the_cli(tmp_path, dpsco):
  cfg = tmp_path / "c.yaml"
  cfg.write_text(f"tuning_seeds: [0, 1]\neval_seeds: [1, 2]\nselect: {{over: [{LR}]}}\n"
                 "problem: {name: least_squares, n_users: 20, m: 2, d: 2}\n"
                 f"algorithm: {{name: nonprivate_sgd, {LR}: [0.1, 0.2]}}\n")
  proc = dpsco("run", str(cfg), "--quiet")
  assert proc.returncode == 2
  assert proc.stderr.strip() == ("dpsco: error: tuning_seeds and eval_seeds must be disjoint; "
                                 "both list 1")
