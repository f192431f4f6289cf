"""The lowest layer of the config vocabulary: the error type, one key's spec, the type check
(:func:`check_instance`, every schema's one validation). It imports nothing of the package but
``_checks`` and ``cache``, so every layer may raise :class:`ConfigError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from dpsco_jax._checks import (MAX_SEED, check_delta, check_nonnegative, check_positive,
                               check_probability)
from dpsco_jax.cache import bounded_cache

__all__ = ["ConfigError", "ConfigTypeError", "KeySpec", "Schema", "MAX_COUNT", "check_instance",
           "validating", "check_refused", "check_read_only_with", "check_type", "specs",
           "type_name"]

#: Largest value of a count key: JAX's default integers (int32) count steps and index users.
MAX_COUNT = 2 ** 31 - 1


class ConfigError(ValueError):
  """A user error in a config: reported by the CLI as one line, exit code 2."""


class ConfigTypeError(ConfigError, TypeError):
  """A config value of the wrong type: a :class:`ConfigError`, and a ``TypeError`` as the
  argument checks' are (``_checks.ArgumentTypeError``)."""


@dataclasses.dataclass(frozen=True)
class KeySpec:
  """One key of a schema: its accepted type, default (documentation), doc, requiredness."""
  name: str
  type: Any
  default: Any
  doc: str
  required: bool
  owner: str  # "runner", "algorithm" or "problem"
  #: a vocabulary key this schema cannot honour: why, and what to give instead
  refused: str | None = None


def specs(schema: type, owner: str) -> dict[str, KeySpec]:
  """``{key: KeySpec}`` of a schema dataclass, each tagged with its ``owner`` section."""
  hints = typing.get_type_hints(schema)
  return {f.name: KeySpec(f.name, hints[f.name], f.default, f.metadata.get("doc", ""),
                          bool(f.metadata.get("required", False)), owner,
                          f.metadata.get("refused"))
          for f in dataclasses.fields(schema)}


def check_refused(spec: KeySpec, value: Any, where: str) -> None:
  """A refused key given a value raises its reason, naming the key to use instead."""
  if spec.refused is not None and value is not None:
    raise ConfigError(f"{spec.name} is not accepted by {where}: {spec.refused}")


def check_read_only_with(schema: type, obj: Any) -> None:
  """Refuses a key the schema reads only when another key has one value (its
  ``read_only_with``, ``{key: (other, value)}``), given without it: it would be ignored.

  Args:
    schema: the schema class declaring ``read_only_with`` (none: nothing to check).
    obj: its instance, or any object with those attributes (a trainer's arguments).

  Raises:
    ConfigError: naming the key and what to do instead.
  """
  for key, (other, value) in getattr(schema, "read_only_with", {}).items():
    if getattr(obj, key) is not None and getattr(obj, other) != value:
      raise ConfigError(f"{key} is read only with {other}: {value}; {other} is "
                        f"{getattr(obj, other)!r}: remove {key} or set {other}: {value}")


def type_name(tp: Any) -> str:
  """A type hint in the words an error message uses (``"a number or null"``)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Union:
    names = [type_name(a) for a in args if a is not type(None)]
    return " or ".join(names) + (" or null" if type(None) in args else "")
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in args)
  if origin is tuple:
    return f"a list of {len(args)} numbers" if args[-1] is not Ellipsis else "a list of numbers"
  return {float: "a number", int: "an integer", bool: "true or false", str: "a string",
          dict: "a mapping", list: "a list"}[tp]


def _is_number(v: Any) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _coerce(tp: Any, v: Any) -> tuple[bool, Any]:
  """(accepted, normalized value) of ``v`` under the annotation ``tp``."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Union:
    for a in args:
      ok, out = (v is None, None) if a is type(None) else _coerce(a, v)
      if ok:
        return True, out
    return False, v
  if origin is Literal:
    return any(v is a or (type(v) is type(a) and v == a) for a in args), v
  if origin is tuple:
    if not isinstance(v, (list, tuple)) or not all(_is_number(x) for x in v):
      return False, v
    return (len(v) == len(args) or args[-1] is Ellipsis), tuple(v)
  if tp is float:
    return _is_number(v), v
  if tp is int:
    if isinstance(v, bool) or not _is_number(v):
      return False, v
    if isinstance(v, numbers.Integral):
      return True, int(v)
    return math.isfinite(v) and float(v).is_integer(), int(v) if math.isfinite(v) else v
  if tp is bool:
    return isinstance(v, bool), v
  if tp is str:
    return isinstance(v, str), v
  if tp is dict:  # a mapping with string keys (not swept: the runner sweeps top-level lists)
    return isinstance(v, dict) and all(isinstance(k, str) for k in v), v
  if tp is list:
    return isinstance(v, list), v
  raise TypeError(f"unsupported schema annotation {tp!r}")


