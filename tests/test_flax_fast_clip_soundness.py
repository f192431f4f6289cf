"""Fast clipping never releases more than C per user: a layer grid and four failure classes.

Every check measures, per user, the realised contribution (the clipped sum with only that user
unmasked, its norm in float64) against the clip norm C, set below every user's norm so that
everyone is clipped (the bound is then tight), and the fast norms against the exact ones:
``contribution <= C (1 + 1e-6)`` and ``fast >= exact (1 - 1e-6)``. On ordinary inputs the
fast norms are also tight (``<= exact (1 + 1e-4)``) and the clipped sum equals the vmap
reference. Failure classes: parameter transforms inside a layer's call (Param subclass,
value hook, promote_dtype hook, WeightNorm / SpectralNorm), adversarial Gram inputs
(``x1 = x0 + u``, ``|x0|`` 1e2..1e6, float64 reference), parameters shared across modules,
negative conv padding, bfloat16 parameters and kernels held in non-Param variables (issue
#23). Run with ``-s`` to print the grid (path chosen, worst ratios).
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from dpsco_jax.flax.fast_clip import FastClippedGrad
from dpsco_jax.grads import per_user_grads

TOL = 1e-6


def _sq_loss(model, ex):
  x, y = ex
  return jnp.sum(jnp.square(model(x) - y))


def _contributions(f, params, batch, n):
  out = []
  for u in range(n):
    s, _ = f(params, batch, jnp.arange(n) == u)
    out.append(np.sqrt(sum(np.sum(np.asarray(l, np.float64) ** 2) for l in jax.tree.leaves(s))))
  return np.asarray(out)


def _audit(name, model, loss_fn, batch, *, level, exact=None, ghost="auto", tight=True,
           precision="highest"):
  """Asserts the two soundness inequalities; returns (plan, worst fast/exact, worst contrib/C).
  ``exact``: float64 per-user norms; default: the core's vmap per-user gradients. Everything
  runs at full float32 matmuls (``precision``): the vmap reference and the model's own
  backward otherwise follow the backend default (TF32 / bf16 passes: 1e-3 relative); with
  ``precision=None`` only the contribution bound, which holds at any precision, is checked."""
  ctx = (jax.default_matmul_precision(precision) if precision else contextlib.nullcontext())
  with ctx:
    return _audit_at(name, model, loss_fn, batch, level=level, exact=exact, ghost=ghost,
                     tight=tight and precision is not None, check_ratio=precision is not None)


def _audit_at(name, model, loss_fn, batch, *, level, exact, ghost, tight, check_ratio):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  users = jax.tree.map(lambda x: x[:, None], batch) if level == "item" else batch
  n = jax.tree.leaves(batch)[0].shape[0]
  if exact is None:
    lf = lambda p, ex: loss_fn(nnx.merge(graphdef, p, rest), ex)
    grads = jax.jit(lambda p, u: per_user_grads(lf, p, u))(params, users)
    exact = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(n, -1) ** 2, axis=1)
                        for g in jax.tree.leaves(grads)))
  clip = 0.5 * float(np.min(exact))
  fast = FastClippedGrad(model, loss_fn, clip_norm=clip, level=level, ghost=ghost)
  f = jax.jit(fast.clipped_sum)
  _, info = f(params, batch, jnp.ones((n,), bool))
  ratio = np.asarray(info.norms, np.float64) / exact
  contrib = _contributions(f, params, batch, n) / clip
  plan = fast.plan(params, batch)
  paths = sorted({"/".join(map(str, p)) for p, _ in plan.fast})
  fb = sorted({"/".join(map(str, lp[:-1])) for lp in plan.fallback})
  print(f"\n{name:28s} {level:4s} fast={paths} fallback={fb} "
        f"fast/exact in [{ratio.min():.7f}, {ratio.max():.7f}] contrib/C max {contrib.max():.7f}")
  assert np.all(contrib <= 1 + TOL), contrib
  if check_ratio:
    assert np.all(ratio >= 1 - TOL), ratio
  if tight:
    assert np.all(ratio <= 1 + 1e-4), ratio
    assert np.all(contrib >= 1 - 1e-4), contrib
  return plan, ratio, contrib


def _data(seed, x_shape, y_shape):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(x_shape), jnp.float32),
          jnp.asarray(rng.standard_normal(y_shape), jnp.float32))


def _build(fn, seed=0):
  """Abstract init, then numpy values: no initializer is compiled (keeps the file fast)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: fn(nnx.Rngs(seed))))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), s.dtype)
                       if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype),
                       state)
  return nnx.merge(graphdef, state)


