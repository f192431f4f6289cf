"""Issue 23 part 4: every epsilon a user sees says whether it is exact or an upper bound
(ledger values, reports, DPTrainer history, runner records and tables)."""

import pickle

import dp_accounting
import pytest

from dpsco_jax import runner
from dpsco_jax.privacy.ledger import (Epsilon, PrivacyLedger, PrivacyReport, grid_count)

DELTA = 1e-5
EVENT = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1))


def _ledger(count: int, **kw) -> PrivacyLedger:
  return PrivacyLedger(delta=DELTA, **kw).compose(EVENT, label="step", count=count)


def test_cached_grid_value_is_labelled_upper_bound_and_is_not_below_the_exact_one():
  count = 37
  assert grid_count(count) != count  # the grid rounds this count up
  ledger = _ledger(count)
  cheap, exact = ledger.epsilon(), ledger.epsilon(exact=True)
  assert isinstance(cheap, Epsilon) and cheap.kind == "upper_bound" and not cheap.is_exact
  assert exact.kind == "exact" and exact.is_exact
  assert cheap > exact  # strictly above here: 37 steps accounted as grid_count(37)
  assert float(exact) == pytest.approx(PrivacyLedger(delta=DELTA).compose(
      EVENT, label="x", count=count).epsilon(exact=True), rel=1e-12)


def test_a_value_labelled_exact_is_the_exact_value():
  ledger = _ledger(4)  # on the grid: rounding changes nothing
  cheap = ledger.epsilon()
  assert cheap.kind == "exact" and float(cheap) == float(ledger.epsilon(exact=True))
  report = ledger.report(provenance="accountant")
  assert report.epsilon_kind == "exact" and report.epsilon == float(ledger.epsilon(exact=True))
  # an off-grid ledger's report is still exact, and equals the exact value, not the bound
  off = _ledger(37)
  rep = off.report(provenance="accountant")
  assert rep.epsilon_kind == "exact" and rep.epsilon == float(off.epsilon(exact=True))
  assert rep.epsilon < off.epsilon()


def test_spend_and_check_say_what_they_return():
  ledger = PrivacyLedger(delta=DELTA, epsilon_budget=50.0)
  for _ in range(36):
    ledger.spend(EVENT, label="step")
  planned = ledger.check(EVENT, count=1)
  spent = ledger.spend(EVENT, label="step")  # 37 recorded: rounded up
  assert spent.kind == "upper_bound" and planned.kind == "upper_bound"
  assert spent >= ledger.epsilon(exact=True)


def test_epsilon_prints_its_kind_and_stays_a_number():
  eps = _ledger(37).epsilon()
  assert "upper bound" in str(eps) and "upper_bound" in repr(eps)
  assert f"{eps:.3f}" == f"{float(eps):.3f}"  # a format spec gives the number alone
  back = pickle.loads(pickle.dumps(eps))
  assert back == eps and back.kind == eps.kind
  with pytest.raises(ValueError, match="kind"):
    Epsilon(1.0, "roughly")


def test_report_names_the_kind_and_refuses_an_unknown_one():
  report = _ledger(4).report(provenance="accountant")
  assert "exact" in str(report) and report.to_dict()["epsilon_kind"] == "exact"
  with pytest.raises(ValueError, match="epsilon_kind"):
    PrivacyReport(epsilon=1.0, delta=DELTA, provenance="accountant", epsilon_kind="roughly")


def test_runner_records_and_table_carry_the_kind():
  records = runner.run_config({
      "problem": "least_squares", "n_users": 40, "m": 2, "d": 3, "seed": 0,
      "algorithm": "dp_sgd_user", "epsilon": 2.0, "delta": 1e-5, "num_steps": 5,
      "batch_size": 10, "clip_norm": 1.0}, progress=False)
  assert records[0]["status"] == "ok" and records[0]["epsilon_kind"] == "exact"
  rows = runner.aggregate(records, ["algorithm"])
  assert rows[0]["epsilon_kind"] == "exact"
  header, _, row = runner.format_table(rows, ["algorithm"]).splitlines()
  assert "epsilon_kind" in header.split() and "exact" in row.split()


def _tiny_trainer():
  """A 16-user, 3-item DP-SGD trainer of a linear model (RDP: cheap accounting): the
  checkpoint-seal tests' trainer."""
  from test_checkpoint_seal import _trainer
  return _trainer()


def test_trainer_history_labels_grid_bounds_as_upper_bounds():
  pytest.importorskip("flax")
  tr = _tiny_trainer()
  tr.train(10, report_every=5)
  assert [h["epsilon_kind"] for h in tr.history] == ["upper_bound", "upper_bound"]
  for h, steps in zip(tr.history, (5, 10)):
    exact = PrivacyLedger(delta=tr.delta, accountant="rdp").compose(
        tr.event, label="x", count=steps).epsilon(exact=True)
    assert h["epsilon"] >= float(exact) * (1 - 1e-12)
  assert tr.epsilon().kind == "exact"
