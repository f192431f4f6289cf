"""Private hyper-parameter selection (issue 48, deliverable 1): the law of the number of runs
K, its mean, the RDP bound of Papernot & Steinke's Theorem 2, the cost before anything runs,
the refusals, and the runner's ``select: private`` (K never recorded)."""

import math

import dp_accounting
import jax
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.privacy.selection import (SelectionLaw, candidate_rdp, law_for_grid,
                                         selection_cost, selection_epsilon, selection_rdp,
                                         selection_report)

DRAWS = 20_000
TNB = "truncated_negative_binomial"


def _chi2_pvalue(sample: np.ndarray, law: SelectionLaw) -> float:
  """Goodness of fit of ``sample`` against ``law``'s pmf: bins k = 1..B-1 and a tail k >= B,
  B the first k whose expected count drops below 20."""
  k = np.arange(1, 100_000)
  expected = law.pmf(k) * len(sample)
  top = int(np.argmax(expected < 20)) + 1
  exp_bins = np.append(expected[:top - 1], len(sample) - expected[:top - 1].sum())
  obs = np.bincount(np.minimum(sample, top), minlength=top + 1)[1:]
  return stats.chisquare(obs, exp_bins).pvalue


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (1.0, 0.2), (0.5, 0.05), (-0.5, 0.1)])
def test_sampler_follows_the_law_and_not_a_neighbouring_one(eta, gamma):
  law = SelectionLaw(TNB, gamma, eta)
  sample = law.sample(jax.random.key(7), (DRAWS,))
  assert _chi2_pvalue(sample, law) > 1e-3
  # the test has power: gamma off by 15% is rejected
  assert _chi2_pvalue(sample, SelectionLaw(TNB, gamma * 1.15, eta)) < 1e-4
  assert _chi2_pvalue(sample, SelectionLaw(TNB, gamma / 1.15, eta)) < 1e-4


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (1.0, 0.2), (2.0, 0.05), (-0.5, 0.1)])
def test_mean_matches_pmf_and_sample(eta, gamma):
  law = SelectionLaw(TNB, gamma, eta)
  k = np.arange(1, 200_000)
  assert law.pmf(k).sum() == pytest.approx(1.0, abs=1e-12)
  assert (k * law.pmf(k)).sum() == pytest.approx(law.mean(), rel=1e-10)
  sample = law.sample(jax.random.key(3), (DRAWS,))
  se = sample.std() / math.sqrt(DRAWS)
  assert abs(sample.mean() - law.mean()) < 4 * se


def test_closed_forms():
  assert SelectionLaw("geometric", 0.2, 1.0).mean() == pytest.approx(5.0)
  geo = SelectionLaw("geometric", 0.2)
  assert geo.eta == 1.0
  assert geo.pmf(np.array([1, 2, 3])) == pytest.approx([0.2, 0.16, 0.128])
  log = SelectionLaw(TNB, 0.1, 0.0)
  assert log.pmf(np.array([2]))[0] == pytest.approx(0.9 ** 2 / (2 * math.log(10)))
  assert log.mean() == pytest.approx(9 / math.log(10))


def test_rdp_bound_reproduces_hand_computation():
  # Q (lambda)-RDP eps = lambda / 2 (a Gaussian of multiplier 1); geometric gamma = 1/2:
  # 1 + eta = 2, log(1/gamma) = log 2, E[K] = 2; the best l_hat is 2 (hat term 1 + log 2)
  law = SelectionLaw("geometric", 0.5)
  orders = np.array([2.0, 3.0, 4.0])
  got = selection_rdp(law, orders, orders / 2)
  ln2 = math.log(2)
  assert got == pytest.approx([2 + 2 * ln2, 2.5 + 1.5 * ln2, 3 + 4 / 3 * ln2], rel=1e-12)


def test_candidate_curve_is_the_accountants():
  orders, rdp = candidate_rdp(dp_accounting.GaussianDpEvent(2.0))
  assert rdp == pytest.approx(orders / 8, rel=1e-9)   # lambda / (2 z^2)


def _dpsgd_event(z=1.0, q=0.01, steps=1000):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)


