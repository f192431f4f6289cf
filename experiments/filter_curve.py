"""FILTER robustness curve at n = 1e4 (issue 17 item 3): run and analyse.

    python experiments/filter_curve.py run [--config C] [--records R] [--deadline UNIX_TIME]
        [--max-seeds N] [--cells '["algorithm", n, "huge"|"flip", m, f]' ...]
    python experiments/filter_curve.py analyze [--records R] [--json J] [--png P]

``run`` (several processes may share one run: give each its own ``--records`` file
named ``filter_curve_records*.jsonl``; a cell any of them has finished is skipped) splits ``experiments/configs_eval/filter_curve.yaml`` into cells (one experiments row,
one m, one corruption fraction, all of that row's seeds), runs them with
``dpsco_jax.runner.run_config`` in the order below (cheap and most informative cells first) and
appends each cell's records to a JSONL file; cells already there are skipped, so the run can be
resumed, and a ``--deadline`` stops it between cells. ``analyze`` writes the per-cell table
(halting rate with its Clopper-Pearson 95% interval, excess risk with its Student-t 95%
interval, paired differences with DP-SGD) as JSON and the plot as PNG.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs_eval", "filter_curve.yaml")
RECORDS = os.path.join(HERE, "results", "filter_curve_records.jsonl")
SUMMARY = os.path.join(HERE, "results", "filter_curve.json")
PNG = os.path.join(HERE, "results", "filter_curve.png")
N2000 = os.path.join(HERE, "results", "filter_halting.json")
ALG3, ALG1 = "user_level_accelerated_erm", "user_level_phased_sgd"
DPSGD, NONPRIV = "dp_sgd_user", "nonprivate_sgd"
FRACTIONS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)


def cells(config: dict) -> list[tuple[tuple, dict]]:
  """(key, single-cell config) in run order: Algorithm 1 (cheap) everywhere; Algorithm 3 at
  m = 64 in the config's fraction order; DP-SGD; Algorithm 3 at the config's other m (16 on
  the n = 1e4 curve); non-private SGD."""
  rows = {r["algorithm"]: r for r in config["experiments"]}
  base = {k: v for k, v in config.items() if k not in ("experiments", "m", "corruption")}
  ms = config["m"]
  order = ([(ALG1, m) for m in ms] + [(ALG3, m) for m in ms if m == 64]
           + [(DPSGD, m) for m in ms] + [(ALG3, m) for m in ms if m != 64]
           + [(NONPRIV, m) for m in ms])
  out = []
  for alg, m in order:
    if alg not in rows:   # a config with fewer rows (the fresh-seed confirmations)
      continue
    for f in config["corruption"]:
      cell = copy.deepcopy(base)
      cell.update(m=m, corruption=f, experiments=[rows[alg]])
      out.append(((alg, base["n_users"], base.get("corruption_mode", "huge"), m, f), cell))
  return out


def predict_alg3(n: int, f: float, *, steps: int = 40, eps: float = 1.0, samples: int = 200_000,
                 seed: int = 0) -> float:
  """filter_halting.md's model of Algorithm 3's halting probability (practical preset, two
  phases of n_i = floor(2n/3), floor(n/3) users, K_i = n_i): the h_i huge users of phase i
  (hypergeometric split of floor(f n) over a random permutation) are isolated and the clean
  users all within 2 tau of each other, so the pair score is s_i = (K_i - h_i)^2/K_i + h_i/K_i;
  phase i passes iff s_i + nu_t >= 0.8 K_i + xi_i for all T steps, xi_i ~ Lap(8/eps) drawn once
  per phase, nu_t ~ Lap(16/eps). P(halt) = 1 - E[pass_1 pass_2]."""
  rng = np.random.default_rng(seed)
  sizes = [int(math.floor(2 * n / 3)), int(math.floor(n / 3))]
  huge = int(math.floor(f * n))
  h1 = rng.hypergeometric(huge, n - huge, sizes[0], size=samples)
  h2 = rng.hypergeometric(huge - h1, (n - huge) - (sizes[0] - h1), sizes[1])
  passed = np.ones(samples)
  for k, h in zip(sizes, (h1, h2)):
    s = (k - h) ** 2 / k + h / k
    gap = 0.8 * k + rng.laplace(0.0, 8.0 / eps, samples) - s   # a query fails iff nu < gap
    b = 16.0 / eps
    fail = np.where(gap < 0, 0.5 * np.exp(np.minimum(gap, 0) / b),
                    1 - 0.5 * np.exp(-np.maximum(gap, 0) / b))
    passed *= (1 - fail) ** steps
  return float(1 - passed.mean())


def predict_alg1_clean(groups: int = 50, eps: float = 1.0, phases: int = 2) -> float:
  """Algorithm 1 on clean data (score exactly C): each phase's one-shot test fails with
  probability P(Lap(8/eps) < -C/5) = exp(-C eps/40)/2."""
  return 1 - (1 - 0.5 * math.exp(-groups * eps / 40)) ** phases


def cell_key(record: dict) -> tuple:
  """(algorithm, n, corruption mode, m, fraction): one cell of the curve."""
  return (record["algorithm"], record["n_users"],
          record["config"].get("corruption_mode", "huge"), record["m"],
          record["config"]["corruption"])


def record_files(records: str) -> list[str]:
  """The records file and its siblings from parallel workers (``<stem>*.jsonl``)."""
  import glob
  stem = records[:-len(".jsonl")] if records.endswith(".jsonl") else records
  return sorted(set(glob.glob(stem + "*.jsonl")) | ({records} if os.path.exists(records) else set()))


def load_records(records: str) -> list[dict]:
  """Every record of every worker's file, one per (cell, seed) (the first one kept)."""
  out, seen = [], set()
  for path in record_files(records):
    with open(path) as fh:
      for line in fh:
        if line.strip():
          r = json.loads(line)
          key = cell_key(r) + (r["seed"],)
          if key not in seen:
            seen.add(key)
            out.append(r)
  return out


