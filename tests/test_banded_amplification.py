"""Amplified banded MF noise (issue #27): b-min-sep Poisson sampling (Choquette-Choo et al.
2023, Thm 4) in user-/item-level DP-SGD. The sampler's law (rejecting a wrong rate or a draw
outside the active group), the event against the hand-built dp_accounting composition, its
reduction to Poisson DP-SGD at one band, the refusals, a canary audit with broken-sampler
twins, and plan/run end to end."""

import functools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dpsco_jax as dp
from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
from dpsco_jax.algorithms.common import poisson_capacity
from dpsco_jax.algorithms.dpsgd import banded_poisson as bp
from dpsco_jax.algorithms.dpsgd.plan import dp_sgd_event, plan_dp_sgd
from dpsco_jax.audit import banded_amplification as ba
from dpsco_jax.audit.harness import run_audit
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of

N = 60
BASE = dict(epsilon=2.0, delta=1e-5, sampling="banded_poisson", noise_mechanism="banded",
            bands=4, min_separation=4, sampling_rate=0.3, num_steps=40, learning_rate=0.5,
            mf_strategy="sqrt", averaging="none")


def _plan(**kw):
  return plan_dp_sgd(dict(BASE, **kw), level="user", realized_rows=N, rows_per_user=1,
                     default_clip=1.0, radius=2.0)


# ----------------------------------------------------------------------------- sampler's law
@functools.partial(jax.jit, static_argnames=("steps", "capacity"))
def _inclusions(key, slots, real, rate, *, steps: int, capacity: int) -> jax.Array:
  """[steps, n] counts: how often step ``t`` of the sampler on ``(slots, real)`` includes
  each row (one compile per shape: the samplers under test differ in arguments only)."""
  n = real.size if slots.shape[0] > 1 else slots.shape[1]

  def one(t):
    idx, mask = bp.sample_group(jax.random.fold_in(key, t), slots, real, t, rate=rate,
                                capacity=capacity)
    return jnp.zeros((n,), jnp.int32).at[idx].add(mask.astype(jnp.int32))
  return jax.vmap(one)(jnp.arange(steps))


def _law_rejected(incl: np.ndarray, groups: np.ndarray, rate: float, alpha=1e-3) -> bool:
  """Whether the inclusions contradict the law: exactly 0 outside group ``t mod b``; inside,
  the total is Binomial(#active row-steps, p) (two-sided exact test) and the per-row counts
  are homogeneous Binomial(active steps of the row, p) (chi-square)."""
  steps, n = incl.shape
  active = groups[None, :] == (np.arange(steps) % (groups.max() + 1))[:, None]
  if incl[~active].any() or incl.max() > 1:
    return True
  trials = int(active.sum())
  if stats.binomtest(int(incl[active].sum()), trials, rate).pvalue < alpha:
    return True
  per_row, n_row = incl.sum(0), active.sum(0)
  chi2 = float(np.sum((per_row - rate * n_row) ** 2 / (n_row * rate * (1 - rate))))
  return stats.chi2.sf(chi2, n) < alpha


def test_partition_is_public_balanced_and_disjoint():
  slots, real = map(np.asarray, bp.group_slots(jax.random.key(3), 23, 5))
  assert slots.shape == (5, 5) and real.sum() == 23
  assert sorted(slots[real].tolist()) == list(range(23))        # every row in exactly one
  assert set(real.sum(1).tolist()) == {4, 5}                    # sizes differ by <= 1
  again, _ = bp.group_slots(jax.random.key(3), 23, 5)           # drawn from the key alone
  np.testing.assert_array_equal(slots, np.asarray(again))


def test_sampler_law_within_the_active_group_and_broken_samplers_rejected():
  n, b, p, steps = N, 4, 0.3, 800
  slots, real = bp.group_slots(jax.random.key(1), n, b)
  s_np, r_np = np.asarray(slots), np.asarray(real)
  groups = np.empty(n, int)
  for g in range(b):
    groups[s_np[g][r_np[g]]] = g
  cap = poisson_capacity(int(s_np.shape[1]), p)
  key = jax.random.key(2)

  def rejected(rate, sl=slots, rl=real, capacity=cap):
    incl = _inclusions(key, sl, rl, rate, steps=steps, capacity=capacity)
    return _law_rejected(np.asarray(incl), groups, p)
  assert not rejected(p)
  assert rejected(1.1 * p)
  # a row listed in a second group (participations closer than b) is caught
  leaky = s_np.copy()
  leaky[1, 0] = s_np[0, 0]
  assert rejected(p, jnp.asarray(leaky))
  # and so is plain Poisson over every row (the partition ignored)
  assert rejected(p, jnp.arange(n)[None], jnp.ones((1, n), bool), n)


