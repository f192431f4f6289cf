"""User-partitioned data: arrays plus a user-id column -> padded, static-shape user batches.

:class:`UserData` holds leaves ``[U, m, ...]``: ``U`` users (in order of first appearance) and
``m = max_items_per_user`` item slots. ``m`` bounds one user's contribution: a user with more
items keeps ``m`` of them, chosen from that user's own rows and id only, so user-level
neighbours stay neighbours (item-level guarantees do not survive it: item-level algorithms
refuse data with dropped items). Empty slots hold copies of the user's own items with weight
0. Algorithms see ``{"example", "weight"}`` views through :func:`weighted_loss`, so padding
cannot be forgotten. :meth:`UserData.shard` keeps one process's users while
:attr:`UserData.spec` states the whole dataset's facts.

Only :class:`DataSpec` is read by a plan; under ``add_remove`` the number of users is private
and a plan reads the *declared* ``n_users`` instead (:mod:`dpsco_jax.privacy.relations`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_bool
from dpsco_jax.cache import bounded_cache
from dpsco_jax.data import grouping
from dpsco_jax.data.grouping import canonical_ids

__all__ = ["DataSpec", "FACTS", "ShardInfo", "UserData", "weighted_loss"]

SELECTIONS = ("random", "first")
#: The facts a :class:`DataSpec` holds that a plan may read (see :attr:`DataSpec.measured`).
FACTS = ("n_users", "max_items_per_user")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """The public facts about a dataset that a data-free plan may read.

  Attributes:
    n_users: users in the data (public under ``replace_one`` / ``zero_out``; under
      ``add_remove`` plans use the config's declared ``n_users`` instead).
    max_items_per_user: item slots per user ``m``, the per-user contribution bound.
    item_shapes: ``(path, shape, dtype)`` of one item's leaves.
    measured: which of :data:`FACTS` were *measured on the data* rather than declared; a plan
      whose privacy reads a fact its relation does not make public refuses a measured one
      (:func:`dpsco_jax.plan`). :attr:`UserData.spec` marks ``n_users`` measured, and
      ``max_items_per_user`` unless it was given to :meth:`UserData.from_arrays`.
  """
  n_users: int
  max_items_per_user: int
  item_shapes: tuple[tuple[str, tuple[int, ...], str], ...] = ()
  measured: frozenset = frozenset()

  def __post_init__(self):
    for name in FACTS:
      _check_int(getattr(self, name), f"DataSpec.{name}", minimum=1)
    measured = frozenset(self.measured)
    unknown = measured - set(FACTS)
    if unknown:
      raise ValueError(f"DataSpec.measured names unknown facts {sorted(unknown)}; facts: "
                       f"{FACTS}")
    object.__setattr__(self, "measured", measured)

  def declared(self, fact: str) -> bool:
    """Whether ``fact`` was declared rather than measured on the data.

    Args:
      fact: ``"n_users"`` or ``"max_items_per_user"``.

    Returns:
      True when declared (ValueError: ``fact`` is not one of :data:`FACTS`).
    """
    if fact not in FACTS:
      raise ValueError(f"unknown fact {fact!r}; facts: {FACTS}")
    return fact not in self.measured


#: How :meth:`UserData.shard` splits users over processes.
SHARD_LAYOUTS = ("contiguous", "strided")


def _check_int(v: Any, name: str, minimum: int | None = None) -> int:
  """``int(v)`` for an int (bools refused: TypeError), ``>= minimum`` (ValueError)."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {v!r}")
  if minimum is not None and v < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {v}")
  return int(v)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
  """Which users of a ``n_users_total``-user dataset one process holds.

  ``contiguous``: process ``p`` holds users ``[floor(p n / count), floor((p+1) n / count))``
  (a memory map's slice stays a memory map); ``strided``: users ``p, p + count, ...``. The
  shards partition the users, and positions depend on ``(layout, n_users_total, count)``
  alone, so every process maps a global sample to its own users without communicating.
  """
  index: int
  count: int
  n_users_total: int
  layout: str = "contiguous"

  def __post_init__(self):
    for name in ("index", "count", "n_users_total"):
      object.__setattr__(self, name, _check_int(getattr(self, name), f"ShardInfo.{name}"))
    if self.count < 1 or not 0 <= self.index < self.count:
      raise ValueError(f"shard index must be in [0, count={self.count}), got {self.index}")
    if self.n_users_total < self.count:
      raise ValueError(f"{self.n_users_total} users cannot be split over {self.count} "
                       "processes: every process needs at least one user")
    if self.layout not in SHARD_LAYOUTS:
      raise ValueError(f"layout must be one of {SHARD_LAYOUTS}, got {self.layout!r}")

  def bounds(self) -> np.ndarray:
    """``[count + 1]`` start positions of the contiguous shards (``bounds[-1] = n``)."""
    return np.arange(self.count + 1, dtype=np.int64) * self.n_users_total // self.count

  def positions(self, process: int | None = None) -> np.ndarray:
    """Global positions of process ``process``'s users (default: this shard's), in order."""
    p = self.index if process is None else int(process)
    if self.layout == "strided":
      return np.arange(p, self.n_users_total, self.count, dtype=np.int64)
    b = self.bounds()
    return np.arange(b[p], b[p + 1], dtype=np.int64)

  def size(self, process: int | None = None) -> int:
    """Users held by process ``process`` (default: this shard)."""
    return len(self.positions(process))

  def owner(self, positions: np.ndarray) -> np.ndarray:
    """The process holding each global position."""
    positions = np.asarray(positions, np.int64)
    if self.layout == "strided":
      return positions % self.count
    return np.searchsorted(self.bounds(), positions, side="right") - 1

  def local(self, positions: np.ndarray) -> np.ndarray:
    """Local row of each global position (all held by its owner: see :meth:`owner`)."""
    positions = np.asarray(positions, np.int64)
    if self.layout == "strided":
      return positions // self.count
    return positions - self.bounds()[self.owner(positions)]


