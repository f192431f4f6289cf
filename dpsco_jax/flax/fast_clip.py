"""Per-example / per-user clipped gradient sums of Flax nnx models without per-example gradients.

The clipped sum ``sum_u w_u g_u``, ``w_u = min(1, C / N_u)``, needs every user's gradient
*norm*, not the gradients. A layer whose parameters enter the loss only through its own call
has a per-user gradient bilinear in its inputs ``a`` and the gradient ``g`` at its output
(Goodfellow 2015; Li et al. 2022 "ghost clipping"; Bu et al. 2023 "book-keeping"): ``G_u =
sum_t a_t g_t^T`` for ``nnx.Linear`` / ``LinearGeneral`` / ``Conv`` kernels, a scatter of
``g_t`` for ``nnx.Embed``, ``sum_t g_t`` for biases; normalization layers use their own VJP per
user. ``g`` comes from one backward pass to zero *taps* added to the layer outputs, vmapped
over users; every other parameter takes the **fallback**, its exact per-user gradient from the
same pass. Which layers may be tapped: :mod:`dpsco_jax.flax.fast_clip_taps`.

Every tapped norm is a **certified upper bound** ``N_u`` on both the exact per-user norm and
the norm of what the user's release adds, under worst-case float32 rounding
(:mod:`dpsco_jax.flax.fast_clip_norms`), so each user's contribution is at most ``w_u N_u <=
C``; contributions are summed in float32 or wider. The result equals the core's
``clip_per_user(C)`` + ``aggregate`` on ``per_user_grads`` to float rounding (masked and
non-finite users contribute exactly zero; sensitivity:
:func:`~dpsco_jax.transforms.clipping.aggregation_sensitivity`). Limit: the loss must be a
deterministic function of (params, example); non-``Param`` state is held fixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from dpsco_jax._checks import check_choice, check_positive
from dpsco_jax.flax import fast_clip_conv as fcv
from dpsco_jax.flax import fast_clip_cost as fc
from dpsco_jax.flax import fast_clip_norms as fn
from dpsco_jax.flax import fast_clip_taps as ft
from dpsco_jax.flax import fast_clip_vmap as fvm
from dpsco_jax.precision import at_guarantee_precision
from dpsco_jax.transforms.clipping import (_TINY, _check_bounded, _check_mean,
                                           aggregation_sensitivity)
from dpsco_jax.transforms.noise import noise_dtype

PyTree = Any
Path = tuple
LossFn = Callable[[nnx.Module, PyTree], jax.Array]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class FastClipPlan:
  """Static description of how each parameter's per-user norm is obtained (shapes only).

  Attributes:
    fast: module paths whose norms come from taps, with their kind.
    fallback: parameter paths handled by per-user (vmap) gradients.
    calls: the tapped calls of one example, in call order.
    layers: per tapped layer (and the fallback), the form taken and its predicted cost
      (:class:`~dpsco_jax.flax.fast_clip_cost.LayerCost`).
    predicted: each path's predicted cost, ``{"fast": ..., "vmap": ...}`` (what ``"auto"``
      decides on).
    conv_chunks: how convolutions size their chunks of users on this backend.
    vmap_chunks: ``(chunks, reason)`` of the vmap path on this backend.
  """
  fast: tuple[tuple[Path, str], ...]
  fallback: tuple[Path, ...]
  calls: tuple[ft.CallSpec, ...]
  layers: tuple[fc.LayerCost, ...] = ()
  predicted: dict | None = None
  conv_chunks: fcv.ChunkRule | None = None
  vmap_chunks: tuple[int, str] | None = None


class ClipInfo(NamedTuple):
  """Data-dependent by-products (never released; for tests and ``debug`` only).

  Attributes:
    norms: ``[U]`` certified per-user norm bounds (NaN/Inf for non-finite users).
    weights: ``[U]`` ``min(1, C/norm)``, 0 for masked or non-finite users.
    kept: ``[U]`` bool, a real user with a finite gradient.
  """
  norms: jax.Array
  weights: jax.Array
  kept: jax.Array


@dataclasses.dataclass
class _Part:
  """One leaf's per-user contribution: ``sum_u w_u dense_u``, else ``release(w, kept,
  donor)``; ``sq`` bounds the squared norm of either."""
  leaf: int
  sq: jax.Array
  dense: jax.Array | None = None
  release: Callable | None = None


# The clipped sum and the norms run under ``at_guarantee_precision``: the certified bounds
# assume float32 products, not the backend default (TF32 on GPUs, bf16 passes on TPUs).


def _flat_inputs(module, kind: str, x: jax.Array, n_users: int) -> jax.Array:
  """A Linear's or LinearGeneral's inputs ``[U, m, ...]`` as rows ``[U, N, p]`` (contracted
  axes last, as ``dot_general`` lays them out against the kernel)."""
  if kind == "linear_general":
    nd = x.ndim - 2  # per-example rank
    axes = [2 + (int(a) % nd) for a in module.axis]
    k = len(axes)
    x = jnp.moveaxis(x, axes, list(range(x.ndim - k, x.ndim)))
    p = fn.prod(module.in_features)
  else:
    p = x.shape[-1]
  return jnp.reshape(x.astype(_F32), (n_users, -1, p))


def _as_rounded(x: jax.Array) -> jax.Array:
  """A per-user gradient leaf in float32 or wider, *as rounded to its own dtype*: XLA:GPU's
  excess precision may drop a ``f32 -> bf16 -> f32`` pair, ``reduce_precision`` is never
  removed, so the norm and the release see the same value on every backend."""
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
    return x
  fi = jnp.finfo(x.dtype)
  return lax.reduce_precision(x.astype(_F32), exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def _safe(x, kept, donor):
  """A kept user's inputs stand in for dropped users' (maybe non-finite; weighted by 0)."""
  return jnp.where(fn.bcast(kept, x), x, x[donor][None])


def _weighted_sum(x, w, kept):
  """``sum_u w_u x_u`` over kept users in float32 or wider, one contraction at HIGHEST (no
  weighted ``[U, ...]`` copy)."""
  x = jnp.where(fn.bcast(kept, x), x.astype(noise_dtype(x.dtype)), 0.0)
  wk = jnp.where(kept, w, 0.0).astype(x.dtype)
  return lax.dot_general(wk, x, (((0,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)


def _weighted(g, w, kept):
  """``w_u g_u`` in float32 or wider (rounded to bfloat16 it exceeded C), 0 for dropped users."""
  g = g.astype(noise_dtype(g.dtype))
  return jnp.where(fn.bcast(kept, g), g * fn.bcast(w, g).astype(g.dtype), 0.0)


class FastClippedGrad:
  """Per-user clipped gradient sums of an nnx model, via taps (fast) or vmap (reference).

  Args:
    model: an ``nnx.Module``; its ``nnx.Param`` leaves are trained, the rest is held fixed.
    loss_fn: ``loss_fn(model, example) -> scalar`` for one example (no batch axis).
    clip_norm: ``C``; every user's (or example's) gradient is scaled by ``min(1, C/N_u)``.
    level: ``"user"`` (batches ``[U, m, ...]``, a user's gradient is the mean over its
      ``m`` items) or ``"item"`` (batches ``[B, ...]``).
    method: ``"fast"`` (taps + fallback), ``"vmap"`` (core ``per_user_grads`` then
      ``clip_and_aggregate``; the reference) or ``"auto"``: the lower predicted cost at the
      batch's shapes (:meth:`plan`; never timings or data). Both are exact: the choice changes
      the speed, never the released value's distribution or its sensitivity.
    ghost: ``"auto"`` | ``"gram"`` | ``"direct"`` for Linear/Conv kernels; ``"gram"`` only
      where its certified error is small; ``"auto"`` picks per layer from shapes and backend.
    conv_budget: convolutions form their per-user kernel gradients in chunks of users whose
      temporaries fit in this fraction of the layer's activations; ``None``: all users at
      once; ``"auto"`` (default): by backend
      (:func:`~dpsco_jax.flax.fast_clip_conv.chunk_rule`). The same numbers either way.
    vmap_chunks: the vmap path forms its clipped sum this many chunks of users at a time (the
      same sum up to float addition order); ``"auto"`` (default): by shapes and backend
      (:func:`~dpsco_jax.flax.fast_clip_vmap.vmap_chunks`).

  Sensitivity: :meth:`sensitivity` (``C`` for the sum under add/remove, ``C/D`` for the mean).
  """

  def __init__(self, model: nnx.Module, loss_fn: LossFn, *, clip_norm: float,
               level: str = "user", method: str = "fast", ghost: str = "auto",
               conv_budget: float | str | None = "auto", vmap_chunks: int | str = "auto"):
    if not isinstance(model, nnx.Module):
      raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    if not callable(loss_fn):
      raise ValueError("loss_fn must be callable: loss_fn(model, example) -> scalar")
    self.clip_norm = check_positive(clip_norm, "clip_norm")
    self.level = check_choice(level, "level", ("user", "item"))
    self.requested_method = check_choice(method, "method", ("fast", "vmap", "auto"))
    self.method: str | None = None if method == "auto" else method
    self.autotune_report: dict | None = None
    self.ghost = check_choice(ghost, "ghost", ("auto", "gram", "direct"))
    auto = isinstance(conv_budget, str) and conv_budget == "auto"
    self.conv_budget = (conv_budget if conv_budget is None or auto
                        else check_positive(conv_budget, "conv_budget"))
    self.vmap_chunks = fvm.check_vmap_chunks(vmap_chunks)
    self._device_bytes: dict[str, int | None] = {}
    self.loss_fn = loss_fn
    self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
    self._leaf_paths = ft.leaf_paths(self.params)
    # refused here, naming them: else the first step's jax.grad fails on them, naming none
    ints = [".".join(map(str, lp)) for lp, x in zip(self._leaf_paths, jax.tree.leaves(self.params))
            if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if ints:
      raise TypeError(f"model: nnx.Param {ints} are not floating point (every nnx.Param is "
                      "trained, i.e. differentiated); make them float, or another nnx.Variable "
                      "type to keep them fixed")
    self._leaf_index = {lp: i for i, lp in enumerate(self._leaf_paths)}
    self._candidates = ft.candidates(model)
    self._plans: dict = {}

  def model_loss(self, params: PyTree, example: PyTree) -> jax.Array:
    """``loss_fn`` as a function of the parameter State (the core's ``loss_fn(params, ex)``).

    Args:
      params: the parameter State.
      example: one item.

    Returns:
      The loss, a scalar.
    """
    return self.loss_fn(nnx.merge(self.graphdef, params, self.rest), example)

  def _as_users(self, batch: PyTree) -> PyTree:
    if self.level == "item":
      return jax.tree.map(lambda x: x[:, None], batch)
    if any(jnp.ndim(x) < 2 for x in jax.tree.leaves(batch)):
      raise ValueError("batch leaves must be shaped [users, m, ...] for level='user'")
    return batch

  def plan(self, params: PyTree, batch: PyTree, *, backend: str | None = None,
           device_memory: int | None = None) -> FastClipPlan:
    """The tap plan for this batch's shapes (cached per example shape): which layers are
    tapped and, per layer, the form and predicted cost at this batch's size on ``backend``.

    Args:
      params: the parameter State.
      batch: the batch (its shapes only are read).
      backend: the backend to cost for (default: JAX's default).
      device_memory: the device memory in bytes (default: the backend's first device's).

    Returns:
      The :class:`FastClipPlan`.
    """
    users = self._as_users(batch)
    n_users, m = jax.tree.leaves(users)[0].shape[:2]
    base = self._base_plan(params, users)
    sizes = {lp: int(jnp.size(x)) for lp, x in zip(self._leaf_paths,
                                                   jax.tree.leaves(self.params))}
    backend = backend or jax.default_backend()
    rule = self._conv_rule(backend, device_memory)
    chunks = fvm.vmap_chunks(self.vmap_chunks, params, users, backend)
    rows = fc.layer_costs(lambda path: self._module(self.params, path), base, sizes,
                          int(n_users), int(m), self.ghost, backend, rule, chunks[0])
    return dataclasses.replace(base, layers=rows, predicted=fc.totals(rows), conv_chunks=rule,
                               vmap_chunks=chunks)

  def _conv_rule(self, backend: str | None = None,
                 device_memory: int | None = None) -> fcv.ChunkRule:
    """How convs are chunked on ``backend`` (device memory asked once per backend)."""
    backend = backend or jax.default_backend()
    if device_memory is None and self.conv_budget == "auto":
      if backend not in self._device_bytes:
        self._device_bytes[backend] = fcv.device_memory(backend)
      device_memory = self._device_bytes[backend]
    return fcv.chunk_rule(self.conv_budget, backend, device_memory)

  def _base_plan(self, params: PyTree, users: PyTree) -> FastClipPlan:
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), users)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            params)
    key = (jax.tree.structure(example), tuple((l.shape, str(l.dtype))
                                              for l in jax.tree.leaves(example)))
    if key not in self._plans:
      self._plans[key] = self._make_plan(abstract, example)
    return self._plans[key]

  def _make_plan(self, abstract_params, example) -> FastClipPlan:
    tapes: list[ft.Tape] = []

    def sg_loss(p, ex):
      loss, tape = ft.taped(nnx.merge(self.graphdef, p, self.rest), "plan", self._candidates,
                            lambda model: self.loss_fn(model, ex))
      tapes.append(tape)
      # a layer called inside an inner transform (scan, remat, vmap, cond) cannot be tapped
      tape.inner.update(path for path, trace in tape.outputs if trace is not tape.trace)
      return loss

    def tangent_out(p, t, ex):
      return jax.jvp(lambda q: sg_loss(q, ex), (p,), (t,))[1]

    closed = jax.make_jaxpr(tangent_out)(abstract_params, abstract_params, example)
    n = len(self._leaf_paths)
    deps = ft.output_deps(closed.jaxpr)
    leaks = {self._leaf_paths[i] for i in range(n) if (deps >> (n + i)) & 1}
    tape = tapes[-1]
    called = {s.path for s in tape.specs} - tape.inner - tape.rewritten
    fast = {}
    for path, kind in self._candidates.items():
      own = [lp for lp in self._leaf_paths if lp[:-1] == path]
      if path in called and own and not any(lp in leaks for lp in own):
        fast[path] = kind
    fallback = tuple(lp for lp in self._leaf_paths if lp[:-1] not in fast)
    calls = tuple(s for s in tape.specs if s.path in fast)
    return FastClipPlan(fast=tuple(fast.items()), fallback=fallback, calls=calls)

  def _fast_pass(self, params, users, plan: FastClipPlan):
    """One vmapped backward pass to the taps: per-user fallback grads, layer inputs and
    output gradients (carrying the 1/m of the per-user mean)."""
    leaves, treedef = jax.tree.flatten(params)
    fb_set = set(plan.fallback)
    fb_idx = [i for i, lp in enumerate(self._leaf_paths) if lp in fb_set]
    fast = dict(plan.fast)
    n_users, m = jax.tree.leaves(users)[0].shape[:2]

    def item_loss(fb_leaves, zs, ex):
      new = list(leaves)
      for j, i in enumerate(fb_idx):
        new[i] = fb_leaves[j]
      model = nnx.merge(self.graphdef, jax.tree.unflatten(treedef, new), self.rest)
      loss, tape = ft.taped(model, "run", fast, lambda model: self.loss_fn(model, ex), zs)
      if len(tape.arrays) != len(plan.calls):
        raise ValueError("the model called its layers differently than when planned; the "
                         "loss must be deterministic in (params, example)")
      return loss, tape.arrays

    def one_user(zs_u, items):
      def user_loss(f, z):
        losses, arrays = jax.vmap(item_loss, in_axes=(None, 0, 0))(f, z, items)
        return jnp.mean(losses), arrays
      loss, vjp_fn, arrays = jax.vjp(user_loss, [leaves[i] for i in fb_idx], zs_u,
                                     has_aux=True)
      fb_g, g = vjp_fn(jnp.ones_like(loss))
      return fb_g, g, arrays

    zs0 = [jnp.zeros((n_users, m) + c.out.shape, c.out.dtype) for c in plan.calls]
    try:
      fb_grads, gs, arrays = jax.vmap(one_user)(zs0, users)
    except jax.errors.UnexpectedTracerError as e:  # tapped layer inside an inner transform
      raise ValueError("fast clipping cannot tap layers called inside jax/nnx transforms "
                       "(scan, remat, vmap) of the model; use method='vmap'") from e
    return fb_idx, fb_grads, gs, arrays

  def _module(self, params, path):
    node = nnx.merge(self.graphdef, params, self.rest)
    for k in path:  # attributes, or items of nnx.List / nnx.Dict containers
      node = getattr(node, k) if isinstance(k, str) and hasattr(node, k) else node[k]
    return node

  def _parts(self, params, plan, gs, arrays, n_users: int) -> list[_Part]:
    """Every tapped parameter leaf as a :class:`_Part` (bound or dense per-user grads)."""
    by_path: dict[Path, list[int]] = {}
    for k, c in enumerate(plan.calls):
      by_path.setdefault(c.path, []).append(k)
    parts = []
    for path, kind in plan.fast:
      ks, module = by_path[path], self._module(params, path)
      leaf = lambda attr, path=path: self._leaf_index[path + (attr,)]
      if kind == "local":
        per_user = self._local_grads(module, [plan.calls[k] for k in ks],
                                     [arrays[k] for k in ks], [gs[k] for k in ks])
        for lp, v in zip(ft.leaf_paths(per_user), jax.tree.leaves(per_user)):
          v = _as_rounded(v)
          parts.append(_Part(leaf(lp[0]), fn.sqsum_upper(v), dense=v))
        continue
      q = (fn.prod(module.out_features) if kind == "linear_general" else gs[ks[0]].shape[-1])
      g = jnp.concatenate([jnp.reshape(gs[k].astype(_F32), (n_users, -1, q)) for k in ks], 1)
      if kind in ("linear", "linear_general"):
        a = jnp.concatenate([_flat_inputs(module, kind, arrays[k][0], n_users) for k in ks], 1)
        form = fc.kernel_form(a.shape[1], a.shape[2], g.shape[2], self.ghost,
                              jax.default_backend())  # the backend traced for, as plan()'s
        bound, m = fn.kernel_bound(a, g, form)
        parts.append(_Part(leaf("kernel"), jnp.square(bound), dense=m, release=lambda w, kept,
                           d, a=a, g=g: fn.kernel_release(_safe(a, kept, d),
                                                          _weighted(g, w, kept))))
      elif kind == "conv":  # patches per chunk of users: bounded memory
        xs, gk = [arrays[k][0] for k in ks], [gs[k] for k in ks]
        cp = fcv.plan_conv(module, [x.shape for x in xs], [y.shape for y in gk], n_users,
                           self.ghost, self._conv_rule())
        sq, m = fcv.conv_bound(module, xs, gk, self.ghost, cp.chunk, cp.recomputed)
        parts.append(_Part(leaf("kernel"), sq, dense=m, release=lambda w, kept, d, c=module,
                           xs=xs, gk=gk, b=cp.chunk: fcv.conv_release(c, xs, gk, w, kept, b)))
      else:  # embed
        idx = jnp.concatenate([jnp.reshape(arrays[k][0], (n_users, -1)) for k in ks], 1)
        v = module.num_embeddings
        idx = jnp.zeros_like(idx) if v == 1 else jnp.where(idx < 0, idx + v, idx)
        parts.append(_Part(leaf("embedding"), jnp.square(fn.embed_bound(idx, g)),
                           release=lambda w, kept, d, idx=idx, g=g, v=v:
                           fn.embed_release(_safe(idx, kept, d), _weighted(g, w, kept), v)))
      if kind in ("linear", "linear_general", "conv") and module.bias is not None:
        b = jnp.sum(g, axis=1)  # [U, out]: materialised, released as is
        parts.append(_Part(leaf("bias"), fn.sqsum_upper(b), dense=b))
    return parts

  @staticmethod
  def _local_grads(module, specs, arrays, gs):
    """Per-user VJP of the layer's own call w.r.t. its params at the recorded inputs."""
    graphdef, p0, rest = nnx.split(module, nnx.Param, ...)
    orig = ft.ORIG_CALL[type(module)]

    def user(arrs_u, gs_u):
      def outputs(p):
        mod = nnx.merge(graphdef, p, rest)
        outs = []
        for spec, arrs in zip(specs, arrs_u):
          def one(*a, spec=spec):
            args, kwargs = ft.rebuild(spec, a)
            return orig(mod, *args, **kwargs)
          outs.append(jax.vmap(one)(*arrs))  # over the user's items
        return outs
      return jax.vjp(outputs, p0)[1](gs_u)[0]

    return jax.vmap(user)(arrays, gs)

  def _parts_and_bounds(self, params, batch):
    """All parts (tapped and fallback) and the certified per-user norm bounds ``[U]``."""
    users = self._as_users(batch)
    n_users = jax.tree.leaves(users)[0].shape[0]
    plan = self._base_plan(params, users)
    fb_idx, fb_grads, gs, arrays = self._fast_pass(params, users, plan)
    parts = self._parts(params, plan, gs, arrays, n_users)
    fb_grads = [_as_rounded(g) for g in fb_grads]
    parts += [_Part(i, fn.sqsum_upper(g), dense=g) for i, g in zip(fb_idx, fb_grads)]
    total = sum((p.sq for p in parts), jnp.zeros((n_users,), _F32))
    bound = jnp.sqrt(total / (1.0 - fn.gamma(len(parts) + 2))) * (1.0 + 4 * fn.UNIT)
    return parts, bound

  def _weights(self, norms, user_mask, clip_norm=None):
    kept = jnp.isfinite(norms)
    if user_mask is not None:
      kept = kept & user_mask
    clip = self.clip_norm if clip_norm is None else clip_norm
    w = jnp.where(kept, jnp.minimum(1.0, clip / jnp.maximum(norms, _TINY)), 0.0)
    return norms, w, kept

  def autotune(self, params: PyTree, batch: PyTree, user_mask: jax.Array | None = None, *,
               repeats: int | None = None) -> str:
    """Resolves ``method="auto"`` for ``batch``'s shapes by the cost model (no timing, no
    data) and returns it, with the predictions in :attr:`autotune_report`; ``auto`` also
    resolves at each call. A fixed ``method`` is returned as is.

    Args:
      params: the parameter State.
      batch: the batch (its shapes only are read).
      user_mask: unused (compatibility).
      repeats: unused (compatibility).

    Returns:
      The method, ``"fast"`` or ``"vmap"``.
    """
    del user_mask, repeats
    if self.requested_method != "auto":
      return self.method
    plan = self.plan(params, batch)
    self.method = "fast" if plan.predicted["fast"] < plan.predicted["vmap"] else "vmap"
    self.autotune_report = {"chosen": self.method, "predicted": plan.predicted,
                            "layers": [dataclasses.asdict(r) for r in plan.layers],
                            "shapes": jax.tree.map(lambda x: tuple(jnp.shape(x)), batch)}
    return self.method

  @at_guarantee_precision
  def norms(self, params: PyTree, batch: PyTree) -> jax.Array:
    """Per-user (per-example) gradient norms ``[U]``: exact (``vmap``) or certified upper
    bounds (``fast``).

    Args:
      params: the parameter State.
      batch: the batch.

    Returns:
      The ``[U]`` norms (secret: never release them).
    """
    users = self._as_users(batch)
    if self.autotune(params, batch) == "vmap":
      chunks, _ = fvm.vmap_chunks(self.vmap_chunks, params, users)
      return fvm.chunked_norms(self.model_loss, params, users, chunks)
    return self._parts_and_bounds(params, batch)[1]

  @at_guarantee_precision
  def clipped_sum(self, params: PyTree, batch: PyTree, user_mask: jax.Array | None = None,
                  *, clip_norm: jax.Array | float | None = None) -> tuple[PyTree, ClipInfo]:
    """``sum_u w_u g_u`` with ``w_u = min(1, C/N_u)`` (0 for masked or non-finite users),
    shaped like ``params``, and the (secret) :class:`ClipInfo`.

    Args:
      params: the parameter State.
      batch: the batch.
      user_mask: bool ``[U]``, False for padding (default: every slot is a user).
      clip_norm: clip at this ``C`` instead (a traced scalar allowed: adaptive clipping's
        ``C_t``); the bounds ``N_u`` do not depend on ``C``, so still ``w_u N_u <= C``.

    Returns:
      ``(summed, info)``.
    """
    method = self.autotune(params, batch)
    users = self._as_users(batch)
    n_users = jax.tree.leaves(users)[0].shape[0]
    if user_mask is not None and jnp.shape(user_mask) != (n_users,):
      raise ValueError(f"user_mask must have shape ({n_users},), got {jnp.shape(user_mask)}")
    if method == "vmap":
      chunks, _ = fvm.vmap_chunks(self.vmap_chunks, params, users)
      clip = self.clip_norm if clip_norm is None else clip_norm
      summed, norms = fvm.chunked_clipped_sum(self.model_loss, params, users, clip, user_mask,
                                              chunks)
      return summed, ClipInfo(*self._weights(norms, user_mask, clip_norm))

    parts, bound = self._parts_and_bounds(params, batch)
    norms, w, kept = self._weights(bound, user_mask, clip_norm)
    donor = jnp.argmax(kept)  # a kept user, whose inputs stand in for dropped users' (_safe)
    leaves, treedef = jax.tree.flatten(params)
    out = [jnp.zeros(x.shape, noise_dtype(x.dtype)) for x in leaves]
    for part in parts:  # a contribution is w_u times exactly what N_u bounds
      # float32 or wider, like the vmap path's (see _weighted)
      got = (_weighted_sum(part.dense, w, kept) if part.dense is not None
             else part.release(w, kept, donor))
      out[part.leaf] = jnp.reshape(got, leaves[part.leaf].shape)
    any_kept = jnp.any(kept)
    summed = jax.tree.unflatten(treedef, [jnp.where(any_kept, o.astype(noise_dtype(x.dtype)), 0.0)
                                          for o, x in zip(out, leaves)])
    return summed, ClipInfo(norms, w, kept)

  def aggregate(self, params: PyTree, batch: PyTree, user_mask: jax.Array | None = None, *,
                mode: str = "mean", denominator: float | None = None) -> PyTree:
    """The clipped sum, divided by the fixed ``denominator`` for ``mode="mean"`` (the core's
    ``clip_per_user(C)`` + ``aggregate(mode, denominator)``).

    Args:
      params: the parameter State.
      batch: the batch.
      user_mask: bool ``[U]``, False for padding (default: every slot is a user).
      mode: ``"mean"`` (default) or ``"sum"``.
      denominator: the fixed denominator ``D``, required for ``"mean"``.

    Returns:
      The aggregate, shaped like ``params``.

    Raises:
      ValueError: an unknown ``mode``, ``"mean"`` without a ``denominator`` > 0, or a mean that
        would overflow float32.
    """
    # the core's checks: a mean that would overflow float32 is refused
    scale = _check_mean(mode, denominator)
    _check_bounded(self.clip_norm, scale, jax.tree.leaves(self._as_users(batch))[0].shape[0])
    summed, _ = self.clipped_sum(params, batch, user_mask)
    return summed if mode == "sum" else jax.tree.map(lambda x: x / denominator, summed)

  def sensitivity(self, *, mode: str = "mean", denominator: float | None = None,
                  relation: str = "add_remove") -> float:
    """L2 sensitivity of :meth:`aggregate` (the core's ``aggregation_sensitivity``).

    Args:
      mode: ``"mean"`` (default) or ``"sum"``.
      denominator: ``D``, required for ``"mean"``.
      relation: ``add_remove`` (default), ``replace_one`` or ``zero_out``.

    Returns:
      The L2 sensitivity, a float.

    Raises:
      ValueError: as :func:`~dpsco_jax.transforms.aggregation_sensitivity`.
    """
    return aggregation_sensitivity(self.clip_norm, mode=mode, denominator=denominator,
                                   relation=relation)
