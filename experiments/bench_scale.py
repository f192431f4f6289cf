"""One machine, many users (issue 24): UserData build time, per-step sampling cost and peak
memory as the number of users grows.

Workload (the issue's): ``n`` users with 8 items of 20 float32 features each (rows in random
order of users, int64 ids), Poisson sampling with ``q n = 1000`` users per step. With
``--grouped`` the rows are sorted by user instead (each user's 8 rows contiguous, users in
order): the dense layout ``UserData.from_arrays`` takes as reshaped views, without a copy.

For each ``n`` a fresh subprocess (so peaks are per ``n``) measures:

* ``build_s``: ``UserData.from_arrays`` (one sort); in memory up to ``--store-from`` users,
  above that into an on-disk store (``store=``: the padded copy is written with plain file
  writes and read back as memory maps, so it never sits in memory);
* ``old_build_s``: the builder before issue 24 (a per-user scan of the table, ``O(U N)``), up
  to ``--old-build-max`` users (it took 201 s at 1e5);
* ``step_ms``: one step of the host path: :class:`~dpsco_jax.data.PoissonSampler` (``O(q n)``
  work) + :func:`~dpsco_jax.data.gather_batch` + ``jax.device_put`` of the ``[capacity, 8,
  20]`` batch (split into ``sample_ms``, ``gather_ms``, ``put_ms``);
* ``old_step_ms``: the device path it replaces, where the whole table sits on the device and
  a jitted step draws ``n`` coins and gathers the sampled rows, up to ``--old-step-max`` users;
* ``peak_build_gb`` / ``peak_run_gb``: VmHWM (peak resident memory) of the build and of the
  steps, each reset before it starts (``/proc/self/clear_refs``); ``run_rss_anon_gb`` /
  ``run_rss_file_gb`` split the resident memory after the steps into the process's own and
  the store's mapped page cache (clean, reclaimable); ``raw_gb`` is the features
  (``n * 8 * 20 * 4`` bytes; ids add ``n * 8 * 8``); ratios are to ``raw_gb``. ``base_gb``
  is the process before any data (Python + JAX), included in the peaks.

The rest of the issue's table, each section off by default and a key of the JSON summary
when asked for (``--no-rows`` skips the per-n rows):

* ``--devices 4`` (key ``devices``): the fit above with the table on the device, at
  ``--devices-n`` users (default 1e5), in a fresh process on 1 device and in one on 4 forced
  host devices (``--xla_force_host_platform_device_count``) with a ``"users"`` mesh: plan,
  first run (compiles), warm run (``run_s``, ``step_ms``), peaks; and the equality of the
  releases (``max_param_diff``, ``same_privacy``, ``same_record``);
* ``--processes`` (key ``processes``): ``bench_distributed.py``'s summary, 1 vs 2
  ``jax.distributed`` processes at ``--processes-n`` users (``--quick``: its own quick size);
* ``--sweep`` (key ``sweep``): ``bench_sweep.py``'s summary for ``--sweep-only`` (default
  ``quickstart``) on ``--sweep-seeds`` seeds (default 10), batched vs one by one.

Usage: ``python experiments/bench_scale.py [--quick] [--min-n 1e4] [--max-n 1e7] [--steps
200] [--old-build-max 1e4] [--grouped] [--no-rows] [--devices 4] [--processes] [--sweep]``.
The last line of output is the JSON summary.
``BENCH_SCALE_TMP`` names the directory of the stores (default: the system's temporary
directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ITEMS, FEATURES, PER_STEP = 8, 20, 1000


def status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def reset_peak() -> None:
  """Sets VmHWM back to the current resident size, so the next peak is one phase's."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def gb(kb: int) -> float:
  return kb / 2**20


