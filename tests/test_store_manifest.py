"""Issue 46: a UserData store carries a manifest (each file's size, dtype, shape, checksum) and a
fingerprint; a store whose files do not match it is refused on open, naming the file, instead
of being trained on as if it were the table that was written."""

import json
import os
import shutil

import numpy as np
import pytest

from dpsco_jax.data import UserData
from dpsco_jax.data import grouping
from dpsco_jax.data.grouping import StoreIntegrityError

LEAVES = ("leaf_0.npy", "leaf_1.npy")   # examples {"x", "y"}: x is leaf_0, y is leaf_1
SMALL = ("item_mask.npy", "n_dropped.npy", "n_items.npy", "user_ids.npy")


def _table(seed=0, counts=(3, 3, 3, 3, 3, 3, 1)):
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(100 + 10 * seed, 100 + 10 * seed + len(counts)), counts)
  n = ids.size
  return {"x": rng.standard_normal((n, 2)).astype(np.float32),
          "y": rng.standard_normal((n, 2)).astype(np.float32)}, ids


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  """A store, and another one of the same shapes (other values) to take files from."""
  root = tmp_path_factory.mktemp("stores")
  ex, ids = _table(0)
  UserData.from_arrays(ex, ids, max_items_per_user=3, store=root / "a")
  # same shapes, every file different: other values, ids, counts, mask and drops
  ex_b, ids_b = _table(1, counts=(1, 4, 3, 3, 3, 3, 2))
  UserData.from_arrays(ex_b, ids_b, max_items_per_user=3, store=root / "b")
  return root


@pytest.fixture
def store(pristine, tmp_path):
  shutil.copytree(pristine / "a", tmp_path / "s")
  return tmp_path / "s"


def _meta(store, edit):
  with open(store / "meta.json") as f:
    meta = json.load(f)
  edit(meta)
  with open(store / "meta.json", "w") as f:
    json.dump(meta, f)


def _flip_last_byte(path):
  with open(path, "r+b") as f:
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
    f.seek(-1, os.SEEK_END)
    f.write(bytes([last[0] ^ 1]))


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 4)


def _swap(store, a, b):
  os.rename(store / a, store / "tmp")
  os.rename(store / b, store / a)
  os.rename(store / "tmp", store / b)


def test_the_issue_cases_are_refused_naming_the_file(store, pristine):
  ok = UserData.open(store)                     # intact: opens, same data as written
  np.testing.assert_array_equal(ok.examples["x"], UserData.open(pristine / "a").examples["x"])
  cases = [
      (lambda s: _flip_last_byte(s / "leaf_0.npy"), "leaf_0.npy does not match its checksum"),
      (lambda s: _swap(s, "leaf_0.npy", "leaf_1.npy"), "leaf_0.npy does not match"),
      (lambda s: _meta(s, lambda m: m.update(names=m["names"][::-1])), "fingerprint"),
      (lambda s: shutil.copy(pristine / "b" / "user_ids.npy", s / "user_ids.npy"),
       "user_ids.npy does not match its checksum"),
      (lambda s: _meta(s, lambda m: m.update(names=m["names"][:1])), "manifest lists"),
      (lambda s: _truncate(s / "leaf_1.npy"), "leaf_1.npy is .* bytes, its manifest says"),
  ]
  for damage, match in cases:
    shutil.rmtree(store)
    shutil.copytree(pristine / "a", store)
    damage(store)
    with pytest.raises(StoreIntegrityError, match=match):
      UserData.open(store)


# Every class of fault on every file of a store: each must be refused, naming that file (or
# meta.json for faults of the manifest itself). Sizes and headers are checked even with
# verify=False; only a same-size edit or swap of a leaf needs the checksum.
FILES = LEAVES + SMALL


def _edit(store, name, pristine):
  _flip_last_byte(store / name)


def _other_dataset(store, name, pristine):
  shutil.copy(pristine / "b" / name, store / name)


def _truncated(store, name, pristine):
  _truncate(store / name)


def _missing(store, name, pristine):
  os.remove(store / name)


def _extended(store, name, pristine):
  with open(store / name, "ab") as f:
    f.write(b"\0" * 8)


PARTNER = {"leaf_0.npy": "leaf_1.npy", "leaf_1.npy": "leaf_0.npy", "n_items.npy":
           "n_dropped.npy", "n_dropped.npy": "n_items.npy", "item_mask.npy": "leaf_0.npy",
           "user_ids.npy": "n_items.npy"}


def _swapped(store, name, pristine):
  """Renamed with another file (the error may name either: the first one checked)."""
  _swap(store, name, PARTNER[name])


def _header(store, name, pristine):
  """Same size, another dtype in the header ('<f4' <-> '<i4', '|b1' <-> '|u1')."""
  raw = (store / name).read_bytes()
  for a, b in ((b"<f4", b"<i4"), (b"<i8", b"<u8"), (b"|b1", b"|u1")):
    if a in raw[:128]:
      (store / name).write_bytes(raw.replace(a, b, 1))
      return
  raise AssertionError(f"no dtype to change in {name}")


