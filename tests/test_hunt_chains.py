"""Bug-hunt findings on transform chains, DPTrainer and UserData, one test each (each failed
before its fix)."""

import numpy as np
import pytest

from dpsco_jax.data import UserData


@pytest.mark.parametrize("column,error", [
    (np.array([1, "a", 2, 3, 4], dtype=object), TypeError),   # an object column
    ([[1], [1, 2], [1], [1], [1]], ValueError),                # a ragged column
])
def test_from_table_names_an_object_or_ragged_column(column, error):
  # An object column crashed deep in the padding ("Cannot change data-type for array of
  # references."), a ragged one in numpy ("setting an array element..."): neither named it.
  with pytest.raises(error, match="'feat'"):
    UserData.from_table({"u": [1, 2, 1, 2, 3], "feat": column}, user_column="u")
