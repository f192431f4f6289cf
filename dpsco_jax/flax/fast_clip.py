"""Exact per-example / per-user gradient norms for Flax nnx models without per-example gradients.

The clipped sum ``sum_u min(1, C/||g_u||) g_u`` needs every user's gradient *norm*, not the
gradients themselves. For a layer whose parameters enter the loss only through the layer's
own call, the per-user gradient is a bilinear function of what the layer saw on the forward
pass (its inputs ``a``) and of the gradient of the loss with respect to its output (``g``):

* ``nnx.Linear`` / ``nnx.Conv`` kernel: ``G_u = (1/m) sum_{j,t} a_{jt} g_{jt}^T`` over the
  user's items ``j`` and positions ``t`` (sequence steps, pixels, repeated calls; for ``Conv``
  ``a_{jt}`` is the receptive-field patch). Its squared norm is the Gram form

      ||G_u||_F^2 = (1/m^2) sum_{s,t} (a_s . a_t)(g_s . g_t),

  which is ``||a||^2 ||g||^2`` for one vector per example (Goodfellow 2015; Li et al. 2022,
  "ghost clipping", eq. 3; Bu et al. 2023 for the book-keeping below). When the positions
  outnumber ``din*dout/(din+dout)`` the layer's per-user gradient is formed directly instead
  (cheaper, same value).
* ``nnx.Embed``: ``a_s . a_t`` is ``[idx_s == idx_t]``.
* bias parameters: ``sum_t g_t``; ``nnx.LayerNorm`` (scale, bias): the layer's own VJP,
  vmapped over users (its parameters are vectors, so this is cheap).

``g`` comes from one backward pass to zero "taps" added to each layer output (the VJP with
respect to activations only, so no weight gradients are formed), vmapped over users. The
clipped sum then follows without a second pass over the network ("book-keeping"): for each
tapped layer, the VJP of the layer alone with respect to its parameters at the recorded inputs
with cotangent ``w_u g`` (``w_u`` the clip factor). Parameters of any other layer (or of a
supported layer whose parameters are also read elsewhere, e.g. a tied embedding) take the
fallback: their per-user gradients come out of the same backward pass (the ``vmap`` path,
restricted to those parameters) and add their squared norms and weighted sum.

Which layers are tapped is decided once per input shape by tracing the loss with every
candidate layer's parameters behind ``stop_gradient`` and checking, on the jaxpr of the JVP,
which parameter tangents still reach the loss: any that do are used outside the layer's call
and go to the fallback, so the norms are exact by construction, never an under-estimate.

The result equals ``clip_per_user(C)`` + ``aggregate(mode, D)`` of the core applied to
``per_user_grads`` (to float rounding): same weights ``min(1, C / max(||g_u||, 1e-30))``,
masked users and users with non-finite gradients contribute exactly zero, and the sensitivity
is the core's :func:`~dpsco_jax.transforms.clipping.aggregation_sensitivity`.

Layers called inside a transform of the model (``lax.scan``, ``nnx.scan``, ``remat``, ``cond``)
are detected when planning and take the fallback. Limit: the loss must be a deterministic
function of (params, example); non-``Param`` state (batch statistics, RNG counters) is held
fixed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import _conv_dimension_numbers, canonicalize_padding
from jax import lax

from dpsco_jax._checks import check_choice, check_positive
from dpsco_jax.grads import per_user_grads
from dpsco_jax.transforms.clipping import (aggregation_sensitivity, clip_and_aggregate,
                                           tree_global_norms)

PyTree = Any
Path = tuple
LossFn = Callable[[nnx.Module, PyTree], jax.Array]

_HI = lax.Precision.HIGHEST
_TINY = 1e-30  # the core's floor on the norm in min(1, C/||g||)

# --------------------------------------------------------------------------------------------
# Taps: class-level wrappers of the supported layers' __call__, inert unless a tape is active
# and the module is one the tape tracks.
# --------------------------------------------------------------------------------------------

_TAPE: contextvars.ContextVar["_Tape | None"] = contextvars.ContextVar("dpsco_fast_clip_tape",
                                                                       default=None)
_KINDS = {nnx.Linear: "linear", nnx.Conv: "conv", nnx.Embed: "embed", nnx.LayerNorm: "local"}
_ORIG_CALL = {cls: cls.__call__ for cls in _KINDS}
_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = [0]


def _make_wrapper(cls):
  orig = _ORIG_CALL[cls]

  def __call__(self, *args, **kwargs):
    tape = _TAPE.get()
    if tape is None or id(self) not in tape.modules:
      return orig(self, *args, **kwargs)
    return tape.call(self, orig, args, kwargs)

  __call__.__wrapped__ = orig
  __call__.__doc__ = orig.__doc__
  return __call__


_WRAPPERS = {cls: _make_wrapper(cls) for cls in _KINDS}


@contextlib.contextmanager
def _patched():
  with _PATCH_LOCK:
    if _PATCH_DEPTH[0] == 0:
      for cls, w in _WRAPPERS.items():
        cls.__call__ = w
    _PATCH_DEPTH[0] += 1
  try:
    yield
  finally:
    with _PATCH_LOCK:
      _PATCH_DEPTH[0] -= 1
      if _PATCH_DEPTH[0] == 0:
        for cls, orig in _ORIG_CALL.items():
          cls.__call__ = orig


def _current_trace():
  """The innermost active JAX trace (private API, pinned jax<0.11); None if unavailable, which
  disables the inner-transform detection below (such models then fail loudly instead)."""
  try:
    from jax._src import core
    return core.trace_ctx.trace
  except (ImportError, AttributeError):  # pragma: no cover
    return None


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


@dataclasses.dataclass(frozen=True)
class _CallSpec:
  """One call of a tapped layer, as seen by the per-example trace."""
  path: Path
  kind: str
  treedef: Any                      # of (args, kwargs)
  array_pos: tuple[int, ...]        # positions of array leaves in the flattened (args, kwargs)
  statics: tuple                    # the non-array leaves, in order
  out: jax.ShapeDtypeStruct         # per-example output shape (the tap)


class _Tape:
  """Per-trace recorder. ``mode='plan'``: layer params behind stop_gradient, record call specs.
  ``mode='run'``: add tap ``zs[k]`` to the k-th call's output, record its array inputs."""

  def __init__(self, mode: str, modules: dict[int, tuple[Path, str]], zs=None):
    self.mode, self.modules, self.zs = mode, modules, zs
    self.specs: list[_CallSpec] = []
    self.arrays: list[list[jax.Array]] = []
    self.outputs: list[tuple[Path, Any]] = []  # (path, trace the call ran under)
    self.inner: set[Path] = set()
    self.trace = _current_trace()

  def call(self, module, orig, args, kwargs):
    path, kind = self.modules[id(module)]
    leaves, treedef = jax.tree.flatten((args, kwargs))
    pos = tuple(i for i, x in enumerate(leaves) if _is_array(x))
    statics = tuple(x for i, x in enumerate(leaves) if i not in pos)
    if self.mode == "plan":
      gd, st = nnx.split(module)
      y = orig(nnx.merge(gd, jax.tree.map(lax.stop_gradient, st)), *args, **kwargs)
      if not _is_array(y):
        raise ValueError(f"tapped layer {path} must return one array")
      self.specs.append(_CallSpec(path, kind, treedef, pos, statics,
                                  jax.ShapeDtypeStruct(y.shape, y.dtype)))
      self.outputs.append((path, _current_trace()))
      return y
    k = len(self.arrays)
    y = orig(module, *args, **kwargs)
    self.arrays.append([jnp.asarray(leaves[i]) for i in pos])
    return y + self.zs[k].astype(y.dtype)


