"""A whole run's config validated against its algorithm's and problem's schemas.

One vocabulary: every algorithm spells one idea the same way (``clip_norm``,
``learning_rate``, ``batch_size``, ``num_steps``, ``relation``, paper 004's ``inner_`` /
``outer_``); retired names (:data:`ALIASES`) are refused with a "did you mean" naming the new.

Accepted YAML types (the schemas' annotations): ``float`` a number (not a bool or a string);
``int`` an integer (an integral float such as ``1e4`` is made an int), a count in
``[0, MAX_COUNT]`` except ``seed`` in ``[0, 2**32 - 1]``; ``bool`` only ``true`` / ``false``;
``Literal[...]`` one of the names; ``Optional[...]`` allows ``null``; ``tuple[float, ...]`` a
list inside a list (the runner sweeps lists); ``dict`` a mapping with string keys. A private
algorithm needs ``epsilon`` or a ``noise_multiplier`` (``0``: the one spelling of
"non-private") and ``delta``.

:func:`typed_run` validates once and returns the typed configs the planners and drivers read;
``n_users`` and ``debug`` are the problem's and the runner's keys in a run (:func:`keys_of`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from dpsco_jax.config.families import (  # noqa: F401 (the schemas, re-exported)
    CONFIG_ONLY_ALGORITHMS, PROBLEM_SCHEMAS, AlgorithmKeys, RunnerKeys)
from dpsco_jax.config.types import (ConfigError, KeySpec, check_type, specs, type_name,
                                    validating)

__all__ = ["ConfigError", "ALGORITHM_SCHEMAS", "CONFIG_ALGORITHM_SCHEMAS", "PROBLEM_SCHEMAS",
           "RunnerKeys", "ALIASES", "RETIRED", "check_name", "validate", "typed_run", "keys_of",
           "describe", "typed", "specs", "suggest_key"]


class _RegisteredConfigs(Mapping):
  """Every registered algorithm's config class, read from the registry on access (imported
  then, so that importing the schemas stays cheap)."""

  def __init__(self, extra: Mapping[str, type] | None = None):
    self._extra = dict(extra or {})

  def _table(self) -> dict[str, type]:
    from dpsco_jax.algorithms.registry import algorithms
    return {**{name: entry.config for name, entry in algorithms().items()}, **self._extra}

  def __getitem__(self, name: str) -> type:
    return self._table()[name]

  def __iter__(self):
    return iter(self._table())

  def __len__(self) -> int:
    return len(self._table())

  def __repr__(self) -> str:
    return f"ALGORITHM_SCHEMAS({self._table()!r})"


ALGORITHM_SCHEMAS: Mapping[str, type] = _RegisteredConfigs()
#: What a config's ``algorithm`` may name: the registered algorithms and
#: :data:`~dpsco_jax.config.families.CONFIG_ONLY_ALGORITHMS`.
CONFIG_ALGORITHM_SCHEMAS: Mapping[str, type] = _RegisteredConfigs(CONFIG_ONLY_ALGORITHMS)


#: One idea per group: the vocabulary's name first, then the retired names (refused as unknown
#: keys, with the member its algorithm reads as the suggestion).
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


def keys_of(algorithm: str, problem: str) -> dict[str, KeySpec]:
  """Every key a run of ``algorithm`` (config-only ones too) on ``problem`` reads."""
  out = specs(RunnerKeys, "runner")
  out.update(specs(PROBLEM_SCHEMAS[problem], "problem"))
  shared = {f.name for f in dataclasses.fields(AlgorithmKeys)}
  for name, spec in specs(CONFIG_ALGORITHM_SCHEMAS[algorithm], "algorithm").items():
    if name in shared and name in out:
      continue   # the problem's n_users / the runner's debug: their spec (required) stands
    if name in out and out[name].owner == "problem" and out[name].type != spec.type:
      # one key, two meanings (paper 000's privacy `noise` switch vs the label noise)
      spec = dataclasses.replace(spec, owner="ambiguous",
                                 doc=f"{spec.doc} / problem: {out[name].doc}")
    out[name] = spec
  return out


def suggest_key(key: str, allowed: dict[str, KeySpec]) -> str | None:
  """The key of ``allowed`` that ``key`` is a known alias of (``ALIASES``), else None."""
  for group in ALIASES:
    if key in group:
      for other in group:
        if other != key and other in allowed:
          return other
  hit = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
  return hit[0] if hit else None


def check_name(field: str, value: Any, known: Mapping) -> str:
  """``value`` if it names one of ``known``, else a :class:`ConfigError` with a suggestion."""
  if not isinstance(value, str) or value not in known:
    hint = difflib.get_close_matches(str(value), list(known), n=1)
    raise ConfigError(f"unknown {field} {value!r}" + (f" (did you mean {hint[0]!r}?)" if hint
                                                     else "")
                      + f"; known: {', '.join(sorted(known))}")
  return value


def check_known_keys(keys: Any, allowed: Mapping, where: str) -> None:
  """A :class:`ConfigError` for the first of ``keys`` not in ``allowed``, with a suggestion
  (:func:`suggest_key`) and the keys ``where`` reads."""
  for key in keys:
    if key not in allowed:
      hint = suggest_key(str(key), allowed)
      raise ConfigError(f"unknown key {key!r} for {where}"
                        + (f" (did you mean {hint!r}?)" if hint else "")
                        + f"; it reads: {', '.join(sorted(allowed, key=str.lower))}")


def validate(cfg: dict) -> dict:
  """One run's config checked (:func:`typed_run`): a normalized copy, or a
  :class:`ConfigError` naming the key."""
  return typed_run(cfg)[0]


def typed_run(cfg: dict) -> tuple[dict, Any, Any]:
  """``(normalized copy of cfg, its algorithm's typed config, its problem's)``: the names
  checked here (unknown, ambiguous keys), the values by building the typed configs (their
  ``__post_init__``, the one validator)."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  for field in ("algorithm", "problem"):
    if field not in cfg:
      raise ConfigError(f"config is missing the field {field!r}")
  algorithm = check_name("algorithm", cfg["algorithm"], CONFIG_ALGORITHM_SCHEMAS)
  problem = check_name("problem", cfg["problem"], PROBLEM_SCHEMAS)
  allowed = keys_of(algorithm, problem)
  where = f"algorithm {algorithm!r} on problem {problem!r}"
  check_known_keys(cfg, allowed, where)
  for key, spec in allowed.items():
    if spec.owner == "ambiguous" and key in cfg:
      raise ConfigError(f"{key} is ambiguous for {where}: the algorithm reads it as "
                        f"{type_name(spec.type)} ({spec.doc}); rename the problem's key or "
                        "leave it out")
  schema = CONFIG_ALGORITHM_SCHEMAS[algorithm]
  for key, value in cfg.items():   # a typed config reads null as unset: say when it cannot be
    if value is None:
      check_type(allowed[key], value)
  with validating(where):
    built = [RunnerKeys.of(cfg), PROBLEM_SCHEMAS[problem].of(cfg), schema.of(cfg)]
  out = dict(cfg)
  for instance in built:   # the normalized values (an integral float of an int key: an int)
    out.update((k, getattr(instance, k)) for k in instance if k in cfg)
  _check_epsilon_given(schema, "epsilon" in cfg, cfg.get("noise_multiplier"), where)
  return out, built[2], built[1]


