"""Review findings on dpsco_jax.flax, one test each (each failed before its fix)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax.flax import DPTrainer

pytest.importorskip("orbax.checkpoint")


def _ce(model, ex):
  return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])


def _data(n=12, m=2):
  x = np.random.default_rng(0).normal(size=(n, m, 3)).astype(np.float32)
  return {"x": x, "y": (x[..., 0] > 0).astype(np.int32)}


def _trainer(model, optimizer=None, **kw):
  args = dict(data=_data(), clip_norm=1.0, sampling_rate=0.5, expected_batch_size=6.0,
              noise_multiplier=1.0, delta=1e-5, key=0)
  return DPTrainer(model, _ce, optimizer or optax.sgd(0.1), **{**args, **kw})


class _Wider(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(3, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)
    self.c = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.c(self.b(self.a(x)))


def test_restore_into_another_model_names_the_mismatch_and_prints_no_key(tmp_path):
  # Restoring a Linear's checkpoint into a trainer of a bigger model (or another optimizer)
  # raised orbax's raw tree-mismatch error, which printed the restoring trainer's arrays by
  # value: its sampling and noise keys (the same as the saved run's under the same seed).
  _trainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0))).train(1, checkpoint_dir=tmp_path)
  other = _trainer(_Wider(nnx.Rngs(0)))
  secrets = [str(int(v)) for k in (other.state.sample_key, other.state.opt_state[0].key)
             for v in np.asarray(jax.random.key_data(k))]
  with pytest.raises(ValueError, match="model's parameters or its optimizer") as err:
    other.restore(tmp_path)
  text = str(err.value)
  assert not [s for s in secrets if s in text], text