def _rebuild(spec: _CallSpec, arrays: Sequence[jax.Array]):
  arrays, statics = iter(arrays), iter(spec.statics)
  n = len(spec.array_pos) + len(spec.statics)
  leaves = [next(arrays) if i in spec.array_pos else next(statics) for i in range(n)]
  return jax.tree.unflatten(spec.treedef, leaves)


# --------------------------------------------------------------------------------------------
# Planning: which modules are tapped (exactness check on the JVP jaxpr).
# --------------------------------------------------------------------------------------------


def _key_to_py(k):
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _leaf_paths(params: PyTree) -> list[Path]:
  """Param path (module path + attribute) of every leaf of an nnx State, in flatten order."""
  out = []
  for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [_key_to_py(k) for k in kp]
    if keys and keys[-1] == "value":
      keys = keys[:-1]
    out.append(tuple(keys))
  return out


def _candidate_kind(module) -> str | None:
  """The tap kind of a module, or None when it must take the fallback."""
  for cls, kind in _KINDS.items():
    if not isinstance(module, cls):
      continue
    # A subclass that overrides __call__ may use its params differently.
    if type(module).__call__ not in (_ORIG_CALL[cls], _WRAPPERS[cls]):
      return None
    if kind == "linear" and (module.dot_general is not lax.dot_general
                             or module.preferred_element_type is not None):
      return None
    if kind == "conv" and (module.mask is not None or module.feature_group_count != 1
                           or module.conv_general_dilated is not lax.conv_general_dilated
                           or module.preferred_element_type is not None):
      return None
    return kind
  return None


