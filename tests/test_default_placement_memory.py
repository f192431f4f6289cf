"""Memory of ``dp.fit`` at the default (device) placement (issue 46, "Memory at the default").

The device path put the table on the device with ``jnp.asarray``, which copies every leaf
through a second host copy: at 1e6 users (0.6 GB of features) ``dp_sgd_user`` peaked at
2.4x the table above the built data (experiments/bench_fit_memory.py). ``UserData.user_view`` / ``item_view`` now use
``jax.device_put``: on a CPU backend a 64-byte aligned leaf is used in place (no copy), an
unaligned one is copied once. Released params are unchanged (bitwise; aligned vs copied)."""

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax.data import UserData
from dpsco_jax.data.problem import UserDataProblem

ITEMS, FEATURES = 8, 20

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="in-place device arrays are a CPU-backend property")


def _table(users: int, offset: int, seed: int = 0) -> np.ndarray:
  """``[users * ITEMS, FEATURES]`` float32 at ``offset`` bytes past a 64-byte boundary."""
  nbytes = users * ITEMS * FEATURES * 4
  buf = np.empty(nbytes + 128, np.uint8)
  start = (-buf.ctypes.data % 64) + offset
  x = buf[start:start + nbytes].view(np.float32).reshape(users * ITEMS, FEATURES)
  x[:] = np.random.default_rng(seed).standard_normal(x.shape, np.float32)
  return x


def _data(x: np.ndarray) -> UserData:
  ids = np.repeat(np.arange(x.shape[0] // ITEMS), ITEMS)
  return UserData.from_arrays({"x": x}, ids, max_items_per_user=ITEMS)


def _loss(w, ex):
  return 0.5 * jnp.square(jnp.dot(ex["x"], w) - 1.0)


def _config(users: int, steps: int = 3) -> dict:
  return {"epsilon": 2.0, "delta": 1e-6, "clip_norm": 1.0, "learning_rate": 0.1,
          "num_steps": steps, "sampling_rate": min(1.0, 100 / users), "n_users": users}


def _kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


@cpu_only
@pytest.mark.parametrize("level", ["user", "item"])
def test_an_aligned_table_reaches_the_device_without_a_copy(level):
  x = _table(64, offset=0)
  data = _data(x)
  problem = UserDataProblem(_loss, jnp.zeros(FEATURES), data, level=level)
  leaf = problem.data["example"]["x"]          # what the device path's jitted scan reads
  assert leaf.unsafe_buffer_pointer() == x.ctypes.data
  assert leaf.dtype == jnp.float32 and leaf.shape == (64, ITEMS, FEATURES)
  np.testing.assert_array_equal(np.asarray(leaf), x.reshape(64, ITEMS, FEATURES))


@cpu_only
def test_a_table_the_library_groups_is_aligned_and_reaches_the_device_without_a_copy():
  """Rows not grouped by user are written into padded leaves the library allocates: at
  numpy's default alignment (16 bytes off 64) device_put copied each of them once more."""
  x = _table(64, offset=16)
  ids = np.tile(np.arange(64), ITEMS)             # users interleaved: the table is regrouped
  data = UserData.from_arrays({"x": x}, ids, max_items_per_user=ITEMS)
  padded = data.examples["x"]
  assert padded.ctypes.data % 64 == 0 and padded.flags.c_contiguous
  leaf = UserDataProblem(_loss, jnp.zeros(FEATURES), data).data["example"]["x"]
  assert leaf.unsafe_buffer_pointer() == padded.ctypes.data
  np.testing.assert_array_equal(np.asarray(leaf), x[np.argsort(ids, kind="stable")].reshape(
      64, ITEMS, FEATURES))


def test_an_unaligned_table_is_copied_with_the_same_values_and_dtypes():
  x = _table(64, offset=16)
  ex = {"x": x, "y": np.arange(64 * ITEMS, dtype=np.int64)}    # int64 -> int32, as before
  data = UserData.from_arrays(ex, np.repeat(np.arange(64), ITEMS))
  view = data.user_view()["example"]
  for name in ("x", "y"):
    want = jnp.asarray(data.examples[name])
    assert view[name].dtype == want.dtype and view[name].shape == want.shape
    np.testing.assert_array_equal(np.asarray(view[name]), np.asarray(want))


def test_user_weights_are_the_float64_ratios_rounded_to_float32():
  rng = np.random.default_rng(2)
  counts = rng.integers(1, 13, size=200)                      # ragged users, some truncated
  ids = np.repeat(np.arange(200), counts)
  data = UserData.from_arrays({"x": np.zeros((ids.size, 2), np.float32)}, ids,
                              max_items_per_user=7)
  want = np.asarray(data.item_mask * (7 / data.n_items[:, None]), np.float32)
  got = np.asarray(data.user_view()["weight"])
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want)


def test_fit_releases_the_same_params_from_an_aligned_and_a_copied_table():
  users = 300                                 # one compile: both tables have one shape
  got = [dpsco_jax.fit("dp_sgd_user", _config(users), _loss, jnp.zeros(FEATURES),
                       _data(_table(users, off)), jax.random.key(4)).params for off in (0, 16)]
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[1]))


@cpu_only
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS (/proc/self/clear_refs)")
def test_a_warm_fit_at_the_default_placement_adds_no_copy_of_an_aligned_table():
  users = 50_000                              # 31 MiB of features
  x = _table(users, offset=0)
  data = _data(x)
  cfg = _config(users)
  run = lambda: jax.block_until_ready(dpsco_jax.fit(                         # noqa: E731
      "dp_sgd_user", cfg, _loss, jnp.zeros(FEATURES), data, jax.random.key(0)).params)
  run()                                       # compiles: its peak is the compiler's
  gc.collect()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                              # VmHWM := VmRSS
  before = _kb("VmRSS")
  run()
  rise = (_kb("VmHWM") - before) * 1024
  # jnp.asarray held the table twice more at the peak (a host copy and the device copy)
  assert rise < 0.4 * x.nbytes, (rise / 2**20, x.nbytes / 2**20)
