"""The runner's config file syntax before validation: ``problem:`` / ``data:`` / ``algorithm:``
sections, row labels and the ``compare:`` block (see :mod:`dpsco_jax.runner`'s docstring).

Sections are flattened to the flat run mapping that :func:`dpsco_jax.config_schema.validate`
and the drivers read: ``algorithm: {name: dp_sgd_user, epsilon: 1.0}`` is the flat
``algorithm: dp_sgd_user, epsilon: 1.0``. A key inside a section must be a key of that
section's schema (``keys_of(algorithm, problem)`` says whose it is); a key in the wrong section
is a :class:`ConfigError` naming it and the section it belongs to. Keys that neither schema
reads are left for ``validate`` (which suggests a spelling).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from dpsco_jax.config_schema import ConfigError

#: section key -> the flat field its ``name`` sets (``data`` is another word for ``problem``)
SECTIONS = {"problem": "problem", "data": "problem", "algorithm": "algorithm"}
#: top-level keys that are not run keys (handled by the runner itself)
RUNNER_ONLY = ("experiments", "name", "description", "compare", "select", "tuning_seeds",
               "eval_seeds")


def _as_list(v: Any) -> list:
  return v if isinstance(v, list) else [v]


def _flatten_entry(entry: dict, where: str) -> tuple[dict, dict[str, str]]:
  """(flat mapping, {key: the section it came from}) of one mapping of a config."""
  flat = {k: v for k, v in entry.items() if not (k in SECTIONS and isinstance(v, dict))}
  origins: dict[str, str] = {}
  if "data" in flat:
    raise ConfigError(f"{where}data: must be a mapping (the problem's section, with its name), "
                      f"got {flat['data']!r}")
  if isinstance(entry.get("problem"), dict) and isinstance(entry.get("data"), dict):
    raise ConfigError(f"{where}problem and data are the same section; give one of them")
  for sec, field in SECTIONS.items():
    body = entry.get(sec)
    if isinstance(body, list) and any(isinstance(x, dict) for x in body):
      raise ConfigError(f"{where}{sec}: a list of sections; write one experiments entry per "
                        "section (a list of names is swept: name: [a, b])")
    if not isinstance(body, dict):
      continue
    for key, value in body.items():
      target = field if key == "name" else key
      if target in flat:
        raise ConfigError(f"{where}{sec}.{key}: {target!r} is given twice (in the section and "
                          "outside it); give it once")
      flat[target] = value
      if key != "name":
        origins[key] = sec
  if "label" in flat and not isinstance(flat["label"], str):
    raise ConfigError(f"{where}label must be a string (one row label), got {flat['label']!r}")
  return flat, origins


def _schema_fields(schemas: dict, name: str) -> set[str]:
  return {f.name for f in dataclasses.fields(schemas[name])}


def _check_sections(merged: dict, origins: dict[str, str], where: str) -> None:
  """Every key given inside a section is a key of that section's schema, for every algorithm x
  problem the (possibly swept) names take."""
  from dpsco_jax.config_schema import ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS, keys_of
  if not origins:
    return
  for algorithm, problem in itertools.product(_as_list(merged.get("algorithm")),
                                              _as_list(merged.get("problem"))):
    if algorithm not in ALGORITHM_SCHEMAS or problem not in PROBLEM_SCHEMAS:
      continue  # an unknown or missing name: validate reports it, with a suggestion
    own = {"algorithm": _schema_fields(ALGORITHM_SCHEMAS, algorithm),
           "problem": _schema_fields(PROBLEM_SCHEMAS, problem)}
    allowed = keys_of(algorithm, problem)
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
  plain keys; a flat config comes back equal. Checks that section keys are in their section."""
  top_in = {k: v for k, v in config.items() if k not in RUNNER_ONLY}
  top, top_origins = _flatten_entry(top_in, "")
  out = {**{k: v for k, v in config.items() if k in RUNNER_ONLY}, **top}
  variants = config.get("experiments")
  if not variants:
    _check_sections(top, top_origins, "")
    return out
  if not isinstance(variants, list):
    raise ConfigError(f"experiments: must be a list of mappings, got {variants!r}")
  flat_variants = []
  for i, variant in enumerate(variants):
    if not isinstance(variant, dict):
      raise ConfigError(f"experiments: every entry must be a mapping, got {variant!r}")
    flat, origins = _flatten_entry(variant, f"experiments[{i}].")
    merged_origins = {**{k: s for k, s in top_origins.items() if k not in flat}, **origins}
    _check_sections({**top, **flat}, merged_origins, f"experiments[{i}].")
    flat_variants.append(flat)
  out["experiments"] = flat_variants
  return out


# ------------------------------------------------------------------------------- compare


@dataclasses.dataclass(frozen=True)
class CompareSpec:
  """``compare: {baseline: ..., metric: excess_risk, resamples: 2000, seed: 0}``."""
  baseline: Any  # a row label, an algorithm name, or a mapping of row fields
  metric: str = "excess_risk"
  resamples: int = 2000
  seed: int = 0


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
  unknown = set(spec) - {f.name for f in dataclasses.fields(CompareSpec)}
  if unknown:
    raise ConfigError(f"compare: unknown key(s) {', '.join(sorted(map(str, unknown)))}; it "
                      "reads baseline, metric, resamples, seed")
  if "baseline" not in spec:
    raise ConfigError("compare: needs baseline (a row label, an algorithm name, or a mapping "
                      "of row fields such as {algorithm: dp_sgd_user, epsilon: 1.0})")
  if not isinstance(spec["baseline"], (str, dict)) or not spec["baseline"]:
    raise ConfigError(f"compare.baseline must be a name or a mapping, got {spec['baseline']!r}")
  if not isinstance(spec.get("metric", "excess_risk"), str):
    raise ConfigError(f"compare.metric must be a record field name, got {spec['metric']!r}")
  if not _is_int(spec.get("resamples", 2000)) or spec.get("resamples", 2000) < 100:
    raise ConfigError(f"compare.resamples must be an integer >= 100, got {spec['resamples']!r}")
  if not _is_int(spec.get("seed", 0)):
    raise ConfigError(f"compare.seed must be an integer, got {spec['seed']!r}")
  return CompareSpec(**spec)


def baseline_indices(baseline: Any, items: list[dict]) -> list[int]:
  """Which of ``items`` (run configs, or rows' field values with ``epsilon`` the *requested*
  one) are the baseline: a string is a row label if some item has that label, else an
  algorithm name; a mapping gives field values that must all be equal."""
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
