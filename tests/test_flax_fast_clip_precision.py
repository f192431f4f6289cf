"""Precision lint: every matmul / conv of the fast clipped sum carries ``Precision.HIGHEST``.

CPU cannot show TF32 / bf16-pass effects (XLA:CPU ignores matmul precision), yet on an H200
at the backend default (TF32) fast-clipping tests failed that pass here. So this test reads
the traced program instead of its numbers: ``FastClippedGrad.clipped_sum`` is traced with no
precision context and every ``dot_general`` / ``conv_general_dilated`` equation, recursively
into every sub-jaxpr (pjit, custom_vjp, remat, scan, cond...), must carry ``HIGHEST`` (or
have float64 operands): the per-user norms, the released sum and the per-user gradients they
are taken of are then the float32 ones on every backend, whatever the user's default.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpsco_jax.flax.fast_clip import FastClippedGrad
from precision_lint import low_precision_eqns


class Mlp(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.a = nnx.Linear(6, 5, param_dtype=dtype, rngs=rngs)
    self.b = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)).astype(jnp.float32))


class Cnn(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.c = nnx.Conv(2, 4, (3, 3), param_dtype=dtype, rngs=rngs)
    self.n = nnx.LayerNorm(4, rngs=rngs)
    self.d = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = self.n(jnp.tanh(self.c(x)).astype(jnp.float32))
    return self.d(jnp.mean(h, axis=(0, 1)))


class Attn(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.e = nnx.Embed(7, 8, rngs=rngs)
    self.att = nnx.MultiHeadAttention(2, 8, decode=False, param_dtype=dtype, rngs=rngs)
    self.mix = nnx.Einsum("td,dk->tk", (8, 3), rngs=rngs)
    self.out = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, tokens):
    h = self.e(tokens)
    h = self.att(h).astype(jnp.float32)
    return self.out(jnp.mean(self.mix(h), axis=0))


def _loss(model, ex):
  x, y = ex
  return jnp.sum(jnp.square(model(x) - y))


CASES = {
    "linear": (Mlp, lambda lead: jnp.ones(lead + (6,))),
    "conv": (Cnn, lambda lead: jnp.ones(lead + (5, 5, 2))),
    "attention": (Attn, lambda lead: jnp.zeros(lead + (4,), jnp.int32)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("level", ["item", "user"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_matmul_of_the_clipped_sum_is_at_highest(case, level, dtype):
  build, make_x = CASES[case]
  model = build(nnx.Rngs(0), dtype=jnp.dtype(dtype))
  lead = (3,) if level == "item" else (3, 2)
  batch = (make_x(lead), jnp.zeros(lead + (3,)))
  params = nnx.split(model, nnx.Param, ...)[1]
  fast = FastClippedGrad(model, _loss, clip_norm=1.0, level=level)
  closed = jax.make_jaxpr(fast.clipped_sum)(params, batch, np.ones((3,), bool))
  bad = low_precision_eqns(closed.jaxpr)
  assert not bad, f"{len(bad)} matmuls below HIGHEST, e.g. {bad[:3]}"
  if dtype == "float32":  # and the plan did tap something (not all fallback)
    assert fast.plan(params, batch).fast