def _columns(table: Any, columns: Sequence[str] | None, user_column: str
             ) -> tuple[Any, dict[str, Any]]:
  """``(user ids, {column: values})`` of a pandas DataFrame, a ``datasets.Dataset`` or a
  mapping (the ids apart: under a key of the columns' dict, a column of that name would
  replace them)."""
  if hasattr(table, "column_names"):          # datasets.Dataset
    names = list(table.column_names)
  elif hasattr(table, "columns"):             # pandas.DataFrame
    names = [str(c) for c in table.columns]
  elif isinstance(table, Mapping):
    names = list(table)
  else:
    raise TypeError("table must be a pandas DataFrame, a datasets.Dataset or a mapping of "
                    f"column name -> array, got {type(table).__name__}")
  if user_column not in names:
    raise ValueError(f"user_column {user_column!r} is not a column; columns: {names}")
  if isinstance(columns, str):   # one name, not its letters
    columns = [columns]
  wanted = [c for c in names if c != user_column] if columns is None else list(columns)
  for c in wanted:
    if c not in names:
      raise ValueError(f"column {c!r} is not in the table; columns: {names}")
  def col(c):
    v = table[c]
    return _as_leaf(v.to_numpy() if hasattr(v, "to_numpy") else v, f"column {c!r}")
  # ids go to canonical_ids as they are: np.asarray would turn [1, "1"] into one user
  users = table[user_column]
  users = users.to_numpy() if hasattr(users, "to_numpy") else users
  return users, {c: col(c) for c in wanted}


@bounded_cache()
def weighted_loss(loss_fn: Callable) -> Callable:
  """``loss_fn`` -> ``weight * loss_fn(params, ex["example"])`` for the ``{"example",
  "weight"}`` views of :class:`UserData` (cached per ``loss_fn``: compiled loops are reused).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar``, the loss of one item.

  Returns:
    ``loss(params, ex)`` for ``ex = {"example": ..., "weight": ...}``: the weighted loss. Called
    on an item whose loss is not a scalar it raises ``ValueError``.
  """
  def loss(params, ex):
    value = loss_fn(params, ex["example"])
    if jnp.ndim(value) != 0:
      raise ValueError(f"loss_fn must return a scalar per item, got shape {jnp.shape(value)}")
    return ex["weight"] * value
  loss.__name__ = f"weighted_{getattr(loss_fn, '__name__', 'loss')}"
  return loss