def _old_build(leaves, user_ids, m):
  """The pre-issue-24 grouping (commit 3c6c15c): one full-table scan per user."""
  import numpy as np
  uniq, first, inverse = np.unique(user_ids, return_index=True, return_inverse=True)
  order = np.argsort(first, kind="stable")
  rank = np.empty_like(order)
  rank[order] = np.arange(order.size)
  user_of_row = rank[inverse.reshape(-1)]
  rows_of = [np.flatnonzero(user_of_row == u) for u in range(order.size)]
  slots = np.stack([rows[np.arange(m) % rows.size] for rows in rows_of])
  return [leaf[slots] for leaf in leaves]


def _table(n: int, seed: int = 0, grouped: bool = False):
  import numpy as np
  rng = np.random.default_rng(seed)
  x = np.empty((n * ITEMS, FEATURES), np.float32)
  rng.standard_normal(out=x, dtype=np.float32)
  ids = np.repeat(np.arange(n, dtype=np.int64), ITEMS)
  if not grouped:
    rng.shuffle(ids)          # in place: rows in random order of users
  return x, ids


def _host_steps(data, n: int, steps: int) -> dict:
  import jax
  import numpy as np
  from dpsco_jax.algorithms.common import poisson_capacity
  from dpsco_jax.data import PoissonSampler, gather_batch
  q = min(1.0, PER_STEP / n)
  sampler = PoissonSampler(n, q, capacity=poisson_capacity(n, q), seed=0)
  parts = np.zeros(3)
  sizes = []
  for t in range(steps + 2):
    t0 = time.perf_counter()
    idx, mask = sampler(t)
    t1 = time.perf_counter()
    batch = gather_batch(data, idx, mask)
    t2 = time.perf_counter()
    jax.block_until_ready(jax.device_put((batch, mask)))
    t3 = time.perf_counter()
    if t >= 2:                # two warm-up steps (first device_put allocates)
      parts += (t1 - t0, t2 - t1, t3 - t2)
      sizes.append(int(mask.sum()))
  ms = parts / steps * 1e3
  return {"sample_ms": ms[0], "gather_ms": ms[1], "put_ms": ms[2], "step_ms": ms.sum(),
          "capacity": sampler.capacity, "mean_sampled": float(np.mean(sizes))}


def _old_steps(data, n: int, steps: int) -> float:
  """ms per step of the device path: n coins + nonzero + gather, jitted, data on device."""
  import jax
  from dpsco_jax.algorithms.common import gather_users, poisson_capacity, sample_users
  q = min(1.0, PER_STEP / n)
  cap = poisson_capacity(n, q)
  full = data.user_view()

  @jax.jit
  def step(key, t, full):
    idx, mask = sample_users(jax.random.fold_in(key, t), n, sampling="poisson",
                             batch=PER_STEP, capacity=cap, rate=q)
    return gather_users(full, idx), mask

  key = jax.random.key(0)
  jax.block_until_ready(step(key, 0, full))
  t0 = time.perf_counter()
  for t in range(steps):
    out = step(key, t, full)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps * 1e3


def _config(n: int, steps: int) -> dict:
  return {"epsilon": 2.0, "delta": 1e-7, "clip_norm": 1.0, "learning_rate": 0.1,
          "num_steps": steps, "sampling_rate": min(1.0, PER_STEP / n), "n_users": n}


def _loss(w, ex):
  import jax.numpy as jnp
  return 0.5 * jnp.square(jnp.dot(ex["x"], w) - 1.0)


def _fit(data, n: int, steps: int, placement: str) -> dict:
  """``dpsco_jax.plan`` then ``run`` of ``dp_sgd_user`` end to end (the issue's new-user
  path: q n = 1000 users per step, delta 1e-7): plan seconds, run seconds, ms per step."""
  import jax
  import jax.numpy as jnp
  import dpsco_jax
  t0 = time.perf_counter()
  plan = dpsco_jax.plan("dp_sgd_user", _config(n, steps), data.spec, num_params=FEATURES)
  t1 = time.perf_counter()
  res = dpsco_jax.run(plan, _loss, jnp.zeros(FEATURES), data, jax.random.key(0),
                      data_placement=placement)
  jax.block_until_ready(res.params)
  t2 = time.perf_counter()
  return {f"{placement}_plan_s": t1 - t0, f"{placement}_run_s": t2 - t1,
          f"{placement}_run_ms_per_step": (t2 - t1) / steps * 1e3}


