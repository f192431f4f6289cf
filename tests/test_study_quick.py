"""The study's smokes (issue 28: "heavy sweeps are experiments, not tests: CI keeps a --quick
smoke of each").

Every ``configs/study/*.yaml`` runs through the runner's ``--quick`` (its whole pipeline:
sections, tuning, selection, evaluation, ``compare``; first value of every sweep, one seed per
phase, sizes capped). They check that the code paths still run, not the numbers (those are
STUDY.md's). The analysis scripts' smokes: ``tests/test_study_scripts.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pathlib

import pytest

from dpsco_jax import runner
from dpsco_jax.runner.quick import QUICK_CAPS, quick_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY_CONFIGS = sorted((ROOT / "configs" / "study").glob("*.yaml"))


def test_quick_config_keeps_the_shape_and_shrinks_the_sweeps():
  config = {"name": "x", "problem": {"name": "least_squares", "n_users": [50000, 100]},
            "d": [3, 5], "omega_bounds": [[0.1, 5.0], [0.2, 4.0]], "seed": [4, 5],
            "tuning_seeds": [0, 1, 2], "eval_seeds": [300, 301],
            "select": {"metric": "excess_risk", "over": ["learning_rate"]},
            "compare": {"baseline": "dp_sgd_user", "metric": "excess_risk"},
            "experiments": [{"algorithm": "dp_sgd_user", "learning_rate": [0.1, 0.3, 1.0],
                             "epsilon": [1.0, 4.0], "num_steps": [500, 100]},
                            {"algorithm": {"name": "dp_sgd_item", "clip_norm": [1.0, 2.0]}}]}
  before = copy.deepcopy(config)
  q = quick_config(config)
  assert config == before                      # the input is not changed
  assert q["problem"] == {"name": "least_squares", "n_users": QUICK_CAPS["n_users"]}
  assert q["d"] == 3 and q["omega_bounds"] == [0.1, 5.0]   # one sequence-valued key's value
  assert (q["seed"], q["tuning_seeds"], q["eval_seeds"]) == ([4], [0], [300])
  assert q["select"] == config["select"] and q["compare"] == config["compare"]
  first, second = q["experiments"]
  assert first == {"algorithm": "dp_sgd_user", "learning_rate": [0.1, 0.3], "epsilon": 1.0,
                   "num_steps": QUICK_CAPS["num_steps"]}
  # a key select chooses among keeps two values, uncapped (two capped values could be one)
  chosen = quick_config({**config, "select": {"over": ["num_steps"]}})["experiments"][0]
  assert chosen["num_steps"] == [500, 100]
  assert second == {"algorithm": {"name": "dp_sgd_item", "clip_norm": 1.0}}
  assert quick_config({"n_users": 10})["n_users"] == 10     # a smaller size is kept


CLI_CONFIG = ROOT / "configs" / "study" / "mf_noise_dpsgd_tree.yaml"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
  """``dpsco run CLI_CONFIG --quick --quiet --out FILE`` through the command line's own parser
  (``dpsco_jax.__main__.main``), once for both tests that need this config's smoke
  (test_the_cli_flag and its case of test_every_study_config_runs_quick, which ran the same
  quick sweep twice): its exit code, its stdout (the table) and the file it wrote."""
  from dpsco_jax.__main__ import main
  out = tmp_path_factory.mktemp("cli") / "q.json"
  table = io.StringIO()
  with contextlib.redirect_stdout(table):
    code = main(["run", str(CLI_CONFIG), "--quick", "--quiet", "--out", str(out)])
  return code, table.getvalue(), json.loads(out.read_text())


@pytest.mark.parametrize("path", STUDY_CONFIGS, ids=[p.stem for p in STUDY_CONFIGS])
def test_every_study_config_runs_quick(path, tmp_path, capsys, request):
  if path == CLI_CONFIG:   # the CLI's run of it (cli_run), not a second one
    code, table, written = request.getfixturevalue("cli_run")
    assert code == 0
    records = written["results"]
  else:
    out = tmp_path / "quick.json"
    records = runner.main_run(str(path), out=str(out), progress=False, quick=True)
    table = capsys.readouterr().out
    written = json.loads(out.read_text())
  assert records and all(r["status"] == "ok" for r in records), [
      r.get("error") for r in records if r["status"] != "ok"]
  assert all(r["quick"] is True for r in records)
  assert any(r.get("phase", "eval") == "eval" for r in records)
  assert len(written["results"]) == len(records) and "summary" in written
  assert "--quick" in table     # the table says it is a smoke


def test_the_cli_flag(cli_run):
  code, _, written = cli_run
  assert code == 0
  records = written["results"]
  assert records and all(r["quick"] is True for r in records)
  # one tuning seed and one evaluation seed per selected row, the first of each
  assert {r["seed"] for r in records} == {0, 100}
