"""UserData at scale (issue 24): the one-sort builder keeps exactly the items the old per-user
builder kept, and the on-disk store gives the same data as memory maps."""

import hashlib
import os

import numpy as np
import pytest

from dpsco_jax.data import UserData
from dpsco_jax.data import grouping


def _old_id_seed(user_id):
  value = user_id.item() if hasattr(user_id, "item") else user_id
  return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little")


def _old_from_arrays(leaves, user_ids, m=None, selection="random", seed=0):
  """The O(U N) builder before issue 24 (commit 3c6c15c), verbatim but for the return value:
  ``(padded leaves, mask, ids, kept, dropped)``. The reference the new builder must match."""
  leaves = [np.asarray(x) for x in leaves]
  ids = np.asarray(user_ids)
  uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
  order = np.argsort(first, kind="stable")
  rank = np.empty_like(order)
  rank[order] = np.arange(order.size)
  user_of_row = rank[inverse.reshape(-1)]
  rows_of = [np.flatnonzero(user_of_row == u) for u in range(order.size)]
  counts = np.array([r.size for r in rows_of])
  m = int(counts.max()) if m is None else m
  slots = np.empty((order.size, m), np.int64)
  kept = np.minimum(counts, m)
  for u, rows in enumerate(rows_of):
    if rows.size > m:
      rng = np.random.default_rng([seed, _old_id_seed(uniq[order[u]])])
      rows = (np.sort(rng.choice(rows, m, replace=False))
              if selection == "random" else rows[:m])
    slots[u] = rows[np.arange(m) % rows.size]
  mask = np.arange(m)[None, :] < kept[:, None]
  return [leaf[slots] for leaf in leaves], mask, uniq[order], kept, counts - kept


def _table(rng, n_rows, n_users, id_kind):
  """Rows with a skewed number of items per user (a few heavy users get truncated)."""
  weights = rng.pareto(1.2, n_users) + 1.0
  user = rng.choice(n_users, n_rows, p=weights / weights.sum())
  # permuted so that ids are not sorted by first appearance
  labels = {"int": rng.permutation(10 * n_users)[:n_users] - 3 * n_users,
            # a range too wide for the composite-key sort: the argsort fallback
            "wide": np.unique(rng.integers(-2**62, 2**62, 2 * n_users))[:n_users],
            "uint": np.uint64(2**64 - 1) - rng.permutation(n_users).astype(np.uint64),
            "str": np.array([f"u{v}" for v in rng.permutation(n_users)]),
            "float": rng.permutation(n_users).astype(np.float64) * 7.0}[id_kind]
  labels = rng.permutation(labels)
  ex = {"x": rng.normal(size=(n_rows, 3)).astype(np.float32),
        "y": np.arange(n_rows, dtype=np.int64)}
  return ex, labels[user]


@pytest.mark.parametrize("id_kind", ["int", "wide", "uint", "str", "float"])
@pytest.mark.parametrize("selection", ["random", "first"])
@pytest.mark.parametrize("m", [None, 1, 3, 8])
def test_new_builder_keeps_exactly_the_old_builders_items(id_kind, selection, m):
  rng = np.random.default_rng(hash((id_kind, selection, m)) % 2**32)
  ex, ids = _table(rng, n_rows=600, n_users=70, id_kind=id_kind)
  new = UserData.from_arrays(ex, ids, max_items_per_user=m, selection=selection, seed=5)
  (x, y), mask, uid, kept, dropped = _old_from_arrays([ex["x"], ex["y"]], ids, m,
                                                      selection, seed=5)
  if m is not None and m < 8:
    assert dropped.any()                     # the case under test: truncated users
  np.testing.assert_array_equal(new.user_ids, uid)
  np.testing.assert_array_equal(new.examples["y"], y)     # row numbers: the kept items
  np.testing.assert_array_equal(new.examples["x"], x)
  np.testing.assert_array_equal(new.item_mask, mask)
  np.testing.assert_array_equal(new.n_items, kept)
  np.testing.assert_array_equal(new.n_dropped, dropped)


def test_object_and_list_ids_give_the_same_users_and_selection_as_native_arrays():
  """Object columns are converted to their native dtype; the values, hence the seeds of the
  random selection, are unchanged."""
  rng = np.random.default_rng(3)
  ex, ids = _table(rng, n_rows=300, n_users=30, id_kind="str")
  native = UserData.from_arrays(ex, ids, max_items_per_user=2)
  for other in (ids.astype(object), list(ids)):
    got = UserData.from_arrays(ex, other, max_items_per_user=2)
    np.testing.assert_array_equal(got.examples["y"], native.examples["y"])
    np.testing.assert_array_equal(got.user_ids, native.user_ids)


