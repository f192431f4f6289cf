"""Issue 46 part 3: a DPTrainer checkpoint records the facts and digest of the data it was
trained on, and refuses to resume on other data of the same shape."""

import shutil

import numpy as np
import optax
import pytest

pytest.importorskip("orbax.checkpoint")
from flax import nnx  # noqa: E402

from dpsco_jax.data import UserData  # noqa: E402
from dpsco_jax.flax import DPTrainer  # noqa: E402
from dpsco_jax.flax import checkpoint as ckpt  # noqa: E402
from test_flax_trainer import _tamper as _edit_meta  # noqa: E402  (edits a saved metadata file)


def _table(seed: int) -> tuple[dict, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((24, 3)).astype(np.float32)
  return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}, np.repeat(np.arange(8), 3)


def _loss(model, ex):
  return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])


def _trainer(data) -> DPTrainer:
  return DPTrainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), _loss, optax.sgd(0.5), data=data,
                   clip_norm=1.0, sampling_rate=0.5, delta=1e-5, expected_batch_size=4.0,
                   noise_multiplier=1.2, key=7, accountant="rdp")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("ck")
  ex, ids = _table(0)
  a = UserData.from_arrays(ex, ids, max_items_per_user=3, store=root / "store_a")
  tr = _trainer(a)
  tr.train(1, report_every=1)
  return root, tr.save(root / "ck")


def test_resume_on_the_same_data_and_its_store_only(saved):
  root, path = saved
  ex, ids = _table(0)
  same = _trainer(UserData.from_arrays(ex, ids, max_items_per_user=3)).restore(path)
  assert same.step_count == 1
  assert _trainer(UserData.open(root / "store_a")).restore(path).step_count == 1
  ex_b, _ = _table(1)                                   # same shapes, other values
  with pytest.raises(ValueError, match="trained on other data: digest differ"):
    _trainer(UserData.from_arrays(ex_b, ids, max_items_per_user=3)).restore(path)
  with pytest.raises(ValueError, match="trained on other data: digest differ"):
    _trainer(UserData.from_arrays(ex, ids + 50, max_items_per_user=3)).restore(path)  # ids


def test_other_shapes_are_named_and_private_counts_are_not_shown(saved):
  _, path = saved
  ex, ids = _table(0)
  fewer = UserData.from_arrays({k: v[:21] for k, v in ex.items()}, ids[:21],
                               max_items_per_user=3)
  with pytest.raises(ValueError, match="digest, n_users differ") as err:
    _trainer(fewer).restore(path)
  assert " 8" not in str(err.value) and " 7" not in str(err.value)   # no user counts
  wide = UserData.from_arrays({"x": ex["x"], "y": ex["y"].astype(np.int64)}, ids,
                              max_items_per_user=3)
  with pytest.raises(ValueError, match=r"item_shapes differ \(item_shapes: checkpoint"):
    _trainer(wide).restore(path)


def test_plain_arrays_are_fingerprinted_too(tmp_path):
  ex, ids = _table(0)
  data = UserData.from_arrays(ex, ids, max_items_per_user=3).examples   # [8, 3, ...] leaves
  tr = _trainer(data)
  tr.train(1, report_every=1)
  path = tr.save(tmp_path)
  assert _trainer({k: v.copy() for k, v in data.items()}).restore(path).step_count == 1
  other = {"x": data["x"][::-1].copy(), "y": data["y"]}                   # users reordered
  with pytest.raises(ValueError, match="trained on other data: digest differ"):
    _trainer(other).restore(path)


def test_a_checkpoint_without_data_facts_is_refused(saved, tmp_path):
  root, path = saved
  old = str(tmp_path / "step_00000001")
  shutil.copytree(path, old)
  def as_written_before(meta):   # no data facts, sealed consistently (as an old version did)
    del meta["data"]
    meta.update(ckpt.seal(meta, meta["integrity"]["arrays_sha256"]))
  _edit_meta(old, as_written_before)
  with pytest.raises(ValueError, match="records no data facts"):
    _trainer(UserData.open(root / "store_a")).restore(old)


def test_the_data_facts_hold_no_data(saved):
  ex, ids = _table(0)
  facts = ckpt.data_facts(UserData.from_arrays(ex, ids, max_items_per_user=3))
  assert sorted(facts) == ["digest", "item_shapes", "max_items_per_user", "n_users"]
  assert facts["item_shapes"] == [["['x']", [3], "float32"], ["['y']", [], "int32"]]


def test_a_checkpoint_is_never_replaced_without_overwrite(tmp_path):
  """``save`` used orbax's force=True: a second run saving into the same folder replaced the
  first run's checkpoint of that step without a word."""
  ex, ids = _table(0)
  data = UserData.from_arrays(ex, ids, max_items_per_user=3)
  first = _trainer(data)
  first.train(1, report_every=1)
  path = first.save(tmp_path)
  second = _trainer(data)
  second.train(1, report_every=1)
  with pytest.raises(FileExistsError, match="already exists: pass overwrite=True"):
    second.save(tmp_path)
  assert second.save(tmp_path, overwrite=True) == path
  # a fresh run training into a folder holding a later step is refused before any step
  fresh = _trainer(data)
  with pytest.raises(FileExistsError, match="holds .*step_00000001.*restore from it"):
    fresh.train(1, report_every=1, checkpoint_dir=tmp_path)
  assert fresh.step_count == 0