FILE_FAULTS = [_edit, _other_dataset, _truncated, _missing, _extended, _swapped, _header]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("fault", FILE_FAULTS, ids=lambda f: f.__name__.strip("_"))
def test_every_fault_of_every_file_is_refused(store, pristine, name, fault):
  fault(store, name, pristine)
  names = [name, PARTNER[name]] if fault is _swapped else [name]
  match = "|".join(n.replace(".", r"\.") for n in names)
  with pytest.raises(StoreIntegrityError, match=match):
    UserData.open(store)
  if fault not in (_edit, _other_dataset, _swapped) or name not in LEAVES:
    with pytest.raises(StoreIntegrityError, match=match):   # no leaf checksum needed
      UserData.open(store, verify=False)


META_FAULTS = {
    "names_swapped": (lambda m: m.update(names=m["names"][::-1]), "fingerprint"),
    "leaf_forgotten": (lambda m: m.update(names=m["names"][:1]), "manifest lists"),
    "kind": (lambda m: m.update(examples="array"), "fingerprint"),
    "m_declared": (lambda m: m.update(m_declared=False), "fingerprint"),
    "array_dropped": (lambda m: m.update(arrays=m["arrays"][:-1]), r"malformed.*arrays"),
    "manifest_checksum": (lambda m: m["manifest"][0].update(sha256="0" * 64), "fingerprint"),
    "manifest_size": (lambda m: m["manifest"][2].update(size=1), "item_mask.npy is"),
    "manifest_entry_dropped": (lambda m: m["manifest"].pop(), "manifest lists"),
    "manifest_removed": (lambda m: m.pop("manifest"), "malformed"),
    "fingerprint_edited": (lambda m: m.update(fingerprint="0" * 64), "fingerprint"),
    "old_format": (lambda m: [m.pop("manifest"), m.pop("fingerprint"),
                              m.update(format="dpsco_jax.UserData/1")], "no manifest.*rewrite"),
    "unknown_format": (lambda m: m.update(format="dpsco_jax.UserData/9"), "unknown store"),
}


@pytest.mark.parametrize("case", sorted(META_FAULTS))
def test_every_fault_of_meta_json_is_refused(store, case):
  edit, match = META_FAULTS[case]
  _meta(store, edit)
  with pytest.raises(StoreIntegrityError, match=match):
    UserData.open(store, verify=False)


def test_broken_json_and_extra_files_are_refused(store):
  shutil.copy(store / "leaf_1.npy", store / "leaf_2.npy")   # a leaf meta.json does not list
  with pytest.raises(StoreIntegrityError, match=r"leaf_2\.npy.*does not list"):
    UserData.open(store)
  os.remove(store / "leaf_2.npy")
  UserData.open(store)
  (store / "meta.json").write_text((store / "meta.json").read_text()[:-5])
  with pytest.raises(StoreIntegrityError, match="meta.json .* not valid JSON"):
    UserData.open(store)


def test_verify_must_be_a_bool(store):
  with pytest.raises(TypeError, match="verify"):
    UserData.open(store, verify="no")


def test_fingerprint_is_the_same_in_memory_and_in_the_store(tmp_path):
  ex, ids = _table(0)
  mem = UserData.from_arrays(ex, ids, max_items_per_user=3)
  disk = UserData.from_arrays(ex, ids, max_items_per_user=3, store=tmp_path / "d")
  opened = UserData.open(tmp_path / "d")
  with open(tmp_path / "d" / "meta.json") as f:
    recorded = json.load(f)["fingerprint"]
  assert mem.fingerprint == disk.fingerprint == opened.fingerprint == recorded
  assert len(recorded) == 64 and recorded not in repr(opened)
  # one array example too, with a key that needs quoting
  arr = UserData.from_arrays(ex["x"], ids, store=tmp_path / "arr")
  assert UserData.open(tmp_path / "arr").fingerprint == arr.fingerprint
  odd = {"a'b": ex["x"], "z": ex["y"]}
  UserData.from_arrays(odd, ids, store=tmp_path / "odd")
  assert UserData.open(tmp_path / "odd").fingerprint == UserData.from_arrays(odd, ids).fingerprint


def test_fingerprint_tells_tables_of_one_shape_apart():
  ex, ids = _table(0)
  base = UserData.from_arrays(ex, ids, max_items_per_user=3)
  edited = {"x": ex["x"].copy(), "y": ex["y"]}
  edited["x"][5, 1] += 1e-3
  others = [UserData.from_arrays(edited, ids, max_items_per_user=3),
            UserData.from_arrays({"x": ex["y"], "y": ex["x"]}, ids, max_items_per_user=3),
            UserData.from_arrays(ex, ids + 1, max_items_per_user=3),
            UserData.from_arrays(ex, ids),                         # m measured, not declared
            base.select(np.arange(base.n_users)[::-1]),
            base.shard(0, 1)]
  prints = {base.fingerprint} | {o.fingerprint for o in others}
  assert len(prints) == 1 + len(others)
  assert UserData.from_arrays(ex, ids, max_items_per_user=3).fingerprint == base.fingerprint


def test_array_checksum_streams_in_chunks(monkeypatch):
  """The checksum is the same whatever the block size (it is read in blocks, not whole)."""
  x = np.arange(1000, dtype=np.float32).reshape(100, 10)
  whole = grouping.array_checksum(x)
  monkeypatch.setattr(grouping, "CHUNK_BYTES", 120)    # 3 rows a block
  assert grouping.array_checksum(x) == whole
  assert grouping.array_checksum(x.astype(np.float64)) != whole
  big = np.array([2**70, 5], dtype=object)             # values, never object pointers
  assert grouping.array_checksum(big) == grouping.array_checksum(big.copy())
