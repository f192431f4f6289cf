"""The runner's config syntax before validation: sections, row labels, the ``compare:``
block, the strict YAML reader (:func:`yaml_loader`), the ``select`` / ``compare`` metric checks.

Sections are flattened (``algorithm: {name: dp_sgd_user, epsilon: 1.0}`` is ``algorithm:
dp_sgd_user, epsilon: 1.0``); a key in the wrong section is a :class:`ConfigError` naming its
section. A ``problem:`` without ``name`` that names your code (``factory``, ``model`` /
``loss`` / ``data``) is the ``user`` problem, its ``data:`` a data file.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from dpsco_jax._checks import MAX_SEED
from dpsco_jax.config.families import USER_PROBLEM
from dpsco_jax.config.schema import ConfigError

#: section key -> the flat field its ``name`` sets (``data`` is another word for ``problem``)
SECTIONS = {"problem": "problem", "data": "problem", "algorithm": "algorithm"}
#: top-level keys that are not run keys (handled by the runner itself)
RUNNER_ONLY = ("experiments", "name", "description", "compare", "select", "tuning_seeds",
               "eval_seeds", "batch_seeds", "devices")
#: keys that never belong inside a section (``name`` there is the registered name)
NOT_IN_SECTIONS = ("label",) + tuple(k for k in RUNNER_ONLY if k != "name")
DATA_SUFFIXES = (".npz", ".csv", ".parquet")
#: keys that make a problem without ``name`` the user problem
USER_KEYS = ("factory", "model", "loss", "data")


def _as_list(v: Any) -> list:
  return v if isinstance(v, list) else [v]


def _is_data_file(value: Any) -> bool:
  """A ``data:`` value that names a file (a path, or a mapping with ``path``), not a section."""
  if isinstance(value, dict):
    return "path" in value
  return isinstance(value, str) and value.lower().endswith(DATA_SUFFIXES)


def _is_section(sec: str, body: Any) -> bool:
  return isinstance(body, dict) and not (sec == "data" and _is_data_file(body))


def _flatten_entry(entry: dict, where: str) -> tuple[dict, dict[str, str]]:
  """(flat mapping, {key: the section it came from}) of one mapping of a config."""
  flat = {k: v for k, v in entry.items() if not (k in SECTIONS and _is_section(k, v))}
  origins: dict[str, str] = {}
  if "data" in flat and not all(_is_data_file(v) for v in _as_list(flat["data"])):
    raise ConfigError(f"{where}data: must be a mapping (the problem's section, with its name) "
                      f"or a data file (a path ending in {', '.join(DATA_SUFFIXES)}, or "
                      f"{{path: ..., user_column: ...}}), got {flat['data']!r}")
  if _is_section("problem", entry.get("problem")) and _is_section("data", entry.get("data")):
    raise ConfigError(f"{where}problem and data are the same section; give one of them")
  for sec, field in SECTIONS.items():
    body = entry.get(sec)
    if isinstance(body, list) and any(_is_section(sec, x) for x in body):
      raise ConfigError(f"{where}{sec}: a list of sections; write one experiments entry per "
                        "section (a list of names is swept: name: [a, b])")
    if not _is_section(sec, body):
      continue
    for key, value in body.items():
      _check_section_key(sec, key, where)
      target = field if key == "name" else key
      if target in flat:
        raise ConfigError(f"{where}{sec}.{key}: {target!r} is given twice (in the section and "
                          "outside it); give it once")
      flat[target] = value
      if key != "name":
        origins[key] = sec
  if "label" in flat and not isinstance(flat["label"], str):
    raise ConfigError(f"{where}label must be a string (one row label), got {flat['label']!r}")
  if "problem" not in flat and any(k in flat for k in USER_KEYS):
    flat["problem"] = USER_PROBLEM  # your factory, or your model + loss + data
  return flat, origins


def _check_section_key(sec: str, key: Any, where: str) -> None:
  """Refuses a row label or a runner key inside a section (flattened, it would be lost)."""
  if key == "label":
    raise ConfigError(f"{where}{sec}.label: 'label' names a row, not a key of the {sec} "
                      f"section: write label: beside {sec}: (at the top level or in its "
                      "experiments entry)")
  if key in NOT_IN_SECTIONS:
    raise ConfigError(f"{where}{sec}.{key}: {key!r} is a top-level runner key, not a key of "
                      f"the {sec} section: write it at the top level of the config")


def experiments_of(config: dict) -> list[dict] | None:
  """The config's ``experiments`` entries (None when absent), checked: a non-empty list of
  mappings."""
  if "experiments" not in config:
    return None
  variants = config["experiments"]
  if not isinstance(variants, list) or not variants:
    raise ConfigError(f"experiments must be a non-empty list of mappings (one per group of "
                      f"rows), got {variants!r} ({type(variants).__name__})")
  for i, variant in enumerate(variants):
    if not isinstance(variant, dict):
      raise ConfigError(f"experiments[{i}] must be a mapping (an experiments entry), got "
                        f"{variant!r} ({type(variant).__name__})")
  return variants


def check_runner_keys(config: dict) -> None:
  """The top-level keys read before any run config is built (``experiments``, ``name``,
  ``description``), checked first."""
  experiments_of(config)
  _refuse_misspelt_runner_keys(config)
  for key in ("name", "description"):
    value = config.get(key)
    if value is not None and not isinstance(value, str):
      raise ConfigError(f"{key} must be a string, got {value!r} ({type(value).__name__})")


def _refuse_misspelt_runner_keys(config: dict) -> None:
  """A top-level key no schema reads but spelt like a runner key (``experiment:``,
  ``selct:``): named with its spelling, not lost (a missing ``experiments`` would otherwise
  be reported as a missing algorithm, a missing ``select`` not at all)."""
  import difflib
  from dpsco_jax.config.schema import CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS
  known = {*RUNNER_ONLY, *SECTIONS, "label"}
  for schemas in (CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS):
    known.update(k for name in schemas for k in _schema_fields(schemas, name))
  for key in config:
    if not isinstance(key, str) or key in known:
      continue
    hint = difflib.get_close_matches(key, RUNNER_ONLY, n=1, cutoff=0.75)
    if hint:
      raise ConfigError(f"unknown top-level key {key!r} (did you mean {hint[0]!r}?)")


def _schema_fields(schemas: dict, name: str) -> set[str]:
  return {f.name for f in dataclasses.fields(schemas[name])}


def _check_sections(merged: dict, origins: dict[str, str], where: str) -> None:
  """Every key given inside a section is a key of that section's schema, for every algorithm x
  problem the names take."""
  from dpsco_jax.config.schema import CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS, keys_of
  if not origins:
    return
  for algorithm, problem in itertools.product(_as_list(merged.get("algorithm")),
                                              _as_list(merged.get("problem"))):
    if not isinstance(algorithm, str) or not isinstance(problem, str) or (
        algorithm not in CONFIG_ALGORITHM_SCHEMAS or problem not in PROBLEM_SCHEMAS):
      continue  # an unknown or missing name: validate reports it, with a suggestion
    allowed = keys_of(algorithm, problem)
    # every algorithm's schema holds n_users and debug (AlgorithmKeys), but in a config they
    # are the problem's and the runner's keys wherever keys_of gives them those owners
    own = {"algorithm": {k for k in _schema_fields(CONFIG_ALGORITHM_SCHEMAS, algorithm)
                         if allowed[k].owner not in ("problem", "runner")},
           "problem": _schema_fields(PROBLEM_SCHEMAS, problem)}
    for key, sec in origins.items():
      if key in own[SECTIONS[sec]] or key not in allowed:
        continue  # in its section, or unknown to both (validate suggests a spelling)
      owner = allowed[key].owner
      names = f"algorithm {algorithm!r} on problem {problem!r}"
      if owner == "runner":
        raise ConfigError(f"{where}{sec}.{key}: {key!r} is a runner key, not a {sec} key: "
                          "write it outside the sections")
      if owner in ("algorithm", "problem"):
        home = "algorithm:" if owner == "algorithm" else "problem: (or data:)"
        raise ConfigError(f"{where}{sec}.{key}: {key!r} is a key of the {owner}, not of the "
                          f"{sec} section ({names}); move it to the {home} section")


def flatten_sections(config: dict) -> dict:
  """The config with every section (top level and each ``experiments`` entry) flattened into
  plain keys (a flat config comes back equal), section keys checked."""
  top_in = {k: v for k, v in config.items() if k not in RUNNER_ONLY}
  top, top_origins = _flatten_entry(top_in, "")
  out = {**{k: v for k, v in config.items() if k in RUNNER_ONLY}, **top}
  variants = experiments_of(config)
  if variants is None:
    _check_sections(top, top_origins, "")
    return out
  flat_variants = []
  for i, variant in enumerate(variants):
    flat, origins = _flatten_entry(variant, f"experiments[{i}].")
    merged_origins = {**{k: s for k, s in top_origins.items() if k not in flat}, **origins}
    _check_sections({**top, **flat}, merged_origins, f"experiments[{i}].")
    flat_variants.append(flat)
  out["experiments"] = flat_variants
  return out


#: The only integer spelling read as a number: YAML 1.1's octal ``010``, hex, binary, ``1_000``
#: and base-60 ``1:30`` are read otherwise by YAML 1.2 and every other reader: refused.
_PLAIN_INT = r"^[-+]?(?:0|[1-9][0-9]*)$"
_PLAIN_FLOAT = (r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"
                r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")


def yaml_loader():
  """A strict SafeLoader for config files: ``1e-5`` is a float (a string in YAML 1.1), a key
  given twice in one mapping is an error (not the last value silently: a second ``epsilon:
  100.0``), and numbers must be spelled plainly (:data:`_PLAIN_INT`)."""
  import re
  import yaml
  from yaml.constructor import ConstructorError

  class Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
      seen: dict = {}
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
          continue  # keys merged in by `<<: *anchor` may be overridden: that is their point
        key = self.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
          if key in seen:
            raise ConstructorError(
                "while reading a mapping", node.start_mark,
                f"key {key!r} is given twice (lines {seen[key]} and {line}); give it once",
                key_node.start_mark)
          seen[key] = line
        except TypeError:  # an unhashable key: SafeLoader reports it below
          continue
      return super().construct_mapping(node, deep=deep)

    def _plain(self, node, pattern: str, what: str) -> str:
      value = self.construct_scalar(node)
      if not re.match(pattern, str(value)):
        raise ConstructorError(
            None, None, f"{what} {value!r} is spelled in a YAML 1.1 form that readers disagree "
            "on (octal 010, hex 0x10, binary 0b11, 1_000, base-60 1:30); write it in plain "
            "decimal", node.start_mark)
      return value

    def construct_yaml_int(self, node):
      return int(self._plain(node, _PLAIN_INT, "integer"))

    def construct_yaml_float(self, node):
      self._plain(node, _PLAIN_FLOAT, "number")
      return super().construct_yaml_float(node)

  Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
  Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)
  Loader.add_implicit_resolver(
      "tag:yaml.org,2002:float",
      re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
      list("-+0123456789"))
  return Loader


#: Record fields that are never a number (a metric must be one).
NON_METRIC_FIELDS = ("algorithm", "problem", "provenance", "privacy_level", "relation",
                     "epsilon_kind", "status", "error", "label", "config", "phase",
                     "privacy_notes", "debug", "seed", "source", "user_metrics")


def check_metric_name(metric: Any, where: str) -> str:
  """A metric names a numeric record field: a string, not one of :data:`NON_METRIC_FIELDS`
  (the record itself: :func:`check_record_metric`)."""
  if not isinstance(metric, str) or not metric:
    raise ConfigError(f"{where} must be a record field name, got {metric!r}")
  if metric in NON_METRIC_FIELDS:
    raise ConfigError(f"{where}: {metric!r} is not a numeric record field; use e.g. "
                      "excess_risk, epsilon, gradient_evaluations, wall_time_s, or a user "
                      "problem's metric")
  return metric


def is_metric_value(v: Any) -> bool:
  """A number, or a non-finite float as the runner's JSON view writes it ("nan", "inf")."""
  return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in ("nan", "inf",
                                                                           "-inf")


