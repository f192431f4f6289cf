"""UserData: grouping by user id, the contribution bound, padding and its weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.data import DataSpec, MissingConstant, UserData, UserDataProblem, weighted_loss
from dpsco_jax.grads import per_user_grads


def _rows(n=40, d=3, seed=0, users=7):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, users, n)
  return {"x": rng.normal(size=(n, d)).astype(np.float32),
          "y": rng.normal(size=n).astype(np.float32)}, ids


def test_groups_rows_by_user_in_order_of_first_appearance():
  ex = {"x": np.arange(6, dtype=np.float32)[:, None], "y": np.arange(6, dtype=np.float32)}
  ids = np.array(["b", "a", "b", "c", "a", "b"])
  data = UserData.from_arrays(ex, ids)
  assert list(data.user_ids) == ["b", "a", "c"]
  np.testing.assert_array_equal(data.n_items, [3, 2, 1])
  assert data.max_items_per_user == 3 and len(data) == 3
  np.testing.assert_array_equal(data.item_mask, [[1, 1, 1], [1, 1, 0], [1, 0, 0]])
  # real items in table order; padding repeats the user's own items
  np.testing.assert_array_equal(data.examples["y"], [[0, 2, 5], [1, 4, 1], [3, 3, 3]])
  assert data.spec == DataSpec(3, 3, (("['x']", (1,), "float32"), ("['y']", (), "float32")),
                               frozenset({"n_users", "max_items_per_user"}))


def test_contribution_bound_random_and_first_selection():
  ex = {"v": np.arange(20, dtype=np.float32)}
  ids = np.zeros(20, int)
  first = UserData.from_arrays(ex, ids, max_items_per_user=5, selection="first")
  np.testing.assert_array_equal(first.examples["v"][0], [0, 1, 2, 3, 4])
  r1 = UserData.from_arrays(ex, ids, max_items_per_user=5, seed=3)
  r2 = UserData.from_arrays(ex, ids, max_items_per_user=5, seed=3)
  r3 = UserData.from_arrays(ex, ids, max_items_per_user=5, seed=4)
  np.testing.assert_array_equal(r1.examples["v"], r2.examples["v"])       # seeded
  assert not np.array_equal(r1.examples["v"], r3.examples["v"])
  assert len(set(r1.examples["v"][0].tolist())) == 5 and r1.n_items[0] == 5
  # over many seeds the kept items are not biased towards the start of the table
  kept = np.concatenate([UserData.from_arrays(ex, ids, max_items_per_user=5, seed=s)
                         .examples["v"][0] for s in range(200)])
  assert abs(kept.mean() - 9.5) < 0.6


def test_user_view_mean_is_over_real_items_only():
  ex, ids = _rows()
  data = UserData.from_arrays(ex, ids, max_items_per_user=9)
  loss = lambda w, e: 0.5 * (e["x"] @ w - e["y"]) ** 2
  w = jnp.array([0.3, -0.2, 0.5])
  got = per_user_grads(weighted_loss(loss), w, data.user_view())
  for u in range(data.n_users):
    rows = np.flatnonzero(ids == data.user_ids[u])[:9] if data.n_items[u] < 9 else None
    if rows is None:
      continue  # subsampled users: checked by the selection test
    want = np.mean([np.asarray(jax.grad(loss)(w, {"x": ex["x"][r], "y": ex["y"][r]}))
                    for r in rows], axis=0)
    np.testing.assert_allclose(got[u], want, rtol=1e-5, atol=1e-6)
  # the item view weighs each real item once and padding zero
  iv = data.item_view()
  np.testing.assert_array_equal(np.asarray(iv["weight"]), data.item_mask.astype(np.float32))


def test_from_table_mapping_dataframe_like_and_hf_like():
  ex, ids = _rows(n=12)
  table = {"user": ids, "x": ex["x"], "y": ex["y"]}
  a = UserData.from_table(table, user_column="user")

  class Frame:  # the pandas surface used: .columns and column.to_numpy()
    columns = ["user", "x", "y"]
    def __getitem__(self, c):
      return type("S", (), {"to_numpy": lambda s, v=table[c]: v})()

  class HF:  # the datasets.Dataset surface used: .column_names and column lists
    column_names = ["user", "x", "y"]
    def __getitem__(self, c):
      return list(table[c])

  for other in (UserData.from_table(Frame(), user_column="user"),
                UserData.from_table(HF(), user_column="user")):
    np.testing.assert_array_equal(other.examples["x"], a.examples["x"])
    np.testing.assert_array_equal(other.user_ids, a.user_ids)
  only_x = UserData.from_table(table, user_column="user", columns=["x"])
  assert set(only_x.examples) == {"x"}


@pytest.mark.parametrize("kwargs, match", [
    ({"user_ids": np.zeros((3, 1))}, "one-dimensional"),
    ({"user_ids": np.zeros(5)}, "leading row axis"),
    ({"max_items_per_user": 0}, ">= 1"),
    ({"max_items_per_user": True}, "must be an int"),
    ({"max_items_per_user": 2.0}, "must be an int"),
    ({"selection": "last"}, "selection"),
])
def test_bad_input_is_refused_naming_it(kwargs, match):
  ex = {"x": np.zeros((4, 2), np.float32)}
  args = {"user_ids": np.arange(4), **kwargs}
  with pytest.raises((ValueError, TypeError), match=match):
    UserData.from_arrays(ex, args.pop("user_ids"), **args)


def test_table_errors_name_the_column():
  with pytest.raises(ValueError, match="user_column 'uid'"):
    UserData.from_table({"x": np.zeros(3)}, user_column="uid")
  with pytest.raises(ValueError, match="column 'z'"):
    UserData.from_table({"u": np.zeros(3), "x": np.zeros(3)}, user_column="u", columns=["z"])
  with pytest.raises(TypeError, match="table must be"):
    UserData.from_table([1, 2], user_column="u")


def test_problem_contracts_vector_loss_missing_constant_and_pytree_roundtrip():
  ex, ids = _rows()
  data = UserData.from_arrays(ex, ids)
  params = {"w": jnp.ones(3), "b": jnp.zeros(())}
  with pytest.raises(ValueError, match="loss_fn must return a scalar per item"):
    UserDataProblem(lambda p, e: e["x"] * p["w"], params, data)
  prob = UserDataProblem(lambda p, e: (e["x"] @ p["w"] + p["b"] - e["y"]) ** 2, params, data)
  assert prob.d == 4 and prob.n_users == data.n_users and prob.radius == np.inf
  with pytest.raises(MissingConstant, match="Lipschitz"):
    _ = prob.lipschitz
  back = prob.unflatten(prob.init_params())
  assert jax.tree.structure(back) == jax.tree.structure(params)
  np.testing.assert_array_equal(back["w"], params["w"])
  with pytest.raises(ValueError, match="> 0"):
    UserDataProblem(lambda p, e: 0.0, params, data, constants={"lipschitz": -1.0})
  with pytest.raises(TypeError, match="must be a number"):
    UserDataProblem(lambda p, e: 0.0, params, data, constants={"lipschitz": "1"})


def test_a_users_kept_items_do_not_depend_on_the_other_users():
  """User-level neighbours stay neighbours: removing (or adding) another user, which shifts
  every later user's position, leaves each remaining user's random selection unchanged."""
  rng = np.random.default_rng(7)
  ids = rng.integers(0, 12, 300)
  ex = {"v": np.arange(300, dtype=np.float32)}
  full = UserData.from_arrays(ex, ids, max_items_per_user=5, seed=1)
  gone = full.user_ids[0]                      # the first user: every position shifts
  keep = ids != gone
  less = UserData.from_arrays({"v": ex["v"][keep]}, ids[keep], max_items_per_user=5, seed=1)
  for u, uid in enumerate(less.user_ids):
    v = int(np.flatnonzero(full.user_ids == uid)[0])
    np.testing.assert_array_equal(less.examples["v"][u], full.examples["v"][v])


# ------------------------------------------------------------------ ids (issue 23)

@pytest.mark.parametrize("ids, error, match", [
    (np.array([1.0, np.nan, 2.0, np.nan]), ValueError, "NaN"),
    ([1, None, 2, 3], ValueError, "None"),
    (np.array([1, None, 2, 3], dtype=object), ValueError, "None"),
    ([1, "1", 2, 3], TypeError, "mix kinds"),             # np.asarray would make both "1"
    (np.array([1, 1.0, 2, 3], dtype=object), TypeError, "mix kinds"),
    ([True, 1, 2, 3], TypeError, "bools"),
    (np.array([True, False, True, True]), TypeError, "bools"),
    ([b"a", "a", "b", "c"], TypeError, "mix kinds"),
    (np.array([0.5, 1.0, 2.0, 3.0]), ValueError, "whole numbers"),
    (np.array([np.inf, 1.0, 2.0, 3.0]), ValueError, "whole numbers"),
    (np.array([1 + 0j, 2, 3, 4]), TypeError, "dtype complex"),
    ([(1,), (2,), (3,), (4,)], ValueError, "one-dimensional"),
    ([object(), 1, 2, 3], TypeError, "object"),
])
def test_ids_that_would_merge_or_split_users_are_refused(ids, error, match):
  ex = {"x": np.arange(4, dtype=np.float32)}
  with pytest.raises(error, match=match):
    UserData.from_arrays(ex, ids)


def test_accepted_id_kinds_keep_their_values():
  ex = {"x": np.arange(4, dtype=np.float32)}
  for ids, want in [([3, 1, 3, 2], [3, 1, 2]), (["b", "a", "b", "c"], ["b", "a", "c"]),
                    (np.array([2.0, 1.0, 2.0, -4.0]), [2.0, 1.0, -4.0]),
                    (np.array([2**40, 5, 2**40, 7], dtype=object), [2**40, 5, 7]),
                    ([2**70, 5, 2**70, 7], [2**70, 5, 7])]:       # beyond int64: exact
    data = UserData.from_arrays(ex, ids)
    assert data.user_ids.tolist() == want
  # HF-style list columns go through the same checks
  with pytest.raises(TypeError, match="mix kinds"):
    UserData.from_table({"u": [1, "1", 2, 3], "x": ex["x"]}, user_column="u")


def _hand_built(**over):
  base = dict(examples={"x": np.zeros((3, 2, 1), np.float32)},
              item_mask=np.array([[1, 1], [1, 0], [1, 0]], bool),
              user_ids=np.array([10, 11, 12]), n_items=np.array([2, 1, 1]),
              n_dropped=np.array([0, 0, 3]))
  base.update(over)
  return UserData(**base)


@pytest.mark.parametrize("over, error, match", [
    ({"user_ids": np.array([10, 11, 10])}, ValueError, "unique"),
    ({"user_ids": np.array([10, 11])}, ValueError, "2 ids for 3 users"),
    ({"user_ids": np.array([10.0, np.nan, 12.0])}, ValueError, "NaN"),
    ({"n_dropped": np.array([0, -1, 0])}, ValueError, "n_dropped must be >= 0"),
    ({"n_dropped": np.array([0, 0])}, ValueError, "shape"),
    ({"n_dropped": np.array([0.0, 0.0, 1.0])}, TypeError, "integer"),
    ({"n_items": np.array([2.0, 1.0, 1.0])}, TypeError, "integer"),
    ({"n_items": np.array([2, 1])}, ValueError, "shape"),
    ({"n_items": np.array([2, 2, 1])}, ValueError, "agree"),
    ({"item_mask": np.ones((3, 2), np.int8)}, ValueError, "bool"),
    ({"examples": {"x": np.zeros((0, 2, 1))}, "item_mask": np.zeros((0, 2), bool),
      "user_ids": np.array([], int), "n_items": np.array([], int), "n_dropped": None},
     ValueError, "no users"),
])
def test_hand_built_user_data_is_checked(over, error, match):
  _hand_built()                                   # the base is valid
  with pytest.raises(error, match=match):
    _hand_built(**over)


def test_empty_or_duplicate_selection_is_refused():
  data = _hand_built()
  assert data.select([2, 0]).user_ids.tolist() == [12, 10]
  with pytest.raises(ValueError, match="no users"):
    data.select(np.zeros(3, bool))
  with pytest.raises(ValueError, match="unique"):
    data.select([0, 0])                           # one user twice: two contributions
