"""Argument validation shared by every public constructor.

A value of the wrong *type* (a bool, a string, ``None`` or any non-number where a number is
expected: ``epsilon: true`` or ``clip_norm: "1.0"`` would otherwise pass) raises
:class:`ArgumentTypeError`, a number outside its range ``ValueError``; both name the parameter.
Numbers are python ints/floats, numpy scalars and 0-d numeric arrays. Traced values (a swept
hyper-parameter inside ``jit``) pass through: the caller validated them while concrete.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
  """A parameter of the wrong type; also a ``ValueError`` for callers that catch configuration
  errors as ``ValueError``."""


def _traced(x: Any) -> bool:
  """A traced hyper-parameter (validated by its caller while concrete)."""
  import jax
  return isinstance(x, jax.core.Tracer)


def _real(x: Any, name: str, what: str, low: float, high: float = math.inf, *,
          closed: str = "", integer: bool = False, rule: str = "", traced: bool = True) -> Any:
  """``float(x)`` for a real non-bool number (python/numpy scalar, 0-d numeric array) in the
  range from ``low`` to ``high`` (open ends, except those ``closed`` names: ``"low"``,
  ``"high"``; so never inf or nan) and, with ``integer``, integral; else raises naming
  ``name`` and ``what`` it must be (``rule``: the range's words). With ``traced``, a traced
  ``x`` is returned unchecked."""
  import jax
  if traced and isinstance(x, jax.core.Tracer):
    return x
  dtype = getattr(x, "dtype", None)
  try:
    # jax's issubdtype: bfloat16 (a jax array's or ml_dtypes' scalar) has numpy kind "V"
    number = not isinstance(x, (bool, np.bool_, str, bytes)) and (
        isinstance(x, numbers.Real) or (dtype is not None and getattr(x, "shape", None) == ()
                                        and (np.dtype(dtype).kind in "iu"
                                             or jax.dtypes.issubdtype(dtype, np.floating))))
  except TypeError:  # e.g. a PRNG key dtype
    number = False
  if not number:
    raise ArgumentTypeError(f"{name} must be {what}, got {type(x).__name__} {x!r}")
  v = float(x)
  if not ((v >= low if "low" in closed else v > low) and (v <= high if "high" in closed
                                                          else v < high)
          and (not integer or v.is_integer())):
    raise ValueError(f"{name} must {rule or 'be ' + what}, got {x!r}")
  return v


def check_positive(x: Any, name: str) -> float:
  return _real(x, name, "a finite number > 0", 0.0)


def check_nonnegative(x: Any, name: str) -> float:
  return _real(x, name, "a finite number >= 0", 0.0, closed="low")


def check_above(x: Any, name: str, bound: float) -> float:
  """A finite number strictly greater than ``bound`` (e.g. a law's shape ``eta > -1``)."""
  return _real(x, name, f"a finite number > {bound:g}", bound, traced=False)


def check_epsilon(x: Any, name: str = "epsilon") -> float:
  return _real(x, name, "a finite number > 0", 0.0)


def check_delta(x: Any, name: str = "delta") -> float:
  return _real(x, name, "a number in (0, 1)", 0.0, 1.0, rule="lie in the open interval (0, 1)")


def check_probability(x: Any, name: str) -> float:
  return _real(x, name, "a number in (0, 1]", 0.0, 1.0, closed="high", rule="lie in (0, 1]")


def check_int(x: Any, name: str, minimum: int = 1) -> int:
  """An integer ``>= minimum``; an integral float (``3.0``, as YAML may give) is accepted."""
  return int(_real(x, name, f"an integer >= {minimum}", minimum, closed="low", integer=True,
                   traced=False))


def check_choice(x: Any, name: str, choices: tuple[str, ...]) -> str:
  if not isinstance(x, str):
    raise ArgumentTypeError(f"{name} must be one of {choices}, got {type(x).__name__} {x!r}")
  if x not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {x!r}")
  return x


def check_bool(x: Any, name: str) -> bool:
  """Only a real bool (python or numpy) switches a flag: ``"false"`` would be truthy, and a
  debug flag that is accidentally on releases data-dependent diagnostics."""
  if not isinstance(x, (bool, np.bool_)):
    raise ArgumentTypeError(f"{name} must be a bool (True or False), got "
                            f"{type(x).__name__} {x!r}")
  return bool(x)


def check_key(key: Any, name: str = "key") -> Any:
  """A PRNG key, returned unchanged: a typed key array of shape ``()`` or a raw ``uint32[2]``
  (shapes and dtypes are static, so traced keys are checked too)."""
  import jax
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  if dtype is None or isinstance(key, (bool, np.bool_)):
    raise ArgumentTypeError(f"{name} must be a jax PRNG key (jax.random.key(seed)), got "
                            f"{type(key).__name__} {key!r}")
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(f"{name} must be a single PRNG key (shape ()), got shape {shape}")
    return key
  if np.dtype(dtype) == np.uint32 and tuple(shape) == (2,):
    return key
  raise ArgumentTypeError(f"{name} must be a jax PRNG key (typed key array or uint32[2]), "
                          f"got dtype {dtype} shape {shape}")


#: Seeds ``jax.random.key`` tells apart: it keeps only the low 32 bits of an int seed (with
#: x64 off), so 0 and 2**32 (or -1 and 2**32 - 1) give the same key and the same noise.
MAX_SEED = 2 ** 32 - 1


def check_seed_or_key(key: Any, name: str = "key") -> Any:
  """``jax.random.key(seed)`` for an int seed in ``[0, MAX_SEED]`` (where distinct seeds give
  distinct keys, so disjoint seed lists never share noise), or a PRNG key (checked)."""
  import jax
  if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
    if not 0 <= int(key) <= MAX_SEED:
      raise ValueError(f"{name} must lie in [0, 2**32 - 1], got {key!r}: the key derivation "
                       "keeps only 32 bits of a seed, so this one would give the key of another "
                       "seed")
    return jax.random.key(int(key))
  return check_key(key, name)


def check_user_mask(mask: Any, n_users: int, name: str = "user_mask") -> Any:
  """A padding mask: bool of shape exactly ``[n_users]`` (``None`` passes: every slot real).

  A ``(1,)`` or ``()`` mask would broadcast over every slot (padded duplicates counted, the
  sensitivity bound broken) and an int/float mask has no single meaning, so both raise instead
  of being cast. Shapes and dtypes are static, so traced masks are checked too."""
  if mask is None:
    return None
  import jax.numpy as jnp
  if not hasattr(mask, "dtype"):
    if isinstance(mask, (list, tuple)) and all(isinstance(v, (bool, np.bool_)) for v in mask):
      mask = jnp.asarray(mask, bool)
    else:
      raise ArgumentTypeError(f"{name} must be a bool array of shape ({n_users},), got "
                              f"{type(mask).__name__}")
  if mask.dtype != jnp.bool_:
    raise ArgumentTypeError(f"{name} must have dtype bool, got {mask.dtype} (an int/float "
                            "mask is not cast: use mask.astype(bool) if that is what you mean)")
  if tuple(mask.shape) != (n_users,):
    raise ValueError(f"{name} must have shape ({n_users},) (one entry per user slot; a "
                     f"broadcasting mask is refused), got {tuple(mask.shape)}")
  return mask
