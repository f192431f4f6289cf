"""The vmap path of ``FastClippedGrad`` in chunks of users (``dpsco_jax/flax/fast_clip_vmap.py``):
the same clipped sum as all users at once (to the order of float additions), the same norms,
weights and kept users, the rule from shapes only, and less memory where it chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpsco_jax.flax import fast_clip_vmap as fvm
from dpsco_jax.flax.fast_clip import FastClippedGrad


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


class Cnn(nnx.Module):
  def __init__(self, ch: int, rngs: nnx.Rngs):
    self.c1 = nnx.Conv(3, ch, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(ch, ch, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(ch, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))
    return self.head(jnp.mean(x, axis=(-3, -2)))


def _ce(model, ex):
  x, y = ex
  return -jax.nn.log_softmax(model(x))[y]


def _batch(shape, img=8, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(shape + (img, img, 3)), jnp.float32),
          jnp.asarray(rng.integers(0, 10, shape), jnp.int32))


@pytest.mark.parametrize("level,shape,chunks", [("item", (11,), 3), ("user", (7, 2), 4)])
def test_chunked_vmap_sum_is_the_one_piece_sum(level, shape, chunks):
  """11 examples in chunks of 4, 4, 3 (7 users in 2, 2, 2, 1): with a masked user and one
  whose gradient is NaN (dropped, contributing exactly nothing), the clipped sum equals the
  unchunked one to float rounding, and norms / weights / kept users are the same."""
  model = Cnn(4, nnx.Rngs(0))
  x, y = _batch(shape)
  x = x.at[(2,) if level == "item" else (2, 0)].set(jnp.nan)
  mask = jnp.ones(shape[0], bool).at[5].set(False)
  one = FastClippedGrad(model, _ce, clip_norm=0.05, level=level, method="vmap", vmap_chunks=1)
  many = FastClippedGrad(model, _ce, clip_norm=0.05, level=level, method="vmap",
                         vmap_chunks=chunks)
  s1, i1 = jax.jit(lambda b, m: one.clipped_sum(one.params, b, m))((x, y), mask)
  s2, i2 = jax.jit(lambda b, m: many.clipped_sum(many.params, b, m))((x, y), mask)
  assert not bool(i1.kept[2]) and not bool(i1.kept[5]) and int(i1.kept.sum()) == shape[0] - 2
  np.testing.assert_array_equal(np.asarray(i1.kept), np.asarray(i2.kept))
  finite = np.asarray(jnp.isfinite(i1.norms))
  np.testing.assert_allclose(np.asarray(i2.norms)[finite], np.asarray(i1.norms)[finite],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(i2.weights), np.asarray(i1.weights), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    assert np.isfinite(np.asarray(b)).all()
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
  norms = jax.jit(lambda b: many.norms(many.params, b))((x, y))   # one program, not op by op
  np.testing.assert_allclose(np.asarray(norms)[finite], np.asarray(i1.norms)[finite], rtol=1e-6)
  # clipped: some users are over C = 0.05, every weight <= 1, and the sum's norm <= kept * C
  assert float(i1.weights.max()) <= 1.0 and float(i1.weights.min()) < 1.0
  total = float(jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(s2))))
  assert total <= 0.05 * int(i2.kept.sum()) * (1 + 1e-6)


def test_the_rule_reads_shapes_and_backend_only():
  """``auto`` chunks on CPU only where the per-user gradients are large (>= 8 MiB) and large
  against the batch (>= 2x its elements: slicing copies the batch), never on another
  backend; an int is taken as given (at most one user per chunk); bad values are refused."""
  s = jax.ShapeDtypeStruct
  cnn = {"k": s((3, 3, 64, 64), jnp.float32), "b": s((64,), jnp.float32)}   # 36.9 k / user
  glm = {"w": s((4096, 1), jnp.float32)}
  images = (s((1024, 1, 32, 32, 3), jnp.float32),)
  assert fvm.vmap_chunks("auto", cnn, images, "cpu")[0] == fvm.AUTO_CHUNKS    # 144 MiB, 12x
  assert fvm.vmap_chunks("auto", cnn, images, "gpu")[0] == 1
  assert fvm.vmap_chunks("auto", cnn, (s((16, 1, 32, 32, 3), jnp.float32),), "cpu")[0] == 1
  glm_rows = (s((4096, 64, 4096), jnp.float32),)                            # 4 GiB of data
  assert fvm.vmap_chunks("auto", glm, glm_rows, "cpu")[0] == 1
  assert fvm.vmap_chunks(3, glm, glm_rows, "gpu")[0] == 3
  assert fvm.vmap_chunks(9, cnn, (s((5, 1, 4), jnp.float32),), "cpu")[0] == 5
  # a large model but few users: chunks of at least MIN_CHUNK_USERS (8 -> 1, 24 -> 3, 64 -> 4)
  lm = {"e": s((8192, 256), jnp.float32), "h": s((256, 8192), jnp.float32)}   # 16 MiB / user
  tokens = lambda u: (s((u, 1, 129), jnp.int32),)
  assert [fvm.vmap_chunks("auto", lm, tokens(u), "cpu")[0] for u in (8, 24, 64)] == [1, 3, 4]
  for bad in (0, True, 2.5, "4", None):
    with pytest.raises((ValueError, TypeError)):
      FastClippedGrad(Cnn(2, nnx.Rngs(0)), _ce, clip_norm=1.0, vmap_chunks=bad)
  model = Cnn(4, nnx.Rngs(0))
  f = FastClippedGrad(model, _ce, clip_norm=1.0, level="item", method="vmap")
  chunks, why = f.plan(f.params, _batch((6,))).vmap_chunks
  assert chunks == 1 and "all users at once" in why            # a small model: one piece


def _step_temp(model, loss, batch, chunks: int) -> int:
  """Temporaries of a compiled (not run) item-level vmap-path step in ``chunks`` chunks."""
  f = FastClippedGrad(model, loss, clip_norm=1.0, level="item", method="vmap",
                      vmap_chunks=chunks)
  step = jax.jit(lambda p, b: f.aggregate(p, b, mode="mean", denominator=512.0))
  return step.lower(f.params, batch).compile().memory_analysis().temp_size_in_bytes


def test_chunks_hold_less_memory_in_a_compiled_step():
  """An MLP whose 512 per-example gradients (66 k parameters each, 135 MB) dwarf everything
  else: compiled (not run), four chunks hold well under the one-piece step's temporaries."""

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(256, 256, rngs=rngs)
      self.b = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  model = Mlp(nnx.Rngs(0))
  batch = (jax.ShapeDtypeStruct((512, 256), jnp.float32),
           jax.ShapeDtypeStruct((512,), jnp.int32))
  one, four = (_step_temp(model, _ce, batch, k) for k in (1, 4))
  grads = 512 * (256 * 256 + 256 + 256 * 10 + 10) * 4
  assert one >= grads and four < 0.5 * one, (one, four, grads)


def test_chunks_are_ordered_when_the_batch_holds_no_float():
  """A token model (int32 inputs and labels, as a language model's batch): the chunks are
  ordered through the parameters, so eight chunks hold well under one piece (81 against 193
  MiB). Ordered through the batch instead (the earlier form: 137 MiB), int tokens carried no
  dependence and XLA scheduled every chunk's gradients at once (bench_gpu's transformer:
  1.39x the non-private peak in 16 chunks as in 4)."""

  class Tokens(nnx.Module):
    def __init__(self, rngs):
      self.emb = nnx.Embed(512, 64, rngs=rngs)
      self.out = nnx.Linear(64, 512, rngs=rngs)

    def __call__(self, t):
      return self.out(jnp.tanh(self.emb(t)))

  def loss(model, ex):
    t, y = ex
    return -jax.nn.log_softmax(model(t))[y]

  batch = (jax.ShapeDtypeStruct((512,), jnp.int32),) * 2
  one, eight = (_step_temp(Tokens(nnx.Rngs(0)), loss, batch, k) for k in (1, 8))
  grads = 512 * (512 * 64 + 64 * 512 + 512) * 4
  assert one >= grads and eight < 0.5 * one, (one, eight, grads)
