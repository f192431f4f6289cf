"""The runner's config vocabulary: one frozen, typed schema per algorithm family and problem.

Every registered algorithm and problem reads a flat config dict today; this module states, for
each of them, the keys it reads (type, default, one-line doc), so that the runner can refuse a
config *before* anything runs instead of silently ignoring a misspelled privacy key
(``epsilonn``, ``deltaa``, a retired name such as ``lr`` for ``learning_rate``, ...).

One vocabulary (issue 13, item 1): every algorithm spells one idea the same way —
``clip_norm``, ``learning_rate``, ``batch_size`` (users or rows per step), ``num_steps``,
``relation``, and for paper 004's two levels ``inner_``/``outer_`` + those names
(``inner_clip_norm``, ``outer_clip_norm``, ``inner_clip_norm_lam``, ``inner_batch_size``,
``outer_batch_size``, ``inner_num_steps``). The retired names (``clip``, ``lr``, ``eta``,
``batch_users``, ``batch``, ``steps``, ``T``, ``adjacency``, ``clip_in``, ``clip_out``,
``batch_in``, ``batch_out``, ``inner_steps``, ``clip_in_lam``) are refused as unknown keys with
a "did you mean" naming the new one (:data:`ALIASES`). ``delta`` is required by every private
algorithm (no silent ``1/n^2`` or ``1e-6`` default).

A schema is a frozen dataclass whose fields are the keys (they live in
:mod:`dpsco_jax.config_families`). Field annotations are the accepted
YAML types:

* ``float``: a number (an int is a number; a bool or a string is not);
* ``int``: an integer (an integral float such as ``1e4`` is accepted and normalized to int).
  Every integer key but ``seed`` is a count (users, steps, rounds, batch sizes ...) and must
  lie in ``[0, MAX_COUNT]`` (2**31 - 1: JAX counts steps in int32, and a wrapped step counter
  would reuse noise keys; ``num_steps: 1e20`` is refused instead of running for ever);
  ``seed`` must lie in ``[0, 2**32 - 1]``, the seeds the key derivation tells apart;
* ``bool``: only ``true`` / ``false``;
* ``Literal[...]``: one of the named strings (or a bool where the union allows it);
* ``Optional[...]``: ``null`` allowed; ``null`` then means what the field's doc says (for most
  keys "use the default", for ``epsilon`` of the SRGD and DP-SGD families "non-private" /
  "report the accountant's epsilon of an explicit noise_multiplier"). A key without
  ``Optional`` refuses ``null``. Non-private is never a default: a private algorithm whose
  ``epsilon`` is optional still needs the key (``epsilon: null`` says "non-private" out
  loud) unless a ``noise_multiplier`` is given.
* ``tuple[float, ...]``: a sequence. The runner sweeps list values, so a sequence-valued key
  is written as a list inside a list (``shares: [[0.5, 0.3, 0.2]]``).
* ``dict``: a mapping with string keys (``args:`` of a user problem's factory, a ``data:``
  file's options); the runner does not sweep inside it. ``list``: a list (inside such a
  mapping).

Besides the registered algorithms, a config may name the config-only ones
(:data:`~dpsco_jax.config_families.CONFIG_ONLY_ALGORITHMS`: ``flax.DPTrainer``), which run on
the ``user`` problem (your model, loss and data: :mod:`dpsco_jax.runner_user`);
:data:`CONFIG_ALGORITHM_SCHEMAS` holds both.

A field's default is documentation: ``None`` with a non-Optional type means "derived by the
driver" (the doc gives the formula). ``required`` fields must be given.

:func:`validate` checks one run's config (after the runner's sweep expansion): unknown keys
(with a "did you mean" over the keys of that algorithm and problem, retired names first),
strict types, required keys, and keys that mean different things to the algorithm and to the
problem. Errors are :class:`ConfigError` naming the key.

This is the first step of issue 13 (one typed config per algorithm): the drivers still read the
dict; the schemas are the contract they are checked against.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import typing
from typing import Any, Literal, Union

from dpsco_jax._checks import MAX_SEED
from dpsco_jax.config_families import (  # noqa: F401 (the schemas, re-exported)
    ALGORITHM_SCHEMAS, CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS, RunnerKeys)

#: Largest value of a count key: JAX's default integers (int32) count steps and index users.
MAX_COUNT = 2 ** 31 - 1

__all__ = ["ConfigError", "ALGORITHM_SCHEMAS", "CONFIG_ALGORITHM_SCHEMAS", "PROBLEM_SCHEMAS",
           "RunnerKeys", "ALIASES",
           "RETIRED", "validate", "keys_of", "describe", "typed"]


class ConfigError(ValueError):
  """A user error in a config: reported by the CLI as one line, exit code 2."""


#: One idea per group: the vocabulary's name first, then the retired names. No schema has a
#: retired name, so a config that gives one is refused as an unknown key and told the member of
#: the group that its algorithm reads (``lr: 0.1`` -> did you mean 'learning_rate'?).
ALIASES: tuple[tuple[str, ...], ...] = (
    ("clip_norm", "clip"),
    ("learning_rate", "lr", "eta"),
    ("batch_size", "batch_users", "batch"),
    ("num_steps", "steps", "T"),
    ("relation", "adjacency"),
    ("inner_clip_norm", "clip_in"),
    ("outer_clip_norm", "clip_out"),
    ("inner_clip_norm_lam", "clip_in_lam"),
    ("inner_batch_size", "batch_in"),
    ("outer_batch_size", "batch_out"),
    ("inner_num_steps", "inner_steps"),
    ("epsilon", "eps"),
)

#: The retired names (refused everywhere).
RETIRED: frozenset[str] = frozenset(name for group in ALIASES for name in group[1:])


# ------------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class KeySpec:
  """One key of a schema: its accepted type, default (documentation), doc, requiredness."""
  name: str
  type: Any
  default: Any
  doc: str
  required: bool
  owner: str  # "runner", "algorithm" or "problem"


def _specs(schema: type, owner: str) -> dict[str, KeySpec]:
  hints = typing.get_type_hints(schema)
  return {f.name: KeySpec(f.name, hints[f.name], f.default, f.metadata.get("doc", ""),
                          bool(f.metadata.get("required", False)), owner)
          for f in dataclasses.fields(schema)}


def keys_of(algorithm: str, problem: str) -> dict[str, KeySpec]:
  """Every key a run of ``algorithm`` on ``problem`` reads (runner, algorithm, problem).
  ``algorithm`` may also be a config-only one (``flax.DPTrainer``)."""
  out = _specs(RunnerKeys, "runner")
  out.update(_specs(PROBLEM_SCHEMAS[problem], "problem"))
  for name, spec in _specs(CONFIG_ALGORITHM_SCHEMAS[algorithm], "algorithm").items():
    if name in out and out[name].owner == "problem" and out[name].type != spec.type:
      # one key, two meanings (paper 000's privacy `noise` switch vs the label noise)
      spec = dataclasses.replace(spec, owner="ambiguous",
                                 doc=f"{spec.doc} / problem: {out[name].doc}")
    out[name] = spec
  return out


def _type_name(tp: Any) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Union:
    names = [_type_name(a) for a in args if a is not type(None)]
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
            f"({_type_name(spec.type)})")
  if v is None:
    return "; omit the key to use its default"
  if isinstance(v, float) and spec.type is int:
    return f"; write a whole number, e.g. {spec.name}: {int(v) if math.isfinite(v) else 1}"
  if isinstance(v, (list, tuple)) or typing.get_origin(spec.type) is tuple:
    return ("; the runner sweeps list values: write one sequence as a list inside a list, "
            f"e.g. {spec.name}: [[...]]")
  return ""


def _check_range(spec: KeySpec, v: Any) -> Any:
  """Integer keys are counts in ``[0, MAX_COUNT]``, except ``seed`` (``[0, MAX_SEED]``)."""
  if isinstance(v, bool) or not isinstance(v, int):
    return v
  top, what = (MAX_SEED, "a seed") if spec.name == "seed" else (MAX_COUNT, "a count")
  if not 0 <= v <= top:
    why = ("the key derivation keeps 32 bits of a seed, so a seed outside it gives the key "
           "(and the noise) of another seed" if spec.name == "seed" else
           "JAX counts in int32; a larger count would wrap (and would not finish anyway)")
    raise ConfigError(f"{spec.name} is {what} and must lie in [0, {top}], got {v!r}: {why}")
  return v


def _check_type(spec: KeySpec, v: Any) -> Any:
  ok, out = _coerce(spec.type, v)
  if ok:
    return _check_range(spec, out)
  tp = spec.type
  base = [a for a in typing.get_args(tp) if a is not type(None)] if (
      typing.get_origin(tp) is Union) else [tp]
  what = ("a number" if base == [float] else "an integer" if base == [int]
          else "true or false" if base == [bool] else _type_name(tp))
  raise ConfigError(f"{spec.name} must be {what}, got {v!r} ({type(v).__name__})"
                    + _hint(spec, v))


def _suggest(key: str, allowed: dict[str, KeySpec]) -> str | None:
  for group in ALIASES:
    if key in group:
      for other in group:
        if other != key and other in allowed:
          return other
  hit = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
  return hit[0] if hit else None


def _check_name(cfg: dict, field: str, known: dict) -> str:
  if field not in cfg:
    raise ConfigError(f"config is missing the field {field!r}")
  value = cfg[field]
  if not isinstance(value, str) or value not in known:
    hint = difflib.get_close_matches(str(value), list(known), n=1)
    raise ConfigError(f"unknown {field} {value!r}" + (f" (did you mean {hint[0]!r}?)" if hint
                                                     else "")
                      + f"; known: {', '.join(sorted(known))}")
  return value


def validate(cfg: dict) -> dict:
  """Checks one run's config against its algorithm's and problem's schemas.

  Returns a copy with integral floats of integer keys made ints. Raises :class:`ConfigError`
  naming the key: unknown key (a retired name gets the vocabulary's name as its suggestion),
  wrong type, a key that means different things to the algorithm and the problem, a missing
  required key."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  algorithm = _check_name(cfg, "algorithm", CONFIG_ALGORITHM_SCHEMAS)
  problem = _check_name(cfg, "problem", PROBLEM_SCHEMAS)
  allowed = keys_of(algorithm, problem)
  where = f"algorithm {algorithm!r} on problem {problem!r}"
  for key in cfg:
    if key not in allowed:
      s = _suggest(str(key), allowed)
      raise ConfigError(f"unknown key {key!r} for {where}"
                        + (f" (did you mean {s!r}?)" if s else "")
                        + f"; it reads: {', '.join(sorted(allowed, key=str.lower))}")
  for key, spec in allowed.items():
    if spec.owner == "ambiguous" and key in cfg:
      raise ConfigError(f"{key} is ambiguous for {where}: the algorithm reads it as "
                        f"{_type_name(spec.type)} ({spec.doc}); rename the problem's key or "
                        "leave it out")
  out = {key: _check_type(allowed[key], value) for key, value in cfg.items()}
  for key, spec in allowed.items():
    if spec.required and out.get(key) is None:
      raise ConfigError(f"{where} needs {key} ({spec.doc})")
  schema = CONFIG_ALGORITHM_SCHEMAS[algorithm]
  for group in getattr(schema, "requires_one_of", ()):
    if all(out.get(k) is None for k in group):
      raise ConfigError(f"{where} needs one of {', '.join(group)}")
  _check_epsilon_given(schema, cfg, where)
  return out


def _check_epsilon_given(schema: type, cfg: dict, where: str) -> None:
  """A private algorithm (its schema reads ``epsilon`` and ``delta``) never runs non-private
  by omission: without ``epsilon`` (and without a ``noise_multiplier`` to account) a config
  that names ``delta`` would run with no noise; ``epsilon: null`` says so explicitly."""
  names = {f.name for f in dataclasses.fields(schema)}
  if not {"epsilon", "delta"} <= names or "epsilon" in cfg:
    return
  if cfg.get("noise_multiplier") is not None:
    return  # private: the accountant's epsilon of the explicit multiplier is reported
  raise ConfigError(f"{where} needs epsilon (a privacy budget): a private algorithm does not "
                    "run non-private by omission; write epsilon: null for a non-private "
                    "reference run (where the algorithm allows one), or give noise_multiplier")


def check_instance(obj: Any) -> None:
  """Validates a schema instance built from Python (called by ``Schema.__post_init__``).

  An unset field (``None``) is the documented default (or ``null``) and is skipped unless the
  key is required; every other value is type-checked and normalized in place."""
  schema = type(obj)
  name = schema.__name__
  for key, spec in _specs(schema, "config").items():
    value = getattr(obj, key)
    if value is None:
      if spec.required:
        raise ConfigError(f"{name} needs {key} ({spec.doc})")
      continue
    out = _check_type(spec, value)
    if out is not value:
      object.__setattr__(obj, key, out)
  for group in getattr(schema, "requires_one_of", ()):
    if all(getattr(obj, k) is None for k in group):
      raise ConfigError(f"{name} needs one of {', '.join(group)}")


def typed(cfg: dict) -> tuple[Any, Any]:
  """The validated config as frozen instances ``(algorithm_config, problem_config)``."""
  cfg = validate(cfg)
  def build(schema):
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{k: v for k, v in cfg.items() if k in names})
  return (build(CONFIG_ALGORITHM_SCHEMAS[cfg["algorithm"]]),
          build(PROBLEM_SCHEMAS[cfg["problem"]]))


def describe(algorithm: str, problem: str) -> str:
  """One line per key: ``name  type  default  doc`` (the CLI's ``dpsco keys``)."""
  rows = []
  for spec in keys_of(algorithm, problem).values():
    default = "required" if spec.required else ("derived" if spec.default is None
                                                else repr(spec.default))
    rows.append((spec.name, _type_name(spec.type), default, f"[{spec.owner}] {spec.doc}"))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                   for r in rows)
