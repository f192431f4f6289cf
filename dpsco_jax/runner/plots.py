"""The runner's plots: excess risk against a swept field (Student-t 95% error bars over seeds)
and, with ``compare:``, the ratio to the baseline (percentile bootstrap 95% error bars)."""

from __future__ import annotations

import math

from dpsco_jax.runner.stats import row_metrics


def _pyplot():
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as err:  # optional extra
    raise RuntimeError("plotting needs matplotlib: pip install 'dpsco_jax[plot]'") from err
  return plt


def _lines(rows: list[dict], x_field: str, fields: list[str]) -> dict[tuple, list[dict]]:
  others = [f for f in fields if f != x_field]
  lines: dict[tuple, list[dict]] = {}
  for r in rows:
    lines.setdefault(tuple(r[f] for f in others), []).append(r)
  return {k: sorted(v, key=lambda r: r[x_field])
          for k, v in sorted(lines.items(), key=lambda kv: str(kv[0]))}


def _bars(mid: list[float], lo: list[float], hi: list[float]) -> list[list[float]]:
  """Error bar lengths below / above (0 where the interval is undefined)."""
  return [[m - l if math.isfinite(l) else 0.0 for m, l in zip(mid, lo)],
          [h - m if math.isfinite(h) else 0.0 for m, h in zip(mid, hi)]]


def _draw(rows: list[dict], x_field: str, fields: list[str], path: str, y: str, lo: str,
          hi: str, ylabel: str, hline: float | None = None) -> str:
  plt = _pyplot()
  others = [f for f in fields if f != x_field]
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, rs in _lines(rows, x_field, fields).items():
    mid = [r[y] for r in rs]
    ax.errorbar([r[x_field] for r in rs], mid,
                yerr=_bars(mid, [r[lo] for r in rs], [r[hi] for r in rs]),
                label=", ".join(f"{f}={v}" for f, v in zip(others, key)), marker="o",
                capsize=3)
  if hline is not None:
    ax.axhline(hline, color="gray", linewidth=0.8, linestyle="--")
  ax.set_xlabel(x_field)
  ax.set_ylabel(ylabel)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_metric(rows: list[dict], x_field: str, fields: list[str], path: str) -> str:
  """Excess risk (mean and 95% t-interval over seeds) of aggregated rows against ``x_field``,
  one line per other group; without excess risk (a user problem), the first metric."""
  metrics = row_metrics(rows)
  m = metrics[0] if metrics else "excess_risk"
  rows = [r for r in rows if r.get("seeds") and r.get(x_field) is not None]
  return _draw(rows, x_field, fields, path, f"{m}_mean", f"{m}_ci95_lo", f"{m}_ci95_hi",
               "excess risk" if m == "excess_risk" else m)


def plot_ratio(rows: list[dict], x_field: str, fields: list[str], path: str) -> str:
  """Ratio to the baseline (``compare:``) against ``x_field`` with its percentile bootstrap
  95% interval as error bars; a dashed line at 1."""
  rows = [r for r in rows if r.get("compare_role") == "compared"
          and math.isfinite(r.get("ratio", math.nan)) and r.get(x_field) is not None]
  metric = rows[0]["compare_metric"] if rows else "metric"
  return _draw(rows, x_field, fields, path, "ratio", "ratio_ci95_lo", "ratio_ci95_hi",
               f"{metric} / baseline (bootstrap 95%)", hline=1.0)
