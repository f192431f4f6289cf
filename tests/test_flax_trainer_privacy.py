"""DPTrainer's privacy contract (issue 11.2): a data-free plan whose sampling rate, denominator
and noise scale do not depend on the data under any relation; per-step releases that move by
at most the claimed sensitivity when one user is removed / zeroed / replaced adversarially;
the reported epsilon equal to an independent dp_accounting computation; a target epsilon that
is a budget; and the audit hook's noise scale."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting.pld import pld_privacy_accountant
from flax import nnx

from dpsco_jax.flax import DPTrainer

D_IN, C, Q, Z, DELTA = 4, 1.0, 0.5, 1.1, 1e-5
_REL = dp_accounting.NeighboringRelation


class Lin(nnx.Module):
  """Linear, no bias: the per-item gradient is x itself (a zero item contributes zero)."""

  def __init__(self, rngs):
    self.l = nnx.Linear(D_IN, 1, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.l(x)


def _loss(model, ex):
  return jnp.sum(model(ex[0]))


_init = nnx.jit(lambda: Lin(nnx.Rngs(0)))


def _data(n=12, m=2, adversary=True):
  """Users with small gradients along +e0 (norm 0.5 < C: unclipped); the last user is the
  adversary: a huge gradient opposite to everyone else (clipped to exactly C)."""
  x = np.zeros((n, m, D_IN), np.float32)
  x[..., 0] = 0.5
  if adversary:
    x[-1, :, 0] = -1e3
  return (jnp.asarray(x),)


def _trainer(data, relation, method="fast", **kw):
  args = dict(data=data, clip_norm=C, sampling_rate=Q, delta=DELTA, noise_multiplier=Z,
              relation=relation, method=method, key=3)
  if relation == "add_remove":
    args["expected_batch_size"] = 6.0  # declared public: not len(data) * q
  args.update(kw)
  return DPTrainer(_init(), _loss, optax.sgd(0.0), **args)  # lr 0: same params every step


def _neighbour(data, relation):
  x = np.asarray(data[0])
  if relation == "add_remove":
    return (jnp.asarray(x[:-1]),)  # the adversary removed
  y = x.copy()
  y[-1] = 0.0  # zero_out: the adversary's record contributes nothing
  if relation == "replace_one":
    y[-1, :, 0] = 1e3  # replaced by the opposite adversary: the clipped sum moves by 2C
  return (jnp.asarray(y),)


@pytest.mark.parametrize("relation,method,bound", [
    ("add_remove", "fast", 1.0), ("add_remove", "vmap", 1.0), ("zero_out", "fast", 1.0),
    ("replace_one", "fast", 2.0)])
def test_one_user_moves_each_release_by_at_most_the_sensitivity(relation, method, bound):
  d = _data()
  d2 = _neighbour(d, relation)
  a, b = _trainer(d, relation, method), _trainer(d2, relation, method)
  # The plan is data-free: identical for D and D' (at the previous HEAD, D = q * len(data)).
  for attr in ("q", "denominator", "noise_stddev", "noise_multiplier", "event", "sensitivity"):
    assert getattr(a, attr) == getattr(b, attr), attr
  assert a.denominator == (6.0 if relation == "add_remove" else Q * 12)
  steps, key = 12, jax.random.key(11)
  ra = a.release_fn(steps, noise=False)(key, d)["l"]["kernel"].value[..., 0]   # [T, d]
  rb = b.release_fn(steps, noise=False)(key, d2)["l"]["kernel"].value[..., 0]
  diff = np.linalg.norm(np.asarray(ra - rb), axis=-1) * a.denominator  # clipped-sum moves
  assert diff.max() <= bound * C * (1 + 1e-5)
  assert diff.max() >= 0.99 * bound * C  # the adversary was sampled and hit the bound: tight
  assert np.all((diff < 1e-5) | (diff > 0.99 * bound * C))  # nobody else moved


def test_add_remove_needs_a_declared_denominator():
  with pytest.raises(ValueError, match="expected_batch_size"):
    DPTrainer(_init(), _loss, optax.sgd(0.1), data=_data(), clip_norm=C, sampling_rate=Q,
              delta=DELTA, noise_multiplier=Z)


@pytest.mark.parametrize("relation,native", [
    ("add_remove", _REL.ADD_OR_REMOVE_ONE), ("zero_out", _REL.ADD_OR_REMOVE_ONE),
    ("replace_one", _REL.REPLACE_ONE)])
def test_reported_epsilon_equals_independent_dp_accounting(relation, native):
  tr = _trainer(_data(n=6), relation, batch_capacity=6)
  tr.train(7, report_every=3)
  acc = pld_privacy_accountant.PLDAccountant(native, value_discretization_interval=1e-3)
  acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(Z)), 7)
  want = acc.get_epsilon(DELTA)
  assert tr.epsilon() == pytest.approx(want, rel=1e-9)
  assert tr.privacy_report().epsilon == pytest.approx(want, rel=1e-9)
  assert tr.privacy_report().relation == relation
  assert all(h["epsilon"] >= want * (1 - 1e-9) for h in tr.history[-1:])  # bounds, not below
  # blocks report upper bounds on the exact epsilon at that step
  for h in tr.history:
    exact = pld_privacy_accountant.PLDAccountant(native, value_discretization_interval=1e-3)
    exact.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(Z)),
                  h["step"])
    assert h["epsilon"] >= exact.get_epsilon(DELTA) * (1 - 1e-9)


def test_target_epsilon_is_a_budget_and_relations_are_checked():
  with pytest.raises(ValueError, match="target_epsilon"):  # z=1.1 over 50 steps: eps >> 1
    _trainer(_data(), "add_remove", target_epsilon=1.0, num_steps=50)
  tr = _trainer(_data(), "add_remove", noise_multiplier=None, target_epsilon=1.0,
                num_steps=5)
  assert tr.ledger.epsilon_budget == 1.0
  from dpsco_jax.privacy import PrivacyBudgetExceeded
  before = np.asarray(tr.params["l"]["kernel"].value)
  with pytest.raises(PrivacyBudgetExceeded):  # 6 > 5 planned steps: refused before step 1
    tr.train(6, report_every=1)
  assert tr.step_count == 0 and not tr.ledger.events
  np.testing.assert_array_equal(before, np.asarray(tr.params["l"]["kernel"].value))
  with pytest.raises(ValueError, match="relation"):
    _trainer(_data(), "swap_one")
  with pytest.raises(ValueError, match="relation"):
    _trainer(_data(), None)
  with pytest.raises(ValueError, match="cannot account"):  # RDP lacks replace-one Poisson
    _trainer(_data(), "replace_one", accountant="rdp")


def test_audit_hook_noise_scale_and_default_unchanged():
  # Zero gradients: the release is pure noise of stddev z C / D. Accept 1x, reject 0.5x, 1.5x.
  zero = (jnp.zeros((10, 1, D_IN)),)
  tr = _trainer(zero, "add_remove", expected_batch_size=4.0)
  release = jax.jit(jax.vmap(tr.release_fn(3), in_axes=(0, None)))
  out = np.asarray(release(jax.random.split(jax.random.key(0), 200), zero)["l"]["kernel"].value)
  assert out.shape == (200, 3, D_IN, 1)
  sd, want = float(out.std()), Z * C / 4.0
  assert abs(sd / want - 1) < 0.05  # 2400 draws: relative error ~1.5%
  assert abs(sd / (0.5 * want) - 1) > 0.5 and abs(sd / (1.5 * want) - 1) > 0.2
  assert tr.step_count == 0 and not tr.ledger.events  # the hook touched nothing
