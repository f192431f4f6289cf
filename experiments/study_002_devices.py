"""Study 002 (issue 28): wall time and query depth of paper 002's private ReSQue
(``resque_private_sco``) with each round's oracle calls split over 1, 2 and 4 forced host
devices (the mesh path of commit ce1134e: ``solvers.draw_queries`` shards the round's
per-item gradients over the ``"users"`` axis, items replicated).

Problem: planted mean-absolute regression (the ``absolute`` problem of configs/resque.yaml, noise
0), item level, one item per user. An item is a block of ``k`` measurements
``(x_ij, y_ij)``, ``x_ij`` uniform on the unit sphere of R^d, ``y_ij = <x_ij, w*>``,
``|w*| = R/2``; loss ``f(w; item) = (1/k) sum_j |<x_ij, w> - y_ij|`` (convex, L = 1). The
optimum is ``w*`` with ``f* = 0`` and the population excess is exact:
``F(w) - F* = c_d |w - w*|`` with ``c_d = E|x_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))``.
Two item costs:

  * ``glm``:   k = 1 (an ordinary GLM item), n = 4e4, d = 20: a cheap oracle;
  * ``block``: k = 256 measurements per item, n = 1e4, d = 20: each oracle call costs 256x
    more, so that the round's gradients dominate the sequential part of an Alg. 4 call.

Per device count D in (1, 2, 4): one fresh subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (JAX_PLATFORMS=cpu); D = 1 runs without
a mesh (the plain path), D = 2, 4 with ``Mesh(jax.devices(), ("users",))``. ``fit`` part: one
warm-up ``dpsco_jax.fit`` (compiles; reported), then ``REPS`` timed runs with the same key
(median reported). ``round`` part (another fresh subprocess per D): one Alg. 4 round at the
run's largest T, the jitted ``draw_queries`` (the sharded, parallelizable part) alone and the
whole ``localized_resque_sgd`` call (draws + the sequential ReSQue scan + noise), median of 20
calls each. The parent compares the released params across device counts (max abs diff
against D = 1) and writes experiments/results/study_002_devices.json (last stdout line: its
summary).

Query depth: each Alg. 4 call is ONE batched round of ``T^ - 1`` oracle calls (its queries
do not depend on the iterates), so the sequential rounds of a run are its Alg. 4 calls:
planned (worst case, ``record['phases'][i]['planned_alg4_calls']``) and realized
(``debug``); the oracle calls per run are ``planned_gradients`` / realized ``gradients``.

The box: 2 physical cores (shared with other jobs; the load average is logged around every
subprocess). At most ~2x can be expected from 2 devices, and the 4-device number measures the
overhead of 4 host "devices" on 2 cores, not parallel speedup.

The ``paired`` part (``block`` only) is a check against load drift between subprocesses: one
process with 4 forced devices runs no mesh / a 2-device / a 4-device mesh interleaved, and
times one eager op on a plain vs a replicated array.

Run: ``.venv/bin/python experiments/study_002_devices.py`` (all parts, ~18 minutes on 2 shared
cores, most of it compilation: a warm-up with a mesh compiles for 55-150 s); one part:
``... --only fit|round|paired [glm] [block]`` (other parts are kept from the JSON).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results" / "study_002_devices.json"
DEVICES = (1, 2, 4)
REPS = 3
MICRO_REPS = 20
#: ``--quick`` (CI's smoke; the workers inherit it through the environment): the ``tiny``
#: problem on 1 and 2 devices, one timed rep, written to ``--out`` (never the study's JSON)
QUICK_SETTINGS = ((1, 2), 1, 2)   # DEVICES, REPS, MICRO_REPS of a quick run
QUICK = os.environ.get("DPSCO_STUDY_QUICK") == "1"
if QUICK:
  DEVICES, REPS, MICRO_REPS = QUICK_SETTINGS
RADIUS, LIPSCHITZ = 1.0, 1.0
# configs/resque.yaml (b)'s practical config; T_frac / max_iter set so a run takes seconds
BASE_CFG = {"epsilon": 1.0, "delta": 1e-5, "preset": "practical", "constants": "c_priv",
            "c_priv": 1.0, "rho": 0.02, "rho_over_r": 2.0, "max_bisection": 1, "phases": 1,
            "debug": True}
PROBLEMS = {
    "glm": {"n": 40000, "d": 20, "k": 1, "cfg": {"T_frac": 1.0, "max_iter": 20}},
    "block": {"n": 10000, "d": 20, "k": 256, "cfg": {"T_frac": 0.25, "max_iter": 20}},
    "tiny": {"n": 2000, "d": 5, "k": 1, "cfg": {"T_frac": 1.0, "max_iter": 2}},  # --quick
}


# ================================================================ worker (one subprocess) ==

def _problem(n: int, d: int, k: int):
  import numpy as np
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, k, d)).astype(np.float32)
  x /= np.linalg.norm(x, axis=-1, keepdims=True)
  w_star = rng.normal(size=d)
  w_star *= (RADIUS / 2) / np.linalg.norm(w_star)
  y = (x @ w_star.astype(np.float32)).astype(np.float32)
  return x, y, w_star


def _c_d(d: int) -> float:
  return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def _setup(name: str, devices: int):
  import warnings
  warnings.filterwarnings("ignore")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dpsco_jax.data import UserData
  assert len(jax.devices()) == devices, jax.devices()
  spec = PROBLEMS[name]
  n, d, k = spec["n"], spec["d"], spec["k"]
  x, y, w_star = _problem(n, d, k)
  data = UserData.from_arrays({"x": x, "y": y}, np.arange(n), max_items_per_user=1)

  def loss(w, ex):
    return jnp.mean(jnp.abs(ex["x"] @ w - ex["y"]))

  mesh = (jax.sharding.Mesh(np.array(jax.devices()), ("users",)) if devices > 1 else None)
  cfg = {**BASE_CFG, **spec["cfg"]}
  return spec, (x, y, w_star), data, loss, mesh, cfg


def worker_fit(name: str, devices: int) -> dict:
  """One warm-up fit, then REPS timed fits (same key)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dpsco_jax
  spec, (x, y, w_star), data, loss, mesh, cfg = _setup(name, devices)
  d = spec["d"]
  params = jnp.zeros(d, jnp.float32)
  consts = {"lipschitz": LIPSCHITZ, "radius": RADIUS}

  def fit():
    t0 = time.perf_counter()
    r = dpsco_jax.fit("resque_private_sco", cfg, loss, params, data, jax.random.key(0),
                      constants=consts, mesh=mesh)
    jax.block_until_ready(r.params)
    return r, time.perf_counter() - t0

  load0 = os.getloadavg()[0]
  res, warm_s = fit()
  times = [fit()[1] for _ in range(REPS)]
  w = np.asarray(res.params, np.float64)
  ph, dbg = res.record["phases"][0], res.debug["phases"][0]
  return {
      "problem": name, "devices": devices, "jax_devices": len(jax.devices()),
      "mesh": mesh is not None, "n": spec["n"], "d": d, "k": spec["k"], "config": cfg,
      "warmup_s": warm_s, "times_s": times, "median_s": statistics.median(times),
      "planned_rounds": int(ph["planned_alg4_calls"]),
      "planned_oracle_calls": int(ph["planned_gradients"]),
      "gradient_evaluations": int(res.gradient_evaluations),
      "realized_rounds": int(dbg["alg4_calls"]), "realized_oracle_calls": int(dbg["gradients"]),
      "ball_acceleration_iterations": int(dbg["iterations"]), "exit": dbg["exit"],
      "round_size_T": int(ph["num_steps"]),
      "privacy": {"epsilon": float(res.privacy.epsilon), "delta": float(res.privacy.delta),
                  "provenance": res.privacy.provenance},
      "params": w.tolist(),
      "excess_risk": _c_d(d) * float(np.linalg.norm(w - w_star)),
      "excess_risk_at_init": _c_d(d) * float(np.linalg.norm(w_star)),
      "loadavg_1min": [load0, os.getloadavg()[0]],
  }


