"""``dpsco run CONFIG --quick``: the whole pipeline of a sweep at its smallest, before a long run.

:func:`quick_config` keeps the config's shape (every ``experiments`` entry, ``select``,
``compare``, sections, labels) and shrinks what it sweeps: every swept list keeps its first
value (the keys ``select.over`` chooses among keep two), ``seed`` / ``tuning_seeds`` /
``eval_seeds`` keep their first seed, and the sizes in :data:`QUICK_CAPS` are capped. A smoke
of the code path, not a measurement: the records say ``quick: true``; validation refuses
exactly what the full run would (but a precondition that fails only at full size).
"""

from __future__ import annotations

from typing import Any

__all__ = ["QUICK_CAPS", "quick_config"]

#: size keys capped in a quick run (a larger value is replaced by the cap; a smaller one kept)
QUICK_CAPS = {"n_users": 2000, "n_train": 1000, "n_val": 1000, "n_eval": 2000,
              "num_steps": 20, "inner_num_steps": 20}
#: runner keys that hold seeds: each keeps its first seed
_SEED_KEYS = ("seed", "tuning_seeds", "eval_seeds")
#: runner blocks left as they are (their lists are not sweeps)
_KEEP = ("select", "compare", "experiments", "name", "description")
_SECTIONS = ("problem", "algorithm", "data")


def _first(value: Any) -> Any:
  return value[0] if isinstance(value, list) and value else value


def _cap(key: str, value: Any) -> Any:
  cap = QUICK_CAPS.get(key)
  if cap is None or isinstance(value, bool) or not isinstance(value, int):
    return value
  return min(value, cap)


def _shrink(mapping: dict, chosen: frozenset) -> dict:
  """One run mapping (top level, experiments entry or section) shrunk."""
  out = {}
  for key, value in mapping.items():
    if key in _KEEP:
      out[key] = value
    elif key in _SECTIONS and isinstance(value, dict):
      out[key] = _shrink(value, chosen)
    elif key in _SEED_KEYS and isinstance(value, list):
      out[key] = value[:1]
    elif key in chosen and isinstance(value, list):
      out[key] = value[:2]   # uncapped: two capped values could be one (nothing to choose)
    else:
      out[key] = _cap(key, _first(value))
  return out


def _selected_keys(config: dict) -> frozenset:
  """The keys ``select.over`` chooses among (anything malformed is the runner's to refuse)."""
  select = config.get("select")
  over = select.get("over") if isinstance(select, dict) else None
  if isinstance(over, str):
    over = [over]
  return frozenset(k for k in over if isinstance(k, str)) if isinstance(over, list) else frozenset()


def quick_config(config: dict) -> dict:
  """The quick version of a loaded config (the input is not changed)."""
  if not isinstance(config, dict):
    return config   # the runner's own checks say what is wrong with it
  chosen = _selected_keys(config)
  out = _shrink(config, chosen)
  if isinstance(config.get("experiments"), list):
    out["experiments"] = [_shrink(e, chosen) if isinstance(e, dict) else e
                          for e in config["experiments"]]
  return out
