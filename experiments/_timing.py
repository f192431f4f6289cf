"""Paired, interleaved timing of jitted step functions (shared by the ``bench_*`` scripts).

A *step* is a jitted function ``step(*carry, *static_args) -> carry`` (e.g.
``(params, opt_state, batch) -> (params, opt_state)``); timing chains ``iters`` calls, so
every call depends on the previous one, and blocks once at the end of each window.

Method (the benchmark machines are small, noisy and shared):
  * compile and run once before timing (compile time is excluded and reported separately);
  * pick ``iters`` so that one window of the slowest candidate lasts about ``window_s``;
  * run ``reps`` repetitions; in each, time every candidate once, alternating the order
    (ABAB..., then BABA...) so slow drifts of the machine's load hit all candidates alike;
  * report the median per-step time of each candidate and the median of the *paired*
    per-repetition ratios ``t_candidate / t_reference`` (more robust to drift than the ratio
    of medians).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax


def smoke_xla_flags() -> None:
  """For a ``--quick`` smoke run: XLA:CPU compiles several times faster unoptimised and without
  its fusion emitters (a jaxlib < 0.11 switch: 0.11 aborts on the unknown flag). Must run before
  the backend starts; the costs and times are then those of unoptimised code, meaningful as a
  shape / plumbing check only."""
  from importlib.metadata import version  # noqa: PLC0415
  old_jaxlib = tuple(int(x) for x in version("jaxlib").split(".")[:2]) < (0, 11)
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in ("--xla_backend_optimization_level=0",
               *(["--xla_cpu_use_fusion_emitters=false"] if old_jaxlib else [])):
    if flag.split("=")[0] not in flags:
      flags += " " + flag
  os.environ["XLA_FLAGS"] = flags.strip()


@dataclass
class Candidate:
  """``step(*carry, *args) -> carry`` timed from the initial ``carry``."""
  name: str
  step: Callable[..., Any]
  carry: tuple
  args: tuple = ()
  compile_s: float = 0.0
  times: list[float] = field(default_factory=list)

  def warm(self) -> float:
    """Compiles and runs once; returns the wall time of that first call (compile + run)."""
    t0 = time.perf_counter()
    self.carry = tuple(jax.block_until_ready(self.step(*self.carry, *self.args)))
    self.compile_s = time.perf_counter() - t0
    return self.compile_s

  def window(self, iters: int) -> float:
    """Seconds per step over ``iters`` chained calls."""
    carry = self.carry
    t0 = time.perf_counter()
    for _ in range(iters):
      carry = self.step(*carry, *self.args)
    jax.block_until_ready(carry)
    dt = (time.perf_counter() - t0) / iters
    self.carry = tuple(carry)
    return dt


@dataclass
class Comparison:
  names: list[str]
  median_s: dict[str, float]
  ratio: dict[str, float]          # median of paired ratios to the reference (first) candidate
  ratio_iqr: dict[str, tuple[float, float]]
  compile_s: dict[str, float]
  iters: int
  reps: int
  times: dict[str, list[float]] = field(default_factory=dict)

  def paired_ratio(self, name: str, reference: str) -> float:
    """Median over repetitions of ``t[name] / t[reference]`` (any two candidates)."""
    return statistics.median(a / b for a, b in zip(self.times[name], self.times[reference]))


def _quantile(xs: Sequence[float], q: float) -> float:
  s = sorted(xs)
  if len(s) == 1:
    return s[0]
  pos = q * (len(s) - 1)
  lo = int(pos)
  hi = min(lo + 1, len(s) - 1)
  return s[lo] + (pos - lo) * (s[hi] - s[lo])


def compare(candidates: Sequence[Candidate], *, reps: int = 7, window_s: float = 0.25,
            min_iters: int = 1, max_iters: int = 1000, min_reps: int = 3,
            budget_s: float | None = None) -> Comparison:
  """Times ``candidates`` interleaved; ratios are relative to ``candidates[0]``.

  ``budget_s`` caps the timed part: when one repetition of all candidates would make
  ``reps`` repetitions exceed it, fewer repetitions are run (never fewer than ``min_reps``).
  """
  if len(candidates) < 2:
    raise ValueError("compare needs at least two candidates")
  for c in candidates:
    c.warm()
    c.times = []
  # Calibration: one step of each (already compiled) gives the iteration count.
  once = [c.window(1) for c in candidates]
  slowest = max(once)
  iters = int(min(max_iters, max(min_iters, round(window_s / max(slowest, 1e-9)))))
  if budget_s is not None:
    per_rep = iters * sum(once)
    reps = int(max(min_reps, min(reps, budget_s // max(per_rep, 1e-9))))
  first = 0
  if iters == 1:  # slow steps: the calibration pass already is a valid first repetition
    for c, t in zip(candidates, once):
      c.times.append(t)
    first = 1
  for r in range(first, reps):
    order = candidates if r % 2 == 0 else list(reversed(candidates))
    for c in order:
      c.times.append(c.window(iters))
  ref = candidates[0]
  ratio, iqr = {}, {}
  for c in candidates:
    paired = [t / t0 for t, t0 in zip(c.times, ref.times)]
    ratio[c.name] = statistics.median(paired)
    iqr[c.name] = (_quantile(paired, 0.25), _quantile(paired, 0.75))
  return Comparison(names=[c.name for c in candidates],
                    median_s={c.name: statistics.median(c.times) for c in candidates},
                    ratio=ratio, ratio_iqr=iqr,
                    compile_s={c.name: c.compile_s for c in candidates},
                    iters=iters, reps=reps, times={c.name: list(c.times) for c in candidates})


def format_comparison(title: str, comp: Comparison) -> str:
  """A small fixed-width table: candidate, median ms/step, paired ratio [IQR], compile s."""
  ref = comp.names[0]
  lines = [f"{title}  (ratios vs '{ref}'; {comp.reps} reps x {comp.iters} steps)",
           f"  {'candidate':<44} {'ms/step':>9} {'ratio':>7} {'IQR':>15} {'compile s':>10}"]
  for n in comp.names:
    lo, hi = comp.ratio_iqr[n]
    lines.append(f"  {n:<44} {1e3 * comp.median_s[n]:>9.2f} {comp.ratio[n]:>7.2f} "
                 f"{f'[{lo:.2f}, {hi:.2f}]':>15} {comp.compile_s[n]:>10.2f}")
  return "\n".join(lines)