def _fast_paths(plan):
  return {p[0] if len(p) == 1 else p for p, _ in plan.fast}


# --------------------------------------------------------------------------------------------
# The grid: every supported layer and setting, item and user level.
# --------------------------------------------------------------------------------------------

CONV2D = {
    "c_same_s2": dict(kernel_size=(3, 3), strides=(2, 1), padding="SAME"),
    "c_valid_kdil": dict(kernel_size=(2, 3), padding="VALID", kernel_dilation=(2, 1)),
    "c_explicit": dict(kernel_size=(3, 2), padding=((1, 2), (0, 1))),
    "c_circular": dict(kernel_size=(2, 2), padding="CIRCULAR", kernel_dilation=(1, 2)),
    "c_reflect": dict(kernel_size=(3, 3), padding="REFLECT"),
    "c_in_dil": dict(kernel_size=(2, 2), input_dilation=(2, 1), padding=((1, 1), (0, 1))),
    "c_groups2": dict(kernel_size=(3, 3), feature_group_count=2, padding="SAME"),
    "c_nobias": dict(kernel_size=(1, 1), use_bias=False),
}
CONV1D = {
    "c_causal": dict(kernel_size=(3,), padding="CAUSAL"),
    "c_s2_valid": dict(kernel_size=(2,), strides=(2,), padding="VALID"),
    "c_dil2": dict(kernel_size=(3,), kernel_dilation=(2,), padding="SAME"),
    "c_groups4": dict(kernel_size=(2,), feature_group_count=4, padding=((2, 0),)),
}
CONV3D = {
    "c_same": dict(kernel_size=(2, 2, 2), strides=(1, 2, 1), padding="SAME"),
    "c_groups2": dict(kernel_size=(2, 1, 2), feature_group_count=2, padding="VALID"),
}


class Branches(nnx.Module):
  """Parallel conv branches (one per setting) feeding a Linear head, with a LayerNorm."""

  def __init__(self, configs, cin, cout, rngs):
    self.names = tuple(configs)
    for name, cfg in configs.items():
      setattr(self, name, nnx.Conv(cin, cout, rngs=rngs, **cfg))
    self.ln = nnx.LayerNorm(cout, rngs=rngs)
    self.head = nnx.Linear(cout, 2, rngs=rngs)

  def __call__(self, x):
    h = sum(jnp.mean(jnp.tanh(getattr(self, k)(x)), axis=tuple(range(x.ndim - 1)))
            for k in self.names)
    return self.head(self.ln(h))


