"""Taps on nnx layer calls and the soundness rule that decides which layers may be tapped.

A *tap* replaces a layer's per-example weight gradient by a formula in its input ``a`` and the
gradient at its output ``g`` (e.g. ``a^T g`` for ``nnx.Linear``), right only when the layer
computes ``y = f(a, raw parameter values)`` with exactly that ``f``. So a layer is tapped only
when all of these hold (anything else takes the exact per-example fallback):

1. its class is *exactly* ``nnx.Linear``, ``LinearGeneral`` (no ``batch_axis``), ``Conv``,
   ``Embed``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm`` or ``Einsum`` (its own VJP), with the
   default ``promote_dtype`` and ``dot_general`` / ``conv_general_dilated``, no
   ``preferred_element_type``, no conv ``mask`` or negative padding, and (bilinear kinds)
   float32 parameters and compute ``dtype``;
2. its ``Param``s are plain variables (no overridden value accessor, no value hooks, not
   ``hijax`` / ``ref``), and the weights the tap differentiates are ``Param``s;
3. none of its ``Param``s is held by another graph node (a module reused whole is fine);
4. at every call, each ``Param``'s raw value is the very array merged (an identity check:
   ``nnx.WeightNorm`` / ``SpectralNorm`` fail it);
5. its parameters reach the loss only through its calls (checked on the JVP jaxpr with them
   behind ``stop_gradient`` inside the calls), and no call is inside an inner transform.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import canonicalize_padding
from jax import lax

Path = tuple

_TAPE: contextvars.ContextVar["Tape | None"] = contextvars.ContextVar("dpsco_fast_clip_tape",
                                                                       default=None)
# "local" layers get their exact per-user gradients from their own VJP at the recorded inputs
KINDS = {nnx.Linear: "linear", nnx.LinearGeneral: "linear_general", nnx.Conv: "conv",
         nnx.Embed: "embed", nnx.LayerNorm: "local", nnx.RMSNorm: "local",
         nnx.GroupNorm: "local", nnx.Einsum: "local"}
ORIG_CALL = {cls: cls.__call__ for cls in KINDS}
# Value accessors of nnx.Variable a Param subclass must not override (rule 2).
_ACCESSORS = ("get_value", "set_value", "__getitem__", "__setitem__", "create_value",
              "get_raw_value", "set_raw_value", "__jax_array__", "value", "__call__",
              "update_from_state", "copy_from")
_HOOKS = ("on_get_value", "on_set_value", "on_create_value")


_TAPPED: dict[type, type] = {}
_TAPPED_LOCK = threading.Lock()


def _tapped_class(cls: type) -> type:
  """``cls`` with the tapping ``__call__``: a subclass made once per class (thread safe)."""
  orig = ORIG_CALL[cls]

  @functools.wraps(orig)
  def __call__(self, *args, **kwargs):
    tape = _TAPE.get()
    if tape is None or id(self) not in tape.modules:
      return orig(self, *args, **kwargs)
    return tape.call(self, orig, args, kwargs)

  with _TAPPED_LOCK:
    if cls not in _TAPPED:
      _TAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                 "__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
    return _TAPPED[cls]


def taped(model, mode: str, wanted: dict[Path, str], fn, zs=None) -> tuple[Any, "Tape"]:
  """``(fn(model), tape)``, ``model`` (a fresh ``nnx.merge`` for one trace) with its ``wanted``
  layers tapped in ``mode`` (:class:`Tape`): they get the tapping subclass of their class, so
  no class is patched and no other model sees a tap."""
  tape = Tape(mode, {}, zs)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and tuple(path) in wanted:
      tape.modules[id(node)] = (tuple(path), wanted[tuple(path)])
      if type(node) in KINDS:
        node.__class__ = _tapped_class(type(node))
      for var in module_params(node).values():  # the raw values right after the merge
        tape.raw[id(var)] = var.get_raw_value()
  token = _TAPE.set(tape)
  try:
    return fn(model), tape
  finally:
    _TAPE.reset(token)


def _current_trace():
  """The innermost JAX trace (private API); None disables the inner-transform detection."""
  try:
    from jax._src import core
    return core.trace_ctx.trace
  except (ImportError, AttributeError):  # pragma: no cover
    return None


def is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


@dataclasses.dataclass(frozen=True)
class CallSpec:
  """One call of a tapped layer, as seen by the per-example trace."""
  path: Path
  kind: str
  treedef: Any                      # of (args, kwargs)
  array_pos: tuple[int, ...]        # positions of array leaves in the flattened (args, kwargs)
  statics: tuple                    # the non-array leaves, in order
  out: jax.ShapeDtypeStruct         # per-example output shape (the tap)
  ins: tuple = ()                   # per-example shapes of the array inputs (cost model)
  in_group: int = -1                # first call given the very same input arrays


def module_params(module) -> dict[str, nnx.Variable]:
  """The module's own ``Param`` attributes (tapped modules have no submodules)."""
  return {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param)}


