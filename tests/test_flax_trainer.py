"""DPTrainer: bit-identical checkpoint/resume, a ledger that is never reset and cannot be edited,
partial checkpoints never chosen, budget enforcement before release, the noise scale of the
shared chain, fast == vmap, accumulation == one-shot, contracts on loss and data, redacted
reprs, strict argument types."""

import json
import os

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax.flax import DPTrainer
from dpsco_jax.flax.checkpoint import seal
from dpsco_jax.privacy import LedgerIntegrityError
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded, PrivacyLedger, _digest

pytest.importorskip("orbax.checkpoint")


class Tiny(nnx.Module):
  def __init__(self, din, dout, rngs):
    self.l1 = nnx.Linear(din, 4, rngs=rngs)
    self.l2 = nnx.Linear(4, dout, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _ce(model, ex):
  x, y = ex
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


def _user_data(n=16, m=3, d=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, m, d)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray((x[..., 0] > 0).astype(np.int32))


_init_tiny = nnx.jit(lambda: Tiny(3, 2, rngs=nnx.Rngs(0)))  # compiled once, fresh models


def _trainer(loss=_ce, **kw):
  args = dict(data=_user_data(), clip_norm=1.0, sampling_rate=0.4, delta=1e-5,
              expected_batch_size=6.4, noise_multiplier=1.2, key=7, accountant="rdp")
  args.update(kw)
  return DPTrainer(_init_tiny(), loss, optax.sgd(0.5), **args)


def _leaves(state):
  return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                     else x) for x in jax.tree.leaves(state)]


@pytest.mark.slow
def test_resume_is_bit_identical_and_never_resets_the_ledger(tmp_path):
  full = _trainer()
  full.train(6, report_every=2, checkpoint_dir=tmp_path, checkpoint_every=4)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]

  resumed = _trainer()
  resumed.restore(tmp_path / "step_00000004")
  assert resumed.step_count == 4
  eps_at_ckpt = full.history[1]["epsilon"]
  assert eps_at_ckpt > 0
  assert resumed.epsilon() == pytest.approx(eps_at_ckpt, rel=1e-12)  # not reset
  assert resumed.history == full.history[:2]
  resumed.train(2, report_every=2)

  for a, b in zip(_leaves(full.state), _leaves(resumed.state), strict=True):
    assert a.dtype == b.dtype and np.array_equal(a, b)  # params, noise key+count, sample key
  assert resumed.epsilon() == pytest.approx(full.epsilon(), rel=1e-12)
  assert [h["epsilon"] for h in resumed.history] == pytest.approx(
      [h["epsilon"] for h in full.history], rel=1e-12)

  # a trainer that already spent refuses to restore (it would roll the ledger back)
  with pytest.raises(ValueError, match="fresh trainer"):
    resumed.restore(tmp_path)
  # a checkpoint of another privacy configuration is refused
  with pytest.raises(ValueError, match="configuration"):
    _trainer(noise_multiplier=2.0).restore(tmp_path)


@pytest.mark.slow
def test_budget_is_enforced_before_release_also_after_resume(tmp_path):
  probe = PrivacyLedger(delta=1e-5, accountant="rdp")
  ev = dp_accounting.PoissonSampledDpEvent(0.4, dp_accounting.GaussianDpEvent(1.2))
  probe.compose(ev, label="x", count=2)
  budget = probe.epsilon() * 1.01  # room for exactly 2 steps

  tr = _trainer(epsilon_budget=budget)
  tr.train(2, report_every=2, checkpoint_dir=tmp_path)
  before = _leaves(tr.state)
  with pytest.raises(PrivacyBudgetExceeded):
    tr.train(1, report_every=1)
  for a, b in zip(before, _leaves(tr.state)):  # nothing ran, nothing was released
    assert np.array_equal(a, b)
  assert tr.step_count == 2

  resumed = _trainer(epsilon_budget=budget).restore(tmp_path)
  with pytest.raises(PrivacyBudgetExceeded):
    resumed.train(1, report_every=1)


