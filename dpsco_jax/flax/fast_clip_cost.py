"""Predicted cost of the fast path, per layer, and of the vmap path: what ``method="auto"``
and the per-layer kernel form are decided on (shapes only: never timings, never data).

Private helper of :mod:`dpsco_jax.flax.fast_clip`. Counts are *extra* work over the
non-private step (``jax.grad`` of the batch loss), in float32 elements, for ``U`` users whose
tapped call sees ``n`` rows per user (items x positions), ``p`` inputs and ``q`` outputs:

* **ghost norm** (Gram form, Li et al. 2022): ``U n^2 (p + q)`` multiply-adds for the two Gram
  matrices, ``2 U n^2`` elements held; the release is the layer's own weight gradient;
* **instantiation** (direct form, the per-user gradient ``M_u = A_u^T G_u``, as in mixed
  ghost clipping, Bu et al. 2022): its ``U n p q`` multiply-adds replace the weight gradient,
  plus ``U n (p + q)`` for the row norms of the certified slack; ``U p q`` elements held
  (a convolution also holds the im2col patches of one chunk of ``b`` users, ``b n p``: see
  :mod:`~dpsco_jax.flax.fast_clip_conv`, whose chunk each row reports);
* embeddings always take the Gram form (``U n^2 q``; instantiating is ``U V q``);
* normalization layers, biases and fallback parameters hold their per-user gradients
  (``U size``), as the vmap path holds every parameter's.

Per Linear / LinearGeneral layer the form (:func:`kernel_form`) depends on the backend, as
measured. On CPU (and TPU, not measured) it is the FLOPs rule: ghost norm when
``n (p + q) <= p q`` (its ``U n^2 (p+q)`` against instantiation's ``U n p q``). On a GPU it is
this model's own comparison, ``n^2 (p+q) + 2 W n^2`` against ``n (p+q) + p q + W p q`` per user
(``W = MEMORY_WEIGHT``): instantiation's ``n p q`` replaces the weight gradient that the ghost
form still computes in its release, so only its held ``p q`` counts against it. The two
disagree on bench_gpu's transformer (``n = 128``, ``p, q`` of 256 to 1024), and each was right
on its own backend: on an H100 every projection instantiated ran 1.19x the non-private step
against the ghost norms' 1.26x and optax.contrib.dpsgd's 1.23x
(``experiments/results/gpu/bench_gpu_transformer_h100_s6.log``), while on this CPU (medium
size) the ghost norms ran 1.22x against 1.71x (XLA:CPU runs the per-user batched matmuls far
below its GEMM rate). Either way the ghost form is taken only where its certified float32
error stays small (:func:`~dpsco_jax.flax.fast_clip_norms.use_gram`); convolutions keep the
FLOPs rule (:mod:`~dpsco_jax.flax.fast_clip_conv`). A path's predicted cost is
``FLOPs + MEMORY_WEIGHT * elements held``. The FLOPs are matmul multiply-adds (Gram
matrices, per-user gradients), run at matmul throughput; an element held per user is
written, read for its norm and read again for the weighted sum by memory-bound kernels. Per
element and pass that is ~20 multiply-adds on this CPU and ~50 on an H100/H200 (50 TFLOP/s
float32 against ~1 T float32/s of HBM), so ``MEMORY_WEIGHT = 64`` (3 passes). With it and
:data:`GROUPED_CONV_WEIGHT` the model reproduces the orderings measured in
``experiments/bench_cost.md`` (CPU: vmap for the GLM and, in chunks of users, for the CNNs
and both transformers; unchunked, fast for the transformers) and on the H200 (fast for both
CNNs and both transformers, a tie on the GLM). The vmap path's held elements are divided by
its chunks (:func:`layer_costs`), so a chunked vmap step is predicted as it ran.
``auto`` takes the fast path only when its prediction is strictly lower (ties go to vmap: no
tap overhead).

Layers fed the very same input arrays (``nnx.MultiHeadAttention``'s ``query``/``key``/``value``
on one ``x``) form identical input rows, and XLA computes their Gram matrix (or row norms)
once: it is counted once (``U n^2 q`` and ``U n^2`` held for the others). Counting it per
layer over-predicted the MHA transformer by 2.7e9 (3.18e10, above vmap's 3.06e10: ``auto``
picked vmap at full size, where fast holds 1.16x against 1.67x the non-private step's memory
and ran 1.26 against 1.34 on the H200); ``tests/test_flax_fast_clip_cost.py`` checks the
counted FLOPs against XLA's.
"""

from __future__ import annotations

import dataclasses

from dpsco_jax.flax import fast_clip_conv as fcv
from dpsco_jax.flax import fast_clip_norms as fn

MEMORY_WEIGHT = 64