def worker_round(name: str, devices: int) -> dict:
  """One Alg. 4 round at the run's largest T (``T^ - 1`` queries): the jitted
  ``draw_queries`` alone (the part the mesh splits) and the whole ``localized_resque_sgd``
  call (draws + the sequential ReSQue scan + noise); items are an argument of both (a
  closed-over array would be baked into the program as a constant)."""
  import jax
  import jax.numpy as jnp
  import dpsco_jax
  from dpsco_jax.algorithms.resque import solvers
  spec, (x, y, _), data, loss, mesh, cfg = _setup(name, devices)
  plan = dpsco_jax.plan("resque_private_sco", cfg, data.spec, num_params=spec["d"],
                        constants={"lipschitz": LIPSCHITZ, "radius": RADIUS})
  p = plan.detail.phases[0].p
  T, r, rho, beta = int(p["t_cap"]), float(p["erm"].r), float(p["erm"].rho), float(p["beta"])
  items = {"x": jnp.asarray(x), "y": jnp.asarray(y)}   # the flat items the driver queries
  users = None
  if mesh is not None:   # as the driver does: items replicated, the round split over users
    users = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("users"))
    items = jax.device_put(items, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  center = jnp.zeros(spec["d"], jnp.float32)
  draws = jax.jit(lambda it, key, c: solvers.draw_queries(key, loss, it, c, rho, T - 1,
                                                          users)[2])

  def alg4(it, key, c):
    return solvers.localized_resque_sgd(loss, it, c, key, T=T, radius=r, rho=rho, beta=beta,
                                        lipschitz=LIPSCHITZ, lam=1.0, users=users)[0]

  def median_call(fn):
    jax.block_until_ready(fn(items, jax.random.key(1), center))   # compile
    ts = []
    for i in range(MICRO_REPS):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(items, jax.random.key(2 + i), center))
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

  load0 = os.getloadavg()[0]
  draw_s, alg4_s = median_call(draws), median_call(alg4)
  return {"problem": name, "devices": devices, "round_size_T": T, "round_draws_s": draw_s,
          "round_alg4_s": alg4_s, "loadavg_1min": [load0, os.getloadavg()[0]]}


