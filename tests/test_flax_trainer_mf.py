"""DPTrainer with the cyclic schedule and MF noise (issue #27): the same run as
``dp.fit("dp_sgd_user", ...)`` (params to float tolerance, epsilon to rounding), exact
per-block epsilons, Poisson + MF refused with the DP-SGD plan's reason, MF state through a
sealed save/restore, and no secret in any repr."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax.data import UserData
from dpsco_jax.flax import DPTrainer, fit_model
from dpsco_jax.privacy import LedgerIntegrityError, PrivacyBudgetExceeded
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.transforms.matrix_factorization import BandedNoiseState, BltNoiseState


class Lin(nnx.Module):
  def __init__(self, rngs):
    self.l = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.l(x)


def loss_fn(model, ex):
  return jnp.sum((model(ex["x"]) - ex["y"]) ** 2)


_init = nnx.jit(lambda: Lin(nnx.Rngs(0)))  # compiled once, fresh models


def _data(n=20, m=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * m, 3)).astype(np.float32)
  y = (x @ np.ones((3, 2), np.float32) + 0.3 * rng.normal(size=(n * m, 2))).astype(np.float32)
  return UserData.from_arrays({"x": x, "y": y}, np.repeat(np.arange(n), m))


# n = 20 users, B = 6: P = 4 steps an epoch (the last batch short), 3 epochs
CFG = dict(epsilon=2.0, delta=1e-5, clip_norm=1.0, learning_rate=0.1, averaging="none",
           sampling="cyclic", batch_size=6, num_steps=12, mf_strategy="sqrt")
MF = {"banded": {"bands": 3}, "blt": {"buffers": 3}, "independent": {}}


def _trainer(noise, key=5, **kw):
  args = dict(data=_data(), clip_norm=1.0, delta=1e-5, sampling="cyclic", batch_size=6,
              num_steps=12, target_epsilon=2.0, noise_mechanism=noise, mf_strategy="sqrt",
              key=jax.random.key(key), **MF[noise])
  args.update(kw)
  return DPTrainer(_init(), loss_fn, optax.sgd(0.1), **args)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(tree)])


@pytest.mark.parametrize("noise", ["banded", "blt", "independent"])
def test_cyclic_trainer_is_dp_sgd_user_run(noise):
  """Same data, key and config: the released params agree to float tolerance (the clipped sums
  are added in another order) and the epsilons are equal (the driver's one Gaussian of
  multiplier z / sens_T; the trainer's per-block mu^2 increments that telescope to it)."""
  model = _init()
  res = fit_model("dp_sgd_user", dict(CFG, noise_mechanism=noise, **MF[noise]), model,
                  loss_fn, _data(), jax.random.key(5))
  tr = _trainer(noise)
  hist = tr.train(12, report_every=5)
  assert tr.noise_multiplier == res.record["noise_multiplier"]   # one calibrator, same inputs
  assert tr.noise_stddev == res.record["noise_std"]      # the plan's stage: bit for bit
  np.testing.assert_allclose(_flat(nnx.state(tr._user_model, nnx.Param)),
                             _flat(nnx.state(model, nnx.Param)), rtol=1e-5, atol=1e-6)
  assert tr.privacy_report().epsilon == pytest.approx(res.privacy.epsilon, rel=1e-9)
  assert [h["epsilon_kind"] for h in hist] == ["exact"] * 3
  assert hist[-1]["epsilon"] == pytest.approx(res.privacy.epsilon, rel=1e-9)
  # each block's epsilon is that of the plan's prefix event (exact, nondecreasing)
  plan = tr.cyclic.plan
  for h in hist:
    want = plan.event_after(h["step"])
    assert h["epsilon"] == pytest.approx(epsilon_of(want, delta=1e-5, relation="zero_out"),
                                         rel=1e-9)
  assert plan.relation == "zero_out" and (plan.participations, plan.min_sep) == (3, 4)
  state = tr.state.opt_state[0]
  if noise != "independent":  # the MF stage's state lives in the trainer's state
    assert isinstance(state, BandedNoiseState if noise == "banded" else BltNoiseState)
    assert int(state.count) == 12


def test_poisson_with_mf_noise_is_refused_naming_the_reason():
  reasons = {"banded": "banded amplification.*not implemented in DPTrainer",
             "blt": "BLT has T bands"}
  for noise in ("banded", "blt"):
    with pytest.raises(ValueError, match=reasons[noise]):
      DPTrainer(_init(), loss_fn, optax.sgd(0.1), data=_data(), clip_norm=1.0,
                sampling_rate=0.3, expected_batch_size=6.0, delta=1e-5,
                noise_multiplier=1.0, noise_mechanism=noise)


def test_cyclic_arguments_and_horizon_are_checked():
  with pytest.raises(ValueError, match="num_steps"):
    _trainer("banded", num_steps=None)
  with pytest.raises(ValueError, match="Poisson-sampling argument"):
    _trainer("banded", sampling_rate=0.3)
  with pytest.raises(ValueError, match="add_remove"):  # the plan's relation check
    _trainer("banded", relation="add_remove")
  with pytest.raises(ValueError, match="rdp"):
    _trainer("blt", accountant="rdp")
  with pytest.raises(PrivacyBudgetExceeded):  # an explicit z over the budget: refused now
    _trainer("banded", noise_multiplier=0.5)
  tr = _trainer("banded")
  tr.train(10, report_every=10)
  with pytest.raises(ValueError, match="past it"):
    tr.train(3)
  assert tr.step_count == 10


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_mf_state_survives_save_and_restore(noise, tmp_path):
  pytest.importorskip("orbax.checkpoint")
  whole = _trainer(noise)
  whole.train(12, report_every=4)
  part = _trainer(noise)
  part.train(8, report_every=4, checkpoint_dir=tmp_path, hmac_key=b"k" * 16)
  fresh = _trainer(noise).restore(tmp_path, hmac_key=b"k" * 16)
  assert fresh.step_count == 8
  ring = fresh.state.opt_state[0][2]  # ring / buffers: restored, not re-initialized
  assert np.any(_flat(ring) != 0)
  np.testing.assert_array_equal(_flat(ring), _flat(part.state.opt_state[0][2]))
  fresh.train(4, report_every=4)
  np.testing.assert_array_equal(_flat(fresh.params), _flat(whole.params))
  assert fresh.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)
  assert [h["epsilon"] for h in fresh.history] == [h["epsilon"] for h in whole.history]
  # another strategy (or a restored ledger that does not match the step) is refused
  with pytest.raises((ValueError, LedgerIntegrityError)):
    _trainer(noise, **({"bands": 2} if noise == "banded" else {"buffers": 2})).restore(
        tmp_path, hmac_key=b"k" * 16)