def test_group_rows_is_a_sort_not_a_scan():
  """Grouping 2e5 rows of 5e4 users takes seconds, not minutes (the old per-user scan grew as
  users x rows). About 1.5 s of CPU here, nearly all of it ``slot_rows``' per-user draw for the
  ~18e3 users with more than m rows under ``selection="random"`` (a Python loop, ~0.1 ms a
  user). CPU time, not wall time: the wall clock of a loaded 2-core box (a study beside the
  suite) read 5.6 s for the same work."""
  import time
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 50_000, 200_000)
  t0 = time.process_time()
  groups = grouping.group_rows(grouping.canonical_ids(ids))
  rows = grouping.slot_rows(groups, 4, selection="random", seed=0)
  elapsed = time.process_time() - t0
  assert groups.n_users == np.unique(ids).size and rows.shape == (groups.n_users, 4)
  assert elapsed < 5.0, elapsed
  # every user's slots are its own rows
  assert np.all(ids[rows] == groups.ids[:, None])


def test_blocked_fill_matches_one_gather(monkeypatch):
  """Filling the padded leaves block by block (bounded temporaries) gives the one-shot
  gather: force tiny blocks so a table spans many of them."""
  monkeypatch.setattr(grouping, "_BLOCK_BYTES", 200)
  rng = np.random.default_rng(1)
  ex, ids = _table(rng, n_rows=500, n_users=60, id_kind="int")
  got = UserData.from_arrays(ex, ids, max_items_per_user=4)
  (x, y), *_ = _old_from_arrays([ex["x"], ex["y"]], ids, 4)
  np.testing.assert_array_equal(got.examples["x"], x)
  np.testing.assert_array_equal(got.examples["y"], y)


def test_store_round_trip_gives_memory_maps_with_the_same_data(tmp_path):
  rng = np.random.default_rng(2)
  ex, ids = _table(rng, n_rows=400, n_users=50, id_kind="str")
  mem = UserData.from_arrays(ex, ids, max_items_per_user=3)
  disk = UserData.from_arrays(ex, ids, max_items_per_user=3, store=tmp_path / "s")
  again = UserData.open(tmp_path / "s")
  for data in (disk, again):
    assert isinstance(data.examples["x"], np.memmap)
    for name in ("x", "y"):
      np.testing.assert_array_equal(data.examples[name], mem.examples[name])
    for field in ("item_mask", "user_ids", "n_items", "n_dropped"):
      np.testing.assert_array_equal(getattr(data, field), getattr(mem, field))
    assert data.spec == mem.spec and data.m_declared
  # a single-array example too; the store refuses to overwrite
  arr = UserData.from_arrays(ex["x"], ids, store=tmp_path / "a")
  np.testing.assert_array_equal(UserData.open(tmp_path / "a").examples,
                                UserData.from_arrays(ex["x"], ids).examples)
  # keys out of sorted order (jax.tree flattens a dict in sorted key order)
  UserData.from_arrays({"y": ex["y"], "x": ex["x"]}, ids, store=tmp_path / "yx")
  yx = UserData.open(tmp_path / "yx")
  np.testing.assert_array_equal(yx.examples["y"], UserData.from_arrays(ex, ids).examples["y"])
  with pytest.raises(FileExistsError, match="not empty"):
    UserData.from_arrays(ex, ids, store=tmp_path / "s")
  assert arr.spec.declared("max_items_per_user") is False


def test_store_refusals(tmp_path):
  ex = {"a": {"b": np.zeros((3, 2))}}
  with pytest.raises(TypeError, match="flat dict"):
    UserData.from_arrays(ex, [1, 2, 3], store=tmp_path / "n")
  with pytest.raises(FileNotFoundError, match="meta.json"):
    UserData.open(tmp_path)
  os.makedirs(tmp_path / "half")
  with pytest.raises(FileNotFoundError, match="not a complete"):
    UserData.open(tmp_path / "half")


def test_composite_key_sort_equals_the_stable_argsort(monkeypatch):
  """Integer ids take a faster sort of composite keys; it must group exactly as the stable
  argsort does (same rows in the same order, same users in the same order)."""
  rng = np.random.default_rng(4)
  for ids in (rng.integers(-50, 50, 5000), rng.integers(0, 3, 5000).astype(np.int8),
              rng.integers(0, 2**20, 5000).astype(np.uint32)):
    fast = grouping.group_rows(ids)
    monkeypatch.setattr(grouping, "_sort_int_ids", lambda ids: None)
    slow = grouping.group_rows(ids)
    monkeypatch.undo()
    for field in ("rows", "start", "count", "ids"):
      np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field))
    assert fast.ids.dtype == ids.dtype