# ----------------------------------------------------------------------------- accounting
def test_plan_event_is_the_hand_built_composition_and_beats_cyclic_accounting():
  p = _plan()
  G, k = 15, 10                          # ceil(60 / 4) rows a group; ceil(40 / 4) rounds
  assert (p.relation, p.group_rows, p.participations, p.min_sep) == ("zero_out", G, k, 4)
  assert p.sampling_rate == 0.3 and p.denominator == pytest.approx(0.3 * G)
  assert p.capacity == poisson_capacity(G, 0.3) and p.truncation_probability == 0.0
  colnorm = float(np.linalg.norm(mf.banded_strategy(40, 4, strategy="sqrt").coefs))
  hand = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      0.3, dp_accounting.GaussianDpEvent(p.noise_multiplier / colnorm)), k)
  assert p.event == hand
  assert epsilon_of(hand, delta=1e-5, relation="zero_out") == pytest.approx(2.0, rel=1e-3)
  # the same releases without sampling (every row of the group, cyclic-style): one Gaussian
  # of z / (sqrt(k) colnorm), strictly worse at p < 1, equal at p = 1
  z = p.noise_multiplier
  cyclic = mf.mf_event(z, mf.participation_sensitivity(p.mf.coefs, 40, participations=k,
                                                       min_sep=4))
  assert epsilon_of(cyclic, delta=1e-5, relation="zero_out") > 1.5 * 2.0
  full = mf.amplified_banded_event(z, p.mf.coefs, 40, sampling_rate=1.0, min_sep=4)
  assert epsilon_of(full, delta=1e-5, relation="zero_out") == pytest.approx(
      epsilon_of(cyclic, delta=1e-5, relation="zero_out"), rel=2e-2)
  # progress reports: the plan's event over a prefix is fewer rounds
  assert p.event_after(40) == p.event and p.event_after(9).count == 3


def test_one_band_is_poisson_dp_sgd_with_independent_noise():
  # an explicit z (the calibrator maps equal events to equal z; no need to run it twice)
  z = dict(epsilon=None, noise_multiplier=1.3)
  one = _plan(bands=1, min_separation=1, sampling_rate=None, batch_size=6, **z)
  poisson = plan_dp_sgd(dict(delta=1e-5, sampling="poisson", batch_size=6, num_steps=40,
                             learning_rate=0.5, averaging="none", relation="zero_out", **z),
                        level="user", realized_rows=N, rows_per_user=1, default_clip=1.0,
                        radius=2.0)
  assert one.event == poisson.event
  assert (one.denominator, one.capacity, one.noise_std, one.truncation_probability) == \
      (poisson.denominator, poisson.capacity, poisson.noise_std,
       poisson.truncation_probability)
  # one band, b groups: k = ceil(T / b) Poisson DP-SGD steps of rate p
  b1 = _plan(bands=1, **z)
  assert b1.event == dp_sgd_event(1.3, sampling="poisson", q=0.3, n=N, batch=5, steps=10)