def test_epsilon_monotone_in_expected_runs_and_noise():
  event = _dpsgd_event()
  eps = [selection_report(SelectionLaw(TNB, g, 0.0), [event], delta=1e-6).epsilon
         for g in (0.5, 0.1, 0.01, 0.001)]
  assert all(a < b for a, b in zip(eps, eps[1:]))
  law = SelectionLaw(TNB, 0.1, 0.0)
  by_noise = [selection_report(law, [_dpsgd_event(z)], delta=1e-6).epsilon
              for z in (2.0, 1.0, 0.8)]
  assert all(a < b for a, b in zip(by_noise, by_noise[1:]))
  # the grid's curve is the worst candidate's: adding a noisier candidate changes nothing
  one = selection_report(law, [_dpsgd_event(1.0)], delta=1e-6).epsilon
  two = selection_report(law, [_dpsgd_event(1.0), _dpsgd_event(3.0)], delta=1e-6).epsilon
  assert two == pytest.approx(one)


def test_report_is_a_ledger_theorem_block_with_the_law_not_k():
  law = SelectionLaw(TNB, 0.1, 0.0)
  report = selection_report(law, [_dpsgd_event()] * 3, delta=1e-6)
  assert report.provenance == "theorem" and report.delta == pytest.approx(1e-6)
  assert "truncated_negative_binomial(eta=0, gamma=0.1)" in report.notes
  assert "E[K] = 3.909" in report.notes
  orders, rdp = candidate_rdp(_dpsgd_event())
  assert report.epsilon == pytest.approx(selection_epsilon(law, orders, rdp, 1e-6)[0])


def test_cost_of_a_4_and_a_16_candidate_grid_at_the_defaults():
  """Defaults: eta = 0, gamma such that E[K] = the number of candidates. DP-SGD candidate:
  q = 0.01, z = 1, 1000 steps, delta 1e-6 (one candidate: epsilon 2.125)."""
  costs = {n: selection_cost(law_for_grid(n), [_dpsgd_event()] * n, delta=1e-6)
           for n in (4, 16)}
  for n, c in costs.items():
    assert c.expected_runs == pytest.approx(n, rel=1e-9)
    assert c.candidate_epsilon == pytest.approx(2.125, abs=0.005)
  assert costs[4].epsilon == pytest.approx(3.475, abs=0.005)
  assert costs[16].epsilon == pytest.approx(4.022, abs=0.005)
  assert "expected runs 4 over 4 candidates" in costs[4].line()


@pytest.mark.parametrize("kwargs,match", [
    (dict(distribution=TNB, gamma=0.1, eta=-1.0), "eta must be a finite number > -1"),
    (dict(distribution=TNB, gamma=0.1, eta=float("nan")), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.1, eta=float("inf")), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.1, eta=True), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.0, eta=0.0), "gamma must lie in the open interval"),
    (dict(distribution=TNB, gamma=1.0, eta=0.0), "gamma must lie in the open interval"),
    (dict(distribution=TNB, gamma=float("nan"), eta=0.0), "gamma must lie"),
    (dict(distribution=TNB, gamma=True, eta=0.0), "gamma must be a number"),
    (dict(distribution=TNB, gamma="0.1", eta=0.0), "gamma must be a number"),
    (dict(distribution="geometric", gamma=0.1, eta=2.0), "eta: the geometric law is eta = 1"),
    (dict(distribution="poisson", gamma=0.1), "poisson is not implemented"),
    (dict(distribution="uniform", gamma=0.1), "distribution must be one of"),
])
def test_bad_law_refused_naming_the_parameter(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SelectionLaw(**kwargs)


# ------------------------------------------------------------------ the runner's select.private
import json

import yaml

from dpsco_jax import runner
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.privacy import selection as selection_module
from dpsco_jax.runner import tuning

TINY = {"name": "private selection", "eval_seeds": [0],
        "problem": {"name": "logistic", "n_users": 64, "m": 2, "d": 3, "radius": 2.0},
        "algorithm": {"name": "dp_sgd_user", "epochs": 1, "batch_size": 32,
                      "learning_rate": [0.5, 2.0], "clip_norm": 1.0, "epsilon": 2.0,
                      "delta": 1e-5},
        "select": {"over": ["learning_rate"], "metric": "excess_risk", "rule": "min_mean",
                   "private": {"distribution": "geometric", "gamma": 0.5}}}


def _write(tmp_path, config):
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(config))
  return str(path)


