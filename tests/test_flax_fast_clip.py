"""Fast (tap / ghost) per-user clipping equals the vmap reference through the core chain.

Every supported nnx layer (Linear on vectors and sequences, Conv with strides/padding modes,
Embed with repeated tokens, LayerNorm, biases), per-user grouping, shared layers, a tied
embedding (must be detected and sent to the fallback), an unsupported layer (fallback only),
masks and a NaN user are compared with ``per_user_grads`` + ``clip_and_aggregate`` of the core.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpsco_jax.flax.fast_clip import FastClippedGrad
from dpsco_jax.flax.fast_clip_norms import embed_bound, kernel_bound
from dpsco_jax.grads import per_user_grads
from dpsco_jax.transforms.clipping import clip_and_aggregate, tree_global_norms

RTOL, ATOL = 2e-4, 2e-5


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  """The vmap reference and the model's own backward run at the backend's default matmul
  precision (TF32 on GPU, bf16 passes on TPU: 1e-3 relative), so equality with it is checked
  at full float32. The clipper's own norms and releases are HIGHEST whatever this says."""
  with jax.default_matmul_precision("highest"):
    yield


def _sq_loss(model, ex):
  x, y = ex
  return jnp.sum(jnp.square(model(x) - y))


def _core_reference(model, loss_fn, batch, clip, level, mask, mode, denom):
  """The core chain: per_user_grads -> clip_per_user -> aggregate (no code of ours)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  lf = lambda p, ex: loss_fn(nnx.merge(graphdef, p, rest), ex)
  users = jax.tree.map(lambda x: x[:, None], batch) if level == "item" else batch
  chain = clip_and_aggregate(clip, mode, denom)

  @jax.jit
  def run(p, u, mask):
    grads = per_user_grads(lf, p, u)
    agg, _ = chain.update(grads, chain.init(p), p, user_mask=mask)
    return tree_global_norms(grads), agg

  return run(params, users, mask)


def _reference_grads(model, loss_fn, batch, level):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  lf = lambda p, ex: loss_fn(nnx.merge(graphdef, p, rest), ex)
  users = jax.tree.map(lambda x: x[:, None], batch) if level == "item" else batch
  grads, norms = jax.jit(lambda p, u: (lambda g: (g, tree_global_norms(g)))(
      per_user_grads(lf, p, u)))(params, users)
  return params, grads, norms


def _check(model, loss_fn, batch, *, level="user", mask=None, ghost="auto",
           expect_fast=None, expect_fallback_modules=(), ref=None):
  params, grads, ref_norms = ref or _reference_grads(model, loss_fn, batch, level)
  n = ref_norms.shape[0]
  # clip at the median norm so some users are clipped and some are not
  clip = float(np.median(np.asarray(ref_norms)))
  mask = jnp.ones((n,), bool) if mask is None else mask
  chain = clip_and_aggregate(clip, "mean", 3.0)
  ref_agg, _ = jax.jit(chain.update)(grads, chain.init(params), params, user_mask=mask)

  fast = FastClippedGrad(model, loss_fn, clip_norm=clip, level=level, ghost=ghost)
  summed, info = jax.jit(fast.clipped_sum)(params, batch, mask)
  chex.assert_shape(info.norms, (n,))
  np.testing.assert_allclose(info.norms, ref_norms, rtol=RTOL, atol=ATOL)
  chex.assert_trees_all_equal_shapes(summed, params)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x / 3.0, summed), ref_agg,
                              rtol=RTOL, atol=ATOL)
  plan = fast.plan(params, batch)
  if expect_fast is not None:
    assert {p for p, _ in plan.fast} == set(expect_fast), plan.fast
  for path in expect_fallback_modules:
    assert any(lp[:-1] == path for lp in plan.fallback), plan.fallback
  return fast, plan


class MLP(nnx.Module):
  def __init__(self, din, dh, dout, rngs):
    self.l1 = nnx.Linear(din, dh, rngs=rngs)
    self.ln = nnx.LayerNorm(dh, rngs=rngs)
    self.l2 = nnx.Linear(dh, dout, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.ln(self.l1(x))))


def _data(seed, x_shape, y_shape):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(x_shape), jnp.float32),
          jnp.asarray(rng.standard_normal(y_shape), jnp.float32))


def _build(cls, *args, seed=0, **kwargs):
  """Initializes a model in one compiled call (eager init compiles every initializer)."""
  return nnx.jit(lambda: cls(*args, rngs=nnx.Rngs(seed), **kwargs))()


@pytest.mark.slow
def test_linear_layernorm_item_level():
  # one vector per example: the Gram form is ||a||^2 ||g||^2
  model = _build(MLP, 5, 6, 3)
  batch = _data(1, (7, 5), (7, 3))
  fast, _ = _check(model, _sq_loss, batch, level="item",
                   expect_fast={("l1",), ("ln",), ("l2",)})
  # the public norms() agrees with the norms inside clipped_sum
  _, info = jax.jit(fast.clipped_sum)(fast.params, batch)
  np.testing.assert_allclose(jax.jit(fast.norms)(fast.params, batch), info.norms, rtol=1e-6)


def test_gram_and_direct_forms_are_tight_upper_bounds():
  # ordinary inputs: both forms bound the exact norm from above and are tight to ~1e-6
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((3, 9, 4)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((3, 9, 5)), jnp.float32)
  want = np.sqrt(np.sum(np.einsum("unp,unq->upq", np.asarray(a, np.float64),
                                  np.asarray(g, np.float64)) ** 2, axis=(1, 2)))
  for ghost in ("gram", "direct", "auto"):
    got = np.asarray(kernel_bound(a, g, ghost)[0], np.float64)
    assert np.all(got >= want) and np.all(got <= want * (1 + 1e-4)), (ghost, got / want)
  idx = jnp.asarray(rng.integers(0, 3, (3, 9)))
  dense = np.zeros((3, 3, 5))
  for u in range(3):
    for t in range(9):
      dense[u, int(idx[u, t])] += np.asarray(g[u, t], np.float64)
  want = np.sqrt(np.sum(dense ** 2, axis=(1, 2)))
  got = np.asarray(embed_bound(idx, g), np.float64)
  assert np.all(got >= want) and np.all(got <= want * (1 + 1e-4)), got / want


@pytest.mark.slow
def test_linear_sequence_inputs_per_user():
  # users x items x sequence positions: the Gram form runs over items and positions
  model = _build(MLP, 4, 5, 2, seed=1)
  batch = _data(2, (5, 3, 4, 4), (5, 3, 4, 2))
  _check(model, _sq_loss, batch, level="user", ghost="gram",
         expect_fast={("l1",), ("ln",), ("l2",)})


class ConvNet(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(2, 3, (3, 3), strides=(2, 1), padding="SAME", rngs=rngs)
    self.c2 = nnx.Conv(3, 2, (2, 2), padding="CIRCULAR", kernel_dilation=(1, 2), rngs=rngs)
    self.c3 = nnx.Conv(2, 2, (3,), padding="CAUSAL", rngs=rngs)
    self.out = nnx.Linear(2, 1, rngs=rngs)

  def __call__(self, x):  # x [H, W, C]
    h = jax.nn.relu(self.c1(x))
    h = jnp.tanh(self.c2(h))          # [H/2, W, 2]
    h = self.c3(h)                    # 1-D conv over W with H/2 as batch dims
    return self.out(jnp.mean(h, axis=(0, 1)))


@pytest.mark.slow
def test_conv_padding_modes_per_user():
  model = _build(ConvNet, seed=3)
  batch = _data(4, (4, 2, 6, 5, 2), (4, 2, 1))
  _check(model, _sq_loss, batch, level="user",
         expect_fast={("c1",), ("c2",), ("c3",), ("out",)})


class TokenModel(nnx.Module):
  def __init__(self, vocab, dim, rngs, tied=False):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)
    self.tied = tied

  def __call__(self, tokens):
    h = jnp.tanh(self.proj(self.embed(tokens)))  # [T, dim]; proj used once per position
    h = self.proj(h)                              # the same layer called twice
    return self.embed.attend(h) if self.tied else self.head(h)


def _ce_loss(model, ex):
  tokens, targets = ex
  logits = model(tokens)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))


@pytest.mark.slow
def test_embed_repeated_tokens_and_shared_layer():
  model = _build(TokenModel, 5, 4, seed=5)
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, 5, (6, 2, 7)))  # 7 tokens of 5: repeats guaranteed
  targets = jnp.asarray(rng.integers(0, 5, (6, 2, 7)))
  _check(model, _ce_loss, (tokens, targets), level="user",
         expect_fast={("embed",), ("proj",), ("head",)})


@pytest.mark.slow
def test_tied_embedding_goes_to_fallback():
  # embed.attend reads the embedding outside Embed.__call__: taps alone would under-estimate
  model = _build(TokenModel, 5, 4, seed=8, tied=True)
  rng = np.random.default_rng(9)
  tokens = jnp.asarray(rng.integers(0, 5, (6, 7)))
  targets = jnp.asarray(rng.integers(0, 5, (6, 7)))
  _, plan = _check(model, _ce_loss, (tokens, targets), level="item",
                   expect_fast={("proj",)}, expect_fallback_modules=[("embed",)])
  assert ("embed",) not in dict(plan.fast)


class Odd(nnx.Module):
  """A layer the fast path does not know: a Param used through plain jnp ops."""

  def __init__(self, d, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (d,)))

  def __call__(self, x):
    return x * jnp.sin(self.w[...]) + self.w[...] ** 2


class WithOdd(nnx.Module):
  def __init__(self, rngs):
    self.cell = nnx.Linear(3, 3, rngs=rngs)
    self.l1 = nnx.Linear(3, 4, rngs=rngs)
    self.odd = Odd(4, rngs)
    # nnx.Einsum is tapped as a local layer (its own exact per-user VJP) since 1849773
    self.ein = nnx.Einsum("i,io->o", (4, 2), (2,), rngs=rngs)

  def __call__(self, x):
    # a supported layer called inside lax.scan: one trace, many executions -> fallback
    x, _ = jax.lax.scan(lambda h, _: (jnp.tanh(self.cell(h)), None), x, None, length=2)
    return self.ein(self.odd(self.l1(x)))


@pytest.mark.slow
def test_unsupported_layers_use_the_fallback():
  model = _build(WithOdd, seed=11)
  batch = _data(12, (5, 3, 3), (5, 3, 2))
  _, plan = _check(model, _sq_loss, batch, level="user", expect_fast={("l1",), ("ein",)},
                   expect_fallback_modules=[("odd",), ("cell",)])


@pytest.mark.slow
def test_masked_nan_and_adversarial_users():
  model = _build(MLP, 4, 5, 2, seed=13)
  x, y = (np.asarray(v) for v in _data(14, (6, 3, 4), (6, 3, 2)))
  clip = 0.3
  fast = FastClippedGrad(model, _sq_loss, clip_norm=clip, level="user")
  params = fast.params
  f = jax.jit(fast.clipped_sum)
  agg_fn = jax.jit(lambda p, b, m: fast.aggregate(p, b, m, mode="mean", denominator=4.0))
  mask = jnp.array([True, True, True, True, False, True])

  # 1. sensitivity: replace one user adversarially (huge data), the sum moves by <= 2C
  a, info = f(params, (x, y), jnp.ones(6, bool))
  assert bool(jnp.all(info.norms > clip))  # everyone is clipped: the bound is tight
  xb, yb = x.copy(), y.copy()
  xb[0], yb[0] = 1e3, -1e3
  b, _ = f(params, (xb, yb), jnp.ones(6, bool))
  diff = np.sqrt(sum(np.sum((np.asarray(u) - np.asarray(v)) ** 2)
                     for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
  assert diff <= 2 * clip * (1 + 1e-5)
  assert fast.sensitivity(mode="sum", relation="replace_one") == pytest.approx(2 * clip)
  assert fast.sensitivity(mode="mean", denominator=4.0) == pytest.approx(clip / 4)

  # 2. a user with a NaN gradient and a masked user contribute exactly zero
  xn = x.copy()
  xn[2, 1, 0] = np.nan
  summed, info = f(params, (xn, y), mask)
  assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree.leaves(summed))
  np.testing.assert_array_equal(info.kept, [True, True, False, True, False, True])
  assert float(info.weights[2]) == 0.0 and float(info.weights[4]) == 0.0
  xo, yo = xn.copy(), y.copy()  # whatever the dropped users hold, nothing changes
  xo[4], yo[4], xo[2, 0] = 5.0, -7.0, np.inf
  other, _ = f(params, (xo, yo), mask)
  chex.assert_trees_all_close(summed, other, rtol=1e-6, atol=1e-7)
  # 3. and the core chain (which drops the NaN user itself) gives the same aggregate
  _, ref = _core_reference(model, _sq_loss, (xn, y), clip, "user", mask, "mean", 4.0)
  chex.assert_trees_all_close(agg_fn(params, (xn, y), mask), ref, rtol=RTOL, atol=ATOL)


def test_bad_arguments_raise():
  model = MLP(2, 2, 1, nnx.Rngs(0))
  with pytest.raises(ValueError, match="clip_norm"):
    FastClippedGrad(model, _sq_loss, clip_norm=0.0)
  with pytest.raises(ValueError, match="level"):
    FastClippedGrad(model, _sq_loss, clip_norm=1.0, level="group")
  with pytest.raises(ValueError, match="method"):
    FastClippedGrad(model, _sq_loss, clip_norm=1.0, method="ghostly")
  with pytest.raises(ValueError, match="model"):
    FastClippedGrad(lambda x: x, _sq_loss, clip_norm=1.0)
  fast = FastClippedGrad(model, _sq_loss, clip_norm=1.0)
  with pytest.raises(ValueError, match="denominator"):
    fast.aggregate(fast.params, (jnp.ones((2, 1, 2)), jnp.ones((2, 1, 1))), mode="mean")


def test_auto_method_follows_the_cost_model_and_equals_both_paths():
  """``method="auto"`` (issue 26): resolved from the batch's shapes by the per-layer cost
  model (no timing, no data), reported by ``plan()``; the result equals both exact paths."""
  model = _build(MLP, 5, 6, 3)
  batch = _data(3, (6, 4, 5), (6, 4, 3))
  mask = jnp.ones((6,), bool).at[2].set(False)
  auto = FastClippedGrad(model, _sq_loss, clip_norm=0.5, method="auto")
  zeros = jax.tree.map(jnp.zeros_like, batch)  # a public stand-in of the training shapes
  chosen = auto.autotune(auto.params, zeros, mask)
  rep = auto.autotune_report
  plan = auto.plan(auto.params, batch)
  assert chosen == rep["chosen"] == ("fast" if plan.predicted["fast"] < plan.predicted["vmap"]
                                     else "vmap")
  assert plan.layers and all(r.method in ("ghost", "instantiate", "layer_vjp", "fallback")
                             and r.cost > 0 for r in plan.layers)
  got, _ = jax.jit(auto.clipped_sum)(auto.params, batch, mask)
  for method in ("fast", "vmap"):
    ref = FastClippedGrad(model, _sq_loss, clip_norm=0.5, method=method)
    want, _ = jax.jit(ref.clipped_sum)(ref.params, batch, mask)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
  fixed = FastClippedGrad(model, _sq_loss, clip_norm=0.5, method="vmap")
  assert fixed.autotune(fixed.params, zeros) == "vmap" and fixed.autotune_report is None


def test_auto_takes_vmap_for_a_glm_and_fast_for_an_embedding_model():
  """The cost model's two ends: one wide Linear with one output (per-user gradient as small as
  the data row: instantiating it is the vmap path) and a large embedding table with short
  sequences (the vmap path would hold a dense table per user)."""
  glm = nnx.Linear(64, 1, rngs=nnx.Rngs(0))
  x = (jnp.zeros((8, 4, 64)), jnp.zeros((8, 4, 1)))
  f = FastClippedGrad(glm, _sq_loss, clip_norm=1.0, method="auto")
  assert f.autotune(f.params, x) == "vmap"
  assert [r.method for r in f.plan(f.params, x).layers] == ["instantiate"]

  class Emb(nnx.Module):
    def __init__(self, rngs):
      self.e = nnx.Embed(512, 16, rngs=rngs)
      self.h = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, t):
      return self.h(jnp.mean(self.e(t), axis=0))

  emb = Emb(nnx.Rngs(0))
  t = (jnp.zeros((8, 6), jnp.int32), jnp.zeros((8, 1)))
  f = FastClippedGrad(emb, _sq_loss, clip_norm=1.0, level="item", method="auto")
  assert f.autotune(f.params, t) == "fast"
  assert {r.layer: r.method for r in f.plan(f.params, t).layers}["e"] == "ghost"


def test_taps_touch_no_class_no_other_model_and_no_other_thread():
  """Issue 26: no class-level patching. While a clipped sum is traced, ``nnx.Linear`` keeps
  its own ``__call__``, a second model called inside the loss and a model run by another
  thread are untouched (and not tapped), and the clipped model itself is left as it was."""
  import threading  # noqa: PLC0415
  orig = nnx.Linear.__call__
  model = _build(MLP, 5, 6, 3)
  other = nnx.Linear(5, 3, rngs=nnx.Rngs(1))
  x1 = jnp.ones((2, 5))
  seen = []

  def loss(m, ex):
    seen.append((nnx.Linear.__call__ is orig, type(other) is nnx.Linear))
    return _sq_loss(m, ex) + 0.0 * jnp.sum(other(ex[0]))

  want = other(x1)
  outs = []
  stop = threading.Event()

  def worker():
    while not stop.is_set():
      outs.append(type(other) is nnx.Linear and nnx.Linear.__call__ is orig
                  and bool(jnp.all(other(x1) == want)))

  th = threading.Thread(target=worker)
  th.start()
  try:
    fast = FastClippedGrad(model, loss, clip_norm=0.5)
    jax.jit(fast.clipped_sum)(fast.params, _data(3, (4, 2, 5), (4, 2, 3)))
  finally:
    stop.set()
    th.join()
  assert seen and all(a and b for a, b in seen)
  assert outs and all(outs)
  from dpsco_jax.flax import fast_clip_taps as ft  # noqa: PLC0415
  tapped = set(ft._TAPPED.values())
  assert tapped  # the taps were installed (on the fresh merges of the trace)...
  assert not any(type(n) in tapped for _, n in nnx.iter_graph(model))  # ...not on the model
  assert {p for p, _ in fast.plan(fast.params, _data(3, (4, 2, 5), (4, 2, 3))).fast}


class GeneralNet(nnx.Module):
  """LinearGeneral both ways (split into heads; contract leading axes), RMSNorm, GroupNorm and
  Einsum: all tapped (issue 14), none on the fallback."""
  def __init__(self, rngs):
    self.split = nnx.LinearGeneral(5, (2, 3), rngs=rngs)
    self.rms = nnx.RMSNorm(3, rngs=rngs)
    self.merge = nnx.LinearGeneral((2, 3), 4, axis=(-2, -1), rngs=rngs)
    self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.head = nnx.LinearGeneral((4, 2), 2, axis=(0, 1), use_bias=False, rngs=rngs)
    self.ein = nnx.Einsum("tk,kj->tj", (2, 1), (1,), rngs=rngs)

  def __call__(self, x):  # x: [T=2, 5] for one example
    h = self.merge(self.rms(self.split(x)))  # [2, 4]
    h = self.gn(jnp.tanh(h)[None])[0]  # GroupNorm over a batch of one
    y = self.head(jnp.swapaxes(h, 0, 1))  # contracts [4, 2] -> [2]
    return self.ein(jnp.stack([y, jnp.sin(y)], axis=-1))[:, 0]  # Einsum [2, 2] -> [2]


def test_linear_general_rmsnorm_groupnorm_are_tapped():
  model = _build(GeneralNet)
  batch = _data(4, (6, 3, 2, 5), (6, 3, 2))
  _check(model, _sq_loss, batch,
         expect_fast={("split",), ("rms",), ("merge",), ("gn",), ("head",), ("ein",)})
  _check(model, _sq_loss, batch, ghost="direct")


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.mha = nnx.MultiHeadAttention(2, 4, qkv_features=4, decode=False, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):  # x: [T, 4]
    return self.out(self.mha(x))[:, 0]


def test_multi_head_attention_projections_are_tapped():
  model = _build(Attention)
  batch = _data(5, (5, 2, 3, 4), (5, 2, 3))
  _check(model, _sq_loss, batch, expect_fast={("mha", "query"), ("mha", "key"),
                                              ("mha", "value"), ("mha", "out"), ("out",)})


def test_linear_general_variants_outside_the_formula_are_not_tapped():
  from dpsco_jax.flax import fast_clip_taps as ft
  rngs = nnx.Rngs(0)
  assert ft.candidate_kind(nnx.LinearGeneral(3, 2, rngs=rngs)) == "linear_general"
  # a batch axis makes the kernel per-batch-index; a custom dot_general changes the product
  assert ft.candidate_kind(nnx.LinearGeneral(3, 2, batch_axis={0: 2}, rngs=rngs)) is None
  assert ft.candidate_kind(nnx.LinearGeneral(3, 2, dot_general=jax.lax.dot_general,
                                             rngs=rngs)) is None
  assert ft.candidate_kind(nnx.LinearGeneral(3, 2, dtype=jnp.bfloat16, rngs=rngs)) is None

  class Sub(nnx.LinearGeneral):  # a subclass may change anything
    pass
  assert ft.candidate_kind(Sub(3, 2, rngs=rngs)) is None


def test_auto_on_a_gpu_takes_the_fast_path_for_convolutions():
  """The cost model by backend, at bench_gpu's full CNN sizes (shapes only: nothing runs).
  On an H200 the fast path was 3.6x (item) / 1.5x (user) faster than every per-example-
  gradient path on these CNNs (vmap turns a per-user conv weight gradient into a user-grouped
  convolution, ~70x below matmul throughput there), while on CPU vmap is the faster path.
  ``auto`` must pick accordingly on each backend (an earlier cost model picked vmap on both)."""
  import sys  # noqa: PLC0415
  from pathlib import Path  # noqa: PLC0415
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
  import bench_gpu  # noqa: PLC0415
  for shape in ((1024,), (256, 8)):
    model = bench_gpu.CNN(32, 10, nnx.Rngs(0))
    batch = (jnp.zeros(shape + (32, 32, 3)), jnp.zeros(shape, jnp.int32))
    level = "item" if len(shape) == 1 else "user"
    f = FastClippedGrad(model, bench_gpu.ce_loss, clip_norm=1.0, level=level, method="auto")
    # the default conv chunking differs by backend (4x larger chunks on a GPU)
    gpu, cpu = (f.plan(f.params, batch, backend=b, device_memory=80 * 2**30).predicted
                for b in ("gpu", "cpu"))
    assert gpu["fast"] < gpu["vmap"], (shape, gpu)
    assert cpu["vmap"] < cpu["fast"], (shape, cpu)
    same = FastClippedGrad(model, bench_gpu.ce_loss, clip_norm=1.0, level=level,
                           method="auto", conv_budget=0.25)
    gpu, cpu = (same.plan(same.params, batch, backend=b).predicted for b in ("gpu", "cpu"))
    assert gpu["fast"] == cpu["fast"]          # only the vmap path's convolutions differ
    assert gpu["fast"] < gpu["vmap"], (shape, gpu)
