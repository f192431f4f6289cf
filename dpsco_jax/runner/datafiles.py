"""Data files named in a config (``data:`` / ``eval_data:``), parsed and checked like every
config key, then read into a :class:`~dpsco_jax.data.UserData` through
:meth:`UserData.from_table` (the layouts: :mod:`dpsco_jax.runner.user`).

A file is read and checked with the config, before anything runs (cached for the run); every
fault is one :class:`ConfigError` naming the file and the array / column, never a value: blank
ids or ids differing only in spaces (a ``.csv`` id is its stripped text unless
``user_id_dtype: int``), non-numeric or non-finite features (the run would silently drop that
user), and values float32 / int32 cannot hold exactly.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import os
import re
from typing import Any

import numpy as np

from dpsco_jax.cache import bounded_cache
from dpsco_jax.config.families import DataFileKeys
from dpsco_jax.config.types import ConfigError, check_type, specs
from dpsco_jax.data.grouping import blank_ids, canonical_ids
from dpsco_jax.runner.config import DATA_SUFFIXES
from dpsco_jax.runner.usercode import one_line_error

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
  user_id_dtype: str | None = None   # .csv only: None / "str" (the text) or "int"
  # the config key, for messages only: not part of equality, so not of the cache key
  where: str = dataclasses.field(default="data", compare=False)

  @property
  def suffix(self) -> str:
    return os.path.splitext(self.path)[1].lower()

  @property
  def what(self) -> str:
    return "array" if self.suffix == ".npz" else "column"

  def error(self, message: str) -> ConfigError:
    """A ConfigError naming the config key and the file."""
    return ConfigError(f"{self.where}: {self.path}: {message}")


def _file_columns(path: str, suffix: str, where: str) -> list[str]:
  """The array / column names of a data file (its header only)."""
  try:
    if suffix == ".npz":
      with _open_npz(path) as z:
        return list(z.files)
    if suffix == ".csv":
      with open(path, newline="", encoding="utf-8-sig") as f:
        return _csv_header(next(csv.reader(f), None), path, where)
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ConfigError(f"{where}: reading {path} (.parquet) needs pyarrow: pip install "
                        "pyarrow") from None
    return list(pq.read_schema(path).names)
  except ConfigError:
    raise
  except Exception as err:  # noqa: BLE001 - a broken file is a config error
    raise ConfigError(f"{where}: cannot read {path} ({one_line_error(err)})") from None


def _csv_header(header: list[str] | None, path: str, where: str) -> list[str]:
  """The column names of a .csv header row (a name given twice would hide a column)."""
  if not header:
    raise ConfigError(f"{where}: {path} is empty (a .csv needs a header row)")
  names = [h.strip() for h in header]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ConfigError(f"{where}: {path}: the header names column {twice[0]!r} more than once")
  return names


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


def _pairs(columns: Any) -> list[tuple[str, Any]]:
  """``(leaf, column or columns)`` of a parsed ``columns`` value (None: none)."""
  if not columns:
    return []
  return list(columns) if isinstance(columns[0], tuple) else [(c, c) for c in columns]


def _column_names(columns: Any) -> list[str]:
  return [c for _, cols in _pairs(columns) for c in ((cols,) if isinstance(cols, str) else cols)]


def _check_id_options(spec: DataFile, where: str) -> None:
  """The ids are never an example leaf (a leaf named like them would replace them), and
  ``user_id_dtype`` is for a .csv's text ids only."""
  leaves = [leaf for leaf, _ in _pairs(spec.columns)]
  if spec.user_column in [*_column_names(spec.columns), *leaves]:
    raise ConfigError(f"{where}.columns: {spec.user_column!r} holds the user ids; the ids "
                      "cannot be an example leaf too")
  if spec.user_id_dtype is not None and spec.suffix != ".csv":
    raise ConfigError(f"{where}.user_id_dtype applies to a .csv file's text ids; a "
                      f"{spec.suffix} id column keeps its own dtype")


