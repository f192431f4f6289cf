"""Log-log slopes of excess risk against n (or m, epsilon) from a runner JSON, with intervals.

For each group of the other fields (algorithm, problem, epsilon, ...), fits
``log(mean excess risk) = a + s log(n)`` over the values of ``--x`` (least squares), and gives a
95% interval for the slope ``s`` by a bootstrap over seeds (the seeds of each ``x`` resampled
independently, 2000 resamples, generator seeded 0: deterministic). Only records of the
evaluation phase (``phase: eval``, or records without a phase) with status ok are used. The
theorem's exponent is printed beside each slope when ``--theory`` gives it; a slope more than
0.15 from it is flagged (the study must explain each flag: constants, regime, or a bug).

    python experiments/study_slopes.py experiments/results/study/srgd_scale.json \
        --x n_users --theory -0.5 [--plot out.png]

The last printed line is JSON: ``{group: {"slope", "lo", "hi", "points", "flag"}}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math

import numpy as np

KEYS = ("algorithm", "problem", "target_epsilon", "m", "n_users", "noise_mechanism", "sampling",
        "d")


def _groups(records: list[dict], x: str) -> dict[tuple, dict[float, list[float]]]:
  out: dict[tuple, dict[float, list[float]]] = collections.defaultdict(
      lambda: collections.defaultdict(list))
  for r in records:
    if r.get("status", "ok") != "ok" or r.get("phase", "eval") != "eval":
      continue
    v = r.get("excess_risk")
    if v is None or not math.isfinite(v) or v <= 0:
      continue
    key = tuple((k, r.get(k)) for k in KEYS if k != x and r.get(k) is not None)
    out[key][float(r[x])].append(float(v))
  return out


def fit_slope(points: dict[float, list[float]], *, resamples: int = 2000, seed: int = 0
              ) -> tuple[float, float, float]:
  """Slope of log(mean) on log(x) and its percentile-bootstrap 95% interval over seeds."""
  xs = sorted(points)
  lx = np.log(xs)

  def slope(means):
    return float(np.polyfit(lx, np.log(means), 1)[0])
  s = slope([np.mean(points[v]) for v in xs])
  rng = np.random.default_rng(seed)
  boots = []
  for _ in range(resamples):
    means = [np.mean(rng.choice(points[v], size=len(points[v]), replace=True)) for v in xs]
    boots.append(slope(means))
  lo, hi = np.percentile(boots, [2.5, 97.5])
  return s, float(lo), float(hi)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("results", help="runner JSON (python -m dpsco_jax run ... --out FILE)")
  ap.add_argument("--x", default="n_users", help="the field on the x axis")
  ap.add_argument("--theory", type=float, default=None, help="the theorem's exponent")
  ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
  args = ap.parse_args()
  data = json.load(open(args.results))
  groups = _groups(data["results"] if isinstance(data, dict) else data, args.x)
  out = {}
  print(f"{'group':70s} {'slope':>7s} {'95% interval':>18s}  points")
  for key, pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
    if len(pts) < 2:
      continue
    s, lo, hi = fit_slope(pts)
    flag = (args.theory is not None and abs(s - args.theory) > 0.15)
    name = ", ".join(f"{k}={v}" for k, v in key)
    short = " ".join(str(v) if k != "target_epsilon" else f"eps={v:g}" for k, v in key
                     if k not in ("m", "d"))
    out[name] = {"slope": round(s, 3), "lo": round(lo, 3), "hi": round(hi, 3), "label": short,
                 "points": {str(k): float(np.mean(v)) for k, v in sorted(pts.items())},
                 "seeds": min(len(v) for v in pts.values()), "flag": bool(flag)}
    print(f"{short[:70]:70s} {s:7.3f} [{lo:7.3f}, {hi:7.3f}]  {len(pts)}"
          + ("   <- off the theorem's exponent by > 0.15" if flag else ""))
  if args.plot:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, g in out.items():
      xs = [float(k) for k in g["points"]]
      ax.loglog(xs, list(g["points"].values()), "o-", label=f"{g['label']} (s={g['slope']})")
    ax.set_xlabel(args.x)
    ax.set_ylabel("mean excess risk (eval seeds)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