@pytest.mark.slow
def test_calibrated_noise_scale_of_the_shared_chain():
  # Zero-gradient loss: one SGD(lr=1) step moves the params by exactly -noise, whose stddev
  # must be z*C/(q n) with z calibrated to the target. Accept 1x, reject 0.5x and 1.5x.
  class Wide(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(20, 20, rngs=rngs)

    def __call__(self, x):
      return self.l(x)

  n, q, clip = 10, 0.5, 2.0
  data = (jnp.zeros((n, 1, 20)),)
  model = nnx.jit(lambda: Wide(nnx.Rngs(0)))()
  tr = DPTrainer(model, lambda mdl, ex: 0.0 * jnp.sum(mdl(ex[0])), optax.sgd(1.0), data=data,
                 clip_norm=clip, sampling_rate=q, delta=1e-5, expected_batch_size=q * n,
                 target_epsilon=2.0, num_steps=1, key=1, accountant="rdp")
  z = tr.noise_multiplier
  expected = z * clip / (q * n)
  assert tr.noise_stddev == pytest.approx(expected)
  before = _leaves(tr.params)
  eps = tr.train(1, report_every=1)[-1]["epsilon"]
  assert 1.8 < eps <= 2.0 * (1 + 1e-6)  # calibrated: meets the target, and tightly
  moved = np.concatenate([(b - a).ravel() for a, b in zip(before, _leaves(tr.params))])
  sd = float(np.std(moved))  # 420 coordinates: relative error ~3.5%
  assert abs(sd / expected - 1) < 0.15
  assert abs(sd / (0.5 * expected) - 1) > 0.5 and abs(sd / (1.5 * expected) - 1) > 0.2
  rep = tr.privacy_report()
  assert rep.provenance == "accountant" and rep.level == "user"
  assert rep.epsilon == pytest.approx(eps)


@pytest.mark.slow
def test_fast_and_vmap_trainers_agree():
  x, y = _user_data(m=1)
  data = (x[:, 0], y[:, 0])
  fast = _trainer(method="fast", level="item", data=data, sampling_rate=0.5)
  slow = _trainer(method="vmap", level="item", data=data, sampling_rate=0.5)
  fast.train(3, report_every=3)
  slow.train(3, report_every=3)
  for a, b in zip(_leaves(fast.params), _leaves(slow.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert fast.epsilon() == slow.epsilon()
  auto = _trainer(method="auto", level="item", data=data, sampling_rate=0.5)
  assert auto.clipper.method in ("fast", "vmap")  # resolved at construction, data-free
  auto.train(3, report_every=3)
  for a, b in zip(_leaves(auto.params), _leaves(slow.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert auto.epsilon() == slow.epsilon()


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="sampling_rate"):
    _trainer(sampling_rate=0.0)
  with pytest.raises(ValueError, match="noise_multiplier"):
    _trainer(noise_multiplier=0.0)
  with pytest.raises(ValueError, match="target_epsilon"):
    _trainer(noise_multiplier=None)
  with pytest.raises(ValueError, match="clip_norm"):
    _trainer(clip_norm=-1.0)
  tr = _trainer()
  with pytest.raises(ValueError, match="checkpoint_every"):
    tr.train(2, report_every=2, checkpoint_dir="/tmp/x", checkpoint_every=3)


@pytest.mark.parametrize("method", ["fast", "vmap"])
def test_accumulated_step_equals_the_one_shot_step(method):
  # Same key, same sampled users: k micro-batches of clipped sums + one noise draw must give
  # the one-shot step (float tolerance). Capacity 16 = all users, so k=1 is one chunk.
  # No precision pin here: the clipped sum (both methods) runs at float32 matmuls whatever the
  # backend default. At TF32 (an H200, before that pin) chunks of 4 and of 16 users were
  # rounded differently and the parameters differed by more than 1e-5 after three steps.
  one = _trainer(method=method, batch_capacity=16)
  acc = _trainer(method=method, batch_capacity=16, accumulation_steps=4)
  assert (one.micro_batch, acc.micro_batch) == (16, 4)
  one.train(3, report_every=3)
  acc.train(3, report_every=3)
  for a, b in zip(_leaves(one.params), _leaves(acc.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert one.epsilon() == acc.epsilon()  # accumulation changes nothing in the accounting
  moved = max(float(np.abs(a - b).max())
              for a, b in zip(_leaves(_trainer().params), _leaves(one.params)))
  assert moved > 1e-3  # the steps did something


def test_multisteps_is_refused_with_the_supported_way():
  for opt in (optax.MultiSteps(optax.sgd(0.1), 2),
              optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation(),
              optax.chain(optax.clip(1.0), optax.MultiSteps(optax.sgd(0.1), 2))):
    with pytest.raises(ValueError, match="accumulation_steps"):
      DPTrainer(_init_tiny(), _ce, opt, data=_user_data(), clip_norm=1.0, sampling_rate=0.4,
                delta=1e-5, expected_batch_size=6.4, noise_multiplier=1.2)


def test_loss_and_layout_contracts_raise_before_any_step():
  x, y = _user_data()
  vec = lambda model, ex: jnp.repeat(jnp.sum(model(ex[0])), 3)  # shape (3,) per item
  for level, data in (("user", (x, y)), ("item", (x[:, 0], y[:, 0]))):
    with pytest.raises(ValueError, match=r"loss_fn.*\(3,\)"):
      _trainer(data=data, level=level, loss=vec)
  # item level given user-shaped [n, m, d] data: the loss of one "item" is not a scalar
  with pytest.raises(ValueError, match="level='user'"):
    _trainer(data=(x, y), level="item")
  # user level given item-shaped [n, d] data
  with pytest.raises(ValueError, match="level='item'"):
    _trainer(data=(x[:, 0], y[:, 0]), level="user")
  with pytest.raises(ValueError, match="level='item'"):  # labels-free item data
    _trainer(data=(x[:, 0],), level="user", loss=lambda model, ex: jnp.sum(model(ex[0])))


def test_state_and_trainer_reprs_redact_keys():
  tr = _trainer()
  tr.train(1, report_every=1)
  secrets = [jax.random.key_data(tr.state.sample_key),
             jax.random.key_data(tr.state.opt_state[0].key)]
  words = {str(int(v)) for k in secrets for v in np.asarray(k).ravel()}
  for text in (repr(tr.state), str(tr.state), repr(tr)):
    assert "redacted" in text
    assert not any(w in text for w in words if len(w) > 3), text
    assert "key_data" not in text and "uint32" not in text


@pytest.mark.parametrize("name,value", [
    ("clip_norm", "1.0"), ("sampling_rate", True), ("target_epsilon", True),
    ("epsilon_budget", True), ("noise_multiplier", "1.2"), ("expected_batch_size", True),
    ("debug", "false"), ("key", "7"), ("batch_capacity", True), ("accumulation_steps", 2.5)])
def test_bad_types_raise_naming_the_parameter(name, value):
  kw = {name: value}
  if name == "target_epsilon":
    kw["num_steps"] = 3
  err = ValueError if name == "accumulation_steps" else TypeError
  with pytest.raises(err, match=name):
    _trainer(**kw)


def _tamper(path, edit):
  meta_file = os.path.join(path, "meta", "metadata")
  with open(meta_file) as f:
    meta = json.load(f)
  edit(meta)
  with open(meta_file, "w") as f:
    json.dump(meta, f)


def _redigest(meta):
  """A consistent forgery of the unkeyed digests: the ledger's and the checkpoint's seal
  (which anyone can recompute; only an HMAC key stops it)."""
  led = meta["ledger"]
  led["digest"] = _digest({"config": led["config"], "entries": led["entries"]})
  meta.update(seal(meta, meta["integrity"]["arrays_sha256"]))


@pytest.mark.slow
def test_restore_refuses_tampered_checkpoints_and_skips_partial_ones(tmp_path):
  src = _trainer(epsilon_budget=50.0)
  src.train(4, report_every=2, checkpoint_dir=tmp_path / "a", checkpoint_every=2)
  good = str(tmp_path / "a" / "step_00000004")
  cases = [  # (edit, what catches it)
      (lambda m: m["ledger"].update(entries=[]), "digest"),  # events removed
      (lambda m: m["ledger"]["entries"][0].update(count=1), "digest"),  # a count lowered
      (lambda m: (m["ledger"]["entries"][0].update(count=1), _redigest(m)), "step count"),
      (lambda m: (m["ledger"].update(entries=[]), _redigest(m)), "step count"),
      (lambda m: m["ledger"]["config"].update(epsilon_budget=1e9), "digest"),  # budget raised
      (lambda m: (m["ledger"]["config"].update(epsilon_budget=1e9), _redigest(m)),
       "configuration"),
      (lambda m: (m["ledger"]["config"].update(accountant="pld"), _redigest(m)),
       "configuration"),  # another accountant
  ]
  import shutil
  for i, (edit, match) in enumerate(cases):
    path = str(tmp_path / f"t{i}" / "step_00000004")
    shutil.copytree(good, path)
    _tamper(path, edit)
    with pytest.raises(LedgerIntegrityError, match=match):
      _trainer(epsilon_budget=50.0).restore(path)
  # the restoring trainer's own configuration must match the checkpoint's ledger
  with pytest.raises(LedgerIntegrityError, match="configuration"):
    _trainer(epsilon_budget=80.0).restore(good)  # budget raised after training
  with pytest.raises(LedgerIntegrityError, match="configuration"):
    _trainer(epsilon_budget=50.0, accountant="pld").restore(good)
  # a crash mid-save leaves a partial temporary folder: never chosen as the latest
  partial = tmp_path / "a" / "step_00000006.orbax-checkpoint-tmp-1234"
  (partial / "state").mkdir(parents=True)
  assert DPTrainer.latest_checkpoint(tmp_path / "a") == good
  back = _trainer(epsilon_budget=50.0).restore(tmp_path / "a")
  assert back.step_count == 4 and back.epsilon() == pytest.approx(src.epsilon(), rel=1e-12)


def test_drives_an_nnx_optimizer_and_updates_the_model_in_place():
  model = _init_tiny()
  opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
  tr = DPTrainer(model, _ce, opt, data=_user_data(), clip_norm=1.0, sampling_rate=0.4,
                 delta=1e-5, expected_batch_size=6.4, noise_multiplier=1.2, key=7,
                 accountant="rdp")
  ref = DPTrainer(_init_tiny(), _ce, optax.adam(0.1), data=_user_data(), clip_norm=1.0,
                  sampling_rate=0.4, delta=1e-5, expected_batch_size=6.4,
                  noise_multiplier=1.2, key=7, accountant="rdp")
  before = _leaves(nnx.state(model, nnx.Param))
  tr.train(2, report_every=1)
  ref.train(2, report_every=2)
  now = _leaves(nnx.state(model, nnx.Param))
  assert any(not np.array_equal(a, b) for a, b in zip(before, now))  # updated in place
  for a, b, c in zip(now, _leaves(tr.params), _leaves(ref.params), strict=True):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)  # same as the plain optax tx
  assert int(opt.step.value) == 2
  opt_vals = [np.asarray(v.value) for v in jax.tree.leaves(
      opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))]
  for a, b in zip(opt_vals, _leaves(tr.state.opt_state[1]), strict=True):
    np.testing.assert_array_equal(a, b)