def _check_epsilon_given(schema: type, given: bool, noise_multiplier: Any, where: str
                         ) -> None:
  """A private algorithm (its schema reads ``epsilon`` and ``delta``) never runs non-private
  by omission: ``noise_multiplier: 0`` says so explicitly."""
  names = {f.name for f in dataclasses.fields(schema)}
  if not {"epsilon", "delta"} <= names or given:
    return
  if noise_multiplier is not None:
    return  # private: the accountant's epsilon of the explicit multiplier is reported
  raise ConfigError(f"{where} needs epsilon (a privacy budget): a private algorithm does not "
                    "run non-private by omission; give noise_multiplier (0: a non-private "
                    "reference run, where the algorithm allows one)")


def typed(cfg: dict) -> tuple[Any, Any]:
  """The validated config as frozen instances ``(algorithm_config, problem_config)``."""
  _, algorithm, problem = typed_run(cfg)
  return algorithm, problem


def describe(algorithm: str, problem: str) -> str:
  """One line per key: ``name  type  default  doc``."""
  rows = []
  private = getattr(CONFIG_ALGORITHM_SCHEMAS[algorithm], "private_requires", ())
  for spec in keys_of(algorithm, problem).values():
    default = "required" if spec.required else (
        "required if private" if spec.name in private and spec.owner == "algorithm"
        else "derived" if spec.default is None else repr(spec.default))
    rows.append((spec.name, type_name(spec.type), default, f"[{spec.owner}] {spec.doc}"))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                   for r in rows)
