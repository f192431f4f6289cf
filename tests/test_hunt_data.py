"""Review findings on dpsco_jax.data, one test each (each failed before its fix)."""

import numpy as np

from dpsco_jax.data import UserData


def test_a_column_named_like_the_internal_user_key_does_not_replace_the_user_ids():
  # from_table passed the user ids under the key "__user__" beside the item columns, so a table
  # with a column of that name had its ids replaced by that column: users grouped wrongly.
  table = {"uid": np.array([0, 0, 1, 2]), "x": np.arange(4.0),
           "__user__": np.array([5, 6, 7, 8])}
  data = UserData.from_table(table, user_column="uid", columns=["x", "__user__"],
                             max_items_per_user=2)
  assert data.n_users == 3
  assert data.spec.max_items_per_user == 2
  np.testing.assert_array_equal(np.asarray(data.item_mask).sum(1), [2, 1, 1])
  assert set(data.examples) == {"x", "__user__"}