def _hint(spec: KeySpec, v: Any) -> str:
  """A suggestion for a value of the wrong type."""
  if isinstance(v, str):
    try:
      float(v)
      return f"; write it without quotes: {spec.name}: {v}"
    except ValueError:
      pass
  if isinstance(v, bool):
    return ("; YAML reads yes/no/on/off/true/false as booleans: write the value "
            f"({type_name(spec.type)})")
  if v is None:
    return "; omit the key to use its default"
  if isinstance(v, float) and spec.type is int:
    return f"; write a whole number, e.g. {spec.name}: {int(v) if math.isfinite(v) else 1}"
  if isinstance(v, (list, tuple)) or typing.get_origin(spec.type) is tuple:
    return ("; the runner sweeps list values: write one sequence as a list inside a list, "
            f"e.g. {spec.name}: [[...]]")
  return ""


def _above_zero(x: float, name: str) -> float:
  """``> 0``, +inf included: for ``radius`` and ``smoothness`` +inf is a declared fact."""
  if not x > 0:
    raise ValueError(f"{name} must be a number > 0 (.inf allowed), got {x!r}")
  return x


def _finite(x: float, name: str) -> float:
  if not math.isfinite(x):
    raise ValueError(f"{name} must be a finite number, got {x!r}")
  return x


#: The range of the vocabulary's signed number keys wherever they appear (one name, one range),
#: checked when a config is built, from YAML or Python; every other number key must be finite.
RANGES: dict[str, Callable[[float, str], float]] = {
    **dict.fromkeys(("epsilon", "epsilon_budget", "clip_norm", "inner_clip_norm",
                     "outer_clip_norm", "inner_clip_norm_lam", "learning_rate", "lipschitz",
                     "epochs", "clip_learning_rate", "initial_clip_norm"), check_positive),
    **dict.fromkeys(("noise_multiplier", "strong_convexity", "heterogeneity", "l2"),
                    check_nonnegative),
    "delta": check_delta,
    "target_quantile": check_delta,   # adaptive clipping's gamma: the open interval (0, 1)
    "count_stddev": check_nonnegative,
    "sampling_rate": check_probability,
    "radius": _above_zero,
    "smoothness": _above_zero,
}


def _check_range(spec: KeySpec, v: Any) -> Any:
  """Integer keys are counts in ``[0, MAX_COUNT]`` (``seed``: ``[0, MAX_SEED]``); number keys
  lie in their :data:`RANGES` entry (finite, when the key has none)."""
  if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)
                              and spec.name in RANGES):
    try:
      RANGES.get(spec.name, _finite)(v, spec.name)
    except ValueError as err:
      raise ConfigError(str(err)) from None
    return v
  if isinstance(v, tuple):   # a sequence key (shares, omega_bounds): finite numbers
    if not all(math.isfinite(float(x)) for x in v):
      raise ConfigError(f"{spec.name} must be a list of finite numbers, got {list(v)!r}")
    return v
  if isinstance(v, bool) or not isinstance(v, int):
    return v
  top, what = (MAX_SEED, "a seed") if spec.name == "seed" else (MAX_COUNT, "a count")
  if not 0 <= v <= top:
    why = ("the key derivation keeps 32 bits of a seed, so a seed outside it gives the key "
           "(and the noise) of another seed" if spec.name == "seed" else
           "JAX counts in int32; a larger count would wrap (and would not finish anyway)")
    raise ConfigError(f"{spec.name} is {what} and must lie in [0, {top}], got {v!r}: {why}")
  return v


def check_type(spec: KeySpec, v: Any) -> Any:
  """``v`` coerced to ``spec``'s type and range-checked; else one error line naming the key."""
  ok, out = _coerce(spec.type, v)
  if ok:
    return _check_range(spec, out)
  base = [a for a in typing.get_args(spec.type) if a is not type(None)] if (
      typing.get_origin(spec.type) is Union) else [spec.type]
  what = type_name(base[0] if base in ([float], [int], [bool]) else spec.type)
  raise ConfigTypeError(f"{spec.name} must be {what}, got {v!r} ({type(v).__name__})"
                        + _hint(spec, v))


#: the run a config is built for, named in its messages (unset: the schema's class name)
_WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("config_where", default=None)
#: inside :func:`validating`, missing required keys wait until every schema has checked its
#: values' types (a wrong type is reported first, as a YAML file is read top down)
_MISSING: contextvars.ContextVar[list | None] = contextvars.ContextVar("config_missing",
                                                                     default=None)