def _as_leaf(value: Any, label: str) -> np.ndarray:
  """``value`` as a numpy array of plain values, or an error naming ``label`` (numpy's own,
  and the padding's on object arrays, name no column)."""
  try:
    arr = np.asarray(value)
  except ValueError as err:
    raise ValueError(f"{label} is ragged (its rows have different shapes: {err}); pad its "
                     "values to one shape first") from err
  if arr.dtype.hasobject:
    raise TypeError(f"{label} has dtype object (mixed kinds, None, or ragged rows): convert "
                    "it to one numeric (or string) dtype first")
  return arr


def require_numeric(examples: Any, what: str = "data") -> None:
  """Raises ``TypeError`` naming the first leaf of objects, strings or dates: whatever reads
  the examples on the device fails on it, and JAX's own error names no leaf."""
  for path, x in jax.tree_util.tree_flatten_with_path(examples)[0]:
    dt = getattr(x, "dtype", None)
    if getattr(dt, "kind", None) in tuple("OUSMm"):
      raise TypeError(f"{what}{jax.tree_util.keystr(path)} has dtype {dt}: every leaf of the "
                      "data goes to the device, which holds numbers only; drop it (e.g. "
                      "UserData.from_table(..., columns=[...]))")


def _int_vector(value: Any, name: str, u: int) -> np.ndarray:
  """``value`` as an integer array ``[u]`` (bools and floats refused: counts are integers)."""
  arr = np.asarray(value)
  if arr.dtype == bool or arr.dtype.kind not in "iu":
    raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
  if arr.shape != (u,):
    raise ValueError(f"{name} must have shape [U={u}], got {arr.shape}")
  return arr