def done_cells(records: str) -> set:
  return {cell_key(r) for r in load_records(records)}


def done_seeds(records: str) -> dict:
  """The seeds each cell has a record for (a cell killed half way resumes at its next seed)."""
  out: dict = {}
  for r in load_records(records):
    out.setdefault(cell_key(r), set()).add(r.get("seed"))
  return out


def run(args) -> None:
  from dpsco_jax.runner import run_config
  with open(args.config) as fh:
    config = yaml.safe_load(fh)
  wanted = [tuple(json.loads(c)) for c in args.cells] if args.cells else None
  todo = cells(config)
  if wanted is not None:  # an explicit order of (algorithm, n, mode, m, corruption) cells
    index = dict(todo)
    todo = [(tuple(k), index[tuple(k)]) for k in wanted]
  for key, cell in todo:
    row = cell["experiments"][0]
    done = done_seeds(args.records).get(key, set())  # re-read: another process may share it
    if done:   # a complete cell is skipped; a partial one runs its missing seeds
      seeds = [s for s in row["seed"] if s not in done][:max(0, (args.max_seeds or 10 ** 9)
                                                             - len(done))]
      if not seeds:
        continue
      row["seed"] = seeds
    if args.deadline and time.time() > args.deadline:
      print(f"deadline reached before cell {key}", flush=True)
      break
    if args.max_seeds:  # a cheaper cell: the first N of the row's seeds
      row["seed"] = list(row["seed"])[:args.max_seeds]
    t0 = time.time()
    written = []

    def append(done, path=args.records, written=written):
      # each run's record as soon as it ends: a cell killed half way (the OOM killer took a
      # 1e6 cell after two hours on 2026-11-27) keeps the seeds it finished
      with open(path, "a") as fh:
        for r in done[len(written):]:
          fh.write(json.dumps(r, default=float) + "\n")
          written.append(r)
    records = run_config(cell, progress=False, on_record=append)
    append(records)
    print(f"{key}: {len(records)} runs, {time.time() - t0:.0f} s, halted "
          f"{sum(r.get('halted_phase') is not None for r in records)}", flush=True)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
  from scipy.stats import beta
  a = (1 - level) / 2
  lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
  hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
  return lo, hi


