"""Data files of a YAML run (issue 46, "Data files"): every fault of a file's contents is one
ConfigError naming the file and the array / column before anything runs; nothing is dropped,
merged, wrapped or narrowed inexactly without the owner being told."""

import zipfile

import numpy as np
import pytest

from dpsco_jax import cache
from dpsco_jax.config.types import ConfigError
from dpsco_jax.data import UserData
from dpsco_jax.data.grouping import blank_ids, canonical_ids
from dpsco_jax.runner.datafiles import load_data_file, parse_data_file

IDS = np.array([1, 1, 2, 2, 3])


def _load(value):
  return load_data_file(parse_data_file(value, "problem.data"))


def _npz(tmp_path, name="d.npz", **arrays):
  arrays = {"user_ids": IDS, "x": np.ones((5, 2)), "y": np.arange(5), **arrays}
  np.savez(tmp_path / name, **arrays)
  return str(tmp_path / name)


def _csv(tmp_path, text, name="d.csv"):
  (tmp_path / name).write_text(text)
  return str(tmp_path / name)


def _refused(value, *parts):
  """The ConfigError of loading ``value``: one line, naming the key, the file and ``parts``."""
  path = value if isinstance(value, str) else value["path"]
  with pytest.raises(ConfigError) as info:
    _load(value)
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("problem.data") and path in msg, msg
  for part in parts:
    assert part in msg, msg
  return msg


# ----------------------------------------------------------------- 1. non-finite values


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_feature_in_a_npz_names_the_array_and_counts(tmp_path, bad):
  x = np.ones((5, 2))
  x[1, 0] = x[1, 1] = x[3, 0] = bad
  msg = _refused(_npz(tmp_path, x=x), "array 'x'", "3 non-finite values", "in 2 rows")
  assert "clean the file or drop those rows" in msg


def test_a_nan_in_a_csv_column_is_refused_naming_the_column(tmp_path):
  path = _csv(tmp_path, "uid,f0,f1\na,1,2\na,nan,2\nb,1,inf\n")
  _refused({"path": path, "user_column": "uid", "columns": {"x": ["f0", "f1"]}},
           "column 'f0'", "1 non-finite value (NaN or inf) in 1 row")


def test_a_parquet_null_is_refused_as_non_finite(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"uid": ["a", "a", "b"], "x": [1.0, None, 3.0]}),
                 tmp_path / "d.parquet")
  _refused({"path": str(tmp_path / "d.parquet"), "user_column": "uid"}, "column 'x'",
           "a parquet null reads as NaN")


def test_only_the_columns_the_run_reads_are_checked(tmp_path):
  z = np.ones((5, 2))
  z[0, 0] = np.nan
  data = _load({"path": _npz(tmp_path, z=z), "columns": ["x", "y"]})
  assert sorted(data.examples) == ["x", "y"] and data.n_users == 3


def test_the_eval_data_is_checked_too(tmp_path):
  x = np.ones((5, 2))
  x[0, 0] = np.nan
  path = _npz(tmp_path, x=x)
  with pytest.raises(ConfigError, match=r"^problem.eval_data: .*array 'x' has 1 non-finite"):
    parse_data_file(path, "problem.eval_data")


def test_library_users_keep_their_non_finite_items():
  """The file check is the runner's: UserData itself still takes NaN items (dropped at
  training by the clip stage, as before)."""
  x = np.ones((5, 2), np.float32)
  x[0, 0] = np.nan
  data = UserData.from_arrays({"x": x}, IDS)
  assert np.isnan(data.examples["x"]).sum() == 1


# ----------------------------------------------------------------- 2. exact narrowing


def test_int64_features_outside_int32_are_refused_not_wrapped(tmp_path):
  _refused(_npz(tmp_path, y=np.array([0, 1, 2**40, 3, -2**40])), "array 'y'",
           "2 integers outside the int32 range [-2147483648, 2147483647]")


def test_uint64_above_int32_is_refused(tmp_path):
  _refused(_npz(tmp_path, y=np.array([0, 1, 2**31, 3, 4], np.uint64)), "array 'y'",
           "1 integer outside the int32 range")


