"""Bug-hunt findings on transform chains, DPTrainer and UserData, one test each (each failed
before its fix)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax import transforms as T
from dpsco_jax.data import UserData
from dpsco_jax.flax import DPTrainer


@pytest.mark.parametrize("column,error", [
    (np.array([1, "a", 2, 3, 4], dtype=object), TypeError),   # an object column
    ([[1], [1, 2], [1], [1], [1]], ValueError),                # a ragged column
])
def test_from_table_names_an_object_or_ragged_column(column, error):
  # An object column crashed deep in the padding ("Cannot change data-type for array of
  # references."), a ragged one in numpy ("setting an array element..."): neither named it.
  with pytest.raises(error, match="'feat'"):
    UserData.from_table({"u": [1, 2, 1, 2, 3], "feat": column}, user_column="u")


class _IntParam(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    self.scale = nnx.Param(jnp.array(3, jnp.int32))

  def __call__(self, x):
    return self.lin(x) * self.scale


def test_trainer_names_an_integer_param_before_any_step():
  # An int nnx.Param passed construction and planning, then the first step crashed inside
  # jax.grad ("grad requires real- or complex-valued inputs ... got int32"), naming no param.
  x = np.random.default_rng(0).normal(size=(8, 2, 3)).astype(np.float32)
  data = {"x": x, "y": (x[..., 0] > 0).astype(np.int32)}

  def loss(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])

  with pytest.raises(TypeError, match="scale"):
    DPTrainer(_IntParam(), loss, optax.sgd(0.1), data=data, clip_norm=1.0, sampling_rate=0.5,
              expected_batch_size=4.0, noise_multiplier=1.0, delta=1e-5, key=0)


@pytest.mark.parametrize("users", [["a"], []])
def test_select_names_users_for_ids_or_an_empty_selection(users):
  # select(["a"]) (ids, not positions) and select([]) raised numpy's "arrays used as indices
  # must be of integer (or boolean) type", naming neither the argument nor what it takes.
  data = UserData.from_arrays(np.ones((3, 2), np.float32), ["a", "b", "a"])
  with pytest.raises((IndexError, ValueError), match="users"):
    data.select(users)


def test_per_user_grads_refuses_offsets_without_the_item_axis():
  # Offsets shaped [U, *p.shape] (no m axis) were read as [U, m] per-item scalars and
  # broadcast over the params when m == p.shape[0]: silently wrong gradients, no error.
  from dpsco_jax.grads import per_user_grads

  def loss(p, ex):
    return jnp.sum(p["w"] * ex) ** 2

  params, batch = {"w": jnp.ones(2)}, jnp.ones((3, 2, 2))
  offsets = {"w": jnp.arange(6.0).reshape(3, 2)}
  with pytest.raises(ValueError, match="offsets"):
    per_user_grads(loss, params, batch, offsets=offsets)


def test_train_refuses_a_checkpoint_dir_that_is_a_file_before_any_step(tmp_path):
  # checkpoint_dir naming a file passed the pre-run check; the steps ran and spent budget,
  # then orbax's save failed (NotADirectoryError on its temporary folder).
  pytest.importorskip("orbax.checkpoint")
  x = np.random.default_rng(0).normal(size=(8, 2, 3)).astype(np.float32)
  data = {"x": x, "y": (x[..., 0] > 0).astype(np.int32)}

  def loss(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])

  trainer = DPTrainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), loss, optax.sgd(0.1), data=data,
                      clip_norm=1.0, sampling_rate=0.5, expected_batch_size=4.0,
                      noise_multiplier=1.0, delta=1e-5, key=0)
  target = tmp_path / "not_a_dir"
  target.write_text("x")
  with pytest.raises(NotADirectoryError, match="checkpoint_dir"):
    trainer.train(1, checkpoint_dir=target)
  assert trainer.step_count == 0 and not trainer.ledger.events


def test_trainer_names_a_string_column_of_its_user_data():
  # A UserData.from_table with a string column (all columns are items by default) crashed
  # in DPTrainer with JAX's "Dtype <U1 is not a valid JAX array type", naming no column.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 3)).astype(np.float32)
  table = {"u": rng.integers(0, 4, 12), "x": x, "y": (x[:, 0] > 0).astype(np.int32),
           "name": np.array(["a"] * 12)}
  data = UserData.from_table(table, user_column="u")

  def loss(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])

  with pytest.raises(TypeError, match="'name'"):
    DPTrainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), loss, optax.sgd(0.1), data=data,
              clip_norm=1.0, sampling_rate=0.5, expected_batch_size=2.0, noise_multiplier=1.0,
              delta=1e-5, key=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_projection_of_low_precision_params_stays_in_the_ball(dtype):
  # project_l2_ball and projected_sgd rounded bfloat16/float16 results to nearest after the
  # projection: points up to ~0.5% outside the ball (||x|| = 1.0046 for R = 1).
  worst = 0.0
  center = {"w": jnp.full((37,), 0.25, dtype)}
  tx = T.projected_sgd(1.0, radius=1.0, center=center)
  params = {"w": jnp.zeros((37,), dtype)}
  state = tx.init(params)
  for s in range(40):
    v = jax.random.normal(jax.random.key(s), (37,)) * 3
    out = T.project_l2_ball({"w": v.astype(dtype)}, 1.0)
    assert out["w"].dtype == dtype
    worst = max(worst, float(jnp.linalg.norm(out["w"].astype(jnp.float32))))
    _, state = tx.update({"w": v}, state, params)
    params = state.released   # the iterate (params + update rounds once more in optax)
    assert params["w"].dtype == dtype
    dist = params["w"].astype(jnp.float32) - center["w"].astype(jnp.float32)
    worst = max(worst, float(jnp.linalg.norm(dist)))
  assert worst <= 1.0, worst


@pytest.mark.parametrize("make", [
    lambda: T.banded_noise(1.0, 2, 0, coefs=[1.0, 0.5]),
    lambda: T.blt_noise(1.0, 2, 0, buf_decay=[0.5], output_scale=[0.3]),
    lambda: T.independent_prefix_sum_noise(1.0, 2, 0),
])
def test_prefix_noise_past_its_horizon_keeps_no_release_in_the_state(make):
  # Past max_steps the output was NaN but the state's noisy_prefix (public, shown by repr)
  # still held the step's noisy prefix: a release no plan accounted for.
  tx = make()
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  for _ in range(3):
    out, state = tx.update({"w": jnp.ones(3)}, state, params)
  assert bool(jnp.all(jnp.isnan(out["w"])))
  assert bool(jnp.all(jnp.isnan(state.noisy_prefix["w"]))), state


def test_from_table_takes_one_column_name_as_a_string():
  # columns="feat" was iterated as letters: refused with "column 'f' is not in the table",
  # a column the user never named.
  table = {"u": [1, 2, 1], "feat": np.ones(3, np.float32), "y": np.zeros(3, np.float32)}
  data = UserData.from_table(table, user_column="u", columns="feat")
  assert list(data.examples) == ["feat"]


def test_sample_queries_names_a_key_that_is_not_a_prng_key():
  # sample_queries(0, ...) (an int seed, which the noise stages accept) failed inside JAX
  # with "invalid PRNG key data ... Got 0", naming no argument.
  with pytest.raises((TypeError, ValueError), match="key must be"):
    T.sample_queries(0, {"w": jnp.zeros(3)}, 0.1, 2)
  xis, _ = T.sample_queries(jax.random.key(0), {"w": jnp.zeros(3)}, 0.1, 2)
  assert xis["w"].shape == (2, 3)


class _WithEmptyParam(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    self.none = nnx.Param(jnp.zeros((0,)))

  def __call__(self, x):
    return self.lin(x) + jnp.sum(self.none)


def test_fast_clipping_takes_a_zero_size_param():
  # A zero-size nnx.Param (shape (0,)) crashed method="fast" with ZeroDivisionError ("integer
  # modulo by zero") in its norm bound; method="vmap" ran.
  from dpsco_jax.flax.fast_clip import FastClippedGrad
  rng = np.random.default_rng(0)
  data = {"x": jnp.asarray(rng.normal(size=(6, 2, 3)), jnp.float32),
          "y": jnp.asarray(rng.integers(0, 2, (6, 2)))}

  def loss(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])

  sums = {}
  for method in ("fast", "vmap"):
    clipper = FastClippedGrad(_WithEmptyParam(), loss, clip_norm=0.5, method=method)
    sums[method], _ = clipper.clipped_sum(clipper.params, data, jnp.ones(6, bool))
  for a, b in zip(jax.tree.leaves(sums["fast"]), jax.tree.leaves(sums["vmap"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("examples,says", [
    ({0: np.ones((3, 2))}, "not strings"),        # flat, but an int key
    ((np.ones((3, 2)),), "a tuple"),              # flat, but a tuple
])
def test_store_refusal_says_what_is_wrong_with_the_examples(tmp_path, examples, says):
  # A flat dict with an int key, or a flat tuple, was refused as "got dict (nested)" /
  # "got tuple (nested)": neither is nested, so the message misled.
  with pytest.raises(TypeError, match=says):
    UserData.from_arrays(examples, [1, 2, 1], store=tmp_path / "s")


def test_user_data_problem_names_a_string_column():
  # UserDataProblem on a from_table UserData with a string column crashed with JAX's
  # "Value 'a' with dtype <U1 is not a valid JAX array type", naming no column.
  from dpsco_jax.data.problem import UserDataProblem
  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 3)).astype(np.float32)
  table = {"u": rng.integers(0, 4, 12), "x": x, "y": x[:, 0], "name": np.array(["a"] * 12)}
  data = UserData.from_table(table, user_column="u")
  with pytest.raises(TypeError, match="'name'"):
    UserDataProblem(lambda p, ex: (jnp.dot(p, ex["x"]) - ex["y"]) ** 2, jnp.zeros(3), data)


def test_from_table_names_a_column_of_the_wrong_length():
  # A column shorter than the user column was refused as "every examples leaf needs a
  # leading row axis of length 5 ..., got shape (3,)", naming no column.
  with pytest.raises(ValueError, match="'short'"):
    UserData.from_table({"u": [1, 2, 1, 2, 3], "ok": np.ones(5), "short": np.ones(3)},
                        user_column="u")


def test_outlier_filter_runs_under_inject_hyperparams_and_jit():
  # optax.inject_hyperparams(outlier_filter) under jit raised TracerBoolConversionError (the
  # lo/hi ramp check on traced values), naming nothing; the other stages run there.
  params, grads = {"w": jnp.zeros(3)}, {"w": jnp.ones((4, 3))}
  injected = optax.inject_hyperparams(T.outlier_filter, static_args=("key", "num_users"))(
      num_users=4, radius=1.0, key=0, epsilon=1.0)
  out, _ = jax.jit(injected.update)(grads, injected.init(params), params)
  plain = T.outlier_filter(4, 1.0, key=0, epsilon=1.0)
  want, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(want["w"]), rtol=1e-6)


def test_accelerated_projected_step_runs_under_inject_hyperparams_and_jit():
  # optax.inject_hyperparams(accelerated_projected_step) under jit raised
  # TracerBoolConversionError (the z_scale range check on its traced default), naming nothing.
  params, grads = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
  injected = optax.inject_hyperparams(T.accelerated_projected_step)(beta=1.0, radius=1.0)
  out, _ = jax.jit(injected.update)(grads, injected.init(params), params)
  plain = T.accelerated_projected_step(1.0, radius=1.0)
  want, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(want["w"]), rtol=1e-6)