def check_record_metric(record: dict, metric: str, where: str) -> None:
  """Raises unless a successful ``record`` has ``metric`` as a numeric field, listing the
  numeric fields it has (a misspelt metric would otherwise select nothing, silently)."""
  value = record.get(metric)
  if is_metric_value(value):
    return
  numeric = sorted(k for k, v in record.items()
                   if is_metric_value(v) and k not in NON_METRIC_FIELDS)
  got = "no such field" if metric not in record else f"{metric} = {value!r}, not a number"
  raise ConfigError(f"{where} {metric!r}: the record of algorithm "
                    f"{record.get('algorithm')!r} has {got}; its numeric fields: "
                    + ", ".join(numeric))



@dataclasses.dataclass(frozen=True)
class CompareSpec:
  """``compare: {baseline: ..., metric: excess_risk, better: lower, resamples: 2000, seed: 0}``
  (``better: higher``: a win is a strictly higher value, e.g. an accuracy)."""
  baseline: Any  # a row label, an algorithm name, or a mapping of row fields
  metric: str = "excess_risk"
  resamples: int = 2000
  seed: int = 0
  better: str = "lower"


def check_keys(spec: dict, known: tuple[str, ...], where: str) -> None:
  """Refuses a key of the block ``spec`` that is not in ``known``, listing them."""
  unknown = set(spec) - set(known)
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; it "
                      f"reads {', '.join(known)}")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def parse_compare(config: dict) -> CompareSpec | None:
  """The ``compare:`` block of a config (None when absent), its fields type-checked."""
  spec = config.get("compare")
  if spec is None:
    return None
  if isinstance(spec, str):
    spec = {"baseline": spec}
  if not isinstance(spec, dict):
    raise ConfigError(f"compare: must be a mapping {{baseline: ..., metric: ...}}, got {spec!r}")
  check_keys(spec, ("baseline", "metric", "better", "resamples", "seed"), "compare")
  if "baseline" not in spec:
    raise ConfigError("compare: needs baseline (a row label, an algorithm name, or a mapping "
                      "of row fields such as {algorithm: dp_sgd_user, epsilon: 1.0})")
  if not isinstance(spec["baseline"], (str, dict)) or not spec["baseline"]:
    raise ConfigError(f"compare.baseline must be a name or a mapping, got {spec['baseline']!r}")
  check_metric_name(spec.get("metric", "excess_risk"), "compare.metric")
  if spec.get("better", "lower") not in ("lower", "higher"):
    raise ConfigError(f"compare.better must be lower or higher (which values of the metric "
                      f"win), got {spec['better']!r}")
  if not _is_int(spec.get("resamples", 2000)) or spec.get("resamples", 2000) < 100:
    raise ConfigError(f"compare.resamples must be an integer >= 100, got {spec['resamples']!r}")
  if not _is_int(spec.get("seed", 0)) or not 0 <= spec.get("seed", 0) <= MAX_SEED:
    raise ConfigError(f"compare.seed must be an integer in [0, {MAX_SEED}], got "
                      f"{spec['seed']!r}")
  return CompareSpec(**spec)


def baseline_indices(baseline: Any, items: list[dict]) -> list[int]:
  """Which of ``items`` (run configs, or rows' fields with the *requested* ``epsilon``) are the
  baseline: a string is a row label if some item has it, else an algorithm name; a mapping
  gives field values that must all be equal."""
  if isinstance(baseline, str):
    field = "label" if any(it.get("label") == baseline for it in items) else "algorithm"
    return [i for i, it in enumerate(items) if it.get(field) == baseline]
  return [i for i, it in enumerate(items)
          if all(k in it and it[k] == v for k, v in baseline.items())]


def check_baseline(spec: CompareSpec, runs: list[dict]) -> None:
  """Refuses (before anything runs) a baseline that no run config matches."""
  if baseline_indices(spec.baseline, runs):
    return
  labels = sorted({r["label"] for r in runs if r.get("label")})
  algorithms = sorted({str(r.get("algorithm")) for r in runs})
  raise ConfigError(f"compare.baseline {spec.baseline!r} matches no run; labels: "
                    f"{', '.join(labels) or '(none)'}; algorithms: {', '.join(algorithms)}")