@contextlib.contextmanager
def validating(where: str):
  """The schemas built inside are one run's config: their messages name ``where``, and a
  missing key is raised once every schema has checked its values' types."""
  tokens = _WHERE.set(where), _MISSING.set([])
  missing = _MISSING.get()
  try:
    yield
  except ConfigTypeError:
    raise
  except Exception:   # a later check of a schema built without its required keys
    if missing:
      raise ConfigError(missing[0]) from None
    raise
  finally:
    _WHERE.reset(tokens[0])
    _MISSING.reset(tokens[1])
  if missing:
    raise ConfigError(missing[0])


def _missing(message: str) -> None:
  waiting = _MISSING.get()
  if waiting is None:
    raise ConfigError(message)
  waiting.append(message)


def check_instance(obj: Any) -> None:
  """Validates a schema instance (``Schema.__post_init__``), from Python, a dict or YAML: an
  unset field is skipped unless required, every other value type-checked and normalized in
  place; one key of each ``requires_one_of`` group, and for a private run (``epsilon`` or a
  nonzero ``noise_multiplier``) every key of ``private_requires``; no key refused by
  ``read_only_with`` (:func:`check_read_only_with`)."""
  schema = type(obj)
  name = _WHERE.get() or schema.__name__
  for key, spec in specs(schema, "config").items():
    value = getattr(obj, key)
    check_refused(spec, value, name)
    if value is None:
      if spec.required:
        _missing(f"{key} is required: {name} needs {key} ({spec.doc})")
      continue
    out = check_type(spec, value)
    if out is not value:
      object.__setattr__(obj, key, out)
  group = next((g for g in getattr(schema, "requires_one_of", ())
                if all(getattr(obj, k) is None for k in g)), None)
  if group is not None:
    _missing(f"{name} needs one of {', '.join(group)}" + (
        " (noise_multiplier: 0 is the one spelling of a non-private reference run)"
        if "noise_multiplier" in group else ""))
  check_read_only_with(schema, obj)
  if getattr(obj, "epsilon", None) is not None or bool(getattr(obj, "noise_multiplier", None)):
    key = next((k for k in getattr(schema, "private_requires", ()) if getattr(obj, k) is None),
               None)
    if key is not None:
      _missing(f"{key} is required: {name} needs {key} for a private run "
               "(epsilon or noise_multiplier given)")


class Schema(Mapping):
  """Base of every schema: a frozen, typed config whose instance is what a planner, a driver
  or a problem factory reads (the schema is the one place a literal default is written).

  Building one from Python (``DpSgdConfig(epsilon=1.0, ...)``) validates it as the runner
  validates YAML: strict types (a bool or a string is not a number; an integral float of an
  integer key becomes an int), required keys, one of each ``requires_one_of`` group. Errors
  are ``ConfigError`` naming the key. :meth:`of` makes the instance from a run's flat mapping
  (or returns an instance as it is). Read it as attributes (``cfg.epsilon``) or as a read-only
  mapping of its set fields: ``cfg["epsilon"]``, ``cfg.get("relation", derived)`` (the
  derived default only when the field is unset), ``"bands" in cfg``, ``dict(cfg)``. Reading a
  name that is not a field raises ``KeyError``: a driver that reads a key its schema does not
  declare is a bug, not a default."""

  def __post_init__(self) -> None:
    check_instance(self)

  @classmethod
  def of(cls, config: Any) -> Any:
    """An instance of ``cls`` as it is, else the fields of ``cls`` that ``config`` (a mapping,
    e.g. a run's flat config, or another schema's instance) sets, validated."""
    if isinstance(config, cls):
      return config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
      config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if not isinstance(config, Mapping):
      raise ConfigError(f"a config must be a mapping or {cls.__name__}, got "
                        f"{type(config).__name__}")
    names = _field_names(cls)
    return cls(**{k: v for k, v in config.items() if k in names and v is not None})

  def __getitem__(self, name: str) -> Any:
    if not isinstance(name, str) or name not in _field_names(type(self)):
      raise KeyError(f"{name!r} is not a key of {type(self).__name__} (a driver reads only "
                     "its schema's keys: add the field, with its default and doc)")
    return getattr(self, name)

  def get(self, name: str, default: Any = None) -> Any:
    """The field's value, or ``default`` when it is unset; an unknown name raises ``KeyError``."""
    value = self[name]
    return default if value is None else value

  def __iter__(self):
    return (k for k in _field_names(type(self)) if getattr(self, k) is not None)

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __contains__(self, name: object) -> bool:
    return (isinstance(name, str) and name in _field_names(type(self))
            and getattr(self, name) is not None)


@bounded_cache()
def _field_names(schema: type) -> dict[str, None]:
  """The schema's field names in order."""
  return dict.fromkeys(f.name for f in dataclasses.fields(schema))
