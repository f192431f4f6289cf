"""Edges of the YAML runner found by a bug hunt as an outside user: output paths, data files,
config files and repeated runs; each is one ConfigError line naming the problem, before
anything runs."""

import numpy as np
import pytest

from dpsco_jax import __main__ as cli
from dpsco_jax import runner
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.runner.datafiles import load_data_file, parse_data_file
from test_runner_outputs import _config as _written, nothing_runs  # noqa: F401 (a fixture)

TINY = """\
problem: {name: least_squares, n_users: 16, m: 1, d: 2}
algorithm: {name: nonprivate_sgd, num_steps: 2, batch_size: 4, learning_rate: 0.1}
"""


def _config(tmp_path, text: str = TINY) -> str:
  return _written(tmp_path, text)


# --out under a path that is a file: os.makedirs raised FileExistsError / NotADirectoryError
# out of the CLI, a traceback instead of one line.
@pytest.mark.parametrize("sub", ["res.json", "deeper/res.json"])
def test_out_inside_a_file_is_one_line_naming_out(tmp_path, capsys, nothing_runs, sub):
  (tmp_path / "afile").write_text("{}")
  out = str(tmp_path / "afile" / sub)
  assert cli.main(["run", _config(tmp_path), "--out", out, "--quiet"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("dpsco: error: --out ") and out in err and "Traceback" not in err


# --out in a folder that cannot be written: the runs ran, then the first write raised, losing
# them with a traceback; now refused before anything runs.
def test_out_in_an_unwritable_folder_is_refused_before_any_run(tmp_path, nothing_runs):
  with pytest.raises(ConfigError, match=r"cannot write the outputs in /proc"):
    runner.main_run(_config(tmp_path), out="/proc/results.json", progress=False)


# a config file that is not UTF-8 text: UnicodeDecodeError escaped load_config (a traceback).
def test_a_config_that_is_not_utf8_is_one_config_error(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_bytes(b"name: \xff\xfe\n")
  with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text"):
    runner.load_config(str(path))


# seed: [0, 0, 1] ran seed 0 twice and the table counted 3 seeds (an interval over copies);
# two experiments entries with the same runs did the same.
@pytest.mark.parametrize("extra", [
    "seed: [0, 0, 1]\n",
    "seed: [0, 1]\nexperiments: [{label: a}, {label: a}]\n"])
def test_a_run_given_twice_is_refused(tmp_path, extra):
  with pytest.raises(ConfigError, match=r"seed 0 is given twice"):
    runner.run_config(runner.load_config(_config(tmp_path, TINY + extra)), progress=False)


def test_the_same_runs_under_two_labels_still_run(tmp_path):
  text = TINY + "experiments: [{label: a}, {label: b}]\n"
  records = runner.run_config(runner.load_config(_config(tmp_path, text)), progress=False)
  assert [r["status"] for r in records] == ["ok", "ok"]


def test_quick_runs_once_the_runs_it_collapses(tmp_path):
  text = TINY + "experiments: [{num_steps: 30}, {num_steps: 40}]\n"
  records = runner.main_run(_config(tmp_path, text), progress=False, quick=True)
  assert [(r["status"], r["num_steps"]) for r in records] == [("ok", 20)]


# experiments: misspelt as experiment: was reported as a missing algorithm; selct: as an
# unknown algorithm key without the runner key it meant.
@pytest.mark.parametrize("key,meant", [("experiment", "experiments"), ("selct", "select"),
                                       ("tuning_seed", "tuning_seeds")])
def test_a_misspelt_runner_key_is_named_with_its_spelling(tmp_path, key, meant):
  text = f"problem: {{name: least_squares, n_users: 16, m: 1, d: 2}}\n{key}: [0]\n"
  with pytest.raises(ConfigError, match=rf"unknown top-level key '{key}' .*'{meant}'"):
    runner.run_config(runner.load_config(_config(tmp_path, text)), progress=False)


def _csv_data(tmp_path, text, **kw):
  path = tmp_path / "d.csv"
  path.write_text(text)
  return {"path": str(path), "user_column": "uid", **kw}


# a .csv feature written 1_000 or with non-ASCII digits was read as a number by Python's
# float() (1000, 3), where other CSV readers keep it as text.
@pytest.mark.parametrize("field", ["1_000", "\u0663", "0x10"])
def test_a_csv_field_not_written_as_a_decimal_is_refused(tmp_path, field):
  value = _csv_data(tmp_path, f"uid,x\n1,0.5\n2,{field}\n3,1e-3\n")
  with pytest.raises(ConfigError, match=r"column 'x' has 1 field not written as a number.*line 3"):
    load_data_file(parse_data_file(value, "problem.data"))


def test_decimal_csv_fields_still_read(tmp_path):
  value = _csv_data(tmp_path, "uid,x\n1,+1.\n2,-.5\n3,2E3\n")
  data = load_data_file(parse_data_file(value, "problem.data"))
  assert sorted(np.asarray(data.items()["x"]).tolist()) == [-0.5, 1.0, 2000.0]


# a .csv written by pandas' to_csv with its index (a blank first header name) read the row
# index as an example column, silently, when columns was not listed.
def test_a_blank_column_name_is_refused_unless_columns_are_listed(tmp_path):
  value = _csv_data(tmp_path, ",uid,x\n0,1,0.5\n1,2,1.5\n")
  with pytest.raises(ConfigError, match=r"a column with a blank name \(column 1\).*index=False"):
    load_data_file(parse_data_file(value, "problem.data"))
  data = load_data_file(parse_data_file({**value, "columns": ["x"]}, "problem.data"))
  assert list(data.examples) == ["x"]


# a directory named like a data file was reported as "no such file".
def test_a_directory_as_data_file_says_so(tmp_path):
  (tmp_path / "d.csv").mkdir()
  with pytest.raises(ConfigError, match=r"d.csv is a directory"):
    parse_data_file({"path": str(tmp_path / "d.csv"), "user_column": "uid"}, "problem.data")


# a max_items_per_user too large to pad every user to: numpy's MemoryError (297 GiB for 200
# users at 1e8) escaped the loader, a traceback out of the CLI. (Raised here, not allocated.)
def test_a_bound_too_large_to_pad_to_is_a_config_error(tmp_path, monkeypatch):
  from dpsco_jax.data import UserData

  def too_big(*args, **kwargs):
    raise MemoryError("Unable to allocate 297. GiB")
  monkeypatch.setattr(UserData, "from_table", too_big)
  value = _csv_data(tmp_path, "uid,x\n1,0.5\n2,1.5\n", max_items_per_user=100000000)
  with pytest.raises(ConfigError, match=r"max_items_per_user 100000000: .*does not fit"):
    load_data_file(parse_data_file(value, "problem.data"))