def _dense_view(leaf: np.ndarray, k: int) -> np.ndarray:
  """``leaf`` ``[N, ...]`` as a read-only ``[N / k, k, ...]`` view."""
  view = leaf.reshape((leaf.shape[0] // k, k) + leaf.shape[1:])
  view.flags.writeable = False
  return view


def _examples_layout(examples: Any) -> tuple[str, list[str]]:
  """``("array", ["examples"])`` or ``("dict", keys)``: the layouts a store can rebuild."""
  if isinstance(examples, Mapping):
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(examples)[0]]
    names = [getattr(p[0], "key", None) for p in paths]
    if all(len(p) == 1 for p in paths) and all(isinstance(k, str) for k in names):
      return "dict", names
    if all(len(p) == 1 for p in paths):   # said exactly: the refusal names what to change
      return f"a dict with keys that are not strings ({names[:3]})", []
    return "a nested dict", []
  elif not isinstance(examples, (list, tuple)):
    return "array", ["examples"]
  return f"a {type(examples).__name__} (use a dict of named arrays)", []


@dataclasses.dataclass(frozen=True, eq=False)
class UserData:
  """Padded user-partitioned data (build with :meth:`from_arrays` or :meth:`from_table`).

  Attributes:
    examples: pytree whose leaves are ``[U, m, ...]`` numpy arrays.
    item_mask: bool ``[U, m]``, True on real items.
    user_ids: ``[U]`` the users' ids, in order of first appearance.
    n_items: ``[U]`` real items kept per user (``<= m``).
    n_dropped: ``[U]`` items beyond the bound that were not kept (data-dependent, never
      released; item-level algorithms refuse data with dropped items).
    m_declared: whether ``m`` is a declared bound (``max_items_per_user`` given) or the
      largest user's measured count (which plans that read ``m`` refuse).
    shard_info: set by :meth:`shard` (``None``: every user).
  """
  examples: Any
  item_mask: np.ndarray
  user_ids: np.ndarray
  n_items: np.ndarray
  n_dropped: np.ndarray | None = None
  m_declared: bool = False
  shard_info: ShardInfo | None = None

  def __post_init__(self):
    # a hand-built UserData gets from_arrays's guarantees: a user twice in a batch would
    # contribute twice
    mask = self.item_mask
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or mask.dtype != bool:
      raise ValueError("item_mask must be a bool array [U, m], got "
                       f"{getattr(mask, 'dtype', type(mask).__name__)} "
                       f"{getattr(mask, 'shape', '')}")
    u, m = mask.shape
    if u == 0:
      raise ValueError("no users: a UserData needs at least one user (empty table or "
                       "empty selection?)")
    if m == 0:
      raise ValueError("max_items_per_user is 0: a UserData needs at least one item slot")
    leaves = jax.tree.leaves(self.examples)
    if not leaves:
      raise ValueError("examples must hold at least one array")
    for leaf in leaves:
      if leaf.shape[:2] != (u, m):
        raise ValueError(f"every examples leaf must be shaped [U={u}, m={m}, ...], got "
                         f"{leaf.shape}")
    ids = canonical_ids(self.user_ids)
    if ids.shape[0] != u:
      raise ValueError(f"user_ids has {ids.shape[0]} ids for {u} users")
    srt = np.sort(ids)
    dup = srt[1:][srt[1:] == srt[:-1]]
    if dup.size:
      raise ValueError(f"user_ids must be unique: {dup[:3].tolist()} appear more than once "
                       "(one user in two rows would contribute twice)")
    object.__setattr__(self, "user_ids", ids)
    n_items = _int_vector(self.n_items, "n_items", u)
    object.__setattr__(self, "n_items", n_items)
    if np.any(n_items < 1) or np.any(mask.sum(1) != n_items):
      raise ValueError("every user needs >= 1 item and item_mask must agree with n_items")
    if self.n_dropped is not None:
      n_dropped = _int_vector(self.n_dropped, "n_dropped", u)
      if np.any(n_dropped < 0):
        raise ValueError("n_dropped must be >= 0 (items beyond the bound that were not kept)")
      object.__setattr__(self, "n_dropped", n_dropped)
    if self.shard_info is not None:
      if not isinstance(self.shard_info, ShardInfo):
        raise TypeError(f"shard_info must be a ShardInfo, got {type(self.shard_info).__name__}")
      if self.shard_info.size() != u:
        raise ValueError(f"shard {self.shard_info.index} of {self.shard_info.count} should hold "
                         f"{self.shard_info.size()} users, it holds {u}")

  @classmethod
  def from_arrays(cls, examples: Any, user_ids: Any, *, max_items_per_user: int | None = None,
                  selection: str = "random", seed: int = 0,
                  store: str | os.PathLike | None = None) -> "UserData":
    """Groups rows by user id: one sort, ``O(N log N)`` for ``N`` rows.

    Args:
      examples: a pytree whose leaves are ``[N, ...]`` arrays, one row per item (read, never
        copied whole). When every user has exactly ``m`` contiguous rows the result's leaves
        are read-only *views* of these arrays: writing into them changes the data.
      user_ids: ``[N]`` the user of each row: all ints, all strings (or bytes), or all
        finite whole-number floats (``NaN``/``None``, bools and mixed kinds are refused).
      max_items_per_user: the contribution bound ``m`` (default: the largest user's count).
      selection: which items a user with more than ``m`` keeps: ``"random"`` (a uniform
        subset seeded by ``seed`` and a hash of the user's id) or ``"first"``.
      seed: seed of the ``"random"`` selection.
      store: a new (or empty) directory to write the padded leaves to, read back as memory
        maps (:meth:`open` reopens it); examples must be one array or a flat dict of arrays.

    Returns:
      The padded, user-grouped :class:`UserData`.

    Raises:
      ValueError, TypeError: bad ``selection``, ``max_items_per_user`` or leaf shapes; ids
        refused by :func:`~dpsco_jax.data.grouping.canonical_ids`; examples a store cannot hold.
      FileExistsError: ``store`` is a directory that is not empty (nothing is overwritten).
    """
    if selection not in SELECTIONS:
      raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    paths, treedef = jax.tree_util.tree_flatten_with_path(examples)
    if not paths:
      raise ValueError("examples must hold at least one array")
    leaves = [_as_leaf(x, "examples" + jax.tree_util.keystr(p)) for p, x in paths]
    ids = canonical_ids(user_ids)
    n = ids.shape[0]
    if n == 0:
      raise ValueError("no rows: user_ids is empty")
    for (path, _), leaf in zip(paths, leaves):
      if leaf.ndim < 1 or leaf.shape[0] != n:
        raise ValueError(f"every examples leaf needs a leading row axis of length {n} "
                         f"(= len(user_ids)), got shape {leaf.shape} for "
                         f"examples{jax.tree_util.keystr(path)}")
    m = (None if max_items_per_user is None
         else _check_int(max_items_per_user, "max_items_per_user", minimum=1))
    _check_int(seed, "seed", minimum=0)   # numpy's own refusal names no parameter
    if store is not None:
      kind, names = _examples_layout(examples)
      grouping.prepare_store(store, kind, names)
    k = grouping.dense_run_length(ids, m)
    if k is not None:
      # dense: every user k contiguous rows, slot j of the u-th user is row u k + j
      m, user_ids = k, ids[::k].copy()
      counts = np.full(n // k, k, np.intp)
      if store is None:
        padded = [_dense_view(leaf, k) for leaf in leaves]
      else:
        padded = grouping.write_padded(
            leaves, lambda lo, hi: np.arange(lo * k, hi * k).reshape(hi - lo, k),
            n // k, k, store)
    else:
      groups = grouping.group_rows(ids)
      counts, user_ids = groups.count, groups.ids
      m = int(counts.max()) if m is None else m
      if store is None and m == 1 and groups.n_users == n:
        padded = [_dense_view(leaf, 1) for leaf in leaves]   # one row per user, in order
      else:
        padded = grouping.write_padded(
            leaves, lambda lo, hi: grouping.slot_rows(groups, m, selection=selection,
                                                      seed=seed, lo=lo, hi=hi),
            groups.n_users, m, store)
    kept = np.minimum(counts, m)
    mask = np.arange(m)[None, :] < kept[:, None]
    data = cls(jax.tree.unflatten(treedef, padded), mask, user_ids, kept, counts - kept,
               m_declared=max_items_per_user is not None)
    if store is not None:
      grouping.save_store_meta(store, examples_kind=kind, names=names, arrays={
          "item_mask": mask, "user_ids": user_ids, "n_items": kept,
          "n_dropped": counts - kept}, m_declared=data.m_declared)
    return data

  @classmethod
  def open(cls, store: str | os.PathLike, *, verify: bool = True) -> "UserData":
    """A UserData written by ``from_arrays(..., store=store)``, every file first checked
    against the store's manifest (:func:`~dpsco_jax.data.grouping.open_store`).

    Args:
      store: the directory written by ``from_arrays(..., store=store)``.
      verify: check every leaf's checksum (default True; ``False``, e.g. on the other
        processes once one has verified the store, still checks sizes, dtypes and shapes).

    Returns:
      The :class:`UserData` whose leaves are read-only memory maps of the store's files.

    Raises:
      StoreIntegrityError: a file was edited, truncated, swapped, added or removed, or
        ``meta.json`` is malformed or of an old format (the message names the file).
      FileNotFoundError: ``store`` is not a complete store (no ``meta.json``).
    """
    examples, arrays, m_declared, digest = grouping.open_store(
        store, verify=check_bool(verify, "verify"))
    data = cls(examples, arrays["item_mask"], arrays["user_ids"], arrays["n_items"],
               arrays["n_dropped"], m_declared=m_declared)
    object.__setattr__(data, "_store_fingerprint", digest)
    return data

  _store_fingerprint = None  # set by open only: select/shard hold other arrays

  @property
  def fingerprint(self) -> str:
    """A SHA-256 of this dataset's arrays and ``m_declared``, the same in memory and in a
    store (computed on each access unless opened from one); a checkpoint records it so training
    resumes only on its data. A digest of private data: never publish it."""
    if self._store_fingerprint is not None:
      return self._store_fingerprint
    entries = [("examples" + jax.tree_util.keystr(path), grouping.array_checksum(leaf))
               for path, leaf in jax.tree_util.tree_flatten_with_path(self.examples)[0]]
    for name in grouping.STORE_ARRAYS:
      value = getattr(self, name)
      entries.append((name, None if value is None else grouping.array_checksum(value)))
    shard = None if self.shard_info is None else dataclasses.asdict(self.shard_info)
    return grouping.fingerprint(entries, grouping.store_facts(self.m_declared, shard))

  @classmethod
  def from_table(cls, table: Any, *, user_column: str, columns: Sequence[str] | None = None,
                 max_items_per_user: int | None = None, selection: str = "random",
                 seed: int = 0, store: str | os.PathLike | None = None) -> "UserData":
    """From a pandas ``DataFrame``, a ``datasets.Dataset`` or a mapping of columns.

    Args:
      table: a pandas ``DataFrame``, a ``datasets.Dataset`` or a mapping of column name to array.
      user_column: the column holding each row's user id.
      columns: the columns that make an item, a list or one name (default: every column but
        ``user_column``).
      max_items_per_user: as :meth:`from_arrays`.
      selection: as :meth:`from_arrays`.
      seed: as :meth:`from_arrays`.
      store: as :meth:`from_arrays`.

    Returns:
      The :class:`UserData` with examples ``{column: [U, m, ...]}``.

    Raises:
      TypeError, ValueError: ``table`` is not a DataFrame, a Dataset or a mapping, or lacks a
        named column; as :meth:`from_arrays`.
    """
    users, cols = _columns(table, columns, user_column)
    return cls.from_arrays(cols, users, max_items_per_user=max_items_per_user,
                           selection=selection, seed=seed, store=store)

  @property
  def n_users(self) -> int:
    return int(self.item_mask.shape[0])

  @property
  def max_items_per_user(self) -> int:
    return int(self.item_mask.shape[1])

  def __len__(self) -> int:
    return self.n_users

  @property
  def spec(self) -> DataSpec:
    shapes = tuple((jax.tree_util.keystr(path), tuple(leaf.shape[2:]), str(leaf.dtype))
                   for path, leaf in jax.tree_util.tree_flatten_with_path(self.examples)[0])
    measured = {"n_users"} | (set() if self.m_declared else {"max_items_per_user"})
    # a shard states the whole dataset's facts: a plan never depends on the process
    n = self.n_users if self.shard_info is None else self.shard_info.n_users_total
    return DataSpec(n, self.max_items_per_user, shapes, frozenset(measured))

  def user_view(self) -> dict:
    """``{"example", "weight"}`` with ``weight = m / k_u`` on real items (the slot mean is the
    mean over the user's real items).

    Returns:
      ``{"example": leaves [U, m, ...] on the device, "weight": float32 [U, m]}``.
    """
    # equal to the float64 [U, m] product cast to float32, without its temporary
    w = self.item_mask * (self.max_items_per_user / self.n_items).astype(np.float32)[:, None]
    # device_put, not jnp.asarray: on CPU an aligned leaf is used in place
    return {"example": jax.tree.map(jax.device_put, self.examples),
            "weight": jax.device_put(w)}

  def item_view(self) -> dict:
    """``{"example", "weight"}`` with weight 1 on real items, 0 on padding.

    Returns:
      ``{"example": leaves [U, m, ...] on the device, "weight": float32 [U, m]}``.
    """
    return {"example": jax.tree.map(jax.device_put, self.examples),   # as user_view
            "weight": jnp.asarray(self.item_mask, jnp.float32)}

  def select(self, users: Any) -> "UserData":
    """The users at positions ``users``, e.g. a train/test split of users.

    Args:
      users: an integer index array of user positions, or a bool mask of shape ``[U]``.

    Returns:
      A new :class:`UserData` of those users (same ``m`` and ``m_declared``).

    Raises:
      IndexError: a position is out of range, or the mask's shape is not ``[U]``.
    """
    pos = np.asarray(users)
    if pos.size == 0:   # np.asarray([]) is float: an empty selection, not a type error
      pos = pos.astype(np.intp)
    try:
      idx = np.arange(self.n_users)[pos]
    except IndexError as err:   # numpy's message names neither the argument nor its kind
      raise IndexError(f"users must be positions in [0, {self.n_users}) or a bool mask of "
                       f"shape ({self.n_users},), not user ids (for ids: "
                       f"np.flatnonzero(np.isin(data.user_ids, ids))); {err}") from err
    return self._take(jax.tree.map(lambda x: np.asarray(x)[idx], self.examples), idx)

  def _take(self, examples: Any, take: Any, shard_info: ShardInfo | None = None
            ) -> "UserData":
    """The users ``take`` of every array but ``examples`` (already taken)."""
    return UserData(examples, self.item_mask[take], self.user_ids[take], self.n_items[take],
                    None if self.n_dropped is None else self.n_dropped[take],
                    m_declared=self.m_declared, shard_info=shard_info)

  def shard(self, process_index: int, process_count: int, *,
            layout: str = "contiguous") -> "UserData":
    """The users process ``process_index`` of ``process_count`` holds in a ``jax.distributed``
    run (:class:`ShardInfo`). The result's arrays are the shard's; its :attr:`spec` is the
    whole dataset's, so a plan made on any process is the one-process plan.

    Args:
      process_index: this process's index, in ``[0, process_count)``
        (``jax.process_index()``).
      process_count: the number of processes (``jax.process_count()``).
      layout: ``"contiguous"`` (default: consecutive blocks of users) or ``"strided"``.

    Returns:
      The shard's :class:`UserData`, with ``shard_info`` set.

    Raises:
      ValueError: this data is already a shard; ``process_index`` out of range; fewer users
        than processes; an unknown ``layout``.
      TypeError: ``process_index`` or ``process_count`` is not an int.
    """
    if self.shard_info is not None:
      raise ValueError("this UserData is already shard "
                       f"{self.shard_info.index} of {self.shard_info.count}: shard the whole "
                       "data instead")
    info = ShardInfo(_check_int(process_index, "process_index"),
                     _check_int(process_count, "process_count"), self.n_users, layout)
    if layout == "contiguous":
      lo, hi = (int(b) for b in info.bounds()[info.index:info.index + 2])
      take = slice(lo, hi)          # views: memory maps stay memory maps
    else:
      take = info.positions()
    return self._take(jax.tree.map(lambda x: x[take], self.examples), take, info)

  def require_all_items(self, who: str) -> None:
    """Raises unless every item was kept: an item-level guarantee (``who``) does not cover
    items dropped by ``max_items_per_user``.

    Args:
      who: the algorithm name the message states.

    Raises:
      ValueError: items were dropped by ``max_items_per_user``.
    """
    if self.n_dropped is not None and self.n_dropped.any():
      raise ValueError(f"{who} gives an item-level guarantee, which does not cover items "
                       "dropped by max_items_per_user (one added or removed item can change "
                       "several kept ones): build the UserData without a smaller "
                       "max_items_per_user, or use a user-level algorithm")

  def items(self) -> Any:
    """Every real item, flattened (e.g. for evaluation).

    Returns:
      A pytree of numpy arrays with leaves ``[sum k_u, ...]``.
    """
    return jax.tree.map(lambda x: np.asarray(x)[self.item_mask], self.examples)

  def __repr__(self) -> str:  # sizes only: never the data
    shard = ("" if self.shard_info is None else
             f", shard={self.shard_info.index}/{self.shard_info.count} of "
             f"{self.shard_info.n_users_total} users")
    return (f"UserData(n_users={self.n_users}, max_items_per_user={self.max_items_per_user}, "
            f"items={int(self.n_items.sum())}{shard})")
