"""Runner statistics: paired comparison (ratio of means, percentile bootstrap interval, win
rate) on hand-made records with known answers."""

import math

import pytest

from dpsco_jax import runner
from dpsco_jax.runner.config import CompareSpec, parse_compare
from dpsco_jax.runner.stats import add_comparisons, paired_comparison

BASE = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}


def test_ratio_exactly_two_has_a_degenerate_interval_excluding_one():
  row = {s: 2 * v for s, v in BASE.items()}
  out = paired_comparison(row, BASE, resamples=500, seed=3)
  assert out["ratio"] == pytest.approx(2.0)
  # every joint resample keeps the pairs, so every resampled ratio is exactly 2
  assert out["ratio_ci95_lo"] == pytest.approx(2.0) and out["ratio_ci95_hi"] == pytest.approx(2.0)
  assert out["wins"] == 0 and out["win_rate"] == 0.0 and out["paired_seeds"] == 4


def test_ratio_below_one_with_noise_excludes_one_and_wins_every_seed():
  base = {s: 1.0 + 0.1 * s for s in range(10)}
  row = {s: 0.5 * v * (1.0 + 0.02 * (-1) ** s) for s, v in base.items()}
  out = paired_comparison(row, base, seed=0)
  expected = sum(row.values()) / sum(base.values())
  assert out["ratio"] == pytest.approx(expected)
  assert out["ratio_ci95_lo"] < out["ratio"] < out["ratio_ci95_hi"] < 1.0
  assert out["wins"] == 10 and out["win_rate"] == 1.0


def test_swapped_pairs_give_ratio_one_with_an_interval_including_one():
  row = {0: 2.0, 1: 1.0, 2: 4.0, 3: 3.0}  # equal means, two seeds lower, two higher
  out = paired_comparison(row, BASE, seed=0)
  assert out["ratio"] == pytest.approx(1.0)
  assert out["ratio_ci95_lo"] < 1.0 < out["ratio_ci95_hi"]
  assert out["wins"] == 2 and out["win_rate"] == 0.5


def test_only_seeds_both_have_are_paired():
  row = {0: 2.0, 1: 4.0, 2: 6.0, 3: 8.0, 5: 100.0}
  base = {**BASE, 4: 0.001}
  out = paired_comparison(row, base)
  assert out["paired_seeds"] == 4 and out["ratio"] == pytest.approx(2.0)
  one = paired_comparison({0: 1.0}, {0: 2.0, 1: 3.0})
  assert one["paired_seeds"] == 1 and one["ratio"] == 0.5 and one["wins"] == 1
  assert math.isnan(one["ratio_ci95_lo"]) and math.isnan(one["ratio_ci95_hi"])
  none = paired_comparison({0: 1.0}, {1: 1.0})
  assert none["paired_seeds"] == 0 and math.isnan(none["ratio"])


def test_bootstrap_is_deterministic_for_a_fixed_seed():
  base = {s: 1.0 + (s * 7919 % 13) / 13 for s in range(8)}
  row = {s: 1.0 + (s * 104729 % 11) / 11 for s in range(8)}
  a = paired_comparison(row, base, seed=42)
  b = paired_comparison(row, base, seed=42)
  c = paired_comparison(row, base, seed=43)
  assert a == b
  assert (a["ratio_ci95_lo"], a["ratio_ci95_hi"]) != (c["ratio_ci95_lo"], c["ratio_ci95_hi"])
  assert a["ratio"] == c["ratio"]


def _records(algorithm, values, label=None, target_epsilon=None, failed_seeds=()):
  out = []
  for seed, v in values.items():
    r = {"algorithm": algorithm, "target_epsilon": target_epsilon, "excess_risk": v,
         "epsilon": target_epsilon or math.inf, "provenance": "accountant",
         "gradient_evaluations": 10, "wall_time_s": 0.1, "seed": seed, "status": "ok",
         "config": {}}
    if label:
      r["label"] = label
    if seed in failed_seeds:
      r = {"algorithm": algorithm, "target_epsilon": target_epsilon, "seed": seed,
           "status": "failed", "error": "boom", "config": {"epsilon": target_epsilon},
           **({"label": label} if label else {})}
    out.append(r)
  return out