def _modules_by_id(model, wanted: dict[Path, str]) -> dict[int, tuple[Path, str]]:
  return {id(node): (tuple(path), wanted[tuple(path)])
          for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Module) and tuple(path) in wanted}


def _output_deps(jaxpr) -> int:
  """Bitmask of the jaxpr's invars that its outputs may depend on (conservative: every output
  of an equation depends on all of its inputs)."""
  from jax.extend.core import Literal
  src = {v: 1 << i for i, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    m = 0
    for v in eqn.invars:
      if not isinstance(v, Literal):
        m |= src.get(v, 0)
    for o in eqn.outvars:
      src[o] = m
  out = 0
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      out |= src.get(v, 0)
  return out


@dataclasses.dataclass(frozen=True)
class FastClipPlan:
  """Static description of how each parameter's per-user norm is obtained.

  Attributes:
    fast: module paths whose norms come from taps, with their kind.
    fallback: parameter paths handled by per-user (vmap) gradients.
    calls: the tapped calls of one example, in call order.
  """
  fast: tuple[tuple[Path, str], ...]
  fallback: tuple[Path, ...]
  calls: tuple[_CallSpec, ...]


# --------------------------------------------------------------------------------------------
# Per-layer norm and book-keeping kernels.
# --------------------------------------------------------------------------------------------


def _conv_patches(conv: nnx.Conv, x: jax.Array) -> jax.Array:
  """Receptive-field patches of ``x`` (leading dims flattened) exactly as ``nnx.Conv`` pads,
  strides and dilates: ``[N, *spatial_out, kernel_volume * in_features]``. The feature order
  inside a patch differs from the kernel layout, which norms do not see."""
  ks = tuple(conv.kernel_size)
  nd = len(ks)

  def bc(v):
    v = 1 if v is None else v
    return (v,) * nd if isinstance(v, int) else tuple(v)

  x = jnp.reshape(x, (-1,) + x.shape[x.ndim - nd - 1:])
  strides, in_dil, k_dil = bc(conv.strides), bc(conv.input_dilation), bc(conv.kernel_dilation)
  padding = canonicalize_padding(conv.padding, nd)
  if padding in ("CIRCULAR", "REFLECT"):
    kd = [(k - 1) * d + 1 for k, d in zip(ks, k_dil)]
    pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kd] + [(0, 0)]
    x = jnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
    padding = "VALID"
  elif padding == "CAUSAL":
    x = jnp.pad(x, [(0, 0), (k_dil[0] * (ks[0] - 1), 0), (0, 0)])
    padding = "VALID"
  return lax.conv_general_dilated_patches(
      x, ks, strides, padding, lhs_dilation=in_dil, rhs_dilation=k_dil,
      dimension_numbers=_conv_dimension_numbers(x.shape), precision=_HI)


def _outer_sqnorm(a: jax.Array, g: jax.Array, ghost: str) -> jax.Array:
  """``||sum_t a_t g_t^T||_F^2`` per user for ``a [U, N, p]``, ``g [U, N, q]``."""
  n, p, q = a.shape[1], a.shape[2], g.shape[2]
  use_gram = ghost == "gram" or (ghost == "auto" and n * (p + q) <= p * q)
  if use_gram:
    aa = jnp.einsum("unk,uvk->unv", a, a, precision=_HI)
    gg = jnp.einsum("unk,uvk->unv", g, g, precision=_HI)
    return jnp.maximum(jnp.sum(aa * gg, axis=(1, 2)), 0.0)
  m = jnp.einsum("unp,unq->upq", a, g, precision=_HI)
  return jnp.sum(jnp.square(m), axis=(1, 2))