def test_int64_within_int32_is_kept_exactly(tmp_path):
  y = np.array([0, 2**31 - 1, -2**31, 3, 4])
  data = _load(_npz(tmp_path, y=y))
  assert data.examples["y"].dtype == np.int32
  np.testing.assert_array_equal(np.sort(data.items()["y"]), np.sort(y))


def test_float64_beyond_float32_is_refused(tmp_path):
  x = np.ones((5, 2))
  x[2, 1] = -1e39
  _refused(_npz(tmp_path, x=x), "array 'x'", "1 value beyond the float32 range")


def test_a_csv_int_column_at_2_to_the_40_is_refused(tmp_path):
  path = _csv(tmp_path, "uid,f0\na,1\nb,1099511627776\n")
  _refused({"path": path, "user_column": "uid"}, "column 'f0'", "outside the int32 range")


def test_an_int_stacked_with_floats_must_be_exact_in_float32(tmp_path):
  path = _csv(tmp_path, "uid,f0,f1\na,0.5,16777217\nb,1.5,2\n")
  _refused({"path": path, "user_column": "uid", "columns": {"x": ["f0", "f1"]}},
           "column 'f1'", "1 integer beyond 2**24 in magnitude", "float32")
  path = _csv(tmp_path, "uid,f0,f1\na,0.5,16777216\nb,1.5,-16777216\n", "ok.csv")
  data = _load({"path": path, "user_column": "uid", "columns": {"x": ["f0", "f1"]}})
  np.testing.assert_array_equal(data.items()["x"][:, 1], [16777216, -16777216])


# ----------------------------------------------------------------- 3. ids


def test_csv_ids_are_their_text_not_a_parsed_number(tmp_path):
  path = _csv(tmp_path, "uid,f0\n01,1\n1,2\n1.0,3\n001,4\n1,5\n")
  data = _load({"path": path, "user_column": "uid"})
  assert data.user_ids.tolist() == ["01", "1", "1.0", "001"]
  np.testing.assert_array_equal(data.n_items, [1, 2, 1, 1])


def test_user_id_dtype_int_reads_integer_ids_and_refuses_others(tmp_path):
  path = _csv(tmp_path, "uid,f0\n01,1\n1,2\n 2 ,3\n")
  data = _load({"path": path, "user_column": "uid", "user_id_dtype": "int"})
  assert data.user_ids.tolist() == [1, 2] and data.n_items.tolist() == [2, 1]
  path = _csv(tmp_path, "uid,f0\n1,1\n\n1.0,2\n2,3\nx,4\n", "bad.csv")
  _refused({"path": path, "user_column": "uid", "user_id_dtype": "int"}, "column 'uid'",
           "2 ids not written as an integer", "the first on line 4")


def test_a_blank_csv_id_is_refused_naming_its_line(tmp_path):
  path = _csv(tmp_path, "uid,f0\na,1\n\n  ,2\nb,3\n,4\n")
  _refused({"path": path, "user_column": "uid"}, "column 'uid' has 2 blank ids",
           "the first on line 4")


def test_ids_equal_but_for_surrounding_spaces_are_refused(tmp_path):
  path = _csv(tmp_path, "uid,f0\n1,1\n2,2\n 1,3\n")
  _refused({"path": path, "user_column": "uid"}, "lines 2 and 4 differ only in surrounding "
           "spaces")
  path = _csv(tmp_path, "uid, f0\n 1, 1\n 2, 2\n 1, 3\n", "spaced.csv")   # spaced alike: fine
  assert _load({"path": path, "user_column": "uid"}).user_ids.tolist() == ["1", "2"]


@pytest.mark.parametrize("ids, part", [
    (np.array(["a", "", "b", "b", "c"]), "1 blank id(s)"),
    (np.array([b"a", b"  ", b"b", b"b", b"c"]), "1 blank id(s)"),
    (np.array([1.0, 1.5, 2.0, 2.0, 3.0]), "must be finite whole numbers"),
    (np.array([1.0, np.nan, 2.0, 2.0, 3.0]), "contain NaN"),
])
def test_bad_npz_id_arrays_are_refused_naming_the_array(tmp_path, ids, part):
  _refused(_npz(tmp_path, user_ids=ids), "ids of array 'user_ids'", part)


