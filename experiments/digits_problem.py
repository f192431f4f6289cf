"""The digits example (``experiments/digits_user_level.py``) as a problem factory, so that the
runner sweeps it from YAML (``configs/digits_user_level.yaml``)::

    problem:
      factory: experiments.digits_problem:make_digits
      args: {n_users: 180, max_items_per_user: 16}

``make_digits`` reuses the example's data construction (scikit-learn's 1,797 digits, users
drawn from a Zipf-like law with a fixed public partition seed, 20% of the users held out),
its nnx MLP, loss and accuracy, and returns what the runner reads: the model (initialized from
the run's seed), the loss of one item, the training users, the held-out users the metric
reads, the metric, the declared constants and the declared (public) number of training users.
"""

from __future__ import annotations

import functools

from flax import nnx

from experiments.digits_user_level import CONSTANTS, MLP, accuracy, loss_fn, make_data


@functools.lru_cache(maxsize=4)
def _data(n_users: int, max_items_per_user: int, partition_seed: int):
  # built once per setting: the partition is public design, not a function of the run's seed
  return make_data(n_users, max_items_per_user, partition_seed)


def make_digits(n_users: int = 180, max_items_per_user: int = 16, hidden: int = 32,
                partition_seed: int = 1234, seed: int = 0) -> dict:
  """The digits problem for the run's ``seed`` (the MLP's initialization)."""
  train, test = _data(n_users, max_items_per_user, partition_seed)
  return {"model": MLP(nnx.Rngs(seed), hidden), "loss": loss_fn, "data": train,
          "eval_data": test, "metrics": {"test_accuracy": accuracy},
          "constants": dict(CONSTANTS), "n_users": train.n_users}