def worker(n: int, steps: int, store: bool, old_build: bool, old_step: bool,
           grouped: bool = False) -> dict:
  import jax
  import numpy as np
  from dpsco_jax.data import UserData
  jax.block_until_ready(jax.numpy.zeros(1))          # backend up: part of the baseline
  out = {"n": n, "mode": "store" if store else "memory",
         "layout": "grouped" if grouped else "shuffled",
         "raw_gb": n * ITEMS * FEATURES * 4 / 2**30, "ids_gb": n * ITEMS * 8 / 2**30,
         "base_gb": gb(status_kb("VmRSS"))}
  x, ids = _table(n, grouped=grouped)
  if old_build:
    t0 = time.perf_counter()
    old = _old_build([x], ids, ITEMS)
    out["old_build_s"] = time.perf_counter() - t0
    del old
  with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_SCALE_TMP")) as tmp:
    reset_peak()
    t0 = time.perf_counter()
    data = UserData.from_arrays({"x": x}, ids, store=os.path.join(tmp, "s") if store else None)
    out["build_s"] = time.perf_counter() - t0
    out["peak_build_gb"] = gb(status_kb("VmHWM"))
    out["zero_copy"] = bool(np.shares_memory(data.examples["x"][:1], x[:ITEMS]))
    assert data.n_users == n and data.max_items_per_user == ITEMS
    del x, ids                 # the run needs only the UserData
    reset_peak()
    out.update(_host_steps(data, n, steps))
    out["peak_run_gb"] = gb(status_kb("VmHWM"))
    # Split of the resident memory after the run: a store's pages that batches touched are
    # file-backed page cache (clean, reclaimable; the kernel maps whole folios, so they grow
    # faster than the rows read), the rest is this process's own memory.
    out["run_rss_anon_gb"] = gb(status_kb("RssAnon"))
    out["run_rss_file_gb"] = gb(status_kb("RssFile"))
    reset_peak()
    out.update(_fit(data, n, steps, "host"))
    out["peak_fit_host_gb"] = gb(status_kb("VmHWM"))
    if old_step and not store:
      out["old_step_ms"] = _old_steps(data, n, steps)
      reset_peak()
      out.update(_fit(data, n, steps, "device"))
      out["peak_fit_device_gb"] = gb(status_kb("VmHWM"))
  for key in ("peak_build_gb", "peak_run_gb"):
    out[key.replace("_gb", "_ratio")] = out[key] / out["raw_gb"]
    out[key.replace("_gb", "_data_ratio")] = (out[key] - out["base_gb"]) / out["raw_gb"]
  return out


