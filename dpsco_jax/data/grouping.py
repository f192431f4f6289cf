"""Grouping rows by user: id validation, one sort, padded slots, and an on-disk store.

The machinery behind :meth:`dpsco_jax.data.UserData.from_arrays`:

* :func:`canonical_ids` refuses ids that would silently merge or split users: ``NaN``,
  ``None``, bools, blank strings and mixtures of kinds. **Rule:** a column of ids is all
  integers, all non-blank strings (or bytes), or all finite whole-number floats. Strings
  compare exactly (``"01"``, ``"1"``, ``" 1"`` are three users).
* :func:`group_rows` groups ``N`` rows with one stable sort; users in order of first appearance.
* :func:`slot_rows`: slot ``j`` of a user with ``k <= m`` rows is its row ``j % k`` (padding
  cycles its own items); a user with ``k > m`` keeps its first ``m`` (``"first"``) or a subset
  drawn from ``default_rng([seed, id_seed(id)])`` (``"random"``).
* :func:`dense_run_length` recognises in ``O(N)`` a table of runs of exactly ``k`` rows per
  distinct user, whose padded leaves are the table reshaped (views, no copy).
* :func:`write_padded` fills the padded leaves block by block, in memory or into ``.npy`` files
  (a store, :func:`open_store`), so the padded copy never sits in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import numpy as np

__all__ = ["canonical_ids", "blank_ids", "id_seed", "group_rows", "Groups", "slot_rows",
           "dense_run_length", "write_padded", "prepare_store", "save_store_meta", "open_store",
           "STORE_FORMAT", "StoreIntegrityError", "STORE_ARRAYS", "array_checksum", "fingerprint",
           "leaf_label", "store_facts", "aligned_empty", "DEVICE_ALIGNMENT"]

STORE_FORMAT = "dpsco_jax.UserData/2"      # meta.json holds a manifest and a fingerprint
_OLD_FORMATS = ("dpsco_jax.UserData/1",)   # no manifest: refused (rewrite the store)
FINGERPRINT_FORMAT = "dpsco_jax.UserData.fingerprint/1"
#: The small arrays of a store, in the (sorted) order of its manifest and fingerprint.
STORE_ARRAYS = ("item_mask", "n_dropped", "n_items", "user_ids")
CHUNK_BYTES = 8 << 20    # checksums read 8 MiB at a time: bounded memory at any table size
_BLOCK_BYTES = 1 << 26   # ~64 MB of padded rows per block: bounded temporaries
_SCAN_ROWS = 1 << 20     # ids compared per chunk by dense_run_length: ~1 MB of bools

def id_seed(user_id: Any) -> int:
  """A stable 64-bit seed from a user id (the same across runs, processes and tables)."""
  value = user_id.item() if hasattr(user_id, "item") else user_id
  return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little")


# id kinds of an object column's elements, bool before int (a bool is an int)
_KINDS = (((bool, np.bool_), "bool"), ((int, np.integer), "int"),
          ((float, np.floating), "float"), ((str, np.str_), "str"), ((bytes, np.bytes_), "bytes"))


def _kind_of(value: Any) -> str:
  if value is None:
    return "None"
  return next((kind for types, kind in _KINDS if isinstance(value, types)),
              type(value).__name__)


def _from_objects(ids: np.ndarray, what: str) -> np.ndarray:
  """An object column of one id kind as a native numpy array (values unchanged)."""
  kinds = {_kind_of(v) for v in ids}
  if "None" in kinds:
    raise ValueError(f"{what} contain None (missing ids): every row needs a user; drop or "
                     "fill those rows first")
  if "bool" in kinds:
    raise TypeError(f"{what} contain bools: pass ints or strings (True would equal the id 1)")
  bad = kinds - {"int", "float", "str", "bytes"}
  if bad:
    raise TypeError(f"{what} must be ints, strings or whole-number floats, got "
                    f"{sorted(bad)} values")
  if len(kinds) > 1:
    raise TypeError(f"{what} mix kinds {sorted(kinds)}: ids of different kinds that look "
                    "alike (1, 1.0, '1') would be merged or split arbitrarily; convert the "
                    "column to one kind")
  kind = kinds.pop()
  if kind == "int":
    try:
      return np.array(ids.tolist(), dtype=np.int64)
    except OverflowError:       # beyond int64: keep exact Python ints (sortable)
      return ids
  return np.array(ids.tolist(), dtype={"float": np.float64, "str": np.str_,
                                       "bytes": np.bytes_}[kind])


def blank_ids(ids: np.ndarray) -> np.ndarray:
  """Positions of the blank ids (``""`` or only whitespace) of a str / bytes id array."""
  if ids.dtype.kind not in "US":
    return np.zeros(0, np.intp)
  return np.flatnonzero((np.strings.str_len(ids) == 0) | np.strings.isspace(ids))


def canonical_ids(user_ids: Any, what: str = "user_ids") -> np.ndarray:
  """``user_ids`` as a 1-D numpy array of one id kind, or a clear error (module docstring).
  Lists are read element by element (``np.asarray([1, "1"])`` would merge them)."""
  if hasattr(user_ids, "to_numpy"):
    user_ids = user_ids.to_numpy()
  ids = user_ids if isinstance(user_ids, np.ndarray) else np.array(user_ids, dtype=object)
  if ids.ndim != 1:
    raise ValueError(f"{what} must be one-dimensional [N], got shape {ids.shape}")
  if ids.dtype == object:
    ids = _from_objects(ids, what)
  if ids.dtype == bool:
    raise TypeError(f"{what} are bools: pass ints or strings (True would equal the id 1)")
  if ids.dtype.kind == "f":
    if np.isnan(ids).any():
      raise ValueError(f"{what} contain NaN (missing ids): NaN ids would be merged into one "
                       "user; drop or fill those rows first")
    if not np.isfinite(ids).all() or np.any(ids != np.floor(ids)):
      raise ValueError(f"float {what} must be finite whole numbers (an integer column that "
                       "became float); other floats are not reliable ids")
  elif ids.dtype.kind not in "iuUSO":
    raise TypeError(f"{what} must be ints, strings or whole-number floats, got dtype "
                    f"{ids.dtype}")
  blank = blank_ids(ids)
  if blank.size:
    raise ValueError(f"{what} contain {blank.size} blank id(s) ('' or only spaces; the first "
                     f"at position {blank[0]}): missing ids would be merged into one user; "
                     "drop or fill those rows first")
  return ids


@dataclasses.dataclass(frozen=True)
class Groups:
  """Rows grouped by user; users in order of first appearance.

  Attributes:
    rows: ``[N]`` row indices sorted by user, in table order within a user.
    start: ``[U]`` offset of each user's rows in ``rows``.
    count: ``[U]`` rows per user.
    ids: ``[U]`` the users' ids.
  """
  rows: np.ndarray
  start: np.ndarray
  count: np.ndarray
  ids: np.ndarray

  @property
  def n_users(self) -> int:
    return int(self.count.size)


def _index_dtype(n: int) -> type:
  return np.int32 if n < 2**31 else np.int64   # half the memory of the largest index array


def _sort_int_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
  """``(rows, sorted ids)`` by one sort of the distinct keys ``(id - min) * N + row`` (faster
  than an argsort); ``None`` when they would overflow int64."""
  n = ids.shape[0]
  lo, hi = int(ids.min()), int(ids.max())
  if hi >= 2**63 or (hi - lo + 1) * n >= 2**63:
    return None
  key = ids.astype(np.int64)          # a copy: the caller's ids are never written
  key -= lo
  key *= n
  step = 1 << 22                      # add the row numbers without an [N] arange
  for a in range(0, n, step):
    key[a:a + step] += np.arange(a, min(n, a + step), dtype=np.int64)
  key.sort()
  rows = np.empty(n, _index_dtype(n))
  np.remainder(key, n, out=rows, casting="unsafe")    # no [N] int64 temporary
  key //= n                           # in place: now the sorted ids, minus lo
  key += lo
  return rows, key.astype(ids.dtype, copy=False)


def group_rows(ids: np.ndarray) -> Groups:
  """Groups the rows of canonical ``ids`` (:func:`canonical_ids`) with one stable sort."""
  n = ids.shape[0]
  if n == 0:
    raise ValueError("no rows: user_ids is empty")
  fast = _sort_int_ids(ids) if ids.dtype.kind in "iu" else None
  if fast is None:
    perm = np.argsort(ids, kind="stable").astype(_index_dtype(n), copy=False)
    sorted_ids = ids[perm]
  else:
    perm, sorted_ids = fast
  new_user = np.empty(n, bool)
  new_user[0] = True
  np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=new_user[1:])
  start = np.flatnonzero(new_user)
  del new_user
  uniq = sorted_ids[start]
  del sorted_ids
  count = np.diff(np.append(start, n))
  order = np.argsort(perm[start], kind="stable")
  return Groups(perm, start[order], count[order], uniq[order])


def slot_rows(groups: Groups, m: int, *, selection: str, seed: int, lo: int = 0,
              hi: int | None = None) -> np.ndarray:
  """``[hi - lo, m]`` table rows behind the item slots of users ``lo..hi`` (module docstring;
  ``"random"`` keeps ``sort(choice(rows, m, replace=False))``)."""
  hi = groups.n_users if hi is None else hi
  start = groups.start[lo:hi, None].astype(np.int64)
  count = groups.count[lo:hi, None]
  offset = np.broadcast_to(np.arange(m), (hi - lo, m)).copy()
  short = count[:, 0] < m               # only these users wrap around (integer % is slow)
  offset[short] %= count[short]
  rows = groups.rows[start + offset]
  if selection == "random":
    for u in np.flatnonzero(count[:, 0] > m):
      mine = groups.rows[start[u, 0]:start[u, 0] + count[u, 0]].astype(np.int64)
      rng = np.random.default_rng([seed, id_seed(groups.ids[lo + u])])
      rows[u] = np.sort(rng.choice(mine, m, replace=False))
  return rows


def _first_run_length(ids: np.ndarray) -> int:
  """Rows in the leading run of equal ids (chunked: no ``[N]`` temporary)."""
  n, step = ids.shape[0], 1 << 16
  for a in range(0, n, step):
    hit = np.flatnonzero(ids[a:a + step] != ids[0])
    if hit.size:
      return a + int(hit[0])
    step = min(step * 2, _SCAN_ROWS)
  return n


def dense_run_length(ids: np.ndarray, m: int | None = None) -> int | None:
  """``k`` when canonical ``ids`` are ``N / k`` runs of exactly ``k`` equal ids, each run a
  different user (``k = m`` when given, else the first run's length); ``None`` otherwise and
  for ``k = 1``. ``O(N)`` chunked comparisons plus one sort of the run heads."""
  n = ids.shape[0]
  if n == 0 or ids.dtype == object:       # object: ids beyond int64, the general path
    return None
  k = _first_run_length(ids) if m is None else int(m)
  if k <= 1 or n % k:
    return None
  users = max(1, _SCAN_ROWS // k)
  for a in range(0, n // k, users):
    run = ids[a * k:(a + users) * k].reshape(-1, k)
    if not np.all(run[:, 1:] == run[:, :1]):
      return None
  heads = np.sort(ids[::k])
  if np.any(heads[1:] == heads[:-1]):     # a user in two runs: k is not its count
    return None
  return k


def _blocks(n_users: int, m: int, leaves: list[np.ndarray]):
  """``(lo, hi)`` user blocks of about ``_BLOCK_BYTES`` padded bytes over all leaves."""
  per_user = m * sum(leaf.dtype.itemsize * int(np.prod(leaf.shape[1:])) for leaf in leaves)
  step = max(1, _BLOCK_BYTES // max(1, per_user))
  for lo in range(0, n_users, step):
    yield lo, min(n_users, lo + step)


# XLA's CPU client uses a host buffer in place only at this alignment (numpy's is 16)
DEVICE_ALIGNMENT = 64


def aligned_empty(shape: tuple, dtype: Any) -> np.ndarray:
  """``np.empty(shape, dtype)`` aligned to :data:`DEVICE_ALIGNMENT` (no copy on device_put)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + DEVICE_ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % DEVICE_ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def write_padded(leaves: list[np.ndarray], rows_of: Callable[[int, int], np.ndarray],
                 n_users: int, m: int, store: str | os.PathLike | None = None
                 ) -> list[np.ndarray]:
  """The padded leaves ``leaf[rows]`` (``[U, m, ...]``), block by block.

  ``rows_of(lo, hi)`` gives the ``[hi - lo, m]`` slot rows of a block of users. Without
  ``store``: arrays in memory; with it, ``store/leaf_<i>.npy`` files returned as read-only
  memory maps.
  """
  shapes = [(n_users, m) + leaf.shape[1:] for leaf in leaves]
  if store is None:
    outs = [aligned_empty(s, leaf.dtype) for s, leaf in zip(shapes, leaves)]
    for lo, hi in _blocks(n_users, m, leaves):
      rows = rows_of(lo, hi)
      for leaf, out in zip(leaves, outs):
        # mode="clip" writes straight into ``out`` ("raise" buffers a copy); rows are valid.
        np.take(leaf, rows, axis=0, out=out[lo:hi], mode="clip")
    return outs
  paths = [os.path.join(store, f"leaf_{i}.npy") for i in range(len(leaves))]
  files = [open(p, "wb") for p in paths]
  try:
    for f, s, leaf in zip(files, shapes, leaves):
      np.lib.format.write_array_header_2_0(f, {
          "descr": np.lib.format.dtype_to_descr(leaf.dtype), "fortran_order": False, "shape": s})
    for lo, hi in _blocks(n_users, m, leaves):
      rows = rows_of(lo, hi)
      for leaf, f in zip(leaves, files):
        f.write(np.take(leaf, rows, axis=0, mode="clip").data)
  finally:
    for f in files:
      f.close()
  return [np.load(p, mmap_mode="r") for p in paths]


# A store: ``leaf_<i>.npy``, the small arrays' ``.npy`` files and ``meta.json`` (written last,
# atomically: layout, a manifest of every file's size, dtype, shape and SHA-256, and the
# fingerprint). :func:`open_store` refuses a store whose files do not match it.


class StoreIntegrityError(ValueError):
  """A store whose files do not match its manifest, or that has none (names the file)."""


def array_checksum(arr: Any) -> str:
  """SHA-256 of an array's dtype, shape and C-order bytes, streamed in ``CHUNK_BYTES``
  blocks; equal to the checksum of the same array's ``.npy`` file."""
  shape, dtype = tuple(arr.shape), np.dtype(arr.dtype)
  h = hashlib.sha256(_array_tag(dtype, shape))
  if len(shape) == 0:
    _update(h, np.asarray(arr).reshape(1))
    return h.hexdigest()
  row = max(1, dtype.itemsize * int(np.prod(shape[1:])))
  step = max(1, CHUNK_BYTES // row)
  for a in range(0, shape[0], step):
    _update(h, np.asarray(arr[a:a + step]))
  return h.hexdigest()


def fingerprint(entries: list[tuple[str, str | None]], facts: dict[str, Any]) -> str:
  """SHA-256 of a dataset's ``(label, array checksum)`` entries and layout ``facts``. A digest
  of private data: it stays with the data and its checkpoints."""
  body = {"format": FINGERPRINT_FORMAT, "arrays": [list(e) for e in entries], "facts": facts}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def leaf_label(examples_kind: str, name: str) -> str:
  """A leaf's label in :func:`fingerprint` (``"examples" + keystr(path)``, as in memory)."""
  return "examples" if examples_kind == "array" else f"examples[{name!r}]"


def store_facts(m_declared: bool, shard: dict | None = None) -> dict[str, Any]:
  """The facts besides the arrays that :func:`fingerprint` covers."""
  return {"m_declared": bool(m_declared), **({} if shard is None else {"shard": shard})}


def _array_tag(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
  return json.dumps([dtype.str, [int(d) for d in shape]]).encode()


def _update(h: Any, block: np.ndarray) -> None:
  if block.dtype == object:     # ids beyond int64: their values, not the object pointers
    h.update(repr(block.tolist()).encode())
  else:
    h.update(np.ascontiguousarray(block).data)


def prepare_store(store: str | os.PathLike, examples_kind: str, names: list[str]) -> None:
  """Creates ``store`` (a new or empty directory) for :func:`save_store_meta`."""
  if examples_kind not in ("dict", "array"):
    raise TypeError("a store holds examples that are one array or a flat dict of arrays, "
                    f"got {examples_kind}")
  os.makedirs(store, exist_ok=True)
  if os.listdir(store):
    raise FileExistsError(f"store {os.fspath(store)!r} is not empty: give a new directory")


def save_store_meta(store: str | os.PathLike, *, examples_kind: str, names: list[str],
                    arrays: dict[str, np.ndarray], m_declared: bool) -> None:
  """The small arrays, then ``meta.json`` with the manifest (last and atomic: a store with
  ``meta.json`` is complete); checksums are of the files as re-read from disk."""
  for name, arr in arrays.items():
    if arr.dtype == object:
      raise TypeError(f"a store cannot hold object-dtype {name} (ids beyond int64?)")
    np.save(os.path.join(store, f"{name}.npy"), arr, allow_pickle=False)
  meta = {"format": STORE_FORMAT, "examples": examples_kind, "names": names,
          "arrays": sorted(arrays), "m_declared": bool(m_declared),
          "manifest": [_describe(store, f) for f in _store_files(len(names), sorted(arrays))]}
  meta["fingerprint"] = _meta_fingerprint(meta)
  tmp = os.path.join(store, ".meta.json.tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f)
  os.replace(tmp, os.path.join(store, "meta.json"))


def _meta_fingerprint(meta: dict[str, Any]) -> str:
  """:func:`fingerprint` of a store's files as its ``meta.json`` lists them."""
  labels = [leaf_label(meta["examples"], n) for n in meta["names"]] + list(meta["arrays"])
  return fingerprint([(label, e["sha256"]) for label, e in zip(labels, meta["manifest"])],
                     store_facts(meta["m_declared"]))


def _store_files(n_leaves: int, arrays: list[str]) -> list[str]:
  return [f"leaf_{i}.npy" for i in range(n_leaves)] + [f"{a}.npy" for a in arrays]


def _describe(store: str | os.PathLike, name: str) -> dict[str, Any]:
  """A manifest entry: name, size, dtype, shape and the array's checksum."""
  path = os.path.join(store, name)
  offset, shape, dtype = _npy_layout(path, name)
  return {"file": name, "size": os.path.getsize(path), "dtype": dtype.str,
          "shape": list(shape), "sha256": _file_checksum(path, offset, shape, dtype)}


def _npy_layout(path: str, name: str) -> tuple[int, tuple[int, ...], np.dtype]:
  """``(data offset, shape, dtype)`` from a ``.npy`` header (refused: not C order, objects)."""
  try:
    with open(path, "rb") as f:
      read = _HEADER_READERS.get(np.lib.format.read_magic(f))
      if read is None:
        raise ValueError("unsupported .npy version")
      shape, fortran, dtype = read(f)
      offset = f.tell()
  except (ValueError, OSError, SyntaxError, TypeError) as err:
    raise StoreIntegrityError(f"store file {name} is not a readable .npy array ({err}): the "
                              "store is damaged; rewrite it") from err
  if fortran or dtype.hasobject:
    raise StoreIntegrityError(f"store file {name} is not a C-order array of plain values")
  return offset, tuple(shape), dtype


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,   # np.save's
                   (2, 0): np.lib.format.read_array_header_2_0}   # write_padded's


def _file_checksum(path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> str:
  """:func:`array_checksum` of a ``.npy`` file's array, read in ``CHUNK_BYTES`` blocks."""
  h = hashlib.sha256(_array_tag(dtype, shape))
  with open(path, "rb") as f:
    f.seek(offset)
    while block := f.read(CHUNK_BYTES):
      h.update(block)
  return h.hexdigest()


def open_store(store: str | os.PathLike, *, verify: bool = True
               ) -> tuple[Any, dict[str, np.ndarray], bool, str]:
  """``(examples, small arrays, m_declared, fingerprint)`` of a store, leaves as read-only
  memory maps.

  Checked first (:class:`StoreIntegrityError`, naming the file): ``meta.json`` against its
  fingerprint, exactly the manifest's files, each one's size, dtype, shape and checksum.
  ``verify=False`` skips the *leaves'* checksums only (for processes opening a store another
  has verified).
  """
  meta = _read_meta(store)
  files = _store_files(len(meta["names"]), meta["arrays"])
  _check_manifest(store, meta, files)
  n_leaves = len(meta["names"])
  for i, entry in enumerate(meta["manifest"]):
    _check_file(store, entry, checksum=verify or i >= n_leaves)
  leaves = [np.load(os.path.join(store, f), mmap_mode="r") for f in files[:n_leaves]]
  examples = (leaves[0] if meta["examples"] == "array"
              else dict(zip(meta["names"], leaves)))
  arrays = {name: np.load(os.path.join(store, f"{name}.npy"), allow_pickle=False)
            for name in meta["arrays"]}
  return examples, arrays, bool(meta["m_declared"]), meta["fingerprint"]


def _read_meta(store: str | os.PathLike) -> dict[str, Any]:
  meta_path = os.path.join(store, "meta.json")
  if not os.path.exists(meta_path):
    raise FileNotFoundError(f"{os.fspath(store)!r} is not a complete UserData store (no "
                            "meta.json): build it with UserData.from_arrays(..., store=...)")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (ValueError, UnicodeDecodeError) as err:
    raise StoreIntegrityError(f"meta.json of store {os.fspath(store)!r} is not valid JSON "
                              f"({err}): the store is damaged; rewrite it") from err
  fmt = meta.get("format") if isinstance(meta, dict) else None
  if fmt in _OLD_FORMATS:
    raise StoreIntegrityError(
        f"store {os.fspath(store)!r} was written in format {fmt}, which has no manifest: its "
        "files cannot be checked against what was written, so it is refused; rewrite it with "
        "UserData.from_arrays(..., store=<new directory>)")
  if fmt != STORE_FORMAT:
    raise StoreIntegrityError(f"unknown store format {fmt!r} in meta.json; expected "
                              f"{STORE_FORMAT}")
  want = {"examples": str, "names": list, "arrays": list, "m_declared": bool,
          "manifest": list, "fingerprint": str}
  bad = [k for k, t in want.items() if not isinstance(meta.get(k), t)]
  bad += [] if meta.get("arrays") == list(STORE_ARRAYS) else ["arrays"]
  if bad or not all(isinstance(e, dict) for e in meta["manifest"]):
    raise StoreIntegrityError(f"meta.json of store {os.fspath(store)!r} is malformed "
                              f"(fields {bad or ['manifest']}): it was edited; rewrite the store")
  return meta


def _check_manifest(store: str | os.PathLike, meta: dict[str, Any], files: list[str]) -> None:
  """meta.json agrees with its fingerprint and the directory holds exactly its files."""
  listed = [e.get("file") for e in meta["manifest"]]
  if listed != files:
    raise StoreIntegrityError(
        f"meta.json names {len(meta['names'])} leaves and arrays {meta['arrays']}, i.e. files "
        f"{files}, but its manifest lists {listed}: meta.json was edited; rewrite the store")
  try:
    recomputed = _meta_fingerprint(meta)
  except (KeyError, TypeError) as err:
    raise StoreIntegrityError(f"meta.json's manifest is malformed ({err!r}): rewrite the "
                              "store") from err
  if recomputed != meta["fingerprint"]:
    raise StoreIntegrityError("meta.json does not match its fingerprint: its layout (names, "
                              "examples, arrays, m_declared) or manifest was edited; rewrite "
                              "the store")
  present = set(os.listdir(store)) - {"meta.json"}
  missing = [f for f in files if f not in present]
  if missing:
    raise StoreIntegrityError(f"store {os.fspath(store)!r} is missing {missing} listed in its "
                              "manifest")
  extra = sorted(present - set(files))
  if extra:
    raise StoreIntegrityError(f"store {os.fspath(store)!r} holds {extra}, which its manifest "
                              "does not list (a leaf meta.json forgot, or a stray file): "
                              "refusing to guess; rewrite the store or remove them")


def _check_file(store: str | os.PathLike, entry: dict[str, Any], *, checksum: bool) -> None:
  """One file against its manifest entry: size, dtype and shape always, then its checksum."""
  name = entry["file"]
  path = os.path.join(store, name)
  size = os.path.getsize(path)
  if size != entry.get("size"):
    raise StoreIntegrityError(f"store file {name} is {size} bytes, its manifest says "
                              f"{entry.get('size')}: it was truncated, extended or replaced")
  offset, shape, dtype = _npy_layout(path, name)
  if dtype.str != entry.get("dtype") or list(shape) != entry.get("shape"):
    raise StoreIntegrityError(f"store file {name} holds {dtype.str} {list(shape)}, its manifest "
                              f"says {entry.get('dtype')} {entry.get('shape')}: it was replaced")
  if offset + dtype.itemsize * int(np.prod(shape)) != size:
    raise StoreIntegrityError(f"store file {name} is {size} bytes, not the header plus its "
                              f"{list(shape)} {dtype.str} array: it is damaged")
  if checksum and _file_checksum(path, offset, shape, dtype) != entry.get("sha256"):
    raise StoreIntegrityError(f"store file {name} does not match its checksum in the manifest: "
                              "its contents were edited, or it was swapped with another file")