def parse_data_file(value: Any, where: str) -> DataFile:
  """A ``data:`` value (``where``: its key) checked like every config key, its file found, its
  columns present and its contents checked by :func:`load_data_file`."""
  if isinstance(value, str):
    value = {"path": value}
  if not isinstance(value, dict):
    raise ConfigError(f"{where} must be a file path or {{path: ..., user_column: ...}}, got "
                      f"{value!r}")
  key_specs = specs(DataFileKeys, "data")
  for key in value:
    if key not in key_specs:
      hint = difflib.get_close_matches(str(key), list(key_specs), n=1)
      raise ConfigError(f"{where}: unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)"
                                                           if hint else "")
                        + f"; it reads: {', '.join(key_specs)}")
  if value.get("path") is None:
    raise ConfigError(f"{where} needs path (the data file)")
  try:
    out = {k: check_type(key_specs[k], v) for k, v in value.items() if v is not None}
  except ConfigError as err:
    raise ConfigError(f"{where}.{err}") from None
  if out.get("max_items_per_user") == 0:
    raise ConfigError(f"{where}.max_items_per_user must be >= 1")
  path = os.path.abspath(os.path.expanduser(out["path"]))
  spec = DataFile(path, out.get("user_column"), _parse_columns(out.get("columns"), where),
                  out.get("max_items_per_user"), out.get("selection", "random"),
                  out.get("seed", 0), out.get("user_id_dtype"), where)
  if spec.suffix not in DATA_SUFFIXES:
    raise ConfigError(f"{where}: {out['path']!r} is not a data file this runner reads "
                      f"({', '.join(DATA_SUFFIXES)})")
  if spec.user_column is None:
    if spec.suffix != ".npz":
      raise ConfigError(f"{where}: a {spec.suffix} table needs user_column (the column of user "
                        "ids)")
    spec = dataclasses.replace(spec, user_column="user_ids")
  _check_id_options(spec, where)
  if os.path.isdir(path):
    raise ConfigError(f"{where}: {path} is a directory, not a data file")
  if not os.path.isfile(path):
    raise ConfigError(f"{where}: no such file {path}")
  names = _file_columns(path, spec.suffix, where)
  what = spec.what
  for name in [spec.user_column, *_column_names(spec.columns)]:
    if name not in names:
      hint = difflib.get_close_matches(name, names, n=1)
      role = "user_column" if name == spec.user_column else "columns"
      raise ConfigError(f"{where}.{role}: {path} has no {what} {name!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; its {what}s: {', '.join(names)}")
  if spec.columns is None and "" in names:   # e.g. pandas' to_csv index: not a feature
    raise ConfigError(f"{where}: {path} has a {what} with a blank name ({what} "
                      f"{names.index('') + 1}), which every example would read: name it, drop "
                      f"it (a pandas index: to_csv(index=False)), or list {where}.columns")
  if len(names) < 2:
    raise ConfigError(f"{where}: {path} has only the user ids ({spec.user_column}); no example "
                      f"{what}s")
  load_data_file(spec)   # its contents too, before anything runs (cached for the run)
  return spec


_INT_TEXT = re.compile(r"[+-]?[0-9]+")
#: a decimal number as CSV readers agree on it: Python's float() also takes 1_000 and non-ASCII
#: digits, which other readers keep as text
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                          r"|[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


def _count(n: int, word: str) -> str:
  return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _wanted(spec: DataFile, names: list[str]) -> list[str]:
  """The ids' name and the names of the columns the examples read."""
  cols = ([n for n in names if n != spec.user_column] if spec.columns is None
          else _column_names(spec.columns))
  return [spec.user_column, *dict.fromkeys(cols)]


def _open_npz(path: str) -> np.lib.npyio.NpzFile:
  z = np.load(path, allow_pickle=False)
  if not isinstance(z, np.lib.npyio.NpzFile):   # a .npy renamed: one array, no names
    raise ValueError("not a .npz archive (np.savez writes one)")
  return z


def _read_npz(spec: DataFile) -> dict[str, np.ndarray]:
  with _open_npz(spec.path) as z:
    out = {}
    for name in _wanted(spec, list(z.files)):
      try:
        out[name] = z[name]
      except Exception as err:  # noqa: BLE001 - a damaged member, an object array
        raise spec.error(f"array {name!r} cannot be read ({one_line_error(err)})") from None
    return out


def _read_parquet(spec: DataFile) -> dict[str, np.ndarray]:
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise spec.error("reading a .parquet file needs pyarrow: pip install pyarrow") from None
  names = _wanted(spec, list(pq.read_schema(spec.path).names))
  table = pq.read_table(spec.path, columns=names)
  # a null becomes NaN in a numeric column (refused as non-finite), None in a text one
  return {n: table.column(n).to_numpy(zero_copy_only=False) for n in names}


def _csv_rows(spec: DataFile) -> tuple[list[str], list[list[str]], list[int]]:
  """``(header, rows, line of each row)``; blank lines skipped, a ragged row refused."""
  with open(spec.path, newline="", encoding="utf-8-sig") as f:
    reader = csv.reader(f)
    header = _csv_header(next(reader, None), spec.path, spec.where)
    rows, lines = [], []
    for row in reader:
      if not row:
        continue
      if len(row) != len(header):
        raise spec.error(f"line {reader.line_num} has {len(row)} fields, the header "
                         f"{len(header)}")
      rows.append(row)
      lines.append(reader.line_num)
  if not rows:
    raise spec.error("has a header but no rows")
  return header, rows, lines