def test_reprs_redact_the_mf_keys_and_buffers():
  tr = _trainer("banded")
  tr.train(4, report_every=4)
  noise_state = tr.state.opt_state[0]
  key_text = str(np.asarray(jax.random.key_data(noise_state.key)))
  ring_text = str(np.asarray(jax.tree.leaves(noise_state.ring)[0]))
  for text in (repr(tr), str(tr.state), repr(noise_state)):
    assert "<redacted>" in text and key_text not in text and ring_text not in text
  assert "sampling='cyclic'" in repr(tr) and "noise='banded'" in repr(tr)


def test_release_fn_gives_the_trainers_privatized_gradients():
  """The audit hook from the trainer's key releases what the trainer's steps consumed:
  with SGD(lr) the t-th privatized gradient is (params_t - params_{t+1}) / lr."""
  tr = _trainer("blt")
  out = tr.release_fn(4)(jax.random.key(5), tr.data)
  params = [_flat(tr.params)]
  for _ in range(4):
    tr.train(1, report_every=1)
    params.append(_flat(tr.params))
  used = np.stack([(a - b) / 0.1 for a, b in zip(params[:-1], params[1:])])
  got = np.stack([_flat(jax.tree.map(lambda x: x[t], out)) for t in range(4)])
  np.testing.assert_allclose(got, used, rtol=1e-4, atol=1e-4)
  noiseless = tr.release_fn(4, noise=False)(jax.random.key(5), tr.data)
  assert not np.allclose(_flat(out), _flat(noiseless))
