"""Issue 46: every driver reports progress the same way (``dpsco_jax.Progress``).

For every registered algorithm that runs on a loss and UserData, on a tiny problem: about 20
reports spread over the run (every ``ceil(T / 20)`` steps, so at least ``min(20, T) // 2`` of
them), ``num_steps`` > 0, constant and the plan's step count, ``step`` strictly increasing and
ending at ``num_steps``, ``epsilon`` non-decreasing where given and, at the last report, the
run's epsilon. An algorithm with no step loop (output perturbation: one release) reports once
with ``step == num_steps == 1``. The reports come from one mechanism
(``algorithms.common.progress_session`` / ``emit_progress`` in the compiled loops, which
compiles nothing into a run without a callback; ``progress_due`` on the host for a host loop:
ReSQue's adaptive loop of Alg. 4 calls, which reports its planned calls).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import api
from dpsco_jax.algorithms import common
from dpsco_jax.algorithms.bilevel import localized_gd
from dpsco_jax.algorithms.resque.private import PlannedCallProgress
from dpsco_jax.data import UserData

from test_api_planners import CASES as PAPER_CASES
from test_api_planners import CONSTANTS as PAPER_CONSTANTS
from test_api_planners import PARAMS as PAPER_PARAMS
from test_api_planners import _users
from test_api_planners import loss as paper_loss

CONSTANTS = {"lipschitz": 1.0, "smoothness": 1.0, "radius": 4.0, "strong_convexity": 0.5}
# explicit noise multipliers: the reports are what is tested, not the calibration
DPSGD = {"epsilon": 50.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
         "num_steps": 30, "batch_size": 8, "relation": "zero_out", "noise_multiplier": 1.0}
SRGD = {"epsilon": 50.0, "delta": 1e-5, "clip_norm": 1.0, "noise_multiplier": 1.0,
        "batch_size": 2}
FILTER = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "sensitivity": "typical"}
CASES = {  # case: (algorithm, n_users, m, config)
    "nonprivate_sgd": ("nonprivate_sgd", 24, 2, {"learning_rate": 0.5, "num_steps": 30}),
    "dp_sgd_user": ("dp_sgd_user", 24, 2, DPSGD),
    "dp_sgd_user_cyclic": ("dp_sgd_user", 24, 2, {**DPSGD, "sampling": "cyclic"}),
    "dp_sgd_user_banded_poisson": ("dp_sgd_user", 24, 2, {
        **DPSGD, "sampling": "banded_poisson", "noise_mechanism": "banded", "bands": 2,
        "mf_strategy": "sqrt"}),
    "dp_sgd_item": ("dp_sgd_item", 24, 2, DPSGD),
    "dp_sgd_group": ("dp_sgd_group", 24, 2, {**DPSGD, "noise_multiplier": None}),
    **{k: (k, 48, 1, SRGD) for k in ("accelerated_dp_srgd", "dp_srgd_unaccelerated",
                                     "accelerated_dp_srgd_independent_noise",
                                     "accelerated_dp_sgd", "single_epoch_dp_sgd")},
    "user_level_phased_sgd": ("user_level_phased_sgd", 120, 1, {
        "epsilon": 2.0, "delta": 1e-5, "sensitivity": "typical", "num_groups": 2}),
    **{k: (k, 40, 1, FILTER) for k in ("user_level_accelerated_erm",
                                       "user_level_accelerated_erm_smoothed")},
    **{k: (k, *case) for k, case in PAPER_CASES.items()},
}
#: one release, no step loop: one report, step == num_steps == 1
NO_STEP_LOOP = {"naive_output_pert", "sc_output_pert", "phased_erm_output_pert",
                "sc_erm_output_pert", "phased_sco_output_pert", "sc_sco_output_pert"}
#: the DP-SGD family: an event per step, so an epsilon at every report
PER_STEP_EVENT = {"dp_sgd_user", "dp_sgd_item"}
#: one case per loop runs by default (a scan of run_chain, the cyclic and b-min-sep scans,
#: SRGD's runner, Algorithms 1 and 3, DP-Loc-GD's rounds of scans, the closing report); the
#: other variants of the same loops, and the slow paper-001/002 drivers, are marked slow
FAST = {"nonprivate_sgd", "dp_sgd_user", "dp_sgd_user_cyclic", "dp_sgd_user_banded_poisson",
        "accelerated_dp_srgd", "user_level_phased_sgd", "user_level_accelerated_erm",
        "dp_loc_gd", "naive_output_pert"}


def _loss(p, ex):
  return jnp.sum(ex["x"] * p) ** 2 + 0.25 * jnp.sum(p ** 2)


def _data(n: int, m: int) -> UserData:
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(n * m, 3)) / 4).astype(np.float32)
  return UserData.from_arrays({"x": x}, np.repeat(np.arange(n), m), max_items_per_user=m)


def _fit(case: str, callback):
  name, n, m, cfg = CASES[case]
  cfg = {k: v for k, v in cfg.items() if v is not None}
  if name in PAPER_CASES:
    data = _users(n, m, even=True)
    p = api.plan(name, cfg, data.spec, num_params=5, constants=PAPER_CONSTANTS)
    return p, api.run(p, paper_loss, PAPER_PARAMS, data, jax.random.key(0), callback=callback)
  data = _data(n, m)
  p = api.plan(name, cfg, data.spec, num_params=3, constants=CONSTANTS)
  return p, api.run(p, _loss, jnp.zeros(3), data, jax.random.key(0), callback=callback)


def _planned_steps(p: api.Plan) -> int | None:
  """The plan's step count where the plan states one: its own object's ``num_steps`` (the
  phases summed for FILTER, the rounds for DP-Loc-(S)GD, whose schedule's ``num_steps`` is one
  round's, the planned Alg. 4 calls for ReSQue), else the schedule's."""
  steps = getattr(p.detail, "num_steps", None)
  return steps if steps is not None else p.schedule.get("num_steps")


def _case_param(case: str):
  name = CASES[case][0]
  marks = [] if case in FAST else [pytest.mark.slow]
  return pytest.param(case, marks=marks)


def test_every_runnable_algorithm_has_a_case():
  runnable = {n for n, e in dpsco_jax.algorithms.registry.algorithms().items()
              if e.unsupported is None}
  assert runnable == {name for name, *_ in CASES.values()}


@pytest.mark.parametrize("case", [_case_param(c) for c in CASES])
def test_every_driver_reports_progress_the_same_way(case):
  seen: list[api.Progress] = []
  p, res = _fit(case, seen.append)
  name = CASES[case][0]
  assert seen, "no report"
  total = seen[0].num_steps
  assert total > 0 and all(s.num_steps == total for s in seen)
  steps = [s.step for s in seen]
  assert all(a < b for a, b in zip(steps, steps[1:])) and steps[-1] == total
  assert seen[-1].epsilon == pytest.approx(float(res.privacy.epsilon), rel=1e-6)
  if name in NO_STEP_LOOP:
    assert steps == [1] and total == 1
    return
  assert len(seen) > 1, "a step loop reports more than once"
  planned = _planned_steps(p)
  if planned is not None:
    assert total == planned
  # every ceil(T / 20) steps and the last one: about 20 reports, at least min(20, T) // 2
  every = -(-total // 20)
  expected = sorted(set(range(every, total + 1, every)) | {total})
  assert len(expected) >= min(20, total) // 2
  if res.record.get("halted_phase") is None:
    assert steps == expected
  else:   # a FILTER phase halted (a released bit): the run closes at its step count early
    assert steps[:-1] == expected[:len(steps) - 1] and len(steps) >= 3
  eps = [s.epsilon for s in seen]
  if name in PER_STEP_EVENT:
    assert None not in eps and all(a <= b for a, b in zip(eps, eps[1:]))
    assert eps[0] < eps[-1]
  else:   # no per-step event: the run's epsilon once it is done
    assert eps[:-1] == [None] * (len(eps) - 1)


def test_a_callback_changes_neither_the_release_nor_the_compiled_loop():
  # SRGD's runner: one program per callback-or-not, the same release with and without
  plain = _fit("single_epoch_dp_sgd", None)[1]
  seen = []
  reported = _fit("single_epoch_dp_sgd", seen.append)[1]
  np.testing.assert_array_equal(np.asarray(plain.params), np.asarray(reported.params))
  assert seen and not common._PROGRESS


def test_no_callback_compiles_nothing_into_the_loop():
  def loop(report, tick):
    def body(c, t):
      common.emit_progress(report, tick, t)
      return c + t, None
    return jax.lax.scan(body, jnp.int32(0), jnp.arange(8))[0]

  bare = jax.jit(lambda: jax.lax.scan(lambda c, t: (c + t, None), jnp.int32(0),
                                      jnp.arange(8))[0]).lower().as_text()
  without = jax.jit(lambda: loop(None, None)).lower().as_text()
  with common.progress_session(lambda step, total: None, 8) as session:
    tick = session.tick()
    with_cb = jax.jit(lambda tk: loop(session.report, tk)).lower(tick).as_text()
  assert without == bare and "callback" not in without
  assert "callback" in with_cb


def test_the_last_step_is_reported_when_the_steps_are_not_a_multiple_of_the_spacing():
  got = []

  def body(c, t, report, tick):
    common.emit_progress(report, tick, t)
    return c, None

  with common.progress_session(lambda step, total: got.append((step, total)), 50) as s:
    jax.jit(lambda tk: jax.lax.scan(lambda c, t: body(c, t, s.report, tk), 0,
                                    jnp.arange(50))[0])(s.tick())
  # every ceil(50 / 20) = 3 steps, and the last one
  assert got == [(k, 50) for k in range(3, 49, 3)] + [(50, 50)]


def test_dp_loc_gd_reports_across_its_rounds_with_the_same_release():
  # M = 2 rounds of 50 steps, one scan each in one program: the reports count 100 steps
  plain = _fit("dp_loc_gd", None)[1]
  seen = []
  reported = _fit("dp_loc_gd", seen.append)[1]
  assert [s.step for s in seen] == list(range(5, 101, 5))
  assert {s.num_steps for s in seen} == {100}
  jax.tree.map(np.testing.assert_array_equal, plain.params, reported.params)
  assert not common._PROGRESS


def test_dp_loc_gd_without_a_callback_compiles_the_solve_it_compiled_before():
  cfg = localized_gd.LocGDConfig(mu=1.0, clip_norm=1.0, noise_multiplier=1.0, rounds=2,
                                 steps=4)
  args = (jnp.zeros(3), {"x": jnp.ones((6, 3))}, jax.random.key(0))
  before = jax.jit(lambda y, d, k: localized_gd.dp_loc_gd(_loss, y, d, k, cfg)).lower(*args)
  without = localized_gd.compiled_solve(_loss, cfg, 0.0).lower(*args, None)
  with common.progress_session(lambda step, total: None, 8) as session:
    with_cb = localized_gd.compiled_solve(_loss, cfg, 0.0, report=session.report).lower(
        *args, session.tick())
  assert without.as_text() == before.as_text() and "callback" not in without.as_text()
  assert "callback" in with_cb.as_text()


def _resque_reports(realized: tuple[int, ...], planned: tuple[int, ...]) -> list:
  got, calls = [], []
  progress = PlannedCallProgress(lambda step, total: got.append((step, total)), sum(planned))
  for n_calls, n_planned in zip(realized, planned):
    alg4 = progress.phase(lambda *a, **k: calls.append(a) or (None, None), n_planned)
    for _ in range(n_calls):
      alg4()
    progress.end_phase()
  assert len(calls) == sum(realized)   # every call ran, once
  return got


def test_resque_reports_the_planned_calls_not_the_ones_the_data_needed():
  # the realized Alg. 4 calls depend on the data (the bisection, early exits; debug only):
  # every run reports the planned calls, whatever it realized (fewer, or a phase over its plan)
  expected = [(s, 40) for s in range(2, 41, 2)]
  assert _resque_reports((30, 10), (30, 10)) == expected
  assert _resque_reports((3, 10), (30, 10)) == expected
  assert _resque_reports((30, 12), (30, 10)) == expected
