"""Study, paper 001: the noise of SCOutputPert (certificate and Algorithm-2 sensitivity) against
naive user-level output perturbation, as m grows, from the data-free plans (no run needed: both
sigmas are closed forms of (n, m, epsilon, delta, L, mu)). Marks the crossover m predicted by
``output_perturbation.crossover_m``. Prints a table; last line JSON; ``--plot FILE.png``.

    python experiments/study_001_noise.py [--plot experiments/results/study/001_noise.png]
"""

from __future__ import annotations

import argparse
import json
import math

from dpsco_jax.algorithms.output_perturbation.naive import crossover_m, noise_ratio

MS = [10 ** k for k in range(1, 13)]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default=None)
  args = ap.parse_args()
  out = {}
  for mode in ("certificate", "alg2"):
    for n in (1_000, 10_000, 100_000, 1_000_000):
      for eps in (1.0, 4.0):
        delta = min(1e-6, 1.0 / n ** 2)
        ratios = [noise_ratio(n_users=n, m=m, epsilon=eps, delta=delta, mode=mode) for m in MS]
        cross = crossover_m(n_users=n, epsilon=eps, delta=delta, mode=mode)
        key = f"{mode} n={n:.0e} eps={eps:g}"
        out[key] = {"m": MS, "ratio": ratios, "crossover_m": cross, "delta": delta}
        print(f"{key:34s} crossover m = {cross:9.3g}   ratio at m=1e2 / 1e4 / 1e6: "
              f"{ratios[1]:9.3g} {ratios[3]:9.3g} {ratios[5]:9.3g}")
  if args.plot:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, mode in zip(axes, ("certificate", "alg2")):
      for key, g in out.items():
        if not key.startswith(mode):
          continue
        line, = ax.loglog(g["m"], g["ratio"], label=key[len(mode) + 1:])
        if math.isfinite(g["crossover_m"]):
          ax.axvline(g["crossover_m"], color=line.get_color(), ls=":", lw=0.8)
      ax.axhline(1.0, color="k", lw=0.8)
      ax.set_title(f"SCOutputPert ({mode}) sigma / naive sigma")
      ax.set_xlabel("items per user m")
    axes[0].set_ylabel("noise ratio (<1: the paper's mechanism adds less)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
