"""``dpsco run CONFIG --quick``: the whole pipeline of a sweep at its smallest, before a long run.

A study config (``configs/study/*.yaml``) runs for hours; a typo in its third experiment, a
``select`` metric no record has or a baseline that matches no row should cost seconds, not the
hours before it. :func:`quick_config` keeps the config's shape (every ``experiments`` entry,
``select``, ``compare``, sections, labels) and shrinks what it sweeps:

* every swept list (top level, in each ``experiments`` entry, inside ``problem:`` /
  ``algorithm:`` / ``data:`` sections) keeps its first value (a list inside a list, the
  spelling of one sequence-valued key, keeps its first sequence), except the keys that
  ``select.over`` chooses among, which keep their first two (a selection needs a choice);
* ``seed``, ``tuning_seeds`` and ``eval_seeds`` keep their first seed (so tuning, selection and
  evaluation all run, on disjoint seeds as the full config has them);
* the sizes in :data:`QUICK_CAPS` are capped (``n_users`` at 2000, ``num_steps`` at 20, ...;
  not the values ``select`` chooses among): the quick run is a smoke of the code path, not a
  measurement, and its numbers say nothing about the full one.

The records say ``quick: true``; nothing else about validation changes (a quick run refuses
exactly what the full run would, except a precondition that only fails at the full size).
CI runs every ``configs/study`` config this way (``tests/test_study_quick.py``).
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
  """One run mapping (the top level without its runner blocks, an experiments entry, a section):
  first values (first two of the ``chosen`` keys), first seeds, capped sizes."""
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
  """The keys ``select.over`` chooses among (a name or a list of names; anything else is the
  runner's to refuse)."""
  select = config.get("select")
  over = select.get("over") if isinstance(select, dict) else None
  if isinstance(over, str):
    over = [over]
  return frozenset(k for k in over if isinstance(k, str)) if isinstance(over, list) else frozenset()


def quick_config(config: dict) -> dict:
  """The quick version of a loaded config (see the module docstring); the input is not
  changed."""
  if not isinstance(config, dict):
    return config   # the runner's own checks say what is wrong with it
  chosen = _selected_keys(config)
  out = _shrink(config, chosen)
  if isinstance(config.get("experiments"), list):
    out["experiments"] = [_shrink(e, chosen) if isinstance(e, dict) else e
                          for e in config["experiments"]]
  return out