def _csv_ids(values: list[str], spec: DataFile, lines: list[int]) -> np.ndarray:
  """The ids of a .csv: the stripped text, or integers with ``user_id_dtype: int``; never a
  number parsed by guess."""
  name, text = spec.user_column, [v.strip() for v in values]
  if spec.user_id_dtype == "int":
    bad = [i for i, v in enumerate(text) if not _INT_TEXT.fullmatch(v)]
    if bad:
      raise spec.error(f"column {name!r} has {_count(len(bad), 'id')} not written as an "
                       f"integer (user_id_dtype: int; the first on line {lines[bad[0]]})")
    try:
      return np.array([int(v) for v in text], dtype=np.int64)
    except OverflowError:
      raise spec.error(f"column {name!r} has ids beyond the int64 range") from None
  ids = np.array(text, dtype=np.str_)
  blank = blank_ids(ids)
  if blank.size:
    raise spec.error(f"column {name!r} has {_count(blank.size, 'blank id')} (the first on line "
                     f"{lines[blank[0]]}): every row needs a user; drop or fill those rows")
  _refuse_spacing_twins(values, text, spec, lines)
  return ids


def _refuse_spacing_twins(values: list[str], text: list[str], spec: DataFile,
                          lines: list[int]) -> None:
  """Two ids equal but for surrounding spaces: one user or two is the owner's to say."""
  if all(v == t for v, t in zip(values, text)):
    return
  first: dict[str, tuple[str, int]] = {}
  for v, t, line in zip(values, text, lines):
    raw, seen = first.setdefault(t, (v, line))
    if raw != v:
      raise spec.error(f"column {spec.user_column!r}: the ids on lines {seen} and {line} differ "
                       "only in surrounding spaces (ids are read stripped, so they would be one "
                       "user): make them identical, or make them different ids")


def _csv_numbers(values: list[str], name: str, spec: DataFile, lines: list[int]) -> np.ndarray:
  """A feature column: int64 if every field is an integer, else float64; a field not written
  as a decimal number is refused."""
  text = [v.strip() for v in values]
  bad = [i for i, v in enumerate(text) if not _NUMBER_TEXT.fullmatch(v)]
  if bad:
    raise spec.error(f"column {name!r} has {_count(len(bad), 'field')} not written as a number "
                     f"(blank, text, 1_000 or non-ASCII digits; the first on line "
                     f"{lines[bad[0]]}); example columns must be numeric")
  try:
    return np.array(text, dtype=np.int64)
  except OverflowError:
    if all(_INT_TEXT.fullmatch(v) for v in text):
      raise spec.error(f"column {name!r} has integers beyond the int64 range") from None
  except ValueError:
    pass
  return np.array(text, dtype=np.float64)


def _read_csv(spec: DataFile) -> dict[str, np.ndarray]:
  header, rows, lines = _csv_rows(spec)
  out = {}
  for name in _wanted(spec, header):
    i = header.index(name)
    values = [r[i] for r in rows]
    out[name] = (_csv_ids(values, spec, lines) if name == spec.user_column
                 else _csv_numbers(values, name, spec, lines))
  return out


def _read_table(spec: DataFile) -> dict[str, np.ndarray]:
  """The ids and the example columns of a data file (ids first)."""
  reader = {".npz": _read_npz, ".csv": _read_csv}.get(spec.suffix, _read_parquet)
  try:
    return reader(spec)
  except ConfigError:
    raise
  except Exception as err:  # noqa: BLE001 - a broken file is a config error
    raise spec.error(f"cannot read it ({one_line_error(err)})") from None


def _checked_ids(ids: np.ndarray, spec: DataFile) -> np.ndarray:
  label = f"{spec.what} {spec.user_column!r}"
  if ids.ndim != 1:
    raise spec.error(f"{label} must hold one id per row (shape [N]), got shape {ids.shape}")
  if ids.shape[0] == 0:
    raise spec.error(f"{label} is empty: the file has no rows")
  try:
    return canonical_ids(ids, f"ids of {label}")
  except (ValueError, TypeError) as err:
    raise spec.error(str(err)) from None


def _run_dtype(dtype: np.dtype) -> np.dtype:
  """The dtype the run computes a leaf in (JAX without x64: 32 bits)."""
  if dtype == np.float64:
    return np.dtype(np.float32)
  if dtype in (np.int64, np.uint64):
    return np.dtype(np.int32)
  return dtype