def test_yaml_private_selection_releases_one_run_covered_by_the_theorem(tmp_path, capsys):
  out = str(tmp_path / "o.json")
  records = runner.main_run(_write(tmp_path, TINY), out=out, progress=False)
  printed = capsys.readouterr().out
  (record,) = records
  expected = tuning.private_plans(
      *_plans_args(TINY))[next(iter(_plans_args(TINY)[0]))].report
  assert record["provenance"] == "theorem"
  assert record["epsilon"] == pytest.approx(expected.epsilon)
  assert record["epsilon"] > record["candidate_epsilon"] > 1.9
  assert record["selection"] == "private" and record["selection_metric"] == "excess_risk"
  assert record["selection_metric_source"].startswith("public")
  assert "geometric(gamma=0.5)" in record["privacy_notes"] and "E[K] = 2" in record["privacy_notes"]
  # the cost is printed before the report (before anything ran)
  assert printed.index("expected runs 2 over 2 candidates") < printed.index("== private selection")
  saved = json.load(open(out))
  assert saved["selection"]["private"] is True and saved["results"][0]["phase"] == "eval"


def _plans_args(config):
  phases = tuning.parse_phases(config)
  algorithms, problems = runner.registry()
  runs = runner._validated(phases.with_seeds(phases.eval_seeds), algorithms, problems)
  fields = tuning.group_fields(phases.select, runner.swept_fields(phases.config))
  groups = tuning.group_candidates(runs, phases.select, fields)
  from dpsco_jax.runner import batch
  problem_of = lambda c: batch.cached_problem(batch.problem_config(c), problems, None,
                                              batch.run_keys(c["seed"])[0])
  from dpsco_jax import api
  plan_of = lambda c, p: api.plan_problem(c["algorithm"], api.algorithms()[c["algorithm"]]
                                          .config.of(c), p)
  return groups, phases.select, problem_of, plan_of


SECRET_K = 4099   # a distinctive number of runs, which no output may show


def test_k_and_the_unreleased_candidates_never_appear(tmp_path, capsys, monkeypatch):
  calls = []

  def fake_run_one(cfg, *, algorithms, problems, cache=None, on_progress=None, mesh=None,
                   driver_key=None, plan=None, typed=None, checked=False):
    calls.append(cfg["learning_rate"])
    metric = 0.7771 + 1e-7 * len(calls)     # distinctive values; the first run is the best
    return {"algorithm": cfg["algorithm"], "problem": cfg["problem"], "seed": cfg["seed"],
            "learning_rate": cfg["learning_rate"], "epsilon": 2.0, "delta": 1e-5,
            "provenance": "accountant", "excess_risk": metric, "gradient_evaluations": 1,
            "wall_time_s": 31.4159 + len(calls), "batch_wall_time_s": 27.1828}

  monkeypatch.setattr(selection_module.SelectionLaw, "sample",
                      lambda self, key, shape=(): np.asarray(SECRET_K))
  monkeypatch.setattr(runner, "run_one", fake_run_one)
  out = str(tmp_path / "o.json")
  records = runner.main_run(_write(tmp_path, TINY), out=out, progress=True)
  text = capsys.readouterr()
  assert len(calls) == SECRET_K          # the selection did run K candidates
  assert set(calls) == {0.5, 2.0}
  (record,) = records
  assert record["excess_risk"] == pytest.approx(0.7771 + 1e-7)
  saved = open(out).read()
  for where in (saved, text.out, text.err, repr(records)):
    assert str(SECRET_K) not in where
    for j in range(2, 10):   # the metrics of unreleased candidates
      assert f"{0.7771 + 1e-7 * j:.7f}" not in where
    # no run's time: the winner's would say whether it compiled (was its candidate's first)
    assert "31.41" not in where and "32.41" not in where and "27.18" not in where
  (kept,) = json.loads(saved)["results"]
  assert not set(tuning.UNCOVERED) & (set(record) | set(kept))


@pytest.mark.parametrize("change,match", [
    ({"metric": "gradient_evaluations"}, "select.metric: a private selection reads a public"),
    ({"private": {"distribution": "truncated_negative_binomial", "eta": -2, "gamma": 0.1}},
     r"select.private.eta must be a finite number > -1"),
    ({"private": {"gamma": 1.5}}, r"select.private.gamma must lie in the open interval"),
    ({"private": {"gamma": True}}, r"select.private.gamma must be a number"),
    ({"private": {"distribution": "poisson", "gamma": 0.1}},
     "select.private.distribution: poisson is not implemented"),
    ({"private": {"gamma": 0.1, "mu": 3}}, r"select.private: unknown key\(s\) mu"),
    ({"private": "yes"}, "select.private must be a mapping"),
])
def test_bad_private_select_refused_before_any_run(change, match, monkeypatch):
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  config = {**TINY, "select": {**TINY["select"], **change}}
  with pytest.raises(ConfigError, match=match):
    runner.run_config(config, progress=False)