def t_ci(x) -> tuple[float, float, float]:
  """Mean and Student-t 95% interval (the runner's :func:`~dpsco_jax.runner.stats.t_interval`)."""
  from dpsco_jax.runner.stats import t_interval
  x = [float(v) for v in x]
  return (float(np.mean(x)), *t_interval(x))


def analyze(args) -> dict:
  records = [r for r in load_records(args.records) if r.get("status", "ok") == "ok"]
  by_cell: dict = {}
  for r in records:
    by_cell.setdefault(cell_key(r), []).append(r)
  table = []
  for (alg, n, mode, m, f), rs in sorted(by_cell.items()):
    rs = sorted(rs, key=lambda r: r["seed"])
    risk = [r["excess_risk"] for r in rs]
    mean, lo, hi = t_ci(risk)
    row = {"algorithm": alg, "n_users": n, "corruption_mode": mode, "m": m, "corruption": f,
           "seeds": len(rs),
           "seed_range": [rs[0]["seed"], rs[-1]["seed"]],
           "excess_risk_mean": mean, "excess_risk_ci95_t": [lo, hi],
           "wall_time_s_mean": float(np.mean([r["wall_time_s"] for r in rs]))}
    if alg == ALG3 and (mode == "huge" or f == 0.0):  # the model is of isolated outliers
      row["predicted_halting_rate"] = round(predict_alg3(n, f), 4)
    if alg == ALG1 and f == 0.0:
      row["predicted_halting_rate"] = round(predict_alg1_clean(), 4)
    if alg in (ALG1, ALG3):
      k = sum(r.get("halted_phase") is not None for r in rs)
      row.update(halted=k, halting_rate=k / len(rs),
                 halting_ci95_clopper_pearson=list(clopper_pearson(k, len(rs))),
                 halted_in_phase={str(p): sum(r.get("halted_phase") == p for r in rs)
                                  for p in (1, 2)})
      kept = [r["excess_risk"] for r in rs if r.get("halted_phase") is None]
      if kept:
        km, klo, khi = t_ci(kept)
        row.update(excess_risk_not_halted_mean=km, excess_risk_not_halted_ci95_t=[klo, khi])
    # paired difference with DP-SGD on the seeds both ran
    base = {r["seed"]: r["excess_risk"] for r in by_cell.get((DPSGD, n, mode, m, f), [])}
    if alg != DPSGD and base:
      seeds = sorted(set(base) & {r["seed"] for r in rs})
      own = {r["seed"]: r["excess_risk"] for r in rs}
      diff = [own[s] - base[s] for s in seeds]
      dm, dlo, dhi = t_ci(diff)
      row.update(vs_dp_sgd_paired_seeds=len(seeds), vs_dp_sgd_diff_mean=dm,
                 vs_dp_sgd_diff_ci95_t=[dlo, dhi],
                 vs_dp_sgd_ratio=float(np.mean([own[s] for s in seeds])
                                       / np.mean([base[s] for s in seeds])),
                 vs_dp_sgd_wins=int(sum(own[s] < base[s] for s in seeds)))
    table.append(row)
  out = {"config": os.path.relpath(CONFIG, os.path.dirname(HERE)),
         "records": os.path.relpath(args.records, os.path.dirname(HERE)),
         "intervals": "halting: Clopper-Pearson 95%; excess risk and paired differences: "
                      "Student-t 95% over seeds",
         "table": table}
  with open(args.json, "w") as fh:
    json.dump(out, fh, indent=1)
  plot(table, args.png)
  for row in table:
    h = ""
    if "halted" in row:
      lo, hi = row["halting_ci95_clopper_pearson"]
      h = f"halt {row['halted']}/{row['seeds']} [{lo:.3f}, {hi:.3f}] pred {row.get('predicted_halting_rate')}"
    lo, hi = row["excess_risk_ci95_t"]
    d = ""
    if "vs_dp_sgd_diff_mean" in row:
      dlo, dhi = row["vs_dp_sgd_diff_ci95_t"]
      d = (f"  vs DP-SGD {row['vs_dp_sgd_diff_mean']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] "
           f"ratio {row['vs_dp_sgd_ratio']:.2f} wins {row['vs_dp_sgd_wins']}/"
           f"{row['vs_dp_sgd_paired_seeds']}")
    print(f"{row['algorithm']:27s} n={row['n_users']} {row['corruption_mode']:4s} "
          f"m={row['m']:3d} f={row['corruption']:.2f} seeds={row['seeds']:2d} "
          f"risk {row['excess_risk_mean']:.4f} [{lo:.4f}, {hi:.4f}] {h}{d}")
  print(markdown(table))
  return out


