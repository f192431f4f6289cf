"""Baselines every paper algorithm is compared against, as chains over the same engine.

* ``nonprivate_sgd``: projected minibatch SGD with iterate averaging (no privacy).
* ``dp_sgd_item``: item-level DP-SGD, every item a row clipped at ``clip_norm``.
* ``dp_sgd_user``: user-level DP-SGD, each sampled user's *mean* gradient clipped at
  ``clip_norm`` (Levy et al. 2021; paper 000's main baseline).
* ``dp_sgd_group``: item-level DP-SGD made user-level by group privacy over a user's ``m``
  items (:mod:`dpsco_jax.privacy.group`).

Chain: ``clip_and_aggregate(C, "mean", D) -> add_gaussian_noise(z C / D) ->
projected_sgd(learning_rate, R, averaging)``; with MF noise ``banded_noise | blt_noise |
tree_increment_noise (output="increment")`` in place of the Gaussian stage (the step consumes
``x_t + (C^{-1} Z)_t``; projection and averaging are post-processing). Relations, what is
public, ``D``, the sampling, the correlated noise and the budget are the plan's (:mod:`.plan`);
the runner executes the plan it is handed and reports its guarantee.

Declared constants: **enforced**. The chain clips every per-row gradient to ``C`` before
aggregating, so the sensitivity ``C / D`` holds whatever the loss's gradient norms; L (and R)
only set defaults (``clip_norm``, the step size). Provenance ``accountant`` on a user's loss.

Audit hook: :func:`dp_sgd_releases` (the per-step noisy aggregates, or increments
``x_t + w_t``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig, SgdSchedule
from dpsco_jax.algorithms.registration import Grid, register
from dpsco_jax._checks import check_bool
from dpsco_jax.algorithms.common import (hparam, progress_session, run_chain,
                                         run_chain_host, scan_slot_batches)
from dpsco_jax.algorithms.dpsgd.banded_poisson import banded_poisson_loop, cyclic_slots
from dpsco_jax.algorithms.dpsgd.plan import (DpSgdPlan, SgdPlan, dp_sgd_plan,
                                             dp_sgd_planner, level_rows, nonprivate_planner)
from dpsco_jax.algorithms.dpsgd.plan import (  # noqa: F401 (re-export)
    dp_sgd_event, group_privacy_targets)
from dpsco_jax.cache import bounded_cache
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit
from dpsco_jax.transforms.adaptive_clipping import adaptive_clip_and_noise
from dpsco_jax.transforms.clipping import aggregate, clip_and_aggregate
from dpsco_jax.transforms.matrix_factorization import banded_noise, blt_noise
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.steps import projected_sgd
from dpsco_jax.transforms.tree_noise import tree_increment_noise, tree_levels


class ReleaseState(NamedTuple):
  """The last privatized aggregate (a released value, not a secret)."""
  release: Any


def keep_release() -> optax.GradientTransformationExtraArgs:
  """Identity stage that keeps its input in the state (the audit hook's per-step record)."""
  return optax.GradientTransformationExtraArgs(
      lambda params: ReleaseState(jax.tree.map(jnp.zeros_like, params)),
      lambda updates, state, params=None, **extra: (updates, ReleaseState(updates)))


def _release_of(state: tuple) -> Any:
  # the adaptive chain has one stage before keep_release (clip, mean and noise fused)
  return next(s for s in state if isinstance(s, ReleaseState)).release


def _noise_stage(h: dict, noise: tuple, steps: int) -> optax.GradientTransformation:
  """``noise``: ``("independent",)``, ``("banded", coefs)``, ``("blt", decay, scale)`` or
  ``("tree",)`` (the binary tree's prefix sums, emitted as increments)."""
  if noise[0] == "tree":
    return tree_increment_noise(h["stddev"], steps, h["noise_key"])
  if noise[0] == "banded":
    return banded_noise(h["stddev"], steps, h["noise_key"], coefs=noise[1], output="increment")
  if noise[0] == "blt":
    return blt_noise(h["stddev"], steps, h["noise_key"], buf_decay=noise[1],
                     output_scale=noise[2], output="increment")
  return add_gaussian_noise(h["stddev"], h["noise_key"])


def dp_sgd_chain(h: dict, denominator: float, averaging: str, keep: bool = False,
                 noise: tuple = ("independent",), steps: int = 1
                 ) -> optax.GradientTransformation:
  """clip -> fixed-denominator mean (fused) -> Gaussian / MF noise [-> keep] -> projected
  SGD. ``noise`` and ``steps`` (the MF horizon) are static. ``noise = ("adaptive", gamma,
  eta, z_Delta, sigma_b)``: clip, mean and both noises are the one adaptive stage."""
  if noise[0] == "adaptive":   # the plan's spec (:meth:`~.plan.AdaptivePlan.stage_spec`)
    _, gamma, eta, sum_multiplier, count_stddev = noise
    # z is the pair's; the stage reads only z_Delta and sigma_b (split made by the plan)
    stages = [adaptive_clip_and_noise(
        h["clip"], target_quantile=gamma, clip_learning_rate=eta, denominator=denominator,
        split=AdaptiveClipSplit(None, sum_multiplier, count_stddev), key=h["noise_key"])]
  else:
    stages = [clip_and_aggregate(h["clip"], "mean", denominator), _noise_stage(h, noise, steps)]
  if keep:
    stages.append(keep_release())
  return optax.chain(*stages, projected_sgd(h["lr"], radius=h["radius"], averaging=averaging))


def sgd_chain(h: dict, denominator: float, averaging: str) -> optax.GradientTransformation:
  """Non-private: mean -> projected SGD."""
  return optax.chain(aggregate("mean", denominator=denominator),
                     projected_sgd(h["lr"], radius=h["radius"], averaging=averaging))


@bounded_cache(32)
def _cyclic_loop(loss_fn, tx_factory, static: tuple, steps: int, batch: int, periods: int,
                 record, report: int | None = None):
  """The scan of :func:`~dpsco_jax.algorithms.common.run_chain` with the batches of
  :func:`cyclic_slots`. ``report``: a progress session's (``tick`` its traced part)."""

  @jax.jit
  def loop(params, order_key, hparams, data, tick=None):
    slots, real = cyclic_slots(order_key, jax.tree.leaves(data)[0].shape[0], batch)

    def batch_of(t):
      start = (t % periods) * batch
      return (jax.lax.dynamic_slice(slots, (start,), (batch,)),
              jax.lax.dynamic_slice(real, (start,), (batch,)))

    return scan_slot_batches(loss_fn, tx_factory(hparams, *static), params, data, batch_of,
                             steps, record, report, tick)

  return loop


def _execute(problem: SCOProblem, plan: DpSgdPlan, key: jax.Array, rows: dict | None = None,
             *, noise: bool = True, keep: bool = False) -> tuple[Any, ...]:
  """Runs the plan (its guarantee was charged when it was made) on ``rows``; ``None``: the
  problem's rows at the plan's level, on the device or, with ``placement == "host"``, sampled
  on the host and only theirs sent to the device (``problem.user_data`` stays in host memory
  or a memory map; Poisson, user rows or the ``U m`` item slots). Under add_remove the
  declared count is the public bound the plan sized the sampling capacity for: more rows than
  that are refused, before any step."""
  host = rows is None and getattr(problem, "placement", "device") == "host"
  if host:
    if plan.adaptive is not None:
      raise ValueError("clip_norm: adaptive does not stream rows from the host yet "
                       "(data_placement='host'): use data_placement='device'")
    if plan.level not in ("user", "item") or plan.sampling != "poisson":
      raise ValueError("data_placement='host' streams Poisson-sampled rows (dp_sgd_user or "
                       f"dp_sgd_item with sampling='poisson'); got level={plan.level!r}, "
                       f"sampling={plan.sampling!r}")
    data = problem.user_data
    n = data.n_users * (1 if plan.level == "user" else data.max_items_per_user)
  else:
    rows = level_rows(problem, plan.level, None) if rows is None else rows
    n = jax.tree.leaves(rows)[0].shape[0]
  if plan.relation == "add_remove" and n > plan.n_public:
    # the realized count is private under add_remove: the message names only the bound
    raise ValueError(f"the data has more {plan.level + ' ' if host else ''}rows than the "
                     f"declared n_users allows ({plan.n_public} rows): under add_remove the "
                     "declared count is the public bound the sampling capacity is sized for")
  capacity = n if plan.capacity is None else plan.capacity
  # the learning rate is an argument of the jitted scan: a grid sweep traces it (common.hparam)
  hparams = {"clip": plan.clip, "stddev": plan.noise_std if noise else 0.0,
             "lr": hparam(problem, "learning_rate", plan.lr),
             "radius": problem.radius, "noise_key": jax.random.fold_in(key, 1)}
  progress = None if keep else getattr(problem, "progress", None)
  mesh = getattr(problem, "mesh", None)
  if host:
    return run_chain_host(problem.loss_fn, problem.user_data, problem.init_params(),
                          dp_sgd_chain, hparams, static=(plan.denominator, plan.averaging, False),
                          steps=plan.steps, key=jax.random.fold_in(key, 2),
                          rate=plan.sampling_rate, capacity=plan.capacity,
                          view="user" if plan.level == "user" else "item_rows", rows=n,
                          progress=progress, mesh=mesh)
  static = (plan.denominator, plan.averaging, keep,
            plan.adaptive.stage_spec(noise) if plan.adaptive is not None
            else ("independent",) if plan.mf is None else plan.mf.stage_spec(), plan.steps)
  record = _release_of if keep else None
  if plan.sampling in ("cyclic", "banded_poisson"):   # batches drawn by this family's loops
    if mesh is not None:
      raise ValueError(f"sampling={plan.sampling!r} does not run on a mesh yet: use one device")
    with progress_session(progress, plan.steps) as session:
      loop = (_cyclic_loop(problem.loss_fn, dp_sgd_chain, static, plan.steps, plan.batch,
                           -(-n // plan.batch), record, session.report)
              if plan.sampling == "cyclic" else
              banded_poisson_loop(problem.loss_fn, dp_sgd_chain, static, plan.steps,
                                  plan.min_sep, plan.sampling_rate, capacity, record,
                                  session.report))
      return loop(problem.init_params(), jax.random.fold_in(key, 2), hparams, rows,
                  session.tick())
  return run_chain(problem.loss_fn, rows, problem.init_params(), dp_sgd_chain, hparams,
                   static=static, steps=plan.steps,
                   key=jax.random.fold_in(key, 2), sampling=plan.sampling,
                   batch=n if plan.sampling == "full" else plan.batch, capacity=capacity,
                   rate=plan.sampling_rate if plan.sampling == "poisson" else None,
                   record=record, mesh=mesh, progress=progress)


def run_dp_sgd(plan: Any, problem: SCOProblem, key: jax.Array) -> Result:
  """Executes a DP-SGD plan (``plan.detail``) on ``problem``'s rows and reports the plan's
  guarantee (``dp_sgd_user``, ``dp_sgd_item`` and ``dp_sgd_group`` are registered on it).

  Args:
    plan: the :class:`dpsco_jax.Plan` of one of the three algorithms.
    problem: the problem it runs on.
    key: the run's PRNG key.

  Returns:
    The :class:`~dpsco_jax.result.Result`: the released point, ``plan.privacy``, the record.
  """
  p: DpSgdPlan = plan.detail
  params, _ = _execute(problem, p, key)
  grad_evals = int(p.steps * p.batch * (problem.m if p.level == "user" else 1))
  return Result(params=params, privacy=plan.privacy, gradient_evaluations=grad_evals,
                record=_record(p))


def _record(plan: DpSgdPlan) -> dict:
  """The run's record: the plan's public numbers (never a clip norm that adapted)."""
  record = {"noise_multiplier": plan.noise_multiplier, "num_steps": plan.steps,
            "batch_size": plan.batch, "denominator": plan.denominator,
            "sampling_rate": plan.sampling_rate, "noise_std": plan.noise_std,
            "clip_norm": plan.clip, "learning_rate": plan.lr, "sampling": plan.sampling,
            "relation": plan.relation, "noise_mechanism": plan.noise,
            # the released point: the uniform average of the iterates (default) or the last
            "averaging": plan.averaging}
  if plan.participations is not None:
    record.update(participations=plan.participations, min_separation=plan.min_sep)
  if plan.group_rows is not None:
    record.update(group_rows=plan.group_rows, truncation_probability=plan.truncation_probability)
  if plan.mf is not None:
    record.update(mf_strategy=plan.mf.source, mf_sensitivity=plan.mf.sensitivity,
                  **({"bands": len(plan.mf.coefs)} if plan.noise == "banded"
                     else {"tree_levels": tree_levels(plan.steps)} if plan.noise == "tree"
                     else {"buffers": len(plan.mf.buf_decay)}))
  if plan.adaptive is not None:   # public constants only; the clip norms are not recorded
    a = plan.adaptive
    record.update(clip_norm="adaptive", initial_clip_norm=a.initial_clip_norm,
                  target_quantile=a.target_quantile, clip_learning_rate=a.clip_learning_rate,
                  count_stddev=a.split.count_stddev, sum_noise_multiplier=a.split.sum_multiplier)
  return record


def dp_sgd_releases(problem: SCOProblem, cfg: dict, key: jax.Array, *, level: str = "user",
                    data: dict | None = None, noise: bool = True) -> Any:
  """Audit hook: the per-step privatized releases of ``dp_sgd_{level}`` on ``data``.

  Returns the noisy aggregates ``sum_i clip(g_i) / D + N(0, (z C / D)^2)``, stacked along a
  leading ``[steps]`` axis (params-shaped otherwise), exactly as the driver with the same
  ``problem``, ``cfg`` and ``key`` draws them (same sampling and noise keys). ``data``
  (default ``problem.data``, leaves ``[users, m, ...]``) is the dataset under test; the plan
  is the planner's, made from ``data``'s rows (identical for neighbours under ``add_remove``),
  and the budget is checked first. ``noise=False`` is a TEST HOOK that returns the noiseless
  aggregates (sensitivity tests); it is never a release."""
  check_bool(noise, "noise")
  plan = dp_sgd_plan(problem, cfg, level=level, data=data)
  plan.charge()
  return _execute(problem, plan, key, level_rows(problem, level, data), noise=noise,
                  keep=True)[2]


# every DP-SGD variant clips rows of the batch on each device (algorithms.common.run_chain);
# the learning rate is an argument of the jitted scan, so a grid over it is one program
_TRAITS = dict(paper="baseline", mesh=True, batched=True,
               grid=Grid(frozenset({"learning_rate"}), ("learning_rate",)))


# dp_sgd_user: user-level DP-SGD with per-user clipping of the mean gradient; dp_sgd_item:
# item-level (per-example clipping), its guarantee item-level only; dp_sgd_group: item rows
# lifted to a user-level guarantee by group privacy over the m items (relations: the plan)
dp_sgd_user = register("dp_sgd_user", config=DpSgdConfig, planner=dp_sgd_planner("user"),
                       host_streaming=True, distributed=True, **_TRAITS)(run_dp_sgd)
dp_sgd_item = register("dp_sgd_item", config=DpSgdConfig, planner=dp_sgd_planner("item"),
                       level="item", reads_m=True, host_streaming=True, distributed=True,
                       **_TRAITS)(run_dp_sgd)
dp_sgd_group = register("dp_sgd_group", config=DpSgdConfig, planner=dp_sgd_planner("group"),
                        level="item", item_guarantee=False, reads_m=True, **_TRAITS)(run_dp_sgd)


@register("nonprivate_sgd", config=SgdSchedule, planner=nonprivate_planner, **_TRAITS)
def nonprivate_sgd(plan: Any, problem: SCOProblem, key: jax.Array) -> Result:
  """Projected minibatch SGD over users with iterate averaging; no privacy (its plan read the
  realized number of users)."""
  p: SgdPlan = plan.detail
  params, _ = run_chain(problem.loss_fn, problem.data, problem.init_params(), sgd_chain,
                        {"lr": hparam(problem, "learning_rate", p.lr), "radius": problem.radius},
                        static=(float(p.batch), p.averaging),
                        steps=p.steps, key=key, sampling=p.sampling, batch=p.batch,
                        capacity=p.capacity, mesh=getattr(problem, "mesh", None),
                        progress=getattr(problem, "progress", None))
  return Result(params=params, privacy=plan.privacy,
                gradient_evaluations=int(p.steps * p.batch * problem.m),
                record={"num_steps": p.steps, "batch_size": p.batch, "learning_rate": p.lr,
                        "averaging": p.averaging})