def test_refusals():
  with pytest.raises(ValueError, match="BLT has T bands"):
    _plan(noise_mechanism="blt")
  with pytest.raises(ValueError, match=r"bands \(8\) must be <= min_separation \(4\)"):
    _plan(bands=8)
  with pytest.raises(ValueError, match=r"bands \(5\) must be <= the min-separation"):
    mf.amplified_banded_event(1.0, np.ones(5), 20, sampling_rate=0.5, min_sep=4)
  with pytest.raises(ValueError, match="add_remove.*partition"):
    _plan(relation="add_remove", n_users=N)
  with pytest.raises(ValueError, match="noise_mechanism='banded'"):
    _plan(noise_mechanism="independent")
  with pytest.raises(ValueError, match="banded_poisson"):   # plain Poisson points to it
    _plan(sampling="poisson", relation="zero_out")
  with pytest.raises(ValueError, match="min_separation"):
    _plan(min_separation=N + 1)
  with pytest.raises(ValueError, match="batch_size"):
    _plan(sampling_rate=None, batch_size=16)               # > G = 15
  ok = dict(epsilon=1.0, delta=1e-5, sampling="banded_poisson", noise_mechanism="banded")
  assert dp.algorithm_config("dp_sgd_item", dict(ok, min_separation=4))["min_separation"] == 4
  assert DpSgdConfig(**ok, min_separation=4).min_separation == 4
  with pytest.raises(ConfigError, match="did you mean 'min_separation'"):
    dp.algorithm_config("dp_sgd_user", dict(ok, min_seperation=4))
  with pytest.raises(ConfigError, match="sampling"):
    dp.algorithm_config("dp_sgd_user", dict(ok, sampling="banded_poison"))
  with pytest.raises(ConfigError, match="sampling"):
    DpSgdConfig(epsilon=1.0, delta=1e-5, sampling="banded_poison")
  from dpsco_jax.flax import trainer_noise
  with pytest.raises(ValueError, match="not in DPTrainer"):
    trainer_noise.check_sampling("banded_poisson")


# ----------------------------------------------------------------------------- canary audit
def test_canary_audit_honest_passes_broken_samplers_caught():
  honest = run_audit(ba.amplified_banded_audit("zero_out"), trials=50_000, key=11)
  assert 1.0 <= honest.claimed_epsilon <= 2.5 and not honest.violated, honest
  every = run_audit(ba.amplified_banded_audit("zero_out", "ignores_groups"), trials=20_000,
                    key=12)
  assert every.claimed_epsilon == honest.claimed_epsilon and every.violated, every
  # a row in two groups (participations 1 step apart, inside the band): ~1.2x the claim at
  # 2e5 trials a side
  two = run_audit(ba.amplified_banded_audit("zero_out", "two_groups"), trials=200_000,
                  key=13)
  assert two.violated, two


# ----------------------------------------------------------------------------- end to end
def test_plan_and_run_end_to_end_with_the_new_event():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N * 3, 3)).astype(np.float32)
  data = dp.UserData.from_arrays({"x": x, "y": x @ np.ones(3, np.float32)},
                                 np.repeat(np.arange(N), 3))
  loss = lambda w, ex: 0.5 * jnp.square(jnp.dot(ex["x"], w["w"]) - ex["y"])
  cfg = {k: v for k, v in BASE.items()}
  cfg.update(clip_norm=1.0, num_steps=24)
  plan = dp.plan("dp_sgd_user", cfg, data.spec, num_params=3)
  assert isinstance(plan.detail.event, dp_accounting.SelfComposedDpEvent)
  assert isinstance(plan.detail.event.event, dp_accounting.PoissonSampledDpEvent)
  assert plan.privacy.epsilon == pytest.approx(2.0, rel=1e-3)
  assert "banded_poisson" in plan.privacy.mechanisms[0] and "b-min-sep" in plan.privacy.notes
  result = dp.run(plan, loss, {"w": jnp.zeros(3)}, data, jax.random.key(4))
  assert np.all(np.isfinite(np.asarray(result.params["w"])))
  assert result.privacy == plan.privacy
  assert result.record["sampling"] == "banded_poisson" and result.record["bands"] == 4
  assert result.record["participations"] == 6 and result.record["min_separation"] == 4
  # the audit hook runs the same schedule: T noisy increments, finite; the noiseless ones are
  # clipped sums over at most a group's capacity, over the fixed denominator D = p G
  from dpsco_jax.algorithms.dpsgd import driver as D
  from dpsco_jax.data.problem import UserDataProblem
  problem = UserDataProblem(loss, {"w": jnp.zeros(3)}, data)
  hook = dict(cfg, num_steps=8, epsilon=None, noise_multiplier=1.0)   # no calibration
  rel = D.dp_sgd_releases(problem, hook, jax.random.key(5))
  assert rel.shape == (8, 3) and np.all(np.isfinite(np.asarray(rel)))
  noiseless = D.dp_sgd_releases(problem, hook, jax.random.key(5), noise=False)
  bound = poisson_capacity(15, 0.3) * 1.0 / (0.3 * 15)
  assert 0 < float(jnp.max(jnp.linalg.norm(noiseless, axis=1))) <= bound + 1e-5
  assert math.isfinite(float(result.privacy.delta))
