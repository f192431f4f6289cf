"""What the store manifest costs (issue 46): write a ``UserData`` store of ``--users`` users (one
item of 4 float32 features each, int64 ids, plus mask / counts), then time

* ``write_s``: ``UserData.from_arrays(..., store=)`` (sort, padded leaves, small arrays, and
  the manifest's checksums, re-read from disk); ``checksum_pass_s`` is one checksum pass over
  every array of the store (the manifest's share of the write);
* ``open_verify_s``: ``UserData.open(store)`` (sizes, headers and every checksum);
* ``open_sizes_s``: ``UserData.open(store, verify=False)`` (sizes, headers, the small arrays'
  checksums; no leaf checksum);
* ``open_store_*_s``: the same two without building the ``UserData`` (whose own checks sort
  the ids: most of an open's time at this size);
* ``fingerprint_memory_s``: ``UserData.fingerprint`` of the same data in memory;

and the checksum throughput in GB/s (store bytes / ``checksum_pass_s``; leaves only: leaf
bytes / the extra time of a verified ``open_store``). Opens are repeated ``--reps`` times,
interleaved (median); the store's pages are in the page cache after the write (warm
reads: a cold read adds the disk's time, which the mmap'd training pays once too). The store
is written under ``--dir`` (default a temporary folder) and deleted afterwards.

    python experiments/bench_store_check.py                # 1e7 users, writes the JSON
    python experiments/bench_store_check.py --users 1000 --out ''   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from dpsco_jax.data import UserData
from dpsco_jax.data import grouping

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "bench_store_check.json")


def _timed(fn, reps: int) -> tuple[float, object]:
  times, out = [], None
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def _store_bytes(store: str) -> int:
  return sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store))


def measure(users: int, root: str, reps: int) -> dict:
  need = users * (4 * 4 + 1 + 3 * 8) * 2          # store + the table in memory, twice over
  free = shutil.disk_usage(root).free
  if free < 2 * need:
    raise SystemExit(f"{root} has {free / 1e9:.1f} GB free, needs about {2 * need / 1e9:.1f}")
  rng = np.random.default_rng(0)
  x = rng.standard_normal((users, 4), dtype=np.float32)
  ids = rng.permutation(users).astype(np.int64)    # one item per user, rows in any order
  store = os.path.join(root, "store")
  t0 = time.perf_counter()
  written = UserData.from_arrays(x, ids, max_items_per_user=1, store=store)
  write_s = time.perf_counter() - t0
  size = _store_bytes(store)
  leaf = os.path.getsize(os.path.join(store, "leaf_0.npy"))
  cases = {"open_verify_s": lambda: UserData.open(store),
           "open_sizes_s": lambda: UserData.open(store, verify=False),
           "open_store_verify_s": lambda: grouping.open_store(store),
           "open_store_sizes_s": lambda: grouping.open_store(store, verify=False)}
  times = {k: [] for k in cases}
  for r in range(reps):              # interleaved, order alternating: a shared, noisy machine
    for k in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
      times[k].append(_timed(cases[k], 1)[0])
  t = {k: statistics.median(v) for k, v in times.items()}
  opened = UserData.open(store)
  arrays = [opened.examples, opened.item_mask, opened.user_ids, opened.n_items,
            opened.n_dropped]
  checksum_s, _ = _timed(lambda: [grouping.array_checksum(a) for a in arrays], reps)
  memory = UserData.from_arrays(x, ids, max_items_per_user=1)
  fp_s, fp = _timed(lambda: memory.fingerprint, reps)
  assert fp == opened.fingerprint == written.fingerprint    # one fingerprint, three ways
  shutil.rmtree(store)
  return {
      "users": users, "store_gb": size / 1e9, "leaf_gb": leaf / 1e9, "reps": reps,
      "write_s": write_s, "checksum_pass_s": checksum_s,
      **t, "verify_extra_s": t["open_store_verify_s"] - t["open_store_sizes_s"],
      "fingerprint_memory_s": fp_s,
      "checksum_gb_per_s": size / 1e9 / checksum_s,
      "leaf_checksum_gb_per_s": leaf / 1e9 / max(1e-9, t["open_store_verify_s"] -
                                                 t["open_store_sizes_s"]),
      "memory_fingerprint_gb_per_s": size / 1e9 / fp_s,
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--users", type=float, default=1e7)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dir", default=None, help="where to write the store (default: a temp dir)")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON output ('' for none)")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory(dir=args.dir) as root:
    row = measure(int(args.users), root, args.reps)
  for k, v in row.items():
    print(f"{k:>28}: {v:.4g}" if isinstance(v, float) else f"{k:>28}: {v}")
  if args.out:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(row, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
  main()
