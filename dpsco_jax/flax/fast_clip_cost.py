"""Predicted cost of the fast path, per layer, and of the vmap path: what ``method="auto"``
and the per-layer kernel form are decided on (shapes only: never timings, never data).

Counts are *extra* work over the non-private step, in float32 elements, for ``U`` users whose
tapped call sees ``n`` rows per user, ``p`` inputs and ``q`` outputs: the **ghost norm** (Gram
form, Li et al. 2022) costs ``U n^2 (p + q)`` multiply-adds and holds ``2 U n^2``; the
**instantiation** (direct form ``M_u = A_u^T G_u``, Bu et al. 2022) ``U n p q + U n (p + q)``
and holds ``U p q`` (a convolution also one chunk's im2col patches); embeddings always take
the Gram form; normalization layers, biases and the fallback hold their per-user gradients
(``U size``), as the vmap path holds every parameter's (divided by its chunks).

A path's cost is ``FLOPs + MEMORY_WEIGHT * elements held``. Linear kernels take the FLOPs rule
(Gram when ``n (p + q) <= p q``) on CPU and TPU and the lower predicted cost on a GPU
(:func:`kernel_form`), Gram only where its certified error stays small; convolutions keep the
FLOPs rule. Layers fed the very same inputs (attention's q/k/v) count their input Gram once.
``auto`` takes the fast path only when strictly cheaper. Measurements:
``experiments/bench_cost.md``.
"""

from __future__ import annotations

import dataclasses

from dpsco_jax.flax import fast_clip_conv as fcv
from dpsco_jax.flax import fast_clip_norms as fn

MEMORY_WEIGHT = 64

#: Extra cost per multiply-add of a per-user *convolution* weight gradient on the vmap path
#: (a user-grouped convolution, ~70x below matmul rate on an H200), by backend; 0 elsewhere.
GROUPED_CONV_WEIGHT = {"gpu": 32.0, "cuda": 32.0, "rocm": 32.0}


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One tapped layer (or the fallback) in :meth:`FastClippedGrad.plan`: its ``method``
  (``"ghost"``, ``"instantiate"``, ``"layer_vjp"`` or ``"fallback"``), predicted extra
  ``flops`` and ``memory``, their weighted ``cost``, the vmap path's ``vmap_cost``; convs:
  the ``chunk`` of users and the ``release`` (``"dense"`` or ``"recompute"``)."""
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


#: Backends whose Linear kernels take the form of the lower predicted cost.
FORM_BY_COST = frozenset({"gpu", "cuda", "rocm"})


def kernel_form(n: int, p: int, q: int, ghost: str, backend: str) -> str:
  """``"gram"`` or ``"direct"`` for a Linear / LinearGeneral kernel (``n`` rows per user, ``p``
  inputs, ``q`` outputs) under ``ghost`` on ``backend``; the same for the step and the plan."""
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
  """A held per-user gradient (in ``chunks`` chunks: a ``1 / chunks`` share held at once)."""
  return _cost(n_users * size, n_users * size / chunks)


def layer_costs(module_of, plan, leaf_sizes: dict, n_users: int, m: int, ghost: str,
                backend: str = "cpu", conv_rule: fcv.ChunkRule | None = None,
                vmap_chunks: int = 1) -> tuple[LayerCost, ...]:
  """Per-layer predicted costs for ``plan`` on ``backend`` (``module_of(path)`` gives the
  layer, ``leaf_sizes`` the parameter sizes), convolutions chunked by ``conv_rule`` (default
  :data:`~dpsco_jax.flax.fast_clip_conv.CONV_CHUNK_BUDGET`), the vmap path in
  ``vmap_chunks`` chunks of users."""
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
    n = m * sum(fn.prod(c.out.shape) // (q * groups) for c in calls)
    bias = (u * q * groups) if getattr(mod, "bias", None) is not None else 0
    # projections of the very same inputs share their input Gram (or row norms)
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
    vmap_cost = _held(own, u, vmap_chunks)
    if kind == "conv":  # as FastClippedGrad clips it: fast_clip_conv.plan_conv
      batched = lambda s: (u, m) + tuple(s)
      cp = fcv.plan_conv(mod, [batched(c.ins[0].shape) for c in calls],
                         [batched(c.out.shape) for c in calls], u, ghost, rule)
      chunk, release = cp.chunk, ("recompute" if cp.recomputed else "dense")
      # one chunk's temporaries and what is held per user until the weights are known
      memory = cp.chunk * fcv.per_user_elements(mod, n, cp.direct) + u * cp.held
      if cp.recomputed and cp.direct:
        flops += groups * u * n * p * q
      vmap_cost += grouped * groups * u * n * p * q  # vmap: a user-grouped convolution
    flops, memory = flops + bias, memory + bias
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
    return fn.prod(mod.in_features), fn.prod(mod.out_features), 1  # tuples in nnx
  if kind == "conv":
    return fcv.conv_dims(mod)
  return int(mod.num_embeddings), int(mod.features), 1  # embed


def _input_key(kind, mod, p, calls):
  """What identifies a Linear / LinearGeneral's input rows (None for other layers)."""
  if kind not in ("linear", "linear_general") or any(c.in_group < 0 for c in calls):
    return None
  axes = tuple(int(a) for a in mod.axis) if kind == "linear_general" else ()
  return (kind, p, axes, tuple(c.in_group for c in calls))


def totals(rows) -> dict[str, float]:
  """Predicted cost of each path: the sum over layers."""
  return {"fast": float(sum(r.cost for r in rows)),
          "vmap": float(sum(r.vmap_cost for r in rows))}