class Tape:
  """Per-trace recorder. ``'plan'``: params behind stop_gradient, record call specs and rule-4
  violations. ``'run'``: add tap ``zs[k]`` to the k-th call's output, record its inputs."""

  def __init__(self, mode: str, modules: dict[int, tuple[Path, str]], zs=None):
    self.mode, self.modules, self.zs = mode, modules, zs
    self.specs: list[CallSpec] = []
    self.arrays: list[list[jax.Array]] = []
    self.outputs: list[tuple[Path, Any]] = []  # (path, trace the call ran under)
    self.inner: set[Path] = set()
    self.rewritten: set[Path] = set()
    self.trace = _current_trace()
    self.raw: dict[int, Any] = {}
    self._ins: list[tuple] = []  # plan mode: every call's input arrays (by identity)

  def _raw_intact(self, module) -> bool:
    return all(self.raw.get(id(v), None) is v.get_raw_value()
               for v in module_params(module).values())

  def call(self, module, orig, args, kwargs):
    path, kind = self.modules[id(module)]
    leaves, treedef = jax.tree.flatten((args, kwargs))
    pos = tuple(i for i, x in enumerate(leaves) if is_array(x))
    statics = tuple(x for i, x in enumerate(leaves) if i not in pos)
    if self.mode == "plan":
      if not self._raw_intact(module):
        self.rewritten.add(path)
      gd, st = nnx.split(module)
      y = orig(nnx.merge(gd, jax.tree.map(lax.stop_gradient, st)), *args, **kwargs)
      if not is_array(y):
        raise ValueError(f"tapped layer {path} must return one array")
      # identity, not equality: the references are kept so that no id is reused in the trace
      objs = tuple(leaves[i] for i in pos)
      group = next((k for k, o in enumerate(self._ins)
                    if len(o) == len(objs) and all(a is b for a, b in zip(o, objs))),
                   len(self._ins))
      self._ins.append(objs)
      self.specs.append(CallSpec(path, kind, treedef, pos, statics,
                                 jax.ShapeDtypeStruct(y.shape, y.dtype),
                                 tuple(jax.ShapeDtypeStruct(jnp.shape(leaves[i]),
                                                            jnp.result_type(leaves[i]))
                                       for i in pos), group))
      self.outputs.append((path, _current_trace()))
      return y
    if not self._raw_intact(module):
      raise ValueError(f"the parameters of layer {path} were rewritten before its call, "
                       "unlike when planned; the model must be deterministic")
    k = len(self.arrays)
    y = orig(module, *args, **kwargs)
    self.arrays.append([jnp.asarray(leaves[i]) for i in pos])
    return y + self.zs[k].astype(y.dtype)


def rebuild(spec: CallSpec, arrays: Sequence[jax.Array]):
  arrays, statics = iter(arrays), iter(spec.statics)
  n = len(spec.array_pos) + len(spec.statics)
  leaves = [next(arrays) if i in spec.array_pos else next(statics) for i in range(n)]
  return jax.tree.unflatten(spec.treedef, leaves)


