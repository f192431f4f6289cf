"""experiments/private_tuning.py (issue 48.4): a quick run's arms and epsilons hold (the
private arm's training and selection total at most 4, the unaccounted arm's release costs
more than the 4 it reports, no secret of the selection in the record), a quick run never
replaces a record, and the sweeps guide's table is the committed record's rendering."""

from __future__ import annotations

import json

import pytest

import dpsco_jax
from experiments import private_tuning as pt

RECORD_KEYS = {"task", "arm", "seed", "score", "learning_rate", "clip_norm",
               "epsilon_reported"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("private_tuning") / "quick.json"
  assert pt.main(["--quick", "--tasks", "logistic", "--out", str(out)]) == 0
  return json.loads(out.read_text())


def test_quick_run_spends_the_total_and_says_what_the_unaccounted_pick_costs(quick):
  info = quick["tasks"]["logistic"]
  rows = {r["arm"]: r for r in quick["rows"]}
  assert set(rows) == set(pt.ARMS) and quick["quick"] is True
  # (a), (a'): training and selection within the total, candidates below it
  for arm, multiple in pt.PRIVATE_ARMS.items():
    cost = info["selection"][arm]
    assert cost["selection_epsilon"] <= pt.EPSILON < cost["selection_epsilon"] * 1.1
    assert rows[arm]["epsilon_reported"] == pytest.approx(cost["selection_epsilon"])
    assert cost["expected_runs"] == pytest.approx(2 * multiple)
    assert cost["candidate_epsilon"] < pt.EPSILON
  # a larger E[K] leaves each candidate less
  assert (info["selection"]["private_ek16"]["candidate_epsilon"]
          < info["selection"]["private"]["candidate_epsilon"])
  # (b) reports the total per run; its release costs more (the grid's composition)
  assert rows["unaccounted"]["epsilon_reported"] <= pt.EPSILON + 1e-9
  assert info["unaccounted_epsilon_bound"] > pt.EPSILON
  assert set(info["eval_seeds"]).isdisjoint(info["tuning_seeds"])
  for r in quick["rows"] + quick["differences"]:
    assert r["failed"] == 0 and r["ci95_lo"] <= r["mean"] <= r["ci95_hi"]


def test_the_noise_found_is_the_smallest_within_the_total(quick):
  """The bisection's z: the cost at z is within the total, at a bracket step less it is not."""
  info = quick["tasks"]["logistic"]
  task = pt.logistic_task(True)
  inst = task.instance(info["eval_seeds"][0])
  lrs = tuple(info["learning_rates"])
  cost = lambda z: dpsco_jax.private_select_cost(
      pt.plans(task, inst, {"noise_multiplier": z}, None, lrs), pt.law_of("private", lrs)).epsilon
  z = info["selection"]["private"]["candidate_noise_multiplier"]
  step = (pt.Z_RANGE[1] / pt.Z_RANGE[0]) ** (0.5 ** 6)   # quick: 6 halvings
  assert cost(z) <= pt.EPSILON < cost(z / step)


def test_the_record_holds_only_what_the_selection_releases(quick):
  private = [r for r in quick["records"] if r["arm"] in pt.PRIVATE_ARMS]
  assert private and all(set(r) == RECORD_KEYS for r in private)
  text = json.dumps(quick)
  assert "wall_time" not in text and '"k"' not in text.lower()


def test_a_quick_run_never_replaces_a_record(tmp_path, monkeypatch):
  monkeypatch.setattr(pt, "run_all", lambda *a: pytest.fail("a quick run ran"))
  assert pt.main(["--quick", "--out", str(pt.RECORD)]) == 2
  existing = tmp_path / "kept.json"
  existing.write_text("{}")
  assert pt.main(["--quick", "--out", str(existing)]) == 2
  assert existing.read_text() == "{}"


def test_the_guides_table_is_the_records_rendering():
  record = json.loads(pt.RECORD.read_text())
  assert record["quick"] is False and set(record["tasks"]) == {"digits", "logistic"}
  for info in record["tasks"].values():
    assert info["eval_seeds"] == list(pt.EVAL_SEEDS)
    assert info["tuning_seeds"] == list(pt.TUNING_SEEDS)
    assert len(info["learning_rates"]) == 4
    assert all(c["selection_epsilon"] <= pt.EPSILON for c in info["selection"].values())
  guide = pt.GUIDE.read_text()
  assert pt.render(record) in guide
  record["rows"][0]["mean"] *= 1.05   # a record the page does not show is caught
  assert pt.render(record) not in guide