def _run_worker(n: int, args, store: bool) -> dict:
  cmd = [sys.executable, __file__, "--worker", str(n), "--steps", str(args.steps)]
  cmd += ["--store"] if store else []
  cmd += ["--old-build"] if n <= args.old_build_max else []
  cmd += ["--old-step"] if n <= args.old_step_max else []
  cmd += ["--grouped"] if args.grouped else []
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    return {"n": n, "mode": "store" if store else "memory",
            "error": proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def devices_worker(n: int, steps: int, devices: int) -> dict:
  """The per-n rows' ``dp_sgd_user`` fit (table on the device: a mesh shards the device
  path only) on ``devices`` forced host devices, with a ``"users"`` mesh over them when there
  are more than one: plan, a first run (compiles), then a timed warm run with the same key.
  Returns the released params, privacy report and record for the comparison across
  processes."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dpsco_jax
  from dpsco_jax.data import UserData
  assert len(jax.devices()) == devices, jax.devices()
  jax.block_until_ready(jnp.zeros(1))
  out = {"devices": devices, "n": n, "steps": steps, "base_gb": gb(status_kb("VmRSS"))}
  x, ids = _table(n)
  data = UserData.from_arrays({"x": x}, ids)
  del x, ids
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("users",)) if devices > 1 else None
  t0 = time.perf_counter()
  plan = dpsco_jax.plan("dp_sgd_user", _config(n, steps), data.spec, num_params=FEATURES)
  out["plan_s"] = time.perf_counter() - t0
  reset_peak()
  for name in ("first_run_s", "run_s"):
    t0 = time.perf_counter()
    res = dpsco_jax.run(plan, _loss, jnp.zeros(FEATURES), data, jax.random.key(0), mesh=mesh,
                        data_placement="device")
    jax.block_until_ready(res.params)
    out[name] = time.perf_counter() - t0
    if name == "first_run_s":
      out["peak_first_run_gb"] = gb(status_kb("VmHWM"))
      reset_peak()
  out["step_ms"] = out["run_s"] / steps * 1e3
  out["peak_run_gb"] = gb(status_kb("VmHWM"))
  out["params"] = [float(v) for v in np.asarray(res.params)]
  out["privacy"] = res.privacy.to_dict()
  out["record"] = res.record
  return out


def _devices_env(devices: int) -> dict:
  # The device count is fixed when JAX starts, hence one process per count. Unlike the
  # tests (multidevice_users.FAST_COMPILE), no unoptimised code generation: these are
  # timings; both processes get the caller's XLA_FLAGS, the forced count aside.
  flags = os.environ.get("XLA_FLAGS", "")
  if devices > 1:
    flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def _subprocess_json(cmd: list[str], env: dict | None = None) -> dict:
  """The last stdout line of ``cmd``, parsed as JSON; ``{"error": ...}`` if it failed."""
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    return {"error": proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def devices_section(n: int, steps: int, devices: int) -> dict:
  """1 device vs a ``devices``-device users mesh, each in a fresh process: warm-run times,
  peaks, and the equality of the releases (params to float tolerance; privacy report and
  record identical)."""
  runs = {}
  for k in (1, devices):
    cmd = [sys.executable, __file__, "--devices-worker", str(k), "--devices-n", str(n),
           "--steps", str(steps)]
    runs[k] = _subprocess_json(cmd, _devices_env(k))
  one, many = runs[1], runs[devices]
  out = {"n": n, "steps": steps, "devices": devices,
         "one": {k: v for k, v in one.items() if k not in ("params", "record")},
         "many": {k: v for k, v in many.items() if k not in ("params", "record")}}
  if "error" in one or "error" in many:
    return out
  out["ratio_run_many_over_one"] = many["run_s"] / one["run_s"]
  out["max_param_diff"] = max(abs(a - b) for a, b in zip(one["params"], many["params"]))
  out["param_scale"] = max(abs(a) for a in one["params"])
  out["same_privacy"] = one["privacy"] == many["privacy"]
  out["same_record"] = one["record"] == many["record"]
  return out


def processes_section(n: int, steps: int, quick: bool) -> dict:
  """``experiments/bench_distributed.py``'s summary (1 vs 2 processes under
  ``jax.distributed``, host-streamed), run as it is run alone."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_distributed.py")
  args = ["--quick"] if quick else ["--n", str(n), "--steps", str(steps)]
  return _subprocess_json([sys.executable, script, *args])


