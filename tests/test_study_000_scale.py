"""experiments/study_000_scale.py (issue 28, paper 000 as n grows): the table it prints is the
right statistics of the records it is given. Synthetic records with known answers: Algorithm 3's
excess risk is exactly half DP-SGD's on every seed (ratio 0.5, interval [0.5, 0.5], all wins) and
falls like n^-1.5 (slope -1.5); a cell where most Algorithm 3 runs halted is left out of the slope;
records off the evaluation seeds, at another m or of label flips are ignored."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import study_000_scale as study  # noqa: E402


def _rec(alg, n, f, seed, risk, *, m=64, mode="huge", halted=None):
  return {"algorithm": alg, "n_users": n, "m": m, "seed": seed, "excess_risk": risk,
          "status": "ok", "halted_phase": halted,
          "config": {"corruption": f, "corruption_mode": mode}}


def test_ratios_slopes_and_filters(tmp_path):
  recs = []
  for n in (10_000, 100_000, 1_000_000):
    for s in range(300, 310):
      base = (1 + 0.1 * (s - 300)) * n ** -1.5
      recs.append(_rec(study.DPSGD, n, 0.05, s, 2 * base))
      recs.append(_rec(study.ALG3, n, 0.05, s, base))
  # most runs halted at n = 3e6 (their fallback risk would wreck the slope if it were used)
  recs += [_rec(study.ALG3, 3_000_000, 0.05, s, 1.0, halted=1 if s < 306 else None) for s in range(300, 310)]
  recs += [_rec(study.ALG3, 1_000_000, 0.05, 700, 99.0),               # not an eval seed
           _rec(study.ALG3, 1_000_000, 0.05, 301, 99.0, m=16),         # another m
           _rec(study.ALG3, 1_000_000, 0.05, 302, 99.0, mode="flip")]  # label flips
  path = tmp_path / "filter_curve_records_x.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  out = study.main(["--records", str(tmp_path / "filter_curve_records*.jsonl")])
  rows = {(r["n_users"], r["corruption"]): r for r in out["rows"]}
  assert set(rows) == {(3_000_000, 0.05), (10_000, 0.05), (100_000, 0.05), (1_000_000, 0.05)}
  for n in (10_000, 100_000, 1_000_000):
    a3 = rows[(n, 0.05)][study.ALG3]
    assert a3["seeds"] == 10 and a3["halted"] == 0
    assert a3["vs_dp_sgd"] == pytest.approx([0.5, 0.5, 0.5])
    assert (a3["wins"], a3["paired"]) == (10, 10)
  assert rows[(3_000_000, 0.05)][study.ALG3]["halted"] == 6
  slope = out["slopes"][f"{study.ALG3} f=0.05"]
  assert slope["slope"] == pytest.approx(-1.5, abs=1e-6)
  assert slope["n"] == [10_000.0, 100_000.0, 1_000_000.0]   # the halted n = 3e6 cell is out
  assert out["slopes"][f"{study.DPSGD} f=0.05"]["slope"] == pytest.approx(-1.5, abs=1e-6)
  # the fresh-seed view sees none of these records
  assert study.main(["--records", str(path), "--seeds", "600-609"])["rows"] == []


def test_slope_against_m_at_one_n(tmp_path):
  """``--m-slope N``: Algorithm 3's risk is exactly 0.5 m^-0.75 on every seed at n = 1e5
  (slope -0.75, a zero-width interval: the bootstrap resamples each m's seeds on its own); another n's records, a cell with fewer than 10 seeds (m = 256) and
  label-flip records are left out; DP-SGD's flat risk gives slope 0."""
  recs = []
  for m in (16, 64):
    for s in range(300, 310):
      recs.append(_rec(study.ALG3, 100_000, 0.02, s, 0.5 * m ** -0.75, m=m))
      recs.append(_rec(study.DPSGD, 100_000, 0.02, s, 0.3, m=m))
      recs.append(_rec(study.ALG3, 10_000, 0.02, s, 5.0, m=m))             # another n
      recs.append(_rec(study.ALG3, 100_000, 0.02, s, 9.0, m=m, mode="flip"))
  recs += [_rec(study.ALG3, 100_000, 0.02, s, 99.0, m=256) for s in range(300, 305)]
  path = tmp_path / "filter_curve_records_m.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  out = study.main(["--records", str(path), "--m-slope", "100000"])
  a3 = out[f"{study.ALG3} f=0.02"]
  assert a3["slope"] == pytest.approx(-0.75, abs=1e-9) and a3["m"] == [16, 64]
  assert a3["ci95"] == pytest.approx([-0.75, -0.75], abs=1e-9)
  assert out[f"{study.DPSGD} f=0.02"]["slope"] == pytest.approx(0.0, abs=1e-9)


def test_bonferroni_interval_counts_every_cell_looked_at(tmp_path):
  """The corrected interval is at level ``1 - 0.05 / K`` with ``K`` the FILTER-vs-DP-SGD cells
  on the seeds over every m and mode (here 4: Algorithm 3 at two n, Algorithm 1 at one, and a
  flip cell at m = 16; a FILTER cell without DP-SGD and one on other seeds do not count). With
  noisy paired risks it contains the 95% interval and is strictly wider; with an exact ratio
  it is that ratio. A wrong K (1: no correction) would leave the two intervals equal."""
  rng = np.random.default_rng(0)
  recs = []
  for s in range(300, 310):
    base = 1.0 + rng.random()
    recs += [_rec(study.DPSGD, 10_000, 0.05, s, base),
             _rec(study.ALG3, 10_000, 0.05, s, base * (0.5 + 0.3 * rng.standard_normal())),
             _rec(study.DPSGD, 100_000, 0.05, s, base), _rec(study.ALG3, 100_000, 0.05, s, 0.5 * base),
             _rec(study.ALG1, 100_000, 0.05, s, 3 * base),
             _rec(study.DPSGD, 10_000, 0.05, s, base, m=16, mode="flip"),
             _rec(study.ALG3, 10_000, 0.05, s, base, m=16, mode="flip"),
             _rec(study.ALG3, 300_000, 0.05, s, base)]                     # no DP-SGD here
    recs.append(_rec(study.ALG3, 10_000, 0.02, s + 300, base))                # other seeds
    recs.append(_rec(study.DPSGD, 10_000, 0.02, s + 300, base))
  path = tmp_path / "filter_curve_records_b.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  assert study.cells_looked(str(path)) == 4
  out = study.main(["--records", str(path)])
  assert out["cells_looked"] == 4
  rows = {(r["n_users"], r["corruption"]): r for r in out["rows"]}
  noisy = rows[(10_000, 0.05)][study.ALG3]
  _, lo, hi = noisy["vs_dp_sgd"]
  blo, bhi = noisy["vs_dp_sgd_bonferroni"]
  assert blo < lo < hi < bhi
  assert rows[(100_000, 0.05)][study.ALG3]["vs_dp_sgd_bonferroni"] == pytest.approx([0.5, 0.5])
  assert rows[(100_000, 0.05)][study.ALG1]["vs_dp_sgd_bonferroni"] == pytest.approx([3.0, 3.0])
  assert "vs_dp_sgd" not in rows[(300_000, 0.05)][study.ALG3]


def test_the_float64_field_compares_only_records_that_carry_it(tmp_path):
  """``--risk excess_risk_f64``: each record's float64 excess risk where it has one (from a
  later file too, when an earlier one holds the same seed without it); records without it
  are left out, and the default view still reads the float32 field of the first record."""
  recs, later = [], []
  for s in range(300, 310):
    recs.append(_rec(study.DPSGD, 1_000_000, 0.0, s, 0.0) | {"excess_risk_f64": 2e-8})
    recs.append(_rec(study.ALG3, 1_000_000, 0.0, s, 6e-8 * (s - 299)))      # float32 only
    later.append(_rec(study.ALG3, 1_000_000, 0.0, s, 6e-8 * (s - 299))
                 | {"excess_risk_f64": 4e-8 * (s - 299)})
  (tmp_path / "filter_curve_records_a.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in recs))
  (tmp_path / "filter_curve_records_b_f64.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in later))
  glob_ = str(tmp_path / "filter_curve_records*.jsonl")
  (row,) = study.main(["--records", glob_, "--risk", "excess_risk_f64"])["rows"]
  assert row[study.ALG3]["mean"] == pytest.approx(4e-8 * 5.5)
  assert row[study.ALG3]["vs_dp_sgd"][0] == pytest.approx(2 * 5.5, rel=0.05)
  (row,) = study.main(["--records", glob_])["rows"]   # float32: DP-SGD's 0 makes no ratio
  assert row[study.ALG3]["mean"] == pytest.approx(6e-8 * 5.5)