def _check_values(x: np.ndarray, name: str, spec: DataFile, n: int) -> None:
  """One row per id, numbers, all finite."""
  label = f"{spec.what} {name!r}"
  if x.ndim == 0 or x.shape[0] != n:
    raise spec.error(f"{label} has shape {x.shape}, the ids {n} rows: every {spec.what} "
                     "needs one row per id")
  if x.dtype.kind not in "biuf":
    raise spec.error(f"{label} holds {x.dtype} values; example {spec.what}s must be numbers "
                     "(bool, int or float)")
  if x.dtype.kind == "f":
    bad = ~np.isfinite(x)
    if bad.any():
      rows = int(bad.reshape(n, -1).any(axis=1).sum())
      null = "; a parquet null reads as NaN" if spec.suffix == ".parquet" else ""
      raise spec.error(f"{label} has {_count(int(bad.sum()), 'non-finite value')} (NaN or inf"
                       f"{null}) in {_count(rows, 'row')}; clean the file or drop those rows")


def _check_exact(x: np.ndarray, name: str, spec: DataFile, target: np.dtype) -> None:
  """Refuses values that ``target`` (the leaf's run dtype) would not hold exactly."""
  label = f"{spec.what} {name!r}"
  if target.kind == "f" and x.dtype.kind == "f" and x.dtype.itemsize > target.itemsize:
    top = float(np.finfo(target).max)
    over = int((np.abs(x) > top).sum())
    if over:
      raise spec.error(f"{label} has {_count(over, 'value')} beyond the {target} range "
                       f"(|x| > {top:.3g}) the run computes in; rescale the column")
  elif target.kind == "f" and x.dtype.kind in "iu":
    bits = np.finfo(target).nmant + 1
    over = int(((x > 2**bits) | (x < -2**bits)).sum())
    if over:
      raise spec.error(f"{label} has {_count(over, 'integer')} beyond 2**{bits} in magnitude, "
                       f"which {target} (its leaf is stacked with float {spec.what}s) cannot "
                       "hold exactly; give it its own leaf or rescale it")
  elif target.kind in "iu" and x.dtype.kind in "iu":
    info = np.iinfo(target)
    over = int(((x < info.min) | (x > info.max)).sum())
    if over:
      raise spec.error(f"{label} has {_count(over, 'integer')} outside the {target} range "
                       f"[{info.min}, {info.max}] the run computes in; rescale the column or "
                       "store it as floats")


def _leaf(cols: str | tuple[str, ...], raw: dict[str, np.ndarray], spec: DataFile,
          n: int) -> np.ndarray:
  """One example leaf: a column, or columns stacked into a vector, checked and narrowed."""
  names = (cols,) if isinstance(cols, str) else cols
  arrays = [raw[c] for c in names]
  for c, x in zip(names, arrays):
    _check_values(x, c, spec, n)
  if len({x.shape for x in arrays}) > 1:
    raise spec.error(f"{spec.what}s {list(names)} have shapes {[x.shape for x in arrays]} and "
                     "cannot be stacked into one leaf")
  target = _run_dtype(np.result_type(*arrays))
  for c, x in zip(names, arrays):
    _check_exact(x, c, spec, target)
  leaf = arrays[0] if isinstance(cols, str) else np.stack(arrays, axis=-1)
  return leaf.astype(target, copy=False)


def _leaves(raw: dict[str, np.ndarray], spec: DataFile, n: int) -> dict[str, np.ndarray]:
  pairs = [(c, c) for c in raw] if spec.columns is None else _pairs(spec.columns)
  return {leaf: _leaf(cols, raw, spec, n) for leaf, cols in pairs}


def load_data_file(spec: DataFile):
  """The :class:`~dpsco_jax.data.UserData` of a data file, read and checked, cached on the
  path, modification time, size and options (:func:`dpsco_jax.cache.clear` empties it)."""
  try:
    st = os.stat(spec.path)
  except OSError as err:
    raise spec.error(f"cannot read it ({one_line_error(err)})") from None
  return _load(spec, st.st_mtime_ns, st.st_size)


@bounded_cache(maxsize=8)
def _load(spec: DataFile, mtime_ns: int, size: int):
  # mtime_ns and size are the cache key's: a rewritten file is read again
  from dpsco_jax.data import UserData
  raw = _read_table(spec)
  ids = _checked_ids(raw.pop(spec.user_column), spec)
  table = _leaves(raw, spec, ids.shape[0])
  try:
    return UserData.from_table({spec.user_column: ids, **table}, user_column=spec.user_column,
                               columns=list(table), max_items_per_user=spec.max_items_per_user,
                               selection=spec.selection, seed=spec.seed)
  except (ValueError, TypeError) as err:
    raise spec.error(one_line_error(err)) from None
  except MemoryError:   # every user is padded to max_items_per_user slots
    raise spec.error(f"max_items_per_user {spec.max_items_per_user}: every user is padded to "
                     "that many items, and the padded table does not fit in memory; declare "
                     "a smaller bound") from None
