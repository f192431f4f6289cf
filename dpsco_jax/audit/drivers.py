"""Driver-level audit specs: the library's algorithms end to end through their audit hooks.

Each ``release`` is a driver's own audit hook (``dp_sgd_releases``, ``DPTrainer.release_fn``,
``srgd_releases``, ``output_perturbation_releases``, ``dp_loc_gd_releases``,
``dp_bilevel_releases``) on a small problem with the linear loss ``<x, w>``, so the canary
``10 C e_0`` has clipped gradient ``C e_0`` at every step; the score sums the releases' ``e_0``
coordinate (tree noise: its likelihood-ratio weights). The neighbour deletes (``add_remove``),
zeroes (``zero_out``) or negates (``replace_one``) the canary. The claim is the driver's own
epsilon; the twins keep it and run a bug: ``noise_halved``; ``realized_count`` (full-batch
``add_remove`` with ``n_users`` read from the data; background users push ``-C e_0``);
``independent_accounting`` (SRGD's tree claimed with ``mu = 1/z``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit.canary import CANARY_NORM, CLIP, DELTA, HI, check_broken, check_relation
from dpsco_jax.audit.harness import AUDITS, AuditSpec, build
from dpsco_jax.audit.mechanisms import e0_sum, gaussian_lr_weights, tree_noise_covariance

__all__ = ["DRIVERS", "GAUSSIAN", "TRIALS", "build_driver", "dp_sgd_driver", "trainer_driver",
           "srgd_driver", "output_perturbation_driver", "loc_gd_driver", "bilevel_driver",
           "linear_problem"]

_SUPPORTED = {"poisson": ("add_remove",), "full": ("zero_out", "add_remove"),
              "fixed": ("replace_one",)}


def _linear_loss(w, ex):
  return jnp.dot(ex["x"], w, precision=HI)


def linear_problem(x: np.ndarray, *, mu: float = 0.0, radius: float = 1.0):
  """An :class:`~dpsco_jax.problems.SCOProblem` over users ``x [n, m, d]`` with the linear
  loss (``mu > 0``: plus ``mu/2 ||w||^2``); ``lipschitz`` is ``max ||x||``."""
  from dpsco_jax.problems import SCOProblem
  x = jnp.asarray(x, jnp.float32)
  n, m, d = x.shape
  if mu > 0:
    loss = lambda w, ex: 0.5 * mu * jnp.dot(w, w, precision=HI) - _linear_loss(w, ex)
  else:
    loss = _linear_loss
  return SCOProblem(name="audit_linear", loss_fn=loss, data={"x": x}, d=d, n_users=n, m=m,
                    radius=radius, lipschitz=float(np.max(np.linalg.norm(np.asarray(x),
                                                                         axis=-1))) or 1.0,
                    smoothness=max(mu, 1e-6), x_opt=jnp.zeros((d,), jnp.float32),
                    risk_fn=lambda w: jnp.float32(0.0), opt_risk=0.0,
                    meta={"strong_convexity": mu} if mu > 0 else {})


def _users(n: int, m: int, dim: int, background: float) -> np.ndarray:
  x = np.zeros((n, m, dim), np.float32)
  x[0, :, 0] = CANARY_NORM * CLIP
  x[1:, :, 0] = background
  return x


def _neighbour(x: np.ndarray, relation: str) -> np.ndarray:
  if relation == "add_remove":
    return x[1:]
  y = x.copy()
  y[0] = 0.0 if relation == "zero_out" else -x[0]
  return y


def dp_sgd_driver(relation: str = "add_remove", broken: str | None = None, *,
                  sampling: str | None = None, users: int = 8, m: int = 2, dim: int = 2,
                  steps: int | None = None, noise_multiplier: float | None = None,
                  sampling_rate: float = 0.5, batch_size: int = 15) -> AuditSpec:
  """``dp_sgd_user`` through ``dp_sgd_releases``; ``sampling`` defaults by relation (poisson,
  full, fixed). Twins: ``noise_halved``, ``realized_count`` (full, add_remove)."""
  from dpsco_jax.algorithms.dpsgd import driver as baselines
  from dpsco_jax.api import solve
  check_relation(relation)
  sampling = sampling or {"add_remove": "poisson", "zero_out": "full",
                          "replace_one": "fixed"}[relation]
  if sampling not in _SUPPORTED or relation not in _SUPPORTED[sampling]:
    raise ValueError(f"relation: dp_sgd_driver audits {_SUPPORTED} (sampling -> relations), "
                     f"got sampling={sampling!r}, relation={relation!r}")
  twins = ("noise_halved",) + (("realized_count",) if (sampling, relation) == (
      "full", "add_remove") else ())
  check_broken(broken, twins, f"dp_sgd_driver({sampling}, {relation})")
  # claims ~2-2.5: the Gaussian ones at mu ~0.55, where a 2x twin is caught at 1e5 trials
  z = noise_multiplier or {"poisson": 1.5, "full": 2.5, "fixed": 4.0}[sampling]
  steps = steps or {"poisson": 1, "full": 2, "fixed": 1}[sampling]
  if sampling == "fixed":  # 15 of 16 users: real sampling, the canary in almost every batch
    users = max(users, batch_size + 1)
  # background users: zero gradients, except the realized-count twin's worst case -C e_0
  bg = -CANARY_NORM * CLIP if sampling == "full" and relation == "add_remove" else 0.0
  x_in = _users(users, m, dim, bg)
  problem = linear_problem(x_in, radius=1.0)
  cfg = {"sampling": sampling, "relation": relation, "num_steps": steps, "delta": DELTA,
         "noise_multiplier": z, "clip_norm": CLIP, "learning_rate": 0.1}
  if sampling == "poisson":
    cfg.update(sampling_rate=sampling_rate, n_users=users)
  elif sampling == "fixed":
    cfg["batch_size"] = batch_size
  elif relation == "add_remove":
    cfg["n_users"] = users
  claim = solve("dp_sgd_user", cfg, problem, jax.random.key(0)).privacy.epsilon
  run_cfg = dict(cfg, noise_multiplier=z / 2.0) if broken == "noise_halved" else cfg

  def release(key, data):
    c = run_cfg
    if broken == "realized_count":  # the bug: "declared" n read off the (private) dataset
      c = dict(cfg, n_users=jax.tree.leaves(data)[0].shape[0])
    return baselines.dp_sgd_releases(problem, c, key, level="user", data=data)

  return AuditSpec(f"dp_sgd_user/{sampling}[{broken or 'honest'}]", relation, release,
                   {"x": jnp.asarray(x_in)}, {"x": jnp.asarray(_neighbour(x_in, relation))},
                   e0_sum, float(claim), DELTA,
                   f"dp_sgd_user(...).privacy.epsilon (z={z:g}, {sampling}, T={steps})")


def trainer_driver(relation: str = "add_remove", broken: str | None = None, *,
                   users: int = 8, m: int = 2, dim: int = 2, steps: int = 1,
                   noise_multiplier: float = 1.5, sampling_rate: float = 0.5) -> AuditSpec:
  """``DPTrainer`` (nnx linear model) through ``release_fn``; claim: the epsilon it plans for
  ``steps`` steps (what ``train`` reports). Twin ``noise_halved``."""
  import optax
  from flax import nnx

  from dpsco_jax.flax import DPTrainer
  check_relation(relation, ("add_remove",),
                 "the trainer audit uses add_remove (its default relation)")
  check_broken(broken, ("noise_halved",), "trainer_driver")

  class _Lin(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(dim, 1, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.l(x)

  x_in = _users(users, m, dim, 0.0)
  data = (jnp.asarray(x_in),)

  def make(z):
    return DPTrainer(_Lin(nnx.Rngs(0)), lambda model, ex: jnp.sum(model(ex[0])),
                     optax.sgd(0.1), data=data, clip_norm=CLIP, sampling_rate=sampling_rate,
                     delta=DELTA, expected_batch_size=sampling_rate * users,
                     relation=relation, noise_multiplier=z, key=0)

  honest = make(noise_multiplier)
  claim = honest.ledger.check(honest.event, count=steps)
  tr = make(noise_multiplier / 2.0) if broken == "noise_halved" else honest
  return AuditSpec(f"DPTrainer[{broken or 'honest'}]", relation, tr.release_fn(steps), data,
                   (jnp.asarray(_neighbour(x_in, relation)),),
                   lambda r: jnp.sum(jax.tree.leaves(r)[0][:, 0, 0]), float(claim), DELTA,
                   f"DPTrainer.ledger.check(event, count={steps}) (z={noise_multiplier:g})")


def srgd_driver(relation: str = "zero_out", broken: str | None = None, *, batch: int = 2,
                steps: int = 16, dim: int = 2, noise_multiplier: float = 2.5,
                epochs: int = 1) -> AuditSpec:
  """``accelerated_dp_srgd`` through ``srgd_releases``: the canary is example 0, so its
  clipped SRG difference ``C e_0`` enters every released prefix sum (zero-out via
  ``user_mask``). Claim: the ledger epsilon of ``plan.event``; twin
  ``independent_accounting``: the releases claimed as the independent-noise variant's.
  ``epochs > 1``: the canary takes part once per epoch (the weights follow its running count);
  twin ``one_participation`` claims the single-epoch sensitivity."""
  from dpsco_jax.algorithms.srgd import driver as srgd
  from dpsco_jax.privacy.ledger import epsilon_of
  check_relation(relation, ("zero_out",),
                 "the SRGD audit uses zero_out (the paper's relation)")
  check_broken(broken, ("one_participation",) if epochs > 1 else ("independent_accounting",),
                "srgd_driver")
  n = batch * steps
  cfg = {"relation": relation, "batch_size": batch, "num_steps": steps, "clip_norm": CLIP,
         "beta": 5.0, "noise_multiplier": noise_multiplier, "delta": DELTA}
  if epochs > 1:
    cfg["epochs"] = epochs
  public = dict(n=n, p=dim, lipschitz=CLIP, smoothness=1.0, radius=1.0)
  plan = srgd.plan_srgd("accelerated_dp_srgd", cfg, **public)
  total = steps * epochs
  if broken == "one_participation":
    from dpsco_jax.privacy.cyclic_participation import cyclic_event, cyclic_sensitivity
    event = cyclic_event(noise_multiplier, cyclic_sensitivity("tree", total, total, 1))
  else:
    event = (plan if broken is None else srgd.plan_srgd(
        "accelerated_dp_srgd_independent_noise", cfg, **public)).event
  claim = epsilon_of(event, delta=plan.delta, relation=plan.relation,
                     accountant=srgd.ACCOUNTANT)
  x = _users(n, 1, dim, 0.0)
  data = {"x": jnp.asarray(x)}
  params0 = jnp.zeros((dim,), jnp.float32)
  shift = np.arange(total) // steps + 1.0       # participations of the canary up to step t
  weights = jnp.asarray(gaussian_lr_weights(tree_noise_covariance(total), shift), jnp.float32)

  def release(key, d):
    return srgd.srgd_releases(plan, _linear_loss, data, params0, key,
                              user_mask=d)["release"]

  mask_in = jnp.ones((n,), bool)
  return AuditSpec(f"accelerated_dp_srgd[{broken or 'honest'}]", relation, release, mask_in,
                   mask_in.at[0].set(False),
                   lambda r: jnp.dot(weights, r[:, 0], precision=HI), float(claim), DELTA,
                   f"epsilon_of(accelerated_dp_srgd[{broken or 'honest'}] event, "
                   f"z={noise_multiplier:g}, T={total}, epochs={epochs})")


def output_perturbation_driver(relation: str = "replace_one", broken: str | None = None, *,
                               users: int = 8, dim: int = 2, epsilon: float = 2.5,
                               mu: float = 1.0) -> AuditSpec:
  """``naive_output_pert`` through ``output_perturbation_releases``: the canary ``e_0``
  replaced by ``-e_0`` moves the minimizer ``mean(x)/mu`` by ``2G/(mu n)``, the calibrated
  bound. Twin ``noise_halved``."""
  from dpsco_jax import api
  from dpsco_jax.algorithms.output_perturbation import driver as op
  check_relation(relation, ("replace_one",),
                 "naive output perturbation (paper 001) is replace_one")
  check_broken(broken, ("noise_halved",), "output_perturbation_driver")
  x = np.zeros((users, 1, dim), np.float32)
  x[0, :, 0] = 1.0
  problem = linear_problem(x, mu=mu, radius=1.0)
  cfg = {"epsilon": epsilon, "delta": DELTA}
  res = api.solve("naive_output_pert", cfg, problem, jax.random.key(0))
  z = res.record["noise_multiplier"]
  run_cfg = cfg if broken is None else {"epsilon": 100.0, "delta": DELTA,
                                        "noise_multiplier": z / 2.0}

  def release(key, d):
    prob = dataclasses.replace(problem, data=d)
    return op.output_perturbation_releases("naive_output_pert", prob, run_cfg,
                                           key)[0]["release"]

  return AuditSpec(f"naive_output_pert[{broken or 'honest'}]", relation, release,
                   {"x": jnp.asarray(x)}, {"x": jnp.asarray(_neighbour(x, relation))},
                   lambda r: r[0], float(res.privacy.epsilon), DELTA,
                   f"naive_output_pert(...).privacy.epsilon (target {epsilon:g}, z={z:.3g})")


def loc_gd_driver(relation: str = "replace_one", broken: str | None = None, *,
                  examples: int = 8, dim: int = 2, steps: int = 4,
                  noise_multiplier: float = 7.0) -> AuditSpec:
  """``dp_loc_gd`` (full batch, one round) through ``dp_loc_gd_releases`` with the runner's
  plan; the canary ``10 C e_0`` is negated. Twin ``noise_halved``."""
  from dpsco_jax import api
  from dpsco_jax.algorithms.bilevel import localized_gd as lg
  check_relation(relation, ("replace_one",), "DP-Loc-GD (paper 004) is replace_one")
  check_broken(broken, ("noise_halved",), "loc_gd_driver")
  x = _users(examples, 1, dim, 0.0)
  problem = linear_problem(x, radius=1.0)
  cfg = {"epsilon": 4.0, "delta": DELTA, "mu": 1.0, "noise_multiplier": noise_multiplier,
         "num_steps": steps, "rounds": 1, "clip_norm": CLIP, "radius0": 1.0}
  plan = api.plan_problem("dp_loc_gd", cfg, problem)   # the plan the driver runs
  claim = api.execute(plan, problem, jax.random.key(0)).privacy.epsilon
  z = noise_multiplier / 2.0 if broken == "noise_halved" else noise_multiplier
  lcfg = dataclasses.replace(plan.detail.config, noise_multiplier=z)
  y0 = jnp.zeros((dim,), jnp.float32)

  def release(key, d):
    return lg.dp_loc_gd_releases(_linear_loss, y0, d, key, lcfg)

  flat = lambda a: {"x": jnp.asarray(a[:, 0])}  # one item per row: examples [n, d]
  return AuditSpec(f"dp_loc_gd[{broken or 'honest'}]", relation, release, flat(x),
                   flat(_neighbour(x, relation)), e0_sum, float(claim), DELTA,
                   f"run_dp_loc_gd(...).privacy.epsilon (z={noise_multiplier:g}, T={steps})")


def bilevel_driver(relation: str = "replace_one", broken: str | None = None, *,
                   examples: int = 8, dim: int = 2, steps: int = 4, epsilon: float = 2.5,
                   inner_share: float = 0.01) -> AuditSpec:
  """``dp_bilevel`` (Alg 1, full batch) through ``dp_bilevel_releases`` with the driver's
  plan. Upper level ``<a_i, x>``, lower ``||y - b_i||^2 / 2``: the penalty hypergradient is
  ``a_i`` everywhere, so the canary ``a_0 = 10 C e_0`` (negated, ``b_0`` kept) moves every
  outer release by ``2 C / n`` and the inner solves not at all; they get ``inner_share`` of the
  budget each. Claim: PLD composition of all ``3T`` mechanisms. Twin ``noise_halved``: every
  multiplier halved."""
  from dpsco_jax import api
  from dpsco_jax.algorithms.bilevel import driver as bl
  check_relation(relation, ("replace_one",), "DP bilevel (paper 004) is replace_one")
  check_broken(broken, ("noise_halved",), "bilevel_driver")
  a = np.zeros((examples, dim), np.float32)
  a[0, 0] = CANARY_NORM * CLIP
  b = np.full((examples, dim), 0.5, np.float32)
  a_out = a.copy()
  a_out[0] = -a[0]
  consts = bl.ProblemConstants(l0f=1.0, l1f=1.0, l0g=1.0, l1g=1.0, l2g=1.0, mu_g=1.0)
  problem = bl.BilevelProblem(
      name="audit_bilevel", f_ex=lambda x, y, ex: jnp.dot(ex["a"], x, precision=HI),
      g_ex=lambda x, y, ex: 0.5 * jnp.sum(jnp.square(y - ex["b"])),
      data={"a": jnp.asarray(a), "b": jnp.asarray(b)}, x0=jnp.zeros((dim,), jnp.float32),
      y0=jnp.zeros((dim,), jnp.float32), consts=consts, x_radius=1.0,
      x_center=jnp.zeros((dim,), jnp.float32), y_radius=2.0)
  cfg = {"epsilon": epsilon, "delta": DELTA, "num_steps": steps, "inner_num_steps": 2,
         "inner_rounds": 1, "outer_clip_norm": CLIP, "inner_clip_norm": CLIP,
         "outer_noise": True,
         "shares": (inner_share, inner_share, 1.0 - 2 * inner_share)}
  plan = api.plan_problem("dp_bilevel", cfg, problem)  # the driver's plan (data free, calibrated)
  bcfg = plan.detail.bcfg
  claim = api.execute(plan, problem, jax.random.key(0)).privacy.epsilon
  if broken == "noise_halved":
    half = lambda c: dataclasses.replace(c, noise_multiplier=c.noise_multiplier / 2.0)
    bcfg = dataclasses.replace(bcfg, outer_noise_multiplier=bcfg.outer_noise_multiplier / 2.0,
                               inner_y=half(bcfg.inner_y), inner_lam=half(bcfg.inner_lam))

  def release(key, d):
    return bl.dp_bilevel_releases(dataclasses.replace(problem, data=d), bcfg, key)

  b_j = jnp.asarray(b)
  return AuditSpec(f"dp_bilevel[{broken or 'honest'}]", relation, release,
                   {"a": jnp.asarray(a), "b": b_j}, {"a": jnp.asarray(a_out), "b": b_j},
                   lambda r: jnp.sum(r.outer[:, 0]), float(claim), DELTA,
                   f"dp_bilevel(...).privacy.epsilon (target {epsilon:g}, T={steps}, "
                   f"z_out={bcfg.outer_noise_multiplier:.3g})")


def _dp_sgd(sampling: str) -> Callable[..., AuditSpec]:
  return functools.partial(dp_sgd_driver, sampling=sampling)


DRIVERS: dict[str, tuple[Callable[..., AuditSpec], tuple[str, ...], tuple[str, ...]]] = {
    # name: (builder, relations, broken twins) — the format of mechanisms.MECHANISMS
    "dp_sgd_user_poisson": (_dp_sgd("poisson"), ("add_remove",), ("noise_halved",)),
    "dp_sgd_user_full": (_dp_sgd("full"), ("zero_out", "add_remove"),
                         ("noise_halved", "realized_count")),
    "dp_sgd_user_fixed": (_dp_sgd("fixed"), ("replace_one",), ("noise_halved",)),
    "dp_trainer": (trainer_driver, ("add_remove",), ("noise_halved",)),
    "accelerated_dp_srgd": (srgd_driver, ("zero_out",), ("independent_accounting",)),
    "accelerated_dp_srgd_epochs": (functools.partial(srgd_driver, epochs=4, steps=8,
                                                     noise_multiplier=8.0), ("zero_out",),
                                   ("one_participation",)),
    "naive_output_pert": (output_perturbation_driver, ("replace_one",), ("noise_halved",)),
    "dp_loc_gd": (loc_gd_driver, ("replace_one",), ("noise_halved",)),
    "dp_bilevel": (bilevel_driver, ("replace_one",), ("noise_halved",)),
}
AUDITS.update(DRIVERS)


#: trials per side at which every twin is flagged (the fixed-size claim is RDP, ~12% loose)
TRIALS = {name: 100_000 for name in DRIVERS} | {"dp_sgd_user_fixed": 400_000}

#: drivers with a Gaussian (mu-GDP) claim: only there is the GDP-fit bound a test
GAUSSIAN = ("dp_sgd_user_full", "accelerated_dp_srgd", "accelerated_dp_srgd_epochs",
            "naive_output_pert", "dp_loc_gd", "dp_bilevel")


build_driver = build  # one lookup over every registered audit (harness.build)
