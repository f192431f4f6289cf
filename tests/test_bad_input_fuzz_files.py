"""Bad data files of every supported format (issue 46): seeded random faults (non-finite
values, out-of-range integers, blank or look-alike ids, truncated bytes, wrong shapes or
lengths, text in a feature column, empty files, no rows) each give a ConfigError naming the
file (and the column where there is one), never another exception and never a silent run.
The CLI stops such a run before any training: one line, exit code 2."""

import numpy as np
import pytest

from dpsco_jax import runner
from dpsco_jax.__main__ import main
from dpsco_jax.config.types import ConfigError
from dpsco_jax.runner.datafiles import load_data_file, parse_data_file
from test_runner_user_code import _write, user_mod  # noqa: F401 (a fixture)

FORMATS = ["npz", "csv", "parquet"]
SEEDS = [0, 1, 2]
N = 12


def _table(rng):
  """A good table: string ids, two float features, an int label."""
  ids = np.array([f"u{i}" for i in rng.integers(0, 4, N)])
  return {"uid": ids, "f0": rng.normal(size=N), "f1": rng.normal(size=N),
          "label": rng.integers(0, 2, N)}


def _write_file(fmt, path, cols):
  if fmt == "npz":
    np.savez(path, **cols)
  elif fmt == "csv":
    names = list(cols)
    lines = [",".join(names)] + [",".join(str(cols[c][i]) for c in names)
                                 for i in range(len(cols["uid"]))]
    path.write_text("\n".join(lines) + "\n")
  else:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({c: list(v) for c, v in cols.items()}), path)


def _row(rng):
  return int(rng.integers(0, N))


# Each fault: (rng, fmt, cols) -> (cols, the column the message names or None). A fault that
# a format cannot hold returns its own variant (noted).
def _non_finite(rng, fmt, cols):
  col = str(rng.choice(["f0", "f1"]))
  cols[col][_row(rng)] = rng.choice([np.nan, np.inf, -np.inf])
  return cols, col


def _int_out_of_range(rng, fmt, cols):
  cols["label"] = cols["label"].astype(np.int64)
  cols["label"][_row(rng)] = int(rng.choice([-1, 1])) * int(rng.integers(2**31, 2**50))
  return cols, "label"


def _float32_overflow(rng, fmt, cols):
  cols["f1"][_row(rng)] = float(rng.choice([-1, 1])) * 10.0 ** float(rng.uniform(39, 300))
  return cols, "f1"


def _blank_id(rng, fmt, cols):
  cols["uid"] = cols["uid"].astype("<U8")
  cols["uid"][_row(rng)] = str(rng.choice(["", " ", "  "]))
  return cols, "uid"


def _look_alike_id(rng, fmt, cols):
  """csv: the same id but for spaces; npz: a non-integer float id; parquet: a null id."""
  i, j = rng.choice(N, 2, replace=False)
  if fmt == "csv":
    cols["uid"] = cols["uid"].astype("<U8")
    cols["uid"][i], cols["uid"][j] = "u1", " u1"
  elif fmt == "npz":
    cols["uid"] = rng.integers(0, 4, N).astype(np.float64)
    cols["uid"][i] += 0.5
  else:
    cols["uid"] = [None if k == i else v for k, v in enumerate(cols["uid"])]
  return cols, "uid"


def _text_feature(rng, fmt, cols):
  cols["f0"] = cols["f0"].astype("<U24")
  cols["f0"][_row(rng)] = str(rng.choice(["abc", "1,5", "--"]))
  if fmt == "csv":
    cols["f0"] = np.array([f'"{v}"' for v in cols["f0"]])   # "1,5" stays one field
  return cols, "f0"


def _wrong_length(rng, fmt, cols):
  """npz: a shorter array; csv: a ragged row; parquet: a list-valued column."""
  if fmt == "npz":
    cols["f1"] = cols["f1"][:-int(rng.integers(1, 4))]
    return cols, "f1"
  if fmt == "csv":
    row = _row(rng)
    cols["f1"] = np.array([f"{v},{v}" if k == row else str(v) for k, v in enumerate(cols["f1"])])
    return cols, None
  cols["f1"] = [[float(v), 1.0] for v in cols["f1"]]
  return cols, "f1"