def test_private_select_needs_eval_seeds_only():
  for seeds in ({"tuning_seeds": [1], "eval_seeds": [0]}, {"seed": [0]}):
    config = {k: v for k, v in TINY.items() if k != "eval_seeds"} | seeds
    with pytest.raises(ConfigError, match="select.private selects inside each private run"):
      tuning.parse_phases(config)


def test_cli_refuses_a_training_metric_with_exit_code_2(tmp_path, dpsco):
  config = {**TINY, "select": {**TINY["select"], "metric": "wall_time_s"}}
  proc = dpsco("run", _write(tmp_path, config))
  assert proc.returncode == 2
  assert proc.stderr.strip().count("\n") == 0 and "select.metric" in proc.stderr


def test_unaccounted_selection_says_so_in_every_eval_record(monkeypatch):
  def fake_run_one(cfg, **kw):
    return {"algorithm": cfg["algorithm"], "problem": cfg["problem"], "seed": cfg["seed"],
            "epsilon": 2.0, "delta": 1e-5, "provenance": "accountant",
            "excess_risk": cfg["learning_rate"], "wall_time_s": 0.0}
  monkeypatch.setattr(runner, "run_one", fake_run_one)
  select = {k: v for k, v in TINY["select"].items() if k != "private"}
  config = {**TINY, "select": select, "tuning_seeds": [1], "batch_seeds": False}
  records = runner.run_config(config, progress=False)
  evals = [r for r in records if r["phase"] == "eval"]
  assert evals and all(r["selection_privacy"] == tuning.PRIVACY_NOTE for r in evals)
  assert all("selection_privacy" not in r for r in records if r["phase"] == "tuning")


# ------------------------------------------- cross-key refusals of a sweep, before any run
FIXED = {**TINY["algorithm"], "learning_rate": 0.5}
ADAPTIVE_TREE = {**FIXED, "clip_norm": "adaptive", "initial_clip_norm": 1.0,
                 "noise_mechanism": "tree", "sampling": "cyclic"}


@pytest.mark.parametrize("config,match", [
    # a plain sweep: the refused row is the second, after a row that would have run
    ({"name": "x", "seed": [0, 1], "problem": TINY["problem"],
      "experiments": [{"algorithm": FIXED}, {"algorithm": ADAPTIVE_TREE}]},
     "dp_sgd_user: clip_norm: adaptive is refused with noise_mechanism='tree'"),
    # a tuning sweep: the group level refused before the tuning runs
    ({"name": "x", "tuning_seeds": [1], "eval_seeds": [0], "problem": TINY["problem"],
      "algorithm": {**FIXED, "name": "dp_sgd_group", "learning_rate": [0.5, 2.0],
                    "clip_norm": "adaptive", "initial_clip_norm": 1.0},
      "select": {"over": ["learning_rate"], "metric": "excess_risk"}},
     "dp_sgd_group: clip_norm: adaptive is refused for dp_sgd_group"),
    # a private selection: a candidate with adaptive clipping and tree noise
    ({**TINY, "algorithm": {**ADAPTIVE_TREE, "learning_rate": [0.5, 2.0]}},
     "clip_norm: adaptive is refused with noise_mechanism='tree'"),
])
def test_a_plan_refusal_stops_the_sweep_before_any_run(config, match, monkeypatch):
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  monkeypatch.setattr(runner, "_batch_records", lambda *a, **k: pytest.fail("a run started"))
  with pytest.raises(ConfigError, match=match):
    runner.run_config(config, progress=False)


def test_cli_refuses_adaptive_clipping_with_tree_noise_in_one_line_exit_2(tmp_path, dpsco):
  config = {"name": "x", "seed": 0, "problem": TINY["problem"],
            "experiments": [{"algorithm": FIXED}, {"algorithm": ADAPTIVE_TREE}]}
  out = tmp_path / "o.json"
  proc = dpsco("run", _write(tmp_path, config), "--out", str(out))
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "noise_mechanism='tree'" in lines[0]
  assert not out.exists()   # nothing ran, nothing written