#: Extra cost per multiply-add of a per-user *convolution* weight gradient on the vmap path,
#: by backend. ``vmap`` turns it into a convolution grouped by user, which XLA:GPU runs far
#: below matmul throughput, while the fast path forms the same gradients as im2col matmuls.
#: Measured on an H200 (jax 0.11.2, fp32 highest, ``experiments/results/gpu/``): bench_gpu's
#: item-level CNN spends 1.06e10 such multiply-adds and its vmap step took 30 ms more than the
#: non-private step (~0.7 TFLOP/s, against ~50 for a float32 matmul: ~70x); fast 2.13x, vmap
#: 7.69x the non-private step; user-level CNN fast 2.19x, vmap 3.35x. 32 is a conservative
#: round figure (any weight above ~1.4 orders both CNNs as measured). XLA:CPU runs both forms
#: at about the same rate (bench_cost.md: vmap is the faster path there), so 0. TPU: not
#: measured, so 0 (the model then predicts as on CPU).
GROUPED_CONV_WEIGHT = {"gpu": 32.0, "cuda": 32.0, "rocm": 32.0}


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One tapped layer (or the fallback parameters) in :meth:`FastClippedGrad.plan`.

  ``method``: ``"ghost"`` (Gram norm), ``"instantiate"`` (direct per-user gradient),
  ``"layer_vjp"`` (per-user VJP of a normalization layer) or ``"fallback"``; ``flops`` and
  ``memory`` the predicted extra multiply-adds and elements of that method, ``cost`` their
  weighted sum, ``vmap_cost`` what the vmap path spends on the same parameters; ``chunk``
  (convolutions only, else 0) the users whose patches are formed at once, ``release``
  (convolutions only) ``"dense"`` (per-user gradients held and summed) or ``"recompute"``
  (inputs and output gradients held, the weighted sum recomputed chunk by chunk)."""
  layer: str
  kind: str
  method: str
  n: int
  p: int
  q: int
  flops: float
  memory: float
  cost: float
  vmap_cost: float
  chunk: int = 0
  release: str = ""


#: Backends whose Linear kernels take the form of the lower predicted cost (see the module doc).
FORM_BY_COST = frozenset({"gpu", "cuda", "rocm"})


def kernel_form(n: int, p: int, q: int, ghost: str, backend: str) -> str:
  """``"gram"`` (ghost norm) or ``"direct"`` (instantiation) for a Linear / LinearGeneral
  kernel seeing ``n`` rows per user, ``p`` inputs and ``q`` outputs, under ``ghost`` on
  ``backend`` (module doc). Shapes only; the same answer for the step and :meth:`plan`."""
  if ghost == "direct" or not fn.use_gram(n, p, q, "gram"):
    return "direct"
  if ghost == "gram":
    return "gram"
  if backend in FORM_BY_COST:
    gram = _cost(n * n * (p + q), 2 * n * n)
    direct = _cost(n * (p + q) + p * q, p * q)
    return "gram" if gram < direct else "direct"
  return "gram" if fn.use_gram(n, p, q, ghost) else "direct"


def _cost(flops: float, memory: float) -> float:
  return float(flops) + MEMORY_WEIGHT * float(memory)


def _held(size: int, n_users: int, chunks: int = 1) -> float:
  """The vmap path's (and a dense part's) per-user gradient: held and normed once; the vmap
  path formed ``chunks`` chunks of users at a time holds a ``1 / chunks`` share at once
  (:mod:`~dpsco_jax.flax.fast_clip_vmap`)."""
  return _cost(n_users * size, n_users * size / chunks)


def layer_costs(module_of, plan, leaf_sizes: dict, n_users: int, m: int, ghost: str,
                backend: str = "cpu", conv_rule: fcv.ChunkRule | None = None,
                vmap_chunks: int = 1) -> tuple[LayerCost, ...]:
  """Per-layer predicted costs for ``plan`` (``module_of(path)`` gives the layer,
  ``leaf_sizes`` maps parameter paths to their sizes) on ``backend``
  (``jax.default_backend()`` names; only convolutions' vmap cost depends on it), with
  convolutions chunked by ``conv_rule`` as :class:`FastClippedGrad` does (default:
  :data:`~dpsco_jax.flax.fast_clip_conv.CONV_CHUNK_BUDGET` of each conv's activations) and
  the vmap path in ``vmap_chunks`` chunks of users (its held elements divided by them: each
  chunk's per-user gradients and activations are consumed before the next chunk's exist).

  Why the held share and not the whole: on this CPU the chunked vmap step of bench_gpu's
  transformer (full size, 4 chunks) ran as fast as the non-private step (0.97 [0.91, 1.02])
  against the fast path's 1.03 [0.99, 1.06], with 0.69x the non-private peak against 1.17x
  (``experiments/bench_cost.md``); unchunked it predicted 3.06e10 against the fast path's
  2.86e10 and lost (1.18). The chunked CNNs ran 1.09 / 1.07 against 1.46 / 1.40 in one
  piece."""
  rule = conv_rule or fcv.chunk_rule(fcv.CONV_CHUNK_BUDGET, backend, None)
  grouped = GROUPED_CONV_WEIGHT.get(backend, 0.0)
  rows = []
  seen_gram, seen_rows = set(), set()  # input keys (_input_key) already counted
  u = n_users
  for path, kind in plan.fast:
    mod = module_of(path)
    calls = [c for c in plan.calls if c.path == path]
    own = sum(s for lp, s in leaf_sizes.items() if lp[:-1] == path)
    name = "/".join(map(str, path))
    if kind == "local":
      rows.append(LayerCost(name, kind, "layer_vjp", 0, 0, own, u * own, u * own,
                            _held(own, u), _held(own, u, vmap_chunks)))
      continue
    p, q, groups = _dims(kind, mod)
    n = m * sum(fn._prod(c.out.shape) // (q * groups) for c in calls)
    bias = (u * q * groups) if getattr(mod, "bias", None) is not None else 0
    # Projections of the very same inputs (nnx.MultiHeadAttention's query/key/value on one x)
    # build the same input rows, so XLA computes their Gram matrix (or row norms) once.
    same = _input_key(kind, mod, p, calls)
    if kind == "embed":
      method, flops, memory = "ghost", u * n * n * q, 2 * u * n * n
    elif (fn.use_gram(n, p, q, ghost) if kind == "conv"  # convs: fast_clip_conv's rule
          else kernel_form(n, p, q, ghost, backend) == "gram"):
      method = "ghost"
      shared = same is not None and same in seen_gram
      flops = groups * u * n * n * (q if shared else p + q)
      memory = groups * (1 if shared else 2) * u * n * n
      seen_gram.add(same)
    else:
      method = "instantiate"
      shared = same is not None and same in seen_rows
      flops = groups * u * (n * (q if shared else p + q) + p * q)
      memory = groups * u * p * q
    seen_rows.add(same)
    chunk, release = 0, ""
    if kind == "conv":  # as FastClippedGrad clips it: fast_clip_conv.plan_conv
      batched = lambda s: (u, m) + tuple(s)
      cp = fcv.plan_conv(mod, [batched(c.ins[0].shape) for c in calls],
                         [batched(c.out.shape) for c in calls], u, ghost, rule)
      chunk, release = cp.chunk, ("recompute" if cp.recomputed else "dense")
      # one chunk's temporaries (patches, Gram or per-user gradients) and what is held per
      # user until the weights are known; a recomputed release is a second n p q per user
      memory = cp.chunk * fcv.per_user_elements(mod, n, cp.direct) + u * cp.held
      if cp.recomputed and cp.direct:
        flops += groups * u * n * p * q
    flops, memory = flops + bias, memory + bias
    vmap_cost = _held(own, u, vmap_chunks)
    if kind == "conv":  # the per-user weight gradient as a user-grouped convolution
      vmap_cost += grouped * groups * u * n * p * q
    rows.append(LayerCost(name, kind, method, n, p, q, float(flops), float(memory),
                          _cost(flops, memory), vmap_cost, chunk, release))
  fb = sum(leaf_sizes[lp] for lp in plan.fallback)
  if fb:
    rows.append(LayerCost("(fallback)", "fallback", "fallback", 0, 0, fb, u * fb, u * fb,
                          _held(fb, u), _held(fb, u, vmap_chunks)))
  return tuple(rows)


def _dims(kind: str, mod) -> tuple[int, int, int]:
  """``(p, q, groups)`` of a tapped layer: inputs and outputs per feature group."""
  if kind == "linear":
    return int(mod.in_features), int(mod.out_features), 1
  if kind == "linear_general":
    return fn._prod(_tuple(mod.in_features)), fn._prod(_tuple(mod.out_features)), 1
  if kind == "conv":
    groups = int(mod.feature_group_count)
    return (fn._prod(mod.kernel_size) * int(mod.in_features) // groups,
            int(mod.out_features) // groups, groups)
  return int(mod.num_embeddings), int(mod.features), 1  # embed


def _input_key(kind, mod, p, calls):
  """What identifies a Linear / LinearGeneral's input rows: its kind, width, contracted axes
  and the identity of every call's inputs (``CallSpec.in_group``); None for other layers."""
  if kind not in ("linear", "linear_general") or any(c.in_group < 0 for c in calls):
    return None
  axes = tuple(int(a) for a in _tuple(mod.axis)) if kind == "linear_general" else ()
  return (kind, p, axes, tuple(c.in_group for c in calls))


def _tuple(x):
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def totals(rows) -> dict[str, float]:
  """Predicted cost of each path: the sum over layers."""
  return {"fast": float(sum(r.cost for r in rows)),
          "vmap": float(sum(r.vmap_cost for r in rows))}


def choose(rows) -> str:
  t = totals(rows)
  return "fast" if t["fast"] < t["vmap"] else "vmap"