def _embed_sqnorm(idx: jax.Array, g: jax.Array) -> jax.Array:
  gg = jnp.einsum("unk,uvk->unv", g, g, precision=_HI)
  same = idx[:, :, None] == idx[:, None, :]
  return jnp.maximum(jnp.sum(jnp.where(same, gg, 0.0), axis=(1, 2)), 0.0)


class ClipInfo(NamedTuple):
  """Data-dependent by-products (never released; for tests and ``debug`` only)."""
  norms: jax.Array    # [U] per-user gradient norms (NaN/Inf for non-finite users)
  weights: jax.Array  # [U] min(1, C/||g_u||), 0 for masked / non-finite users
  kept: jax.Array     # [U] bool: real user with a finite gradient


# --------------------------------------------------------------------------------------------
# The clipper.
# --------------------------------------------------------------------------------------------


class FastClippedGrad:
  """Per-user clipped gradient sums of an nnx model, via taps (fast) or vmap (reference).

  Args:
    model: an ``nnx.Module``; its ``nnx.Param`` leaves are the trainable parameters, the rest
      of its state is held fixed.
    loss_fn: ``loss_fn(model, example) -> scalar`` for one example (leaves without batch
      axis), as in the core convention.
    clip_norm: ``C``; every user's (or example's) gradient is scaled by ``min(1, C/||g||)``.
    level: ``"user"`` (batches ``[U, m, ...]``, a user's gradient is the mean over its
      ``m`` items) or ``"item"`` (batches ``[B, ...]``).
    method: ``"fast"`` (taps + fallback) or ``"vmap"`` (core ``per_user_grads`` then
      ``clip_and_aggregate``; the reference).
    ghost: ``"auto"`` | ``"gram"`` | ``"direct"`` for Linear/Conv kernels (see module doc).

  Sensitivity: :meth:`sensitivity` (``C`` for the sum under add/remove, ``C/D`` for the mean).
  """

  def __init__(self, model: nnx.Module, loss_fn: LossFn, *, clip_norm: float,
               level: str = "user", method: str = "fast", ghost: str = "auto"):
    if not isinstance(model, nnx.Module):
      raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    if not callable(loss_fn):
      raise ValueError("loss_fn must be callable: loss_fn(model, example) -> scalar")
    self.clip_norm = check_positive(clip_norm, "clip_norm")
    self.level = check_choice(level, "level", ("user", "item"))
    self.method = check_choice(method, "method", ("fast", "vmap"))
    self.ghost = check_choice(ghost, "ghost", ("auto", "gram", "direct"))
    self.loss_fn = loss_fn
    self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
    self._leaf_paths = _leaf_paths(self.params)
    self._candidates = {tuple(p): k for p, node in nnx.iter_graph(model)
                        if isinstance(node, nnx.Module)
                        and (k := _candidate_kind(node)) is not None}
    self._plans: dict = {}

  # ---- functional views --------------------------------------------------------------------

  def model_loss(self, params: PyTree, example: PyTree) -> jax.Array:
    """``loss_fn`` as a function of the parameter State (the core's ``loss_fn(params, ex)``)."""
    return self.loss_fn(nnx.merge(self.graphdef, params, self.rest), example)

  def _as_users(self, batch: PyTree) -> PyTree:
    if self.level == "item":
      return jax.tree.map(lambda x: x[:, None], batch)
    for x in jax.tree.leaves(batch):
      if jnp.ndim(x) < 2:
        raise ValueError("batch leaves must be shaped [users, m, ...] for level='user'")
    return batch

  # ---- planning ----------------------------------------------------------------------------

  def plan(self, params: PyTree, batch: PyTree) -> FastClipPlan:
    """The (cached) tap plan for this batch's per-example shapes."""
    users = self._as_users(batch)
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), users)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            params)
    key = (jax.tree.structure(example), tuple((l.shape, str(l.dtype))
                                              for l in jax.tree.leaves(example)))
    if key not in self._plans:
      self._plans[key] = self._make_plan(abstract, example)
    return self._plans[key]

  def _make_plan(self, abstract_params, example) -> FastClipPlan:
    tapes: list[_Tape] = []

    def sg_loss(p, ex):
      model = nnx.merge(self.graphdef, p, self.rest)
      tape = _Tape("plan", _modules_by_id(model, self._candidates))
      tapes.append(tape)
      token = _TAPE.set(tape)
      try:
        loss = self.loss_fn(model, ex)
      finally:
        _TAPE.reset(token)
      # A layer called inside an inner transform (scan, remat, vmap, cond) of the model sees
      # one trace for many executions: taps cannot see its per-position outputs. Its output
      # tracer has escaped that inner trace, so using it here raises; such layers take the
      # fallback.
      tape.inner.update(path for path, trace in tape.outputs if trace is not tape.trace)
      return loss

    def tangent_out(p, t, ex):
      return jax.jvp(lambda q: sg_loss(q, ex), (p,), (t,))[1]

    with _patched():
      closed = jax.make_jaxpr(tangent_out)(abstract_params, abstract_params, example)
    n = len(self._leaf_paths)
    deps = _output_deps(closed.jaxpr)
    leaks = {self._leaf_paths[i] for i in range(n) if (deps >> (n + i)) & 1}
    specs = tapes[-1].specs
    called = {s.path for s in specs} - tapes[-1].inner
    fast = {}
    for path, kind in self._candidates.items():
      own = [lp for lp in self._leaf_paths if lp[:-1] == path]
      if path in called and own and not any(lp in leaks for lp in own):
        fast[path] = kind
    fallback = tuple(lp for lp in self._leaf_paths if lp[:-1] not in fast)
    calls = tuple(s for s in specs if s.path in fast)
    return FastClipPlan(fast=tuple(fast.items()), fallback=fallback, calls=calls)

  # ---- the fast pass -----------------------------------------------------------------------

  def _fast_pass(self, params, users, plan: FastClipPlan):
    """One vmapped backward pass to the taps: per-user fallback grads, recorded layer inputs
    and output gradients (already carrying the 1/m of the per-user mean)."""
    leaves, treedef = jax.tree.flatten(params)
    fb_idx = [i for i, lp in enumerate(self._leaf_paths) if lp in set(plan.fallback)]
    fast = dict(plan.fast)
    n_users, m = jax.tree.leaves(users)[0].shape[:2]

    def full_params(fb_leaves):
      new = list(leaves)
      for j, i in enumerate(fb_idx):
        new[i] = fb_leaves[j]
      return jax.tree.unflatten(treedef, new)

    def item_loss(fb_leaves, zs, ex):
      model = nnx.merge(self.graphdef, full_params(fb_leaves), self.rest)
      tape = _Tape("run", _modules_by_id(model, fast), zs)
      token = _TAPE.set(tape)
      try:
        loss = self.loss_fn(model, ex)
      finally:
        _TAPE.reset(token)
      if len(tape.arrays) != len(plan.calls):
        raise ValueError("the model called its layers differently than when planned; the "
                         "loss must be deterministic in (params, example)")
      return loss, tape.arrays

    def user_loss(fb_leaves, zs_u, items):
      losses, arrays = jax.vmap(item_loss, in_axes=(None, 0, 0))(fb_leaves, zs_u, items)
      return jnp.mean(losses), arrays

    def one_user(zs_u, items):
      fb = [leaves[i] for i in fb_idx]
      loss, vjp_fn, arrays = jax.vjp(lambda f, z: user_loss(f, z, items), fb, zs_u,
                                     has_aux=True)
      fb_g, g = vjp_fn(jnp.ones_like(loss))
      return fb_g, g, arrays

    zs0 = [jnp.zeros((n_users, m) + c.out.shape, c.out.dtype) for c in plan.calls]
    try:
      with _patched():
        fb_grads, gs, arrays = jax.vmap(one_user)(zs0, users)
    except jax.errors.UnexpectedTracerError as e:  # tapped layer inside an inner transform
      raise ValueError("fast clipping cannot tap layers called inside jax/nnx transforms "
                       "(scan, remat, vmap) of the model; use method='vmap'") from e
    return fb_idx, fb_grads, gs, arrays

  def _module(self, params, path):
    model = nnx.merge(self.graphdef, params, self.rest)
    node = model
    for k in path:  # attributes, or items of nnx.List / nnx.Dict containers
      node = getattr(node, k) if isinstance(k, str) and hasattr(node, k) else node[k]
    return node

  def _fast_sqnorms(self, params, plan, gs, arrays, n_users: int) -> jax.Array:
    by_path: dict[Path, list[int]] = {}
    for k, c in enumerate(plan.calls):
      by_path.setdefault(c.path, []).append(k)
    total = jnp.zeros((n_users,), jnp.float32)
    for path, kind in plan.fast:
      ks = by_path[path]
      module = self._module(params, path)
      f32 = lambda x: x.astype(jnp.float32)
      if kind in ("linear", "conv"):
        a_list, g_list = [], []
        for k in ks:
          x, g = arrays[k][0], gs[k]
          if kind == "linear":
            a = jnp.reshape(x, (n_users, -1, x.shape[-1]))
          else:
            p = _conv_patches(module, x)
            a = jnp.reshape(p, (n_users, -1, p.shape[-1]))
          a_list.append(f32(a))
          g_list.append(f32(jnp.reshape(g, (n_users, -1, g.shape[-1]))))
        a, g = jnp.concatenate(a_list, 1), jnp.concatenate(g_list, 1)
        total = total + _outer_sqnorm(a, g, self.ghost)
        if module.bias is not None:
          total = total + jnp.sum(jnp.square(jnp.sum(g, axis=1)), axis=1)
      elif kind == "embed":
        idx_list, g_list = [], []
        for k in ks:
          idx, g = arrays[k][0], gs[k]
          idx = jnp.reshape(idx, (n_users, -1))
          if module.num_embeddings == 1:
            idx = jnp.zeros_like(idx)
          idx = jnp.where(idx < 0, idx + module.num_embeddings, idx)
          idx_list.append(idx)
          g_list.append(f32(jnp.reshape(g, (n_users, -1, g.shape[-1]))))
        total = total + _embed_sqnorm(jnp.concatenate(idx_list, 1),
                                      jnp.concatenate(g_list, 1))
      else:  # local: the layer's own VJP per user (small parameter vectors)
        per_user = self._local_grads(module, [plan.calls[k] for k in ks],
                                     [arrays[k] for k in ks], [gs[k] for k in ks], per_user=True)
        total = total + sum(jnp.sum(jnp.reshape(jnp.square(f32(v)), (n_users, -1)), axis=1)
                            for v in jax.tree.leaves(per_user))
    return total

  @staticmethod
  def _local_grads(module, specs, arrays, gs, *, per_user: bool):
    """VJP of the layer's own call w.r.t. its params at the recorded inputs: per user
    (``per_user=True``, leaves ``[U, ...]``) or summed over users."""
    graphdef, p0, rest = nnx.split(module, nnx.Param, ...)
    orig = _ORIG_CALL[next(c for c in _KINDS if isinstance(module, c))]

    def outputs(p, arrs_all):
      mod = nnx.merge(graphdef, p, rest)
      outs = []
      for spec, arrs in zip(specs, arrs_all):
        def one(*a, spec=spec):
          args, kwargs = _rebuild(spec, a)
          return orig(mod, *args, **kwargs)
        outs.append(jax.vmap(one)(*arrs))  # over items (and users when summed)
      return outs

    if per_user:
      def user(arrs_u, gs_u):
        _, vjp_fn = jax.vjp(lambda p: outputs(p, arrs_u), p0)
        return vjp_fn(gs_u)[0]
      return jax.vmap(user)(arrays, gs)
    flat = [[jnp.reshape(a, (-1,) + a.shape[2:]) for a in arrs] for arrs in arrays]
    gflat = [jnp.reshape(g, (-1,) + g.shape[2:]) for g in gs]
    _, vjp_fn = jax.vjp(lambda p: outputs(p, flat), p0)
    return vjp_fn(gflat)[0]

  # ---- public API --------------------------------------------------------------------------

  def _weights(self, sqnorms, user_mask):
    norms = jnp.sqrt(sqnorms)
    kept = jnp.isfinite(norms)
    if user_mask is not None:
      kept = kept & user_mask
    w = jnp.where(kept, jnp.minimum(1.0, self.clip_norm / jnp.maximum(norms, _TINY)), 0.0)
    return norms, w, kept

  def norms(self, params: PyTree, batch: PyTree) -> jax.Array:
    """Exact per-user (per-example at item level) gradient norms ``[U]``."""
    users = self._as_users(batch)
    if self.method == "vmap":
      return tree_global_norms(per_user_grads(self.model_loss, params, users))
    plan = self.plan(params, batch)
    fb_idx, fb_grads, gs, arrays = self._fast_pass(params, users, plan)
    sq = self._fast_sqnorms(params, plan, gs, arrays, jax.tree.leaves(users)[0].shape[0])
    for g in fb_grads:
      sq = sq + jnp.sum(jnp.reshape(jnp.square(g.astype(jnp.float32)), (g.shape[0], -1)), 1)
    return jnp.sqrt(sq)

  def clipped_sum(self, params: PyTree, batch: PyTree, user_mask: jax.Array | None = None
                  ) -> tuple[PyTree, ClipInfo]:
    """``sum_u w_u g_u`` with ``w_u = min(1, C/||g_u||)`` (0 for masked or non-finite users),
    shaped like ``params``, and the (secret) :class:`ClipInfo`."""
    users = self._as_users(batch)
    n_users = jax.tree.leaves(users)[0].shape[0]
    if user_mask is not None and jnp.shape(user_mask) != (n_users,):
      raise ValueError(f"user_mask must have shape ({n_users},), got {jnp.shape(user_mask)}")
    if self.method == "vmap":
      grads = per_user_grads(self.model_loss, params, users)
      norms = tree_global_norms(grads)
      norms, w, kept = self._weights(jnp.square(norms), user_mask)
      chain = clip_and_aggregate(self.clip_norm, "sum")
      summed, _ = chain.update(grads, chain.init(params), params, user_mask=user_mask)
      return summed, ClipInfo(norms, w, kept)

    plan = self.plan(params, batch)
    fb_idx, fb_grads, gs, arrays = self._fast_pass(params, users, plan)
    sq = self._fast_sqnorms(params, plan, gs, arrays, jax.tree.leaves(users)[0].shape[0])
    for g in fb_grads:
      sq = sq + jnp.sum(jnp.reshape(jnp.square(g.astype(jnp.float32)), (g.shape[0], -1)), 1)
    norms, w, kept = self._weights(sq, user_mask)

    leaves, treedef = jax.tree.flatten(params)
    out = [jnp.zeros_like(x) for x in leaves]

    def bcast(v, x):
      return jnp.reshape(v, v.shape + (1,) * (x.ndim - 1))

    for j, i in enumerate(fb_idx):
      g = fb_grads[j]
      out[i] = jnp.sum(jnp.where(bcast(kept, g), g * bcast(w, g).astype(g.dtype), 0), axis=0)

    # Dropped users' recorded inputs may be non-finite: substitute a kept user's (their
    # cotangent is zero, so any finite input gives an exact zero contribution).
    donor = jnp.argmax(kept)
    def safe(x):
      k = jnp.reshape(kept, kept.shape + (1,) * (x.ndim - 1))
      return jnp.where(k, x, x[donor][None])
    by_path: dict[Path, list[int]] = {}
    for k, c in enumerate(plan.calls):
      by_path.setdefault(c.path, []).append(k)
    for path, _ in plan.fast:
      ks = by_path[path]
      module = self._module(params, path)
      arrs = [[safe(a) for a in arrays[k]] for k in ks]
      wg = [jnp.where(bcast(kept, gs[k]), gs[k] * bcast(w, gs[k]).astype(gs[k].dtype), 0)
            for k in ks]
      grads = self._local_grads(module, [plan.calls[k] for k in ks], arrs, wg, per_user=False)
      for lp, g in zip(_leaf_paths(grads), jax.tree.leaves(grads)):
        out[self._leaf_paths.index(path + lp)] = g
    summed = jax.tree.unflatten(treedef, out)
    any_kept = jnp.any(kept)
    summed = jax.tree.map(lambda x: jnp.where(any_kept, x, jnp.zeros_like(x)), summed)
    return summed, ClipInfo(norms, w, kept)

  def aggregate(self, params: PyTree, batch: PyTree, user_mask: jax.Array | None = None, *,
                mode: str = "mean", denominator: float | None = None) -> PyTree:
    """The core's ``clip_per_user(C)`` + ``aggregate(mode, denominator)`` output: the clipped
    sum, divided by the fixed ``denominator`` for ``mode="mean"``."""
    check_choice(mode, "mode", ("mean", "sum"))
    if mode == "mean":
      check_positive(denominator, "denominator")
    summed, _ = self.clipped_sum(params, batch, user_mask)
    return summed if mode == "sum" else jax.tree.map(lambda x: x / denominator, summed)

  def sensitivity(self, *, mode: str = "mean", denominator: float | None = None,
                  relation: str = "add_remove") -> float:
    """L2 sensitivity of :meth:`aggregate` (the core's ``aggregation_sensitivity``)."""
    return aggregation_sensitivity(self.clip_norm, mode=mode, denominator=denominator,
                                   relation=relation)
