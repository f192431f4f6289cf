"""Argument validation shared by every public constructor.

A value of the wrong *type* (a bool, a string, ``None`` or any non-number where a number is
expected) raises :class:`ArgumentTypeError`; a number outside its range raises ``ValueError``.
Both messages name the offending parameter, so a bad configuration fails at construction,
before any data is touched or any noise is drawn.

Why strict types: ``True`` is an ``int`` to Python and ``float("1.0")`` parses, so a config
value like ``epsilon: true`` or ``clip_norm: "1.0"`` (YAML, a CLI) would otherwise be taken as
a number silently. Numbers are python ints/floats, numpy scalars and 0-d numeric arrays.
Traced values (a hyper-parameter shared across a sweep inside ``jit``) pass through: the caller
validated them while still concrete.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
  """A parameter of the wrong type. A ``TypeError``; also a ``ValueError`` so that callers
  which catch configuration errors as ``ValueError`` (the runner, older code) still do."""


def _traced(x: Any) -> bool:
  """Hyper-parameters passed as traced values (to share one compilation across a sweep) were
  validated by the caller while still concrete; they cannot be inspected here."""
  import jax
  return isinstance(x, jax.core.Tracer)


def _is_number(x: Any) -> bool:
  """True for real numbers that are not bools: python/numpy scalars, 0-d numeric arrays."""
  if isinstance(x, (bool, np.bool_, str, bytes)) or x is None:
    return False
  if isinstance(x, numbers.Real):
    return True
  dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
  if dtype is None or shape != ():
    return False
  try:
    kind = np.dtype(dtype).kind
  except TypeError:  # e.g. a PRNG key dtype
    return False
  return kind in "iuf"


def _number(x: Any, name: str, what: str) -> float:
  if not _is_number(x):
    raise ArgumentTypeError(f"{name} must be {what}, got {type(x).__name__} {x!r}")
  return float(x)


def check_positive(x: Any, name: str) -> float:
  if _traced(x):
    return x
  v = _number(x, name, "a finite number > 0")
  if not math.isfinite(v) or v <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
  return v


def check_nonnegative(x: Any, name: str) -> float:
  if _traced(x):
    return x
  v = _number(x, name, "a finite number >= 0")
  if not math.isfinite(v) or v < 0:
    raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
  return v


def check_above(x: Any, name: str, bound: float) -> float:
  """A finite number strictly greater than ``bound`` (e.g. a law's shape ``eta > -1``)."""
  v = _number(x, name, f"a finite number > {bound:g}")
  if not math.isfinite(v) or v <= bound:
    raise ValueError(f"{name} must be a finite number > {bound:g}, got {x!r}")
  return v


def check_epsilon(x: Any, name: str = "epsilon") -> float:
  return check_positive(x, name)


def check_delta(x: Any, name: str = "delta") -> float:
  if _traced(x):
    return x
  v = _number(x, name, "a number in (0, 1)")
  if not 0.0 < v < 1.0:
    raise ValueError(f"{name} must lie in the open interval (0, 1), got {x!r}")
  return v


def check_probability(x: Any, name: str) -> float:
  if _traced(x):
    return x
  v = _number(x, name, "a number in (0, 1]")
  if not 0.0 < v <= 1.0:
    raise ValueError(f"{name} must lie in (0, 1], got {x!r}")
  return v


def check_int(x: Any, name: str, minimum: int = 1) -> int:
  """An integer ``>= minimum``; an integral float (``3.0``, as YAML may give) is accepted."""
  v = _number(x, name, f"an integer >= {minimum}")
  if not (math.isfinite(v) and v.is_integer()):
    raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
  if int(v) < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
  return int(v)


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
  """A PRNG key: a typed key array (``jax.random.key``) of shape ``()`` or a raw
  ``uint32[2]`` key (``jax.random.PRNGKey``). Returns it unchanged. Shapes and dtypes are
  static, so traced keys are checked too."""
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


def check_seed(x: Any, name: str = "seed") -> int:
  """An int seed in ``[0, MAX_SEED]``, the range in which distinct seeds give distinct keys
  (so two disjoint lists of seeds never share noise). Bools and floats are refused."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    raise ArgumentTypeError(f"{name} must be an integer seed in [0, {MAX_SEED}], got "
                            f"{type(x).__name__} {x!r}")
  if not 0 <= int(x) <= MAX_SEED:
    raise ValueError(f"{name} must lie in [0, 2**32 - 1], got {x!r}: the key derivation keeps "
                     "only 32 bits of a seed, so this one would give the key of another seed")
  return int(x)


def check_seed_or_key(key: Any, name: str = "key") -> Any:
  """An int seed (checked by :func:`check_seed`, turned into ``jax.random.key(seed)``) or a
  PRNG key (checked)."""
  import jax
  if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
    return jax.random.key(check_seed(key, name))
  return check_key(key, name)


def check_user_mask(mask: Any, n_users: int, name: str = "user_mask") -> Any:
  """A padding mask must be bool of shape exactly ``[n_users]``.

  A ``(1,)`` or ``()`` mask would broadcast over every slot (padded duplicates counted, the
  sensitivity bound broken) and an int/float mask has no single meaning (is 2 a weight?), so
  both raise instead of being cast. ``None`` passes through: the caller's documented rule is
  then that every slot is a real user. Shapes and dtypes are static, so this works on traced
  masks too.
  """
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
