"""experiments/study_000_theory.py (issue 28): where paper 000's theory presets can run, from
their data-free plans (no data is built)."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "study_000_theory.py"


def _module():
  spec = importlib.util.spec_from_file_location("study_000_theory", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_algorithm_1_theory_runs_from_3e5_and_algorithm_3_theory_at_no_reachable_n():
  rows = _module().admissible(ns=(1e5, 3e5, 1e7))
  plan = {(r["algorithm"], r["n_users"]): r["plan"] for r in rows}
  assert plan[("user_level_phased_sgd", 100000)].startswith("refused: Theorem B.1")
  assert plan[("user_level_phased_sgd", 300000)] == "ok"
  assert plan[("user_level_phased_sgd", 10000000)] == "ok"
  for n in (300000, 10000000):   # the phase-1 batch outgrows the phase's users
    assert "K_i <= n_i violated" in plan[("user_level_accelerated_erm", n)], plan