def test_user_id_dtype_is_for_csv_only(tmp_path):
  with pytest.raises(ConfigError, match=r"problem.data.user_id_dtype applies to a .csv"):
    parse_data_file({"path": _npz(tmp_path), "user_id_dtype": "int"}, "problem.data")
  with pytest.raises(ConfigError, match=r"user_id_dtype must be one of"):
    parse_data_file({"path": _npz(tmp_path), "user_id_dtype": "float"}, "problem.data")


def test_the_id_column_cannot_also_be_an_example_column(tmp_path):
  path = _csv(tmp_path, "uid,f0\na,1\n")
  with pytest.raises(ConfigError, match=r"problem.data.columns: 'uid' holds the user ids"):
    parse_data_file({"path": path, "user_column": "uid", "columns": ["uid", "f0"]},
                    "problem.data")


def test_canonical_ids_refuse_blank_strings_for_library_users_too():
  with pytest.raises(ValueError, match=r"user_ids contain 2 blank id\(s\) .*position 1"):
    UserData.from_arrays({"x": np.ones((4, 1))}, ["a", "", " \t", "b"])
  np.testing.assert_array_equal(blank_ids(np.array(["a", "", " "])), [1, 2])
  assert canonical_ids(np.array([" a", "a"])).tolist() == [" a", "a"]   # exact strings


# ----------------------------------------------------------------- 4. read errors


def test_a_truncated_npz_is_a_config_error_naming_the_file(tmp_path):
  path = _npz(tmp_path)
  data = open(path, "rb").read()
  open(path, "wb").write(data[:len(data) // 2])
  _refused(path, "cannot read")


def test_a_corrupt_npz_member_is_a_config_error_naming_the_array(tmp_path):
  path = _npz(tmp_path)
  with zipfile.ZipFile(path) as z:
    info = z.getinfo("x.npy")
  data = bytearray(open(path, "rb").read())
  at = info.header_offset + 30 + len(info.filename) + 140   # inside x.npy's data
  data[at] ^= 0xFF
  open(path, "wb").write(bytes(data))
  _refused(path, "array 'x' cannot be read", "CRC")


def test_a_ragged_csv_row_is_a_config_error_naming_the_line(tmp_path):
  path = _csv(tmp_path, "uid,f0,f1\na,1,2\nb,3\n")
  _refused({"path": path, "user_column": "uid"}, "line 3 has 2 fields, the header 3")


def test_a_2d_id_array_is_refused(tmp_path):
  _refused(_npz(tmp_path, user_ids=np.ones((5, 2), int)), "array 'user_ids' must hold one id "
           "per row (shape [N]), got shape (5, 2)")


def test_mismatched_lengths_are_refused(tmp_path):
  _refused(_npz(tmp_path, user_ids=np.array([1, 1, 2, 2])), "array 'x' has shape (5, 2), the "
           "ids 4 rows")


def test_a_header_only_csv_and_a_duplicated_header_are_refused(tmp_path):
  _refused({"path": _csv(tmp_path, "uid,f0\n"), "user_column": "uid"},
           "has a header but no rows")
  with pytest.raises(ConfigError, match=r"the header names column 'f0' more than once"):
    parse_data_file({"path": _csv(tmp_path, "uid,f0,f0\na,1,2\n", "dup.csv"),
                     "user_column": "uid"}, "problem.data")


def test_loads_are_cached_in_the_one_cache_and_a_rewritten_file_is_read_again(tmp_path):
  path = _npz(tmp_path)
  first = _load(path)
  assert _load(path) is first
  assert "dpsco_jax.runner.datafiles._load" in cache.stats()
  x = np.ones((5, 2))
  x[0, 0] = np.nan
  np.savez(path, user_ids=IDS, x=x, y=np.arange(5), z=np.zeros(5))   # a new size
  _refused(path, "array 'x'")
  cache.clear()
  assert cache.stats()["dpsco_jax.runner.datafiles._load"]["size"] == 0