def sweep_section(seeds: int, only: str, quick: bool) -> dict:
  """``experiments/bench_sweep.py``'s summary (each config's rows on ``seeds`` seeds, batched
  vs one by one, each mode in a fresh process), for the config ``only``."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_sweep.py")
  args = ["--seeds", str(seeds), "--only", only] + (["--no-warm"] if quick else [])
  return _subprocess_json([sys.executable, script, *args])


def _section_lines(summary: dict) -> list[str]:
  lines = []
  d = summary.get("devices")
  if d is not None:
    lines.append(f"dp_sgd_user, table on device, n={d['n']:.0e}, {d['steps']} steps: "
                 f"1 device vs {d['devices']} forced host devices (users mesh)")
    for label, r in (("1", d["one"]), (str(d["devices"]), d["many"])):
      if "error" in r:
        lines.append(f"  {label:>2} device(s): error: {r['error']}")
        continue
      lines.append(f"  {label:>2} device(s): plan {r['plan_s']:.2f} s, first run "
                   f"{r['first_run_s']:.2f} s, warm run {r['run_s']:.2f} s "
                   f"({r['step_ms']:.2f} ms/step), peak {r['peak_first_run_gb']:.3f} GB "
                   f"(first run) / {r['peak_run_gb']:.3f} GB (warm)")
    if "max_param_diff" in d:
      lines.append(f"  warm run x{d['ratio_run_many_over_one']:.2f}; max |params difference| "
                   f"{d['max_param_diff']:.2g} (params up to {d['param_scale']:.2g}); same "
                   f"privacy report: {d['same_privacy']}, same record: {d['same_record']}")
  p = summary.get("processes")
  if p is not None:
    if "error" in p:
      lines.append(f"1 vs 2 processes: error: {p['error']}")
    else:
      lines.append(f"1 vs 2 processes (bench_distributed.py, n={p['n']:.0e}, {p['steps']} "
                   f"steps, host-streamed): {p['one_process']['step_ms']:.2f} vs "
                   f"{p['two_processes']['step_ms']:.2f} ms/step (x{p['ratio_two_over_one']:.2f})"
                   f"; max |params difference| {p['max_param_diff']:.2g}")
  s = summary.get("sweep")
  if s is not None:
    if "error" in s:
      lines.append(f"sweep: error: {s['error']}")
    for r in s.get("rows", []):
      warm = (f", warm {r['warm_batched_s']:.1f} s vs {r['warm_one_by_one_s']:.1f} s "
              f"(x{r['warm_speedup']:.2f})" if "warm_speedup" in r else "")
      lines.append(f"sweep (bench_sweep.py) {r['config']}, {r['seeds']} seeds, {r['runs']} "
                   f"runs, batched vs one by one: cold {r['cold_batched_s']:.1f} s vs "
                   f"{r['cold_one_by_one_s']:.1f} s (x{r['cold_speedup']:.2f}){warm}; max "
                   f"|risk difference| {r['max_abs_risk_diff']:.2g}, other fields identical: "
                   f"{r['records_identical_but_risk']}")
  return lines


def _fmt(v, spec):
  return "-" if v is None else format(v, spec)


def _table_lines(rows: list[dict]) -> list[str]:
  head = (f"{'n':>9} {'mode':>6} {'build s':>8} {'old s':>7} {'raw GB':>7} {'peak GB':>8} "
          f"{'peak/raw':>8} {'(-base)':>7} {'run GB':>7} {'step ms':>8} {'old ms':>7}")
  lines = [head]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['n']:>9} {r['mode']:>6} error: {r['error']}")
      continue
    lines.append(
        f"{r['n']:>9.0e} {r['mode']:>6} {r['build_s']:>8.2f} "
        f"{_fmt(r.get('old_build_s'), '>7.2f')} {r['raw_gb']:>7.3f} "
        f"{r['peak_build_gb']:>8.3f} {r['peak_build_ratio']:>8.2f} "
        f"{r['peak_build_data_ratio']:>7.2f} {r['peak_run_gb']:>7.3f} {r['step_ms']:>8.3f} "
        f"{_fmt(r.get('old_step_ms'), '>7.3f')}")
  lines.append("")
  lines.append(f"{'n':>9} {'mode':>6} {'plan s':>7} {'fit host s':>10} {'peak GB':>8} "
               f"{'fit device s':>12} {'peak GB':>8}   (dp_sgd_user end to end)")
  for r in rows:
    if "error" not in r:
      lines.append(f"{r['n']:>9.0e} {r['mode']:>6} {r['host_plan_s']:>7.2f} "
                   f"{r['host_run_s']:>10.2f} {r['peak_fit_host_gb']:>8.3f} "
                   f"{_fmt(r.get('device_run_s'), '>12.2f')} "
                   f"{_fmt(r.get('peak_fit_device_gb'), '>8.3f')}")
  return lines


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="n <= 1e4, a few seconds")
  ap.add_argument("--max-n", type=float, default=1e6, help="largest n (1e7: ~10 GB of RAM)")
  ap.add_argument("--min-n", type=float, default=1e4, help="smallest n")
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--store-from", type=float, default=1e6,
                  help="n from which the build also runs into an on-disk store")
  ap.add_argument("--memory-max", type=float, default=1e6,
                  help="largest n built in memory (the padded copy doubles the table)")
  ap.add_argument("--old-build-max", type=float, default=1e4)
  ap.add_argument("--old-step-max", type=float, default=1e6)
  ap.add_argument("--grouped", action="store_true",
                  help="rows sorted by user (the dense layout built without a copy)")
  ap.add_argument("--no-rows", action="store_true",
                  help="skip the per-n rows (run only the sections asked for below)")
  ap.add_argument("--devices", type=int, default=0,
                  help="also 1 device vs this many forced host devices (a users mesh)")
  ap.add_argument("--devices-n", type=float, default=1e5, help="n of the devices section")
  ap.add_argument("--processes", action="store_true",
                  help="also 1 vs 2 processes (bench_distributed.py at --processes-n)")
  ap.add_argument("--processes-n", type=float, default=1e5)
  ap.add_argument("--sweep", action="store_true",
                  help="also a sweep batched vs one by one (bench_sweep.py --only --sweep-only)")
  ap.add_argument("--sweep-seeds", type=int, default=10)
  ap.add_argument("--sweep-only", default="quickstart",
                  choices=("quickstart", "srgd", "quickstart-grid", "srgd-grid"))
  ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--devices-worker", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--store", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--old-build", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--old-step", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.devices_worker is not None:
    print(json.dumps(devices_worker(int(args.devices_n), args.steps, args.devices_worker)))
    return
  if args.worker is not None:
    print(json.dumps(worker(args.worker, args.steps, args.store, args.old_build,
                            args.old_step, args.grouped)))
    return
  if args.quick:
    sizes, args.steps, args.store_from = [1000, 10_000], 20, 10_000
    args.old_build_max = 1000
    args.devices_n, args.sweep_seeds = min(args.devices_n, 10_000), min(args.sweep_seeds, 2)
  else:
    sizes = [n for n in (10_000, 100_000, 1_000_000, 10_000_000)
             if args.min_n <= n <= args.max_n]
  sizes = [] if args.no_rows else sizes
  rows = []
  if sizes:
    print(_table_lines([])[0], flush=True)
  for n in sizes:
    for store in (False, True):
      if (n <= args.memory_max, n >= args.store_from)[store]:
        rows.append(_run_worker(n, args, store=store))
        print(_table_lines(rows[-1:])[1], flush=True)    # progress: one row per run
  ok = [r for r in rows if "error" not in r]
  if sizes:
    print("\n".join(_table_lines(ok)[len(ok) + 1:]), flush=True)   # the end-to-end table
  summary = {"mode": "quick" if args.quick else "full", "items_per_user": ITEMS,
             "layout": "grouped" if args.grouped else "shuffled",
             "features": FEATURES, "users_per_step": PER_STEP, "steps": args.steps,
             "largest_n": max((r["n"] for r in ok), default=0), "rows": rows}
  # the other sections: keys present only when asked for (the default summary is unchanged)
  if args.devices > 1:
    summary["devices"] = devices_section(int(args.devices_n), args.steps, args.devices)
  if args.processes:
    summary["processes"] = processes_section(int(args.processes_n), args.steps, args.quick)
  if args.sweep:
    summary["sweep"] = sweep_section(args.sweep_seeds, args.sweep_only, args.quick)
  if _section_lines(summary):
    print("\n".join(_section_lines(summary)), flush=True)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