def markdown(table: list[dict]) -> str:
  """One table per (n, corruption mode), one line per (m, fraction): the four algorithms side
  by side."""
  cell = {(r["algorithm"], r["n_users"], r["corruption_mode"], r["m"], r["corruption"]): r
          for r in table}
  risk = lambda r: (f"{r['excess_risk_mean']:.4f} [{r['excess_risk_ci95_t'][0]:.4f}, "  # noqa
                    f"{r['excess_risk_ci95_t'][1]:.4f}]" if r else "not run")
  def halt(r):
    if not r:
      return "not run"
    lo, hi = r["halting_ci95_clopper_pearson"]
    pred = r.get("predicted_halting_rate")
    return (f"{r['halted']}/{r['seeds']} [{lo:.2f}, {hi:.2f}]"
            + (f" (model {pred:.3g})" if pred is not None else ""))
  def vs(r):
    if not r or "vs_dp_sgd_diff_mean" not in r:
      return "—"
    lo, hi = r["vs_dp_sgd_diff_ci95_t"]
    return (f"{r['vs_dp_sgd_diff_mean']:+.4f} [{lo:+.4f}, {hi:+.4f}], ratio "
            f"{r['vs_dp_sgd_ratio']:.2f}, {r['vs_dp_sgd_wins']}/{r['vs_dp_sgd_paired_seeds']}")
  lines = []
  for n, mode in sorted({(r["n_users"], r["corruption_mode"]) for r in table}):
    lines += [f"\n**n = {n:g}, corruption `{mode}`**\n",
              "| m | f | Alg 3 halted [CP 95%] | Alg 3 excess risk [t 95%] | Alg 3 − DP-SGD, "
              "paired [t 95%], ratio, wins | Alg 1 halted [CP 95%] | Alg 1 excess risk | DP-SGD "
              "excess risk | non-private SGD |", "|" + "---|" * 9]
    ms = sorted({r["m"] for r in table if (r["n_users"], r["corruption_mode"]) == (n, mode)},
                reverse=True)
    for m in ms:
      for f in FRACTIONS:
        a3, a1, dp, npv = (cell.get((a, n, mode, m, f)) for a in (ALG3, ALG1, DPSGD, NONPRIV))
        if not any((a3, a1, dp, npv)):
          continue
        lines.append(f"| {m} | {f:.2f} | {halt(a3)} | {risk(a3)} | {vs(a3)} | {halt(a1)} | "
                     f"{risk(a1)} | {risk(dp)} | {risk(npv)} |")
  return "\n".join(lines)


def _curve(ax, rows: list[dict], key: str, lo_hi: str, color: str, marker: str, label: str,
           ls: str = "-") -> None:
  rows = sorted(rows, key=lambda r: r["corruption"])
  if not rows:
    return
  x = np.array([100 * r["corruption"] for r in rows])
  y = np.array([r[key] for r in rows])
  lo = np.array([r[lo_hi][0] for r in rows])
  hi = np.array([r[lo_hi][1] for r in rows])
  ax.errorbar(x, y, yerr=[y - lo, hi - y], color=color, marker=marker, capsize=3, ls=ls,
              label=label)