def plain_variable(var) -> bool:
  """Rule 2: ``var`` stores and returns its raw value unchanged."""
  cls = type(var)
  if any(getattr(cls, name, None) is not getattr(nnx.Variable, name, None)
         for name in _ACCESSORS):
    return False
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  if any(meta.get(h) for h in _HOOKS):
    return False
  return not (meta.get("hijax") or meta.get("ref"))


def _negative_padding(conv) -> bool:
  padding = canonicalize_padding(conv.padding, len(tuple(conv.kernel_size)))
  if isinstance(padding, str):
    return False
  return any(int(lo) < 0 or int(hi) < 0 for lo, hi in padding)


def _float32_compute(module) -> bool:
  params_f32 = all(jnp.result_type(v.get_raw_value()) == jnp.float32
                   for v in module_params(module).values())
  dt = getattr(module, "dtype", None)
  return params_f32 and (dt is None or jnp.dtype(dt) == jnp.float32)


# The attributes a bilinear tap differentiates must be Params (a kernel in another variable
# is a constant of the loss: the fallback then gives it no gradient, its Param bias an exact one)
_TAPPED_ATTRS = {"linear": ("kernel", "bias"), "linear_general": ("kernel", "bias"),
                 "conv": ("kernel", "bias"), "embed": ("embedding",)}


def candidate_kind(module) -> str | None:
  """Rules 1-2: the tap kind of a module, or None when it must take the fallback."""
  kind = KINDS.get(type(module))
  if kind is None or any(
      not (isinstance(getattr(module, a, None), nnx.Param)
           or (a == "bias" and getattr(module, a, None) is None))
      for a in _TAPPED_ATTRS.get(kind, ())):
    return None
  refused = (
      getattr(module, "promote_dtype", nnx_dtypes.promote_dtype) is not nnx_dtypes.promote_dtype
      or not all(plain_variable(v) for v in module_params(module).values())
      or (kind in ("linear", "linear_general", "conv", "embed") and not _float32_compute(module))
      or getattr(module, "preferred_element_type", None) is not None
      or (kind == "linear" and (module.dot_general is not lax.dot_general
                                or getattr(module, "dot_general_cls", None) is not None))
      or (isinstance(module, nnx.Einsum) and module.einsum_op is not jnp.einsum)
      or (kind == "linear_general" and (module.dot_general is not None or module.batch_axis
                                        or getattr(module, "dot_general_cls", None) is not None))
      or (kind == "conv" and (module.mask is not None
                              or module.conv_general_dilated is not lax.conv_general_dilated
                              or _negative_padding(module))))
  return None if refused else kind


def _direct_variables(node):
  """Variables held by a graph node directly (descending plain python containers only)."""
  stack = list(vars(node).values())
  while stack:
    v = stack.pop()
    if isinstance(v, nnx.Variable):
      yield v
    elif isinstance(v, (list, tuple)):
      stack.extend(v)
    elif isinstance(v, dict):
      stack.extend(v.values())


def shared_variable_ids(model) -> set[int]:
  """Rule 3: ids of Variables held by more than one graph node."""
  holders: dict[int, set[int]] = {}
  for _, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Pytree):  # modules and nnx containers hold Variables
      continue
    for var in _direct_variables(node):
      holders.setdefault(id(var), set()).add(id(node))
  return {i for i, h in holders.items() if len(h) > 1}


def candidates(model) -> dict[Path, str]:
  """Module path -> tap kind for every module passing rules 1-3."""
  shared = shared_variable_ids(model)
  out = {}
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    kind = candidate_kind(node)
    if kind is None or any(id(v) in shared for v in module_params(node).values()):
      continue
    out[tuple(path)] = kind
  return out


def leaf_paths(params) -> list[Path]:
  """Param path (module path + attribute) of every leaf of an nnx State, in flatten order."""
  out = []
  for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k)
            for k in kp]
    if keys and keys[-1] == "value":
      keys = keys[:-1]
    out.append(tuple(keys))
  return out


def output_deps(jaxpr) -> int:
  """Rule 5: bitmask of the jaxpr's invars its outputs may depend on (conservatively)."""
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