def test_rows_compare_with_their_baseline_in_json_rows_and_table():
  records = (_records("nonprivate_sgd", BASE)
             + _records("dp", {s: 2 * v for s, v in BASE.items()}, target_epsilon=1.0)
             + _records("dp", {0: 2.0, 1: 1.0, 2: 4.0, 3: 3.0, 4: 9.0}, target_epsilon=4.0,
                        failed_seeds=(3,)))
  fields = ["algorithm", "target_epsilon"]
  rows = runner.summarize(records, fields, CompareSpec("nonprivate_sgd", resamples=500))
  base, eps1, eps4 = rows
  assert base["compare_role"] == "baseline" and "ratio" not in base
  assert eps1["compare_role"] == "compared" and eps1["ratio"] == pytest.approx(2.0)
  assert eps1["compare_baseline"] == "algorithm=nonprivate_sgd"
  assert "bootstrap" in eps1["ratio_ci_method"]
  # seed 3 failed and seed 4 has no baseline: 3 paired seeds (0, 1, 2); wins on seed 1 only
  assert eps4["paired_seeds"] == 3 and eps4["wins"] == 1
  assert eps4["ratio"] == pytest.approx((2 + 1 + 4) / (1 + 2 + 3))
  table = runner.format_table(rows, fields)
  header = table.splitlines()[0]
  assert "ratio[boot95]" in header and "wins" in header
  assert "baseline" in table and "2 [2, 2]" in table and "1/3" in table


def test_baseline_by_label_mapping_and_ambiguity():
  records = (_records("sgd", BASE, label="slow")
             + _records("sgd", {s: v / 2 for s, v in BASE.items()}, label="fast"))
  rows = runner.summarize(records, ["label"], parse_compare({"compare": {"baseline": "slow"}}))
  assert rows[1]["ratio"] == pytest.approx(0.5) and rows[1]["win_rate"] == 1.0
  assert rows[1]["compare_baseline"] == "slow"
  # a mapping baseline picks one epsilon row; every other row is compared with it
  records = (_records("dp", BASE, target_epsilon=1.0)
             + _records("dp", {s: v / 4 for s, v in BASE.items()}, target_epsilon=8.0))
  spec = parse_compare({"compare": {"baseline": {"algorithm": "dp", "epsilon": 1.0}}})
  rows = runner.summarize(records, ["algorithm", "target_epsilon"], spec)
  assert rows[0]["compare_role"] == "baseline" and rows[1]["ratio"] == pytest.approx(0.25)
  # by algorithm name alone, two baseline rows could pair with a third algorithm's row
  records += _records("other", BASE)
  rows = runner.summarize(records, ["algorithm", "target_epsilon"], CompareSpec("dp"))
  assert "ambiguous" in rows[2]["compare_note"]
  assert "n/a" in runner.format_table(rows, ["algorithm", "target_epsilon"])


@pytest.mark.parametrize("block,match", [
    ({"metric": "excess_risk"}, "needs baseline"), ({"baseline": "a", "resample": 10}, "unknown"),
    ({"baseline": "a", "resamples": 5}, "resamples"), ({"baseline": 3}, "baseline"),
    ("", "baseline")])
def test_compare_block_is_checked(block, match):
  with pytest.raises(runner.ConfigError, match=match):
    parse_compare({"compare": block})
  assert parse_compare({}) is None


def test_ratio_plot_draws_bootstrap_error_bars(tmp_path):
  pytest.importorskip("matplotlib")
  from dpsco_jax.runner.plots import plot_ratio
  records = _records("base", BASE) + [
      r for e in (1.0, 4.0)
      for r in _records("dp", {s: e * v * (1 + 0.1 * s) for s, v in BASE.items()},
                        target_epsilon=e)]
  fields = ["algorithm", "target_epsilon"]
  rows = runner.summarize(records, fields, CompareSpec("base", resamples=200))
  path = plot_ratio(rows, "target_epsilon", fields, str(tmp_path / "ratio.png"))
  assert (tmp_path / "ratio.png").stat().st_size > 1000 and path.endswith("ratio.png")