def plot(table: list[dict], path: str) -> None:
  """Columns: n = 1e4 huge at m = 64 (with n = 2000 and n = 5e4 halting beside it), n = 1e4
  huge at m = 16, n = 1e4 label flips at m = 64. Top: halting rate; bottom: excess risk."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [(10_000, "huge", 64), (10_000, "huge", 16), (10_000, "flip", 64)]
  panels = [p for p in panels if any((r["n_users"], r["corruption_mode"], r["m"]) == p
                                     for r in table)]
  fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 8), squeeze=False)
  style = {ALG3: ("C0", "o", "Alg 3 (accelerated ERM + FILTER)"),
           ALG1: ("C1", "s", "Alg 1 (phased SGD + FILTER)"),
           DPSGD: ("C2", "^", "user-level DP-SGD"), NONPRIV: ("C3", "v", "non-private SGD")}
  grid = np.linspace(0, 0.2, 41)
  for j, (n, mode, m) in enumerate(panels):
    top, bot = axes[0, j], axes[1, j]
    for alg, (c, mk, lab) in style.items():
      rows = [r for r in table if (r["algorithm"], r["n_users"], r["corruption_mode"],
                                   r["m"]) == (alg, n, mode, m)]
      if rows and "halted" in rows[0]:
        _curve(top, rows, "halting_rate", "halting_ci95_clopper_pearson", c, mk,
               f"{lab} ({rows[0]['seeds']} seeds)")
      _curve(bot, rows, "excess_risk_mean", "excess_risk_ci95_t", c, mk, lab)
    if mode == "huge":
      top.plot(100 * grid, [predict_alg3(n, f, samples=20_000) for f in grid], color="C0",
               ls="--", lw=1, label="Alg 3, model (filter_halting.md), n = 1e4")
    if (mode, m) == ("huge", 64):
      big = [r for r in table if (r["algorithm"], r["n_users"], r["corruption_mode"],
                                  r["m"]) == (ALG3, 50_000, "huge", 64)]
      if big:
        _curve(top, big, "halting_rate", "halting_ci95_clopper_pearson", "C4", "D",
               f"Alg 3, n = 5e4 ({min(r['seeds'] for r in big)}-"
               f"{max(r['seeds'] for r in big)} seeds)")
        top.plot(100 * grid, [predict_alg3(50_000, f, samples=20_000) for f in grid],
                 color="C4", ls="--", lw=1, label="Alg 3, model, n = 5e4")
      if os.path.exists(N2000):  # the n = 2000 curve, same m
        with open(N2000) as fh:
          old = [h for h in json.load(fh)["halting"] if h["algorithm"] == ALG3]
        top.plot([100 * h["corruption"] for h in old], [h["halting_rate"] for h in old],
                 color="gray", marker=".", ls="-", lw=1, label="Alg 3, n = 2000 (30 seeds)")
        top.plot(100 * grid, [predict_alg3(2000, f, samples=20_000) for f in grid],
                 color="gray", ls="--", lw=1, label="Alg 3, model, n = 2000")
    what = "huge-gradient users (%)" if mode == "huge" else "label-flipped users (%)"
    bot.axhline(0.0827, color="gray", ls=":", lw=1, label="fallback point 0 (0.0827)")
    top.set_title(f"n = {n:g}, m = {m}, {mode}, eps = 1: halting rate (CP 95%)")
    top.set_ylim(-0.03, 1.03)
    top.set_xlabel(what)
    top.legend(fontsize=7)
    bot.set_title(f"excess risk on the clean population (t 95%), m = {m}, {mode}")
    bot.set_yscale("log")
    bot.set_xlabel(what)
    bot.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--config", default=CONFIG)
  r.add_argument("--records", default=RECORDS)
  r.add_argument("--deadline", type=float, default=None)
  r.add_argument("--max-seeds", type=int, default=None,
                 help="run only the first N seeds of each cell's row")
  r.add_argument("--cells", nargs="*", default=None,
                 help='explicit cells in order, each a JSON list '
                      '["algorithm", n_users, "huge"|"flip", m, fraction]')
  a = sub.add_parser("analyze")
  a.add_argument("--records", default=RECORDS)
  a.add_argument("--json", default=SUMMARY)
  a.add_argument("--png", default=PNG)
  args = p.parse_args(argv)
  run(args) if args.cmd == "run" else analyze(args)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(HERE))
  main()