def _wrong_shape(rng, fmt, cols):
  """npz: 2-D ids; csv: a header naming a column twice; parquet: no rows."""
  if fmt == "npz":
    cols["uid"] = cols["uid"].reshape(N // 2, 2)
    return cols, "uid"
  if fmt == "csv":
    return {"uid": cols["uid"], "f0": cols["f0"], "f0 ": cols["f1"]}, "f0"
  return {c: v[:0] for c, v in cols.items()}, None


def _no_rows(rng, fmt, cols):
  return {c: v[:0] for c, v in cols.items()}, None


FAULTS = [_non_finite, _int_out_of_range, _float32_overflow, _blank_id, _look_alike_id,
          _text_feature, _wrong_length, _wrong_shape, _no_rows]


def _spec(path, fmt):
  return {"path": str(path), "user_column": "uid"}


def _assert_refused(path, fmt, column=None):
  with pytest.raises(ConfigError) as info:   # any other exception fails the test
    load_data_file(parse_data_file(_spec(path, fmt), "problem.data"))
  msg = str(info.value)
  assert "\n" not in msg and str(path) in msg, msg
  if column is not None:
    assert repr(column) in msg, msg


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_value_or_layout_is_a_config_error_naming_the_file(tmp_path, fmt, fault, seed):
  rng = np.random.default_rng([seed, FAULTS.index(fault)])
  cols, column = fault(rng, fmt, _table(rng))
  path = tmp_path / f"d.{fmt}"
  _write_file(fmt, path, cols)
  _assert_refused(path, fmt, column)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_bytes_are_a_config_error_naming_the_file(tmp_path, fmt, seed):
  rng = np.random.default_rng(seed)
  path = tmp_path / f"d.{fmt}"
  _write_file(fmt, path, _table(rng))
  data = path.read_bytes()
  if fmt == "csv":
    cut = data.rindex(b",")   # inside the last row: a ragged row (a cut at a line end is
    # a shorter, valid file, which no reader can tell)
  else:
    cut = int(rng.integers(1, len(data)))
  path.write_bytes(data[:cut])
  _assert_refused(path, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_file_is_a_config_error_naming_the_file(tmp_path, fmt):
  if fmt == "parquet":
    pytest.importorskip("pyarrow")
  path = tmp_path / f"d.{fmt}"
  path.write_bytes(b"")
  _assert_refused(path, fmt)


def test_the_good_table_of_every_format_loads(tmp_path):
  """The faults above are the only difference from a file that loads."""
  for fmt in FORMATS:
    if fmt == "parquet":
      try:
        import pyarrow  # noqa: F401
      except ImportError:
        continue
    rng = np.random.default_rng(0)
    cols = _table(rng)
    _write_file(fmt, tmp_path / f"d.{fmt}", cols)
    data = load_data_file(parse_data_file(_spec(tmp_path / f"d.{fmt}", fmt), "problem.data"))
    assert data.n_users == len(set(cols["uid"].tolist()))


def test_the_cli_stops_a_run_on_a_nan_before_training(tmp_path, user_mod, capsys,  # noqa: F811
                                                      monkeypatch):
  users, x = np.repeat(np.arange(8), 2), np.ones((16, 3), np.float32)
  x[5, 1] = np.nan
  np.savez(tmp_path / "nan.npz", user_ids=users, x=x, y=np.zeros(16, np.float32))
  cfg = _write(tmp_path, f"""\
      problem:
        model: "{user_mod}:init_params"
        loss: "{user_mod}:logistic"
        data: {{path: nan.npz, max_items_per_user: 2}}
      algorithm: {{name: nonprivate_sgd}}
      """)

  def no_training(*args, **kwargs):
    raise AssertionError("a run started on a file with a NaN")
  monkeypatch.setattr(runner, "run_one", no_training)
  assert main(["run", cfg, "--quiet"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("dpsco: error: problem.data: "), err
  assert str(tmp_path / "nan.npz") in err[0] and "array 'x' has 1 non-finite value" in err[0]
