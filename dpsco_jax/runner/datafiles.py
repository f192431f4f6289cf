"""Data files named in a config (``data:`` / ``eval_data:``): parsed and checked like every
config key, then read into a :class:`~dpsco_jax.data.UserData` through
:meth:`UserData.from_table` (split out of :mod:`dpsco_jax.runner.user`, which re-exports these
names; the accepted forms are described there).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import difflib
import os
from typing import Any

import numpy as np

from dpsco_jax.config.families import DataFileKeys
from dpsco_jax.config.types import ConfigError, _check_type, _specs
from dpsco_jax.runner.config import DATA_SUFFIXES
from dpsco_jax.runner.usercode import _one_line

__all__ = ["DataFile", "parse_data_file", "load_data_file"]


@dataclasses.dataclass(frozen=True)
class DataFile:
  """A parsed ``data:`` / ``eval_data:`` value (see :class:`DataFileKeys`)."""
  path: str
  user_column: str | None = None
  columns: Any = None  # None, a tuple of names, or a tuple of (leaf, tuple of names | name)
  max_items_per_user: int | None = None
  selection: str = "random"
  seed: int = 0

  @property
  def suffix(self) -> str:
    return os.path.splitext(self.path)[1].lower()


def _file_columns(path: str, suffix: str, where: str) -> list[str]:
  """The array / column names of a data file (its header only)."""
  try:
    if suffix == ".npz":
      with np.load(path, allow_pickle=False) as z:
        return list(z.files)
    if suffix == ".csv":
      with open(path, newline="") as f:
        header = next(csv.reader(f), None)
      if not header:
        raise ConfigError(f"{where}: {path} is empty (a .csv needs a header row)")
      return [h.strip() for h in header]
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ConfigError(f"{where}: reading {path} (.parquet) needs pyarrow: pip install "
                        "pyarrow") from None
    return list(pq.read_schema(path).names)
  except ConfigError:
    raise
  except Exception as err:  # noqa: BLE001 - a broken file is a config error
    raise ConfigError(f"{where}: cannot read {path} ({_one_line(err)})") from None


def _parse_columns(value: Any, where: str) -> Any:
  if value is None:
    return None
  if isinstance(value, list):
    if not value or not all(isinstance(c, str) for c in value):
      raise ConfigError(f"{where}.columns must be a non-empty list of names, got {value!r}")
    return tuple(value)
  if isinstance(value, dict):
    out = []
    for leaf, cols in value.items():
      if isinstance(cols, str):
        out.append((leaf, cols))
      elif isinstance(cols, list) and cols and all(isinstance(c, str) for c in cols):
        out.append((leaf, tuple(cols)))
      else:
        raise ConfigError(f"{where}.columns.{leaf} must be a column name or a list of names, "
                          f"got {cols!r}")
    if not out:
      raise ConfigError(f"{where}.columns must name at least one leaf")
    return tuple(out)
  raise ConfigError(f"{where}.columns must be a list of names or {{leaf: columns}}, got "
                    f"{value!r}")


def _column_names(columns: Any) -> list[str]:
  if columns is None:
    return []
  if columns and isinstance(columns[0], tuple):
    return [c for _, cols in columns for c in ((cols,) if isinstance(cols, str) else cols)]
  return list(columns)


def parse_data_file(value: Any, where: str, *, check_file: bool = True) -> DataFile:
  """A ``data:`` value checked like every config key (unknown keys with a suggestion, strict
  types), its file found and its columns present."""
  if isinstance(value, str):
    value = {"path": value}
  if not isinstance(value, dict):
    raise ConfigError(f"{where} must be a file path or {{path: ..., user_column: ...}}, got "
                      f"{value!r}")
  specs = _specs(DataFileKeys, "data")
  for key in value:
    if key not in specs:
      hint = difflib.get_close_matches(str(key), list(specs), n=1)
      raise ConfigError(f"{where}: unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)"
                                                           if hint else "")
                        + f"; it reads: {', '.join(specs)}")
  if value.get("path") is None:
    raise ConfigError(f"{where} needs path (the data file)")
  try:
    out = {k: _check_type(specs[k], v) for k, v in value.items() if v is not None}
  except ConfigError as err:
    raise ConfigError(f"{where}.{err}") from None
  if out.get("max_items_per_user") == 0:
    raise ConfigError(f"{where}.max_items_per_user must be >= 1")
  path = os.path.abspath(os.path.expanduser(out["path"]))
  spec = DataFile(path, out.get("user_column"), _parse_columns(out.get("columns"), where),
                  out.get("max_items_per_user"), out.get("selection", "random"),
                  out.get("seed", 0))
  if spec.suffix not in DATA_SUFFIXES:
    raise ConfigError(f"{where}: {out['path']!r} is not a data file this runner reads "
                      f"({', '.join(DATA_SUFFIXES)})")
  if spec.user_column is None:
    if spec.suffix != ".npz":
      raise ConfigError(f"{where}: a {spec.suffix} table needs user_column (the column of user "
                        "ids)")
    spec = dataclasses.replace(spec, user_column="user_ids")
  if not check_file:
    return spec
  if not os.path.isfile(path):
    raise ConfigError(f"{where}: no such file {path}")
  names = _file_columns(path, spec.suffix, where)
  what = "array" if spec.suffix == ".npz" else "column"
  for name in [spec.user_column, *_column_names(spec.columns)]:
    if name not in names:
      hint = difflib.get_close_matches(name, names, n=1)
      role = "user_column" if name == spec.user_column else "columns"
      raise ConfigError(f"{where}.{role}: {path} has no {what} {name!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; its {what}s: {', '.join(names)}")
  if len(names) < 2:
    raise ConfigError(f"{where}: {path} has only the user ids ({spec.user_column}); no example "
                      f"{what}s")
  return spec


def _csv_column(values: list[str]) -> np.ndarray:
  for kind in (np.int64, np.float64):
    try:
      return np.asarray(values, dtype=kind)
    except ValueError:
      continue
  return np.asarray(values)


def _read_table(spec: DataFile) -> dict[str, np.ndarray]:
  if spec.suffix == ".npz":
    with np.load(spec.path, allow_pickle=False) as z:
      return {name: z[name] for name in z.files}
  if spec.suffix == ".csv":
    with open(spec.path, newline="") as f:
      rows = list(csv.reader(f))
    header = [h.strip() for h in rows[0]]
    body = [r for r in rows[1:] if r]
    bad = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
    if bad is not None:
      raise ValueError(f"{spec.path}: row {bad + 2} has {len(body[bad])} fields, the header "
                       f"{len(header)}")
    return {h: _csv_column([r[i].strip() for r in body]) for i, h in enumerate(header)}
  import pyarrow.parquet as pq
  return {k: np.asarray(v) for k, v in pq.read_table(spec.path).to_pydict().items()}


def _narrow(x: np.ndarray) -> np.ndarray:
  """float64 / int64 columns as the float32 / int32 JAX computes in."""
  if x.dtype == np.float64:
    return x.astype(np.float32)
  if x.dtype == np.int64 and (x.size == 0 or (x.min() >= -2**31 and x.max() < 2**31)):
    return x.astype(np.int32)
  return x


_FILES: collections.OrderedDict = collections.OrderedDict()


def load_data_file(spec: DataFile):
  """The :class:`~dpsco_jax.data.UserData` of a data file, through
  :meth:`UserData.from_table` (the last few are cached by path, modification time and
  reading options)."""
  from dpsco_jax.data import UserData
  st = os.stat(spec.path)
  key = (spec, st.st_mtime_ns, st.st_size)
  if key in _FILES:
    _FILES.move_to_end(key)
    return _FILES[key]
  raw = _read_table(spec)
  ids = raw.pop(spec.user_column)
  if spec.columns is None:
    table = {k: _narrow(v) for k, v in raw.items()}
  elif isinstance(spec.columns[0], tuple):
    table = {}
    for leaf, cols in spec.columns:
      table[leaf] = _narrow(raw[cols] if isinstance(cols, str)
                            else np.stack([raw[c] for c in cols], axis=-1))
  else:
    table = {c: _narrow(raw[c]) for c in spec.columns}
  data = UserData.from_table({spec.user_column: ids, **table}, user_column=spec.user_column,
                             columns=list(table), max_items_per_user=spec.max_items_per_user,
                             selection=spec.selection, seed=spec.seed)
  _FILES[key] = data
  while len(_FILES) > 8:
    _FILES.popitem(last=False)
  return data
