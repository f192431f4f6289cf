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
:mod:`dpsco_jax.config.families`). Field annotations are the accepted
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
  keys "use the default", for ``epsilon`` of the SRGD and DP-SGD families "report the
  accountant's epsilon of an explicit noise_multiplier"). A key without ``Optional`` refuses
  ``null``. Non-private is never a default: a private algorithm needs ``epsilon`` or a
  ``noise_multiplier``, and ``noise_multiplier: 0`` is the one way, in every family, to say
  "non-private" out loud (its report: provenance ``none``, epsilon inf).
* ``tuple[float, ...]``: a sequence. The runner sweeps list values, so a sequence-valued key
  is written as a list inside a list (``shares: [[0.5, 0.3, 0.2]]``).
* ``dict``: a mapping with string keys (``args:`` of a user problem's factory, a ``data:``
  file's options); the runner does not sweep inside it. ``list``: a list (inside such a
  mapping).

Besides the registered algorithms, a config may name the config-only ones
(:data:`~dpsco_jax.config.families.CONFIG_ONLY_ALGORITHMS`: ``flax.DPTrainer``), which run on
the ``user`` problem (your model, loss and data: :mod:`dpsco_jax.runner.user`);
:data:`CONFIG_ALGORITHM_SCHEMAS` holds both.

A field's default is documentation: ``None`` with a non-Optional type means "derived by the
driver" (the doc gives the formula). ``required`` fields must be given.

:func:`validate` checks one run's config (after the runner's sweep expansion): unknown keys
(with a "did you mean" over the keys of that algorithm and problem, retired names first),
strict types, required keys, and keys that mean different things to the algorithm and to the
problem. Errors are :class:`ConfigError` naming the key.

A schema's literal defaults are the ones that run: a run's typed config (an instance of its
algorithm's schema, :meth:`~dpsco_jax.config.families.Schema.of`; ``dp.plan(...).config``) is
what the planners and drivers of every family read, so a default is written once, here.
Derived defaults (``None`` here) are computed at their call site, only when the config leaves
them out. ``n_users`` and ``debug`` are in every algorithm's schema
(:class:`~dpsco_jax.config.families.AlgorithmKeys`): in a run config they are the problem's
and the runner's keys, and :func:`keys_of` keeps those specs.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from dpsco_jax.config.families import (  # noqa: F401 (the schemas, re-exported)
    CONFIG_ONLY_ALGORITHMS, PROBLEM_SCHEMAS, AlgorithmKeys, RunnerKeys)
# the validation core lives one layer down (the schemas call it from __post_init__);
# re-exported here, where the runner and the tests have always found it
from dpsco_jax.config.types import (  # noqa: F401
    MAX_COUNT, ConfigError, KeySpec, check_instance, check_refused, check_type,
    missing_one_of, private_missing, specs, type_name, validating)

__all__ = ["ConfigError", "ALGORITHM_SCHEMAS", "CONFIG_ALGORITHM_SCHEMAS", "PROBLEM_SCHEMAS",
           "RunnerKeys", "ALIASES",
           "RETIRED", "check_name", "validate", "typed_run", "keys_of", "describe", "typed",
           "specs",
           "suggest_key"]


class _RegisteredConfigs(Mapping):
  """``ALGORITHM_SCHEMAS``: every registered algorithm's config class, read from the registry
  (:func:`dpsco_jax.algorithms.registry.algorithms`) on access. The ``@register(name,
  config=...)`` decorator at each driver is the one place an algorithm's schema is named.

  This module sits above the algorithms (it validates a run against the registry), so reading
  the registry is a downward import; it is made on first access only so that importing the
  schemas stays cheap (no JAX compilation units are imported to validate a YAML key)."""

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


def keys_of(algorithm: str, problem: str) -> dict[str, KeySpec]:
  """Every key a run of ``algorithm`` on ``problem`` reads (runner, algorithm, problem).
  ``algorithm`` may also be a config-only one (``flax.DPTrainer``)."""
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
  """``value`` if it is a string naming one of ``known`` (an algorithm or a problem), else
  :class:`ConfigError` with the closest name as a suggestion."""
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
  required key. See :func:`typed_run` (what this checks, and the typed configs it builds)."""
  return typed_run(cfg)[0]


def typed_run(cfg: dict) -> tuple[dict, Any, Any]:
  """``(normalized copy of cfg, its algorithm's typed config, its problem's)``: a run's config
  validated once.

  The names are checked here (unknown and ambiguous keys, against every schema the run reads);
  the values by building the typed configs of the runner's, the problem's and the algorithm's
  schema (their ``__post_init__``, the one validator: types, ranges, required keys, one-of
  groups, keys a private run needs), whose messages name the run (:func:`validating`)."""
  if not isinstance(cfg, dict):
    raise ConfigError(f"a run config must be a mapping, got {type(cfg).__name__}")
  for field in ("algorithm", "problem"):
    if field not in cfg:
      raise ConfigError(f"config is missing the field {field!r}")
  algorithm = check_name("algorithm", cfg["algorithm"], CONFIG_ALGORITHM_SCHEMAS)
  problem = check_name("problem", cfg["problem"], PROBLEM_SCHEMAS)
  allowed = keys_of(algorithm, problem)
  where = f"algorithm {algorithm!r} on problem {problem!r}"
  for key in cfg:
    if key not in allowed:
      s = suggest_key(str(key), allowed)
      raise ConfigError(f"unknown key {key!r} for {where}"
                        + (f" (did you mean {s!r}?)" if s else "")
                        + f"; it reads: {', '.join(sorted(allowed, key=str.lower))}")
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
  by omission: without ``epsilon`` (and without a ``noise_multiplier`` to account) a config
  that names ``delta`` would run with no noise; ``noise_multiplier: 0`` says so explicitly."""
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
  """One line per key: ``name  type  default  doc`` (no CLI command prints it; the YAML
  reference page is generated from the same schemas)."""
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
