"""experiments/study_000_host_sgd.py (issue 28: DP-SGD at n = 1e6 on a CPU by host-streamed
Poisson sampling): a --quick smoke whose records carry the plan's guarantee, and a check that
each seed's problem is the runner's (same factory, same problem key), so these DP-SGD records
pair seed by seed with filter_curve.py's Algorithm 3 records on the same data."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import study_000_host_sgd as study  # noqa: E402


def test_quick_records_carry_the_plans_guarantee(tmp_path):
  out = study.main(["--quick", "--records", str(tmp_path / "r.jsonl")])
  assert len(out) == 2 and len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
  for rec in out:
    assert rec["algorithm"] == "dp_sgd_user" and rec["sampling_path"] == "host"
    assert rec["n_users"] == 2000 and rec["config"]["corruption"] == 0.05
    assert rec["epsilon"] <= rec["target_epsilon"] * (1 + 1e-9) and rec["provenance"] == "accountant"
    assert np.isfinite(rec["excess_risk"]) and rec["excess_risk"] >= 0


def test_each_seeds_problem_is_the_runners():
  from dpsco_jax.problems import problems
  from dpsco_jax.runner.batch import cached_problem, problem_config, run_keys
  cfg = {"problem": "logistic_corrupted", "n_users": 300, "m": 8, "d": 5, "radius": 4.0,
         "corruption": 0.05, "corruption_mode": "huge", "seed": 303,
         "algorithm": "dp_sgd_user", "epsilon": 1.0}
  runner = cached_problem(problem_config(cfg), problems(), None, run_keys(303)[0])
  pcfg = {k: cfg[k] for k in study.PROBLEM_KEYS} | {"corruption": 0.05, "seed": 303}
  mine = study.logistic_corrupted(pcfg, run_keys(303)[0])
  for k in ("x", "y"):
    np.testing.assert_array_equal(np.asarray(mine.data[k]), np.asarray(runner.data[k]))
  ud = study.user_data(mine)
  np.testing.assert_array_equal(np.asarray(ud.user_view()["example"]["x"]),
                                np.asarray(mine.data["x"]))


def test_a_rerun_resumes_at_the_seeds_its_records_lack(tmp_path, monkeypatch):
  # run_seed stubbed: what is tested is which seeds main() runs and appends
  ran = []

  def fake(config, row, corruption, seed):
    ran.append((corruption, seed))
    m = config["m"][0] if isinstance(config["m"], list) else config["m"]
    return {"algorithm": study.ALG, "problem": config["problem"], "n_users": config["n_users"],
            "m": m, "d": config["d"], "seed": seed,
            "excess_risk": 0.0, "wall_time_s": 0.0, "epsilon": 1.0,
            "config": {"corruption_mode": config["corruption_mode"], "corruption": corruption}}
  monkeypatch.setattr(study, "run_seed", fake)
  path = str(tmp_path / "r.jsonl")
  study.main(["--records", path, "--max-seeds", "2"])
  assert ran == [(0.05, 300), (0.05, 301)]
  study.main(["--records", path, "--max-seeds", "4"])   # 300, 301 are there: 302, 303 run
  assert ran[2:] == [(0.05, 302), (0.05, 303)]
  study.main(["--records", path, "--max-seeds", "2", "--corruption", "0.1"])  # another cell
  assert ran[4:] == [(0.1, 300), (0.1, 301)]
  assert len(open(path).read().splitlines()) == 6
  # same n and corruption, another m: another cell (it was skipped when the resume keyed on n)
  import yaml
  other = tmp_path / "m16.yaml"
  config = yaml.safe_load(open(study.main.__globals__["HERE"] + "/configs_eval/"
                               "filter_curve_1e6.yaml"))
  config["m"] = [16]
  other.write_text(yaml.safe_dump(config))
  study.main(["--records", path, "--max-seeds", "2", "--config", str(other)])
  assert ran[6:] == [(0.05, 300), (0.05, 301)]