class SeqModel(nnx.Module):
  """Linear per position (sequence inputs), LayerNorm, bias-free Linear, Embed."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(7, 4, rngs=rngs)
    self.l1 = nnx.Linear(4, 5, rngs=rngs)
    self.ln = nnx.LayerNorm(5, rngs=rngs)
    self.l2 = nnx.Linear(5, 3, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    h = self.l2(jnp.tanh(self.ln(self.l1(self.embed(tokens)))))  # [T, 3]
    return jnp.mean(h, axis=0) + self.l2(jnp.tanh(self.l1(self.embed(tokens[:2])))).sum(0)


def test_grid_conv2d():
  # user level (item level is the m = 1 case of the same code; see the other grid tests)
  model = _build(lambda r: Branches(CONV2D, 4, 6, r), seed=1)
  batch = _data(2, (3, 2, 6, 5, 4), (3, 2, 2))
  plan, _, _ = _audit("conv2d grid", model, _sq_loss, batch, level="user")
  assert _fast_paths(plan) == set(CONV2D) | {"ln", "head"}


def test_grid_conv1d_conv3d():
  m1 = _build(lambda r: Branches(CONV1D, 4, 8, r), seed=3)
  plan, _, _ = _audit("conv1d grid", m1, _sq_loss, _data(4, (4, 9, 4), (4, 2)), level="item")
  assert _fast_paths(plan) == set(CONV1D) | {"ln", "head"}
  m3 = _build(lambda r: Branches(CONV3D, 2, 4, r), seed=5)
  plan, _, _ = _audit("conv3d grid", m3, _sq_loss, _data(6, (3, 2, 3, 4, 3, 2), (3, 2, 2)),
                      level="user")
  assert _fast_paths(plan) == set(CONV3D) | {"ln", "head"}


@pytest.mark.parametrize("level", ["user", "item"])
def test_grid_sequence_embed_linear_layernorm(level):
  model = _build(SeqModel, seed=7)
  rng = np.random.default_rng(8)
  shape = (4, 2, 6) if level == "user" else (5, 6)
  tokens = jnp.asarray(rng.integers(-2, 7, shape))  # repeats and negative ids
  y = jnp.asarray(rng.standard_normal(shape[:-1] + (3,)), jnp.float32)
  plan, _, _ = _audit("embed/linear/layernorm", model, _sq_loss, (tokens, y), level=level)
  assert _fast_paths(plan) == {"embed", "l1", "ln", "l2"}


# --------------------------------------------------------------------------------------------
# 1. Parameter transforms inside a layer's call.
# --------------------------------------------------------------------------------------------


class Times3(nnx.Param):
  """A Param whose value accessor rescales: the layer computes with 3x the raw value."""

  def get_value(self, **kwargs):
    return 3.0 * super().get_value(**kwargs)


def _rescaling_promote(args, *, dtype=None, inexact=True):
  out = nnx_dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)
  return [None if a is None else 2.0 * a for a in out]


class Hooked(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 4, rngs=rngs)
    self.conv = nnx.Conv(4, 4, (2,), rngs=rngs)
    self.embed = nnx.Embed(5, 3, rngs=rngs)
    self.promo = nnx.Linear(4, 4, promote_dtype=_rescaling_promote, rngs=rngs)
    self.hook = nnx.Linear(4, 2, rngs=rngs)
    self.ok = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, tokens):
    h = self.conv(jnp.tanh(self.lin(self.embed(tokens))))
    return self.ok(self.hook(jnp.tanh(self.promo(h)))).sum(0)


def test_param_subclass_value_hooks_and_promote_dtype_take_the_fallback():
  model = _build(Hooked, seed=21)
  for name, attr in (("lin", "kernel"), ("conv", "kernel"), ("embed", "embedding")):
    layer = getattr(model, name)
    setattr(layer, attr, Times3(getattr(layer, attr).get_value()))
  with warnings.catch_warnings():  # metadata hooks are deprecated, but still honoured by flax
    warnings.simplefilter("ignore")
    model.hook.kernel = nnx.Param(model.hook.kernel.get_value(),
                                  on_get_value=lambda var, v: 3.0 * v)
  rng = np.random.default_rng(22)
  tokens = jnp.asarray(rng.integers(0, 5, (5, 6)))
  y = jnp.asarray(rng.standard_normal((5, 2)), jnp.float32)
  plan, _, _ = _audit("Param x3 / hooks / promote", model, _sq_loss, (tokens, y), level="item")
  assert _fast_paths(plan) == {"ok"}


class Wrapped(nnx.Module):
  def __init__(self, rngs):
    self.wn = nnx.WeightNorm(nnx.Linear(3, 4, rngs=rngs), rngs=rngs)
    self.sn = nnx.SpectralNorm(nnx.Linear(4, 4, rngs=rngs), rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.sn(jnp.tanh(self.wn(x)), update_stats=False)))


def test_weightnorm_and_spectralnorm_take_the_fallback():
  model = Wrapped(nnx.Rngs(23))  # WeightNorm keeps its scales outside the state: eager init
  plan, _, _ = _audit("WeightNorm/SpectralNorm", model, _sq_loss,
                      _data(24, (4, 2, 3), (4, 2, 2)), level="user")
  assert _fast_paths(plan) == {"out"}


# --------------------------------------------------------------------------------------------
# 2. Adversarial Gram inputs (float64 reference).
# --------------------------------------------------------------------------------------------


def _pair_loss(model, x):
  h = model(x)  # [2, k]: the loss sees only h0 - h1, so g0 = -g1
  return jnp.sum(jnp.square(h[0] - h[1] - 1.0))


@pytest.mark.parametrize("ghost", ["auto", "gram", "direct"])
def test_adversarial_cancelling_inputs_linear(ghost):
  model = _build(lambda r: nnx.Linear(16, 8, use_bias=False, rngs=r), seed=25)
  w = np.asarray(model.kernel.get_value(), np.float64)
  rng = np.random.default_rng(26)
  worst = []
  for scale in (1e2, 1e4, 1e6):
    x0 = rng.standard_normal((3, 1, 16)) * scale
    x = np.concatenate([x0, x0 + rng.standard_normal((3, 1, 16))], 1).astype(np.float32)
    x64 = x.astype(np.float64)
    r = (x64[:, 0] - x64[:, 1]) @ w - 1.0
    exact = np.sqrt(np.sum(np.einsum("bd,bk->bdk", x64[:, 0] - x64[:, 1], 2 * r) ** 2, (1, 2)))
    _, ratio, contrib = _audit(f"adversarial linear {scale:.0e}", model, _pair_loss,
                               jnp.asarray(x), level="item", exact=exact, ghost=ghost,
                               tight=False)
    worst.append(ratio.min())
  assert min(worst) >= 1 - TOL


class ScaledEmbed(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(3, 4, rngs=rngs)

  def __call__(self, ex):
    tokens, s = ex
    return self.embed(tokens) * s[:, None]  # [2, 4]


def test_adversarial_cancelling_inputs_embed():
  model = _build(ScaledEmbed, seed=27)
  e = np.asarray(model.embed.embedding.get_value(), np.float64)
  for scale in (1e2, 1e4, 1e6):
    s = np.asarray([[scale, scale + 1.0]] * 3, np.float32)
    tokens = jnp.asarray([[1, 1]] * 3)  # the same row twice, cotangents of opposite sign
    s64 = s.astype(np.float64)
    r = e[1][None] * (s64[:, :1] - s64[:, 1:]) - 1.0            # [3, 4]
    exact = np.sqrt(np.sum((2 * r * (s64[:, :1] - s64[:, 1:])) ** 2, axis=1))
    _audit(f"adversarial embed {scale:.0e}", model, _pair_loss, (tokens, jnp.asarray(s)),
           level="item", exact=exact, tight=False)


# --------------------------------------------------------------------------------------------
# 3. Parameters shared across modules; 4. negative conv padding.
# --------------------------------------------------------------------------------------------


class Shared(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.b.kernel = self.a.kernel                 # two Linears, one kernel (b owns no Param)
    self.embed = nnx.Embed(4, 4, rngs=rngs)
    self.tied = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.tied.kernel = self.embed.embedding       # an Embed table read as a Linear kernel
    self.ln1 = nnx.LayerNorm(4, rngs=rngs)
    self.ln2 = nnx.LayerNorm(4, rngs=rngs)
    self.ln2.scale = self.ln1.scale               # two LayerNorms, one scale
    self.c = nnx.Linear(4, 4, rngs=rngs)
    self.ein = nnx.Einsum("ti,io->to", (4, 4), rngs=rngs)
    self.ein.kernel = self.c.kernel               # a kernel also read by an Einsum
    self.ok = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, ex):
    tokens, x = ex
    h = self.ln1(self.b(jnp.tanh(self.a(x))) + self.embed(tokens))
    h = self.ln2(self.tied(jax.nn.softmax(h)))
    h = jnp.tanh(self.c(h)) + self.ein(h)
    return self.ok(h).sum(0)


def test_shared_params_never_crash_and_take_the_fallback():
  model = _build(Shared, seed=29)
  rng = np.random.default_rng(30)
  tokens = jnp.asarray(rng.integers(0, 4, (4, 2, 3)))
  x = jnp.asarray(rng.standard_normal((4, 2, 3, 4)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((4, 2, 2)), jnp.float32)
  plan, _, _ = _audit("shared params", model, _sq_loss, ((tokens, x), y), level="user")
  assert _fast_paths(plan) == {"ok"}


class NegPad(nnx.Module):
  def __init__(self, rngs):
    self.neg = nnx.Conv(2, 3, (3,), padding=((-1, 2),), rngs=rngs)
    self.pos = nnx.Conv(3, 2, (2,), padding=((1, 0),), rngs=rngs)

  def __call__(self, x):
    return jnp.mean(self.pos(jnp.tanh(self.neg(x))), axis=0)


def test_negative_conv_padding_takes_the_fallback():
  model = _build(NegPad, seed=31)
  plan, _, _ = _audit("negative padding", model, _sq_loss, _data(32, (4, 7, 2), (4, 2)),
                      level="item")
  assert _fast_paths(plan) == {"pos"}


def test_contribution_bound_at_the_backend_default_precision():
  # no precision override: on GPU/TPU the model's own matmuls are TF32/bf16, the clipper's
  # norms and releases stay HIGHEST, and the realised contribution is still <= C
  model = _build(lambda r: Branches(CONV1D, 4, 8, r), seed=41)
  _audit("conv1d grid, default prec", model, _sq_loss, _data(42, (4, 9, 4), (4, 2)),
         level="item", precision=None)
  lin = _build(lambda r: nnx.Linear(16, 8, use_bias=False, rngs=r), seed=43)
  x0 = np.random.default_rng(44).standard_normal((3, 1, 16)) * 1e4
  x = np.concatenate([x0, x0 + 1.0], 1).astype(np.float32)
  _audit("adversarial, default prec", lin, _pair_loss, jnp.asarray(x), level="item",
         precision=None)


# --------------------------------------------------------------------------------------------
# 5. Low-precision parameters and kernels held in non-Param variables (issue #23).
# --------------------------------------------------------------------------------------------


class MixedPrecision(nnx.Module):
  """A bfloat16 Linear (fallback: per-user grads are bfloat16) feeding a float32 one."""

  def __init__(self, rngs):
    self.low = nnx.Linear(6, 5, param_dtype=jnp.bfloat16, rngs=rngs)
    self.out = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.low(x)).astype(jnp.float32))


@pytest.mark.parametrize("level", ["item", "user"])
def test_bfloat16_params_never_release_more_than_c(level):
  # w_u g_u used to be formed (and the sum returned) in bfloat16: a single example's
  # clipped contribution measured 1.0018 C. Now weighted and summed in float32. On an H200
  # this failed again while passing on CPU: XLA:GPU's excess-precision pass removed the
  # f32 -> bf16 -> f32 round trip of the per-user gradients inside the program, so the fast
  # norms were those of unrounded gradients and the reference's of bfloat16 ones; the per-user
  # bfloat16 gradients are now pinned to their rounded values (reduce_precision).
  for name, build in (("bf16 linear", lambda r: nnx.Linear(16, 8, param_dtype=jnp.bfloat16,
                                                           rngs=r)),
                      ("bf16 + f32", MixedPrecision)):
    model = _build(build, seed=51)
    x_dim = 16 if name == "bf16 linear" else 6
    y_dim = 8 if name == "bf16 linear" else 3
    shape = (8,) if level == "item" else (4, 3)
    batch = _data(52, shape + (x_dim,), shape + (y_dim,))
    plan, _, contrib = _audit(name, model, _sq_loss, batch, level=level)
    assert contrib.max() <= 1.0
    fast = FastClippedGrad(model, _sq_loss, clip_norm=1.0, level=level)
    summed, _ = fast.clipped_sum(nnx.split(model, nnx.Param, ...)[1], batch)
    assert all(l.dtype == jnp.float32 for l in jax.tree.leaves(summed))
  assert _fast_paths(plan) == {"out"}


class FrozenKernel(nnx.Variable):
  """A kernel held fixed: not a Param, so not trained and given no gradient."""


class Frozen(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.a.kernel = FrozenKernel(self.a.kernel.get_value())       # bias stays a Param
    self.b = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.b.kernel = nnx.BatchStat(self.b.kernel.get_value())      # no Param at all
    self.c = nnx.Conv(4, 4, (2,), rngs=rngs)
    self.c.kernel = FrozenKernel(self.c.kernel.get_value())
    self.e = nnx.Embed(5, 4, rngs=rngs)
    self.e.embedding = FrozenKernel(self.e.embedding.get_value())
    self.ok = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, ex):
    tokens, x = ex
    h = jnp.tanh(self.a(x)) + self.e(tokens)
    h = jnp.tanh(self.c(jnp.tanh(self.b(h))))
    return self.ok(h).sum(0)


@pytest.mark.parametrize("level", ["item", "user"])
def test_kernels_in_non_param_variables_are_constants(level):
  # used to crash with KeyError('kernel'): the layer was tapped although its kernel is no
  # Param. Such layers now take the fallback (their Param bias gets its exact gradient).
  model = _build(Frozen, seed=53)
  rng = np.random.default_rng(54)
  lead = (5,) if level == "item" else (3, 2)
  tokens = jnp.asarray(rng.integers(0, 5, lead + (3,)))
  x = jnp.asarray(rng.standard_normal(lead + (3, 4)), jnp.float32)
  y = jnp.asarray(rng.standard_normal(lead + (2,)), jnp.float32)
  plan, _, _ = _audit("frozen kernels", model, _sq_loss, ((tokens, x), y), level=level)
  assert _fast_paths(plan) == {"ok"}
  fb = {lp for lp in plan.fallback}
  assert ("a", "bias") in fb and ("c", "bias") in fb
  assert not any(lp[-1] in ("kernel", "embedding") and lp[0] != "ok" for lp in fb)
