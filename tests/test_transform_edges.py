"""Issue 46 edges of the chain stages and of DPTrainer's optimizer guard.

* ``outlier_filter`` / ``filter_points`` / ``pairwise_sq_distances`` on a pytree with a
  zero-width leaf (shape ``(0,)`` or ``(3, 0)`` per user): the leaf has no coordinate, so the
  decisions and the other leaves' filtered mean are those of the pytree without it, and its
  own output is empty (it raised IndexError from inside the pair kernel).
* ``optax.apply_every`` (alone or inside a chain) as DPTrainer's optimizer is refused like
  ``optax.MultiSteps``, naming it (it summed noisy gradients over steps unnoticed)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpsco_jax.flax import DPTrainer
from dpsco_jax.transforms.filtering import filter_points, outlier_filter
from dpsco_jax.transforms.filter_pairs import pairwise_sq_distances

U = 7


def _grads():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(U, 4)).astype(np.float32)
  w[-1] += 50.0   # an outlier: the filter drops it, so the mean depends on the decisions
  return {"w": jnp.asarray(w)}


@pytest.mark.parametrize("width", [(0,), (3, 0)])
def test_outlier_filter_ignores_a_zero_width_leaf(width):
  base = _grads()
  with_empty = {**base, "e": jnp.zeros((U,) + width)}
  outs = []
  for g in (base, with_empty):
    tx = outlier_filter(U, 3.0, key=1, threshold_scale=1e-3, query_scale=1e-3)
    state = tx.init(jax.tree.map(lambda x: x[0], g))
    out, state = tx.update(g, state)
    outs.append(out)
  assert outs[1]["e"].shape == width
  np.testing.assert_array_equal(outs[1]["w"], outs[0]["w"])
  # the outlier is out of the mean: it is not the plain average
  assert float(jnp.max(jnp.abs(outs[0]["w"] - jnp.mean(base["w"], 0)))) > 1.0
  np.testing.assert_array_equal(pairwise_sq_distances(with_empty), pairwise_sq_distances(base))


def test_filter_points_with_only_zero_width_leaves_keeps_everyone():
  """No coordinate at all: every distance is 0, every user is everyone's neighbour."""
  res = filter_points({"e": jnp.zeros((U, 3, 0))}, jax.random.key(0), score_radius=1.0)
  assert float(res.score) == U and bool(jnp.all(res.keep))
  assert res.mean["e"].shape == (3, 0)
  np.testing.assert_array_equal(pairwise_sq_distances({"e": jnp.zeros((U, 0))}),
                                np.zeros((U, U)))


class _Lin(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.zeros((3, 2)))

  def __call__(self, x):
    return x @ self.w.value


def _ce(model, ex):
  return optax.softmax_cross_entropy_with_integer_labels(model(ex[0]), ex[1])


@pytest.mark.parametrize("optimizer, name", [
    (optax.apply_every(2), "optax.apply_every"),
    (optax.chain(optax.sgd(0.1), optax.apply_every(3)), "optax.apply_every"),
    (optax.MultiSteps(optax.sgd(0.1), 2), "optax.MultiSteps"),
])
def test_trainer_refuses_gradient_accumulation_wrappers(optimizer, name):
  x = np.random.default_rng(0).standard_normal((8, 2, 3)).astype(np.float32)
  data = (jnp.asarray(x), jnp.asarray((x[..., 0] > 0).astype(np.int32)))
  with pytest.raises(ValueError, match=f"must not contain {name}.*accumulation_steps"):
    DPTrainer(_Lin(), _ce, optimizer, data=data, clip_norm=1.0, sampling_rate=0.5,
              delta=1e-5, expected_batch_size=4.0, noise_multiplier=1.0, accountant="rdp")