def worker_paired(name: str, devices: int) -> dict:
  """Robustness check against load drift between subprocesses: ONE process with ``devices``
  (= 4) forced devices runs the fit without a mesh and on meshes over the first 2 and all 4
  devices, interleaved (order ABC, CBA, ABC...; warm-ups first), same key. Also times one
  eager op (``x * 0.5 + 1`` on a d-vector) on a plain and on a replicated array: the driver's
  host-side control flow between rounds runs such ops on the rounds' replicated outputs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dpsco_jax
  spec, _, data, loss, _, cfg = _setup(name, devices)
  params = jnp.zeros(spec["d"], jnp.float32)
  consts = {"lipschitz": LIPSCHITZ, "radius": RADIUS}
  meshes = {1: None}
  for D in (2, 4):
    if D <= devices:
      meshes[D] = jax.sharding.Mesh(np.array(jax.devices()[:D]), ("users",))

  def fit(mesh):
    t0 = time.perf_counter()
    r = dpsco_jax.fit("resque_private_sco", cfg, loss, params, data, jax.random.key(0),
                      constants=consts, mesh=mesh)
    jax.block_until_ready(r.params)
    return r, time.perf_counter() - t0

  warm, out, times = {}, {}, {D: [] for D in meshes}
  for D, mesh in meshes.items():
    out[D], warm[D] = fit(mesh)
  order = list(meshes)
  for rep in range(REPS):
    for D in (order if rep % 2 == 0 else order[::-1]):
      times[D].append(fit(meshes[D])[1])

  def eager_us(x):
    f = lambda a: a * 0.5 + 1.0   # noqa: E731
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(200):
      x = f(x)
    jax.block_until_ready(x)
    return (time.perf_counter() - t0) / 200 * 1e6

  eager = {1: eager_us(jnp.ones(spec["d"]))}
  for D, mesh in meshes.items():
    if mesh is not None:
      eager[D] = eager_us(jax.device_put(jnp.ones(spec["d"]), jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec())))
  base = np.asarray(out[1].params)
  return {"problem": name, "devices": devices,
          "rows": [{"mesh_devices": D, "warmup_s": warm[D], "times_s": times[D],
                    "median_s": statistics.median(times[D]),
                    "ratio_to_no_mesh": statistics.median(times[D])
                    / statistics.median(times[1]),
                    "eager_op_us": eager[D],
                    "max_abs_param_diff_vs_no_mesh": float(np.max(np.abs(
                        np.asarray(out[D].params) - base)))} for D in meshes]}


# ================================================================================ parent ==

def run_one(part: str, name: str, devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, __file__, "--worker", part, name, str(devices)],
                        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  if proc.returncode != 0:
    raise RuntimeError(f"{part} {name} on {devices} devices failed:\n{proc.stderr[-3000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  out["subprocess_s"] = time.perf_counter() - t0
  if part == "paired":
    msg = "; ".join(f"mesh {r['mesh_devices']}: {r['median_s']:.2f}s {r['times_s']}, eager "
                    f"{r['eager_op_us']:.0f}us" for r in out["rows"])
    out["loadavg_1min"] = None
  elif part == "fit":
    msg = f"median {out['median_s']:.2f}s {out['times_s']} (warm-up {out['warmup_s']:.1f}s)"
  else:
    msg = (f"round T={out['round_size_T']}: draws {out['round_draws_s'] * 1e3:.2f}ms, "
           f"Alg. 4 call {out['round_alg4_s'] * 1e3:.2f}ms")
  print(f"# {part} {name} D={devices}: {msg}, load {out['loadavg_1min']}", file=sys.stderr,
        flush=True)
  return out


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
  except OSError:
    return "?"


def main(names: list[str], parts: tuple[str, ...] = ("fit", "round"),
         out_path: pathlib.Path = OUT) -> dict:
  """Runs ``parts`` for ``names``; a part not run is kept from the existing JSON at
  ``out_path`` (its own ``measured`` stamp says when)."""
  import numpy as np
  old = json.loads(out_path.read_text()) if out_path.exists() else {}
  runs = old.get("runs", {})
  measured = old.get("measured", {})
  for part in parts:
    for name in names:
      runs.setdefault(part, {})[name] = ([run_one(part, name, D) for D in DEVICES]
                                         if part != "paired" else run_one(part, name, 4))
      measured.setdefault(part, {})[name] = {"commit": _commit(),
                                             "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime())}
  summary = {}
  for name, rs in runs.get("fit", {}).items():
    base = rs[0]
    rounds = {r["devices"]: r for r in runs.get("round", {}).get(name, [])}
    rows = []
    for r in rs:
      row = {
          "devices": r["devices"], "median_s": r["median_s"], "times_s": r["times_s"],
          "ratio_to_1": r["median_s"] / base["median_s"], "warmup_s": r["warmup_s"],
          "planned_rounds": r["planned_rounds"], "realized_rounds": r["realized_rounds"],
          "planned_oracle_calls": r["planned_oracle_calls"],
          "realized_oracle_calls": r["realized_oracle_calls"], "round_size_T": r["round_size_T"],
          "max_abs_param_diff_vs_1": float(np.max(np.abs(np.asarray(r["params"])
                                                          - np.asarray(base["params"])))),
          "same_rounds_as_1": (r["realized_rounds"], r["realized_oracle_calls"])
          == (base["realized_rounds"], base["realized_oracle_calls"]),
          "excess_risk": r["excess_risk"], "loadavg_1min": r["loadavg_1min"]}
      m = rounds.get(r["devices"])
      if m is not None:
        row.update({"round_draws_ms": 1e3 * m["round_draws_s"],
                    "round_alg4_ms": 1e3 * m["round_alg4_s"],
                    "draws_share_of_round": m["round_draws_s"] / m["round_alg4_s"],
                    "round_draws_ratio_to_1": m["round_draws_s"] / rounds[1]["round_draws_s"],
                    "round_alg4_ratio_to_1": m["round_alg4_s"] / rounds[1]["round_alg4_s"]})
      rows.append(row)
    summary[name] = {"n": base["n"], "d": base["d"], "k": base["k"], "config": base["config"],
                     "excess_risk_at_init": base["excess_risk_at_init"],
                     "privacy": base["privacy"], "rows": rows}
    paired = runs.get("paired", {}).get(name)
    if paired is not None:
      summary[name]["paired_one_process"] = paired["rows"]
  out = {"study": "002 ReSQue private SCO on 1/2/4 forced host devices",
         "machine": {"cpu_count": os.cpu_count(), "note": "2 physical cores shared with other "
                     "jobs: at most ~2x from 2 devices; 4 devices measure overhead"},
         "reps": REPS, "micro_reps": MICRO_REPS, "measured": measured, "summary": summary,
         "runs": runs}
  if QUICK:
    out["quick"] = "a smoke of the code path (tiny problem, 1 rep): not a measurement"
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps(out, indent=1) + "\n")
  return out


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    sys.path.insert(0, str(ROOT))
    if QUICK:   # a smoke's timings are no measurement: compile unoptimised (before the backend)
      sys.path.insert(0, str(ROOT / "experiments"))
      from _timing import smoke_xla_flags
      smoke_xla_flags()
    part, name, devices = sys.argv[2], sys.argv[3], int(sys.argv[4])
    fn = {"fit": worker_fit, "round": worker_round, "paired": worker_paired}[part]
    print(json.dumps(fn(name, devices)))
  else:
    import argparse
    ap = argparse.ArgumentParser(description="Study 002: ReSQue on 1, 2, 4 forced host devices")
    ap.add_argument("names", nargs="*", metavar="PROBLEM",
                    help=f"problems ({', '.join(PROBLEMS)}; default: glm block)")
    ap.add_argument("--only", choices=("fit", "round", "paired"),
                    help="run one part (the others are kept from the JSON)")
    ap.add_argument("--quick", action="store_true",
                    help="CI's smoke: the tiny problem on 1 and 2 devices, 1 rep, to --out")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help=f"the JSON (default {OUT.relative_to(ROOT)}; required with --quick)")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in PROBLEMS]
    if unknown:
      ap.error(f"unknown problem {unknown[0]!r}; known: {', '.join(PROBLEMS)}")
    if args.quick:
      if args.out is None or args.out.resolve() == OUT.resolve():
        ap.error("--quick writes a smoke, not the study: give another --out")
      os.environ["DPSCO_STUDY_QUICK"] = "1"   # the workers' settings (read at their import)
      QUICK = True
      DEVICES, REPS, MICRO_REPS = QUICK_SETTINGS
      main(args.names or ["tiny"], (args.only,) if args.only else ("fit", "round"), args.out)
      sys.exit(0)
    parts = (args.only,) if args.only else ("fit", "round")
    main(args.names or ["glm", "block"], parts, args.out or OUT)
    if args.only is None and not args.names:
      main(["block"], ("paired",), args.out or OUT)
