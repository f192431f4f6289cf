"""The study's analysis scripts as CI smokes (issue 28): each runs on the committed records it
reads (``experiments/results/study``), and ``study_002_devices.py --quick`` runs its
forced-device subprocesses on a tiny problem. They check that the code paths still run, not
the numbers (those are STUDY.md's). The configs' smokes: ``tests/test_study_quick.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "study"


def _script(*args: str, timeout: int = 600, env: dict | None = None) -> str:
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, **(env or {})})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _in_process(script: str, *args: str, monkeypatch, capsys) -> str:
  """Runs ``script`` as ``python script args`` from the repo would (``__main__``, its argv,
  its folder first on the path) but in this process, and returns its stdout: an analysis
  script is milliseconds of work behind a new Python's imports (jax, dpsco_jax: 2.4 s of
  CPU with byte-code cached, on the 2-core box). What it sets (argv, path, cwd) is put back
  after the test."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, "argv", [script, *args])
  monkeypatch.setattr(sys, "path", [str((ROOT / script).parent), *sys.path])
  runpy.run_path(str(ROOT / script), run_name="__main__")
  return capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ("experiments/study_001_noise.py",),
    ("experiments/study_pairs.py", str(RESULTS / "srgd_scale.json"),
     "--by", "problem,n_users,target_epsilon",
     "--pairs", "accelerated_dp_srgd:single_epoch_dp_sgd"),
    ("experiments/study_slopes.py", str(RESULTS / "srgd_scale.json"), "--x", "n_users",
     "--theory", "-0.5"),
    ("experiments/srgd_regime.py",),
    ("experiments/study_004_interior.py",),
], ids=["001_noise", "pairs", "slopes", "srgd_regime", "004_interior"])
def test_study_analysis_scripts_run_on_the_committed_records(args, monkeypatch, capsys):
  out = _in_process(*args, monkeypatch=monkeypatch, capsys=capsys)
  last = out.strip().splitlines()[-1]
  assert last.startswith(("{", "[", "|", "selected")), last[:200]
  if last.startswith("{"):
    assert json.loads(last)


def test_study_002_devices_quick(tmp_path):
  out = tmp_path / "s002.json"
  _script("experiments/study_002_devices.py", "--quick", "--only", "fit", "--out", str(out))
  summary = json.loads(out.read_text())
  assert "quick" in summary
  rows = summary["summary"]["tiny"]["rows"]
  assert [r["devices"] for r in rows] == [1, 2]
  # the mesh run releases the same params and spends the same rounds as the plain one
  assert rows[1]["same_rounds_as_1"] and rows[1]["max_abs_param_diff_vs_1"] < 1e-4
  proc = subprocess.run([sys.executable, "experiments/study_002_devices.py", "--quick"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "--out" in proc.stderr   # never over the study's JSON
