"""Accelerated DP-SRGD (paper 003): single-epoch DP-SCO with ~sqrt(n) large-batch steps.

Choquette-Choo, Ganesh, Thakurta, "Optimal Rates for O(1)-Smooth DP-SCO with a Single Epoch
and Large Batches" (2024), Algorithm 1; decoded in spec 003.

One pass over the data in ``T`` disjoint consecutive batches of ``B`` examples. At step ``t``
every example of batch ``t`` gives the SRG difference
``delta_t(d) = (t+1) grad f(x_t, d) - t grad f(x_{t-1}, d)`` (Alg. 1 line 4); the chain is

    clip_per_user(C) -> aggregate(mean, B) -> prefix_sum_noise(z C/B, T, "tree")   [release]
    -> scale_by_srg_weight() -> accelerated_projected_step(beta, R, z_scale)       [post-proc.]

and the released model is ``y_T``. Variants from the same parts (:func:`srgd_chain`):
``accelerated=False`` (the §4.3 sketch: projected SGD with step ``1/beta``, last iterate;
AMBIG: the paper does not write the update out), ``srg=False`` (plain clipped gradients with
independent noise: accelerated DP-SGD, §5.5 / Thm 5.13, or single-epoch DP-SGD),
``noise="independent"`` (the SRG with per-step noise), ``noise="banded" | "blt"`` and
``epochs > 1`` (not in the paper; see :mod:`.plan`).

The registered runners execute the plan (``dpsco_jax.Plan.detail``; privacy: :mod:`.plan`)
and report its guarantee. Presets: :mod:`.presets`. Audit hook: :func:`srgd_releases`."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax.algorithms.srgd.config import SrgdConfig
from dpsco_jax.cache import bounded_cache
from dpsco_jax._checks import (check_bool, check_choice, check_nonnegative, check_positive,
                               check_user_mask)
from dpsco_jax.algorithms.common import (ProgressFn, emit_progress, hparam, mesh_users_axis,
                                         progress_session, traced_hparams)
from dpsco_jax.algorithms.registration import Grid, register
from dpsco_jax.algorithms.srgd.plan import (ACCOUNTANT, NOISES, SUPPORTED_RELATIONS, VARIANTS,
                                            SRGDPlan, paper_epsilon, plan_srgd, scan_settings,
                                            srgd_planner)
from dpsco_jax.algorithms.srgd.presets import (PRESETS, SRGDParams, interior_c_dp,
                                               practical_params, theory_params)
from dpsco_jax.grads import per_user_grads
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import (aggregate, aggregation_sensitivity, clip_per_user,
                                           tree_global_norms)
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.srg import (accelerated_projected_step, scale_by_srg_weight,
                                      srg_differences)
from dpsco_jax.transforms.steps import projected_sgd, released_params
from dpsco_jax.transforms.matrix_factorization import banded_noise, blt_noise
from dpsco_jax.transforms.tree_noise import TreePrefixNoiseState, prefix_sum_noise

PyTree = Any
__all__ = ["accelerated_dp_srgd", "dp_srgd_unaccelerated",
           "accelerated_dp_srgd_independent_noise", "accelerated_dp_sgd", "single_epoch_dp_sgd",
           "PRESETS", "SUPPORTED_RELATIONS", "SRGDParams", "SRGDPlan", "interior_c_dp",
           "paper_epsilon", "plan_srgd", "practical_params", "run_compiled", "run_srgd",
           "single_epoch_batches", "srgd_chain", "srgd_privatizer", "srgd_releases",
           "srgd_stepper", "theory_params", "ACCOUNTANT"]


# ----------------------------------------------------------------------------- the chain
def srgd_privatizer(*, clip_norm: float, batch_size: int, noise_multiplier: float,
                    num_steps: int, key: jax.Array, srg: bool = True, noise: str = "tree",
                    mf: tuple = ()) -> optax.GradientTransformationExtraArgs:
  """The release half: per-example clip -> fixed-``B`` mean -> noise: noisy prefix sums with
  ``srg`` (tree, independent, or MF with ``mf = ("banded", coefs)`` / ``("blt", decay,
  scale)``), else noisy increments (DP-SGD). Std ``z C / B``, the plan's stage."""
  return _privatizer(_increment_std(noise_multiplier, clip_norm, batch_size),
                     clip_norm=clip_norm, batch_size=batch_size, num_steps=num_steps, key=key,
                     srg=srg, noise=noise, mf=mf)


def _increment_std(noise_multiplier: float, clip_norm: float, batch_size: int) -> float:
  """``z C / B``: the std of the increment's stage (``SRGDPlan.stage``), bit for bit."""
  aggregation_sensitivity(clip_norm, mode="mean", denominator=batch_size)  # C, B > 0, C/B finite
  return GaussianStage(check_nonnegative(noise_multiplier, "noise_multiplier"),
                       clipped_mean_sensitivity(float(clip_norm), batch_size)).std


def _privatizer(std: float, *, clip_norm: float, batch_size: int, num_steps: int,
                key: jax.Array, srg: bool, noise: str, mf: tuple
                ) -> optax.GradientTransformationExtraArgs:
  """:func:`srgd_privatizer` adding noise of std ``std`` (a plan's ``noise_std``)."""
  check_choice(noise, "noise", NOISES)
  if noise in ("banded", "blt") and (not mf or mf[0] != noise):
    raise ValueError(f"noise={noise!r} needs its strategy: mf=('{noise}', ...) (the plan's)")
  stages = [clip_per_user(clip_norm), aggregate("mean", batch_size)]
  if srg and noise == "banded":
    stages.append(banded_noise(std, num_steps, key, coefs=mf[1], output="prefix"))
  elif srg and noise == "blt":
    stages.append(blt_noise(std, num_steps, key, buf_decay=mf[1], output_scale=mf[2],
                            output="prefix"))
  elif srg:
    stages.append(prefix_sum_noise(std, num_steps, key, mechanism=noise))
  else:
    if noise != "independent":
      raise ValueError("srg=False feeds plain gradients, whose noise is independent per step "
                       "(DP-SGD / Thm 5.13); use noise='independent'")
    stages.append(add_gaussian_noise(std, key))
  return optax.chain(*stages)


def srgd_stepper(*, beta: float, radius: float | None, srg: bool = True,
                 accelerated: bool = True, z_scale: float = 1.0,
                 learning_rate: float | None = None, averaging: str = "none"
                 ) -> optax.GradientTransformationExtraArgs:
  """The post-processing half: ``/eta_t`` (with SRG) then the accelerated (y, z, x) step, or
  projected SGD with step ``learning_rate`` (default ``1/beta``)."""
  stages = [scale_by_srg_weight()] if srg else []
  if accelerated:
    stages.append(accelerated_projected_step(beta, radius=radius, z_scale=z_scale))
  else:
    lr = 1.0 / check_positive(beta, "beta") if learning_rate is None else learning_rate
    stages.append(projected_sgd(lr, radius=radius, averaging=averaging))
  return optax.chain(*stages)


def srgd_chain(*, clip_norm: float, batch_size: int, noise_multiplier: float, num_steps: int,
               key: jax.Array, beta: float, radius: float | None, srg: bool = True,
               noise: str = "tree", accelerated: bool = True, z_scale: float = 1.0,
               learning_rate: float | None = None, averaging: str = "none"
               ) -> optax.GradientTransformationExtraArgs:
  """Algorithm 1 (spec §7.2) as one optax transformation over stacked per-example
  ``delta_t(d)`` (or plain gradients with ``srg=False``); ``update`` needs ``params = x_t``."""
  return optax.chain(
      srgd_privatizer(clip_norm=clip_norm, batch_size=batch_size,
                      noise_multiplier=noise_multiplier, num_steps=num_steps, key=key, srg=srg,
                      noise=noise),
      srgd_stepper(beta=beta, radius=radius, srg=srg, accelerated=accelerated,
                   z_scale=z_scale, learning_rate=learning_rate, averaging=averaging))


# ----------------------------------------------------------------------------- the driver
def single_epoch_batches(data: PyTree, num_steps: int, batch_size: int) -> PyTree:
  """``[n, ...] -> [T, B, ...]``: consecutive disjoint batches, remainder dropped. Positions are
  fixed by the public ``n``, so a neighbour's example keeps its batch."""
  def split(x):
    if x.shape[0] < num_steps * batch_size:
      raise ValueError(f"data has {x.shape[0]} examples < num_steps * batch_size = "
                       f"{num_steps * batch_size}")
    return x[:num_steps * batch_size].reshape((num_steps, batch_size) + x.shape[1:])
  return jax.tree.map(split, data)


def _diagnostics(rows, released, p_state, clip_norm: float, batch_size: int) -> dict:
  """Data-dependent diagnostics (``debug=True`` only); the fraction is over the ``B`` slots."""
  norms = tree_global_norms(rows)
  diag = {"max_row_norm": jnp.max(norms),
          "clipped_fraction": jnp.sum(norms > clip_norm) / batch_size}
  noise_state = p_state[-1]
  if isinstance(noise_state, TreePrefixNoiseState):
    diag["noise_norm"] = jnp.sqrt(sum(
        jnp.sum(jnp.square(a - b)) for a, b in zip(
            jax.tree.leaves(released), jax.tree.leaves(noise_state.prefix))))
  return diag


def _batches_on_mesh(data: PyTree, mask: jax.Array, num_steps: int, batch_size: int,
                     mesh: Mesh, axis: str = "users") -> tuple[PyTree, jax.Array, NamedSharding]:
  """The batches ``[T, B', ...]`` and masks ``[T, B']`` with each batch's examples sharded
  over ``mesh``'s ``axis``. ``B'`` rounds ``B`` up to the devices; the pad slots copy an
  example and are masked (zero rows, denominator still ``B``). Returns one step's sharding."""
  n_dev = mesh_users_axis(mesh, axis)
  pad = -int(batch_size) % n_dev

  def put(x):
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, axis,
                                                               *([None] * (x.ndim - 2)))))

  def place(x):
    xp = jnp if isinstance(x, jax.Array) else np   # numpy leaves: padded on the host, then placed
    if pad:
      x = xp.concatenate([x, xp.repeat(x[:, :1], pad, axis=1)], axis=1)
    return put(x)
  batches = jax.tree.map(place, single_epoch_batches(data, num_steps, batch_size))
  masks = jnp.asarray(mask)[:num_steps * batch_size].reshape(num_steps, batch_size)
  masks = put(jnp.pad(masks, ((0, 0), (0, pad))))   # pad slots: False
  return batches, masks, NamedSharding(mesh, PartitionSpec(axis))


@bounded_cache()
def _compiled_runner(loss_fn: Callable, settings: tuple, users: NamedSharding | None,
                     report: int | None) -> Callable:
  """The jitted scan over ``T`` steps, memoized on its four positional arguments. ``users``:
  the batches come placed by :func:`_batches_on_mesh`. With ``epochs > 1`` step ``t`` reads
  batch ``t mod P``. ``report``: a progress session's (``None``: no progress)."""
  s = dict(settings)
  T, B, k = s["num_steps"], s["batch_size"], s["epochs"]
  P = T // k

  def run(data, params0, key, user_mask, points, hp=None, tick=None):
    # hp: beta and the learning rate traced (a grid sweep); None: the settings' constants
    beta, lr = ((s["beta"], s["learning_rate"]) if hp is None
                else (hp["beta"], hp["learning_rate"]))
    if users is None:
      batches = single_epoch_batches(data, P, B)
      masks = user_mask[:P * B].reshape(P, B)
    else:
      batches, masks = data, user_mask
    privatizer = _privatizer(s["noise_std"], clip_norm=s["clip_norm"], batch_size=B,
                             num_steps=T, key=key, srg=s["srg"], noise=s["noise"], mf=s["mf"])
    stepper = srgd_stepper(beta=beta, radius=s["radius"], srg=s["srg"],
                           accelerated=s["accelerated"], z_scale=s["z_scale"],
                           learning_rate=lr, averaging=s["averaging"])
    state0 = (privatizer.init(params0), stepper.init(params0))
    replay = None
    if points is not None:  # replay: query points given (x_{-1} = x_0), not the run's own
      prev_points = jax.tree.map(lambda a: jnp.concatenate([a[:1], a[:-1]]), points)
      replay = (points, prev_points)

    def body(carry, xs):
      params, prev, (p_state, s_state) = carry
      batch, mask, t, given = xs
      if k > 1:   # static: the same fixed order every epoch, batch t mod P
        batch, mask = jax.tree.map(lambda b: b[t % P], (batches, masks))
      if users is not None:   # keep the step's examples on their devices
        batch, mask = jax.lax.with_sharding_constraint((batch, mask), users)
      if given is not None:
        params, prev = given
      rows = (srg_differences(loss_fn, params, prev, batch, t, user_mask=mask) if s["srg"]
              else per_user_grads(loss_fn, params, batch, user_mask=mask))   # masked: zero rows
      released, p_state = privatizer.update(rows, p_state, params, user_mask=mask)
      updates, s_state = stepper.update(released, s_state, params)
      out = {"release": released, "query": params} if s["releases"] else {}
      if s["debug"]:
        out.update(_diagnostics(rows, released, p_state, s["clip_norm"], B))
      emit_progress(report, tick, t)   # the step count only
      return (optax.apply_updates(params, updates), params, (p_state, s_state)), out

    per_step = (batches, masks) if k == 1 else (None, None)
    (params, _, (_, s_state)), outs = jax.lax.scan(
        body, (params0, params0, state0), (*per_step, jnp.arange(T), replay))
    return released_params(s_state, params), params, outs

  return jax.jit(run)


def _mask_for(data: PyTree, user_mask: Any) -> jax.Array:
  n = jax.tree.leaves(data)[0].shape[0]
  if user_mask is None:
    return jnp.ones((n,), bool)
  return check_user_mask(user_mask, n)


def run_srgd(loss_fn: Callable, data: PyTree, params0: PyTree, key: jax.Array, *,
             num_steps: int, batch_size: int, beta: float, clip_norm: float,
             noise_multiplier: float, radius: float | None, srg: bool = True,
             noise: str = "tree", accelerated: bool = True, z_scale: float = 1.0,
             learning_rate: float | None = None, averaging: str = "none",
             user_mask: jax.Array | None = None, debug: bool = False, mf: tuple = (),
             epochs: int = 1) -> tuple[PyTree, PyTree, dict]:
  """Runs ``num_steps`` steps in one jitted ``lax.scan`` (no accounting: use a plan).

  ``data`` leaves ``[n, m, ...]``; ``user_mask`` (bool ``[n]``) zeroes examples (zero-out).
  Returns ``(released, last_query_point, diagnostics)``; diagnostics are empty unless
  ``debug``. ``key`` and the data are traced (vmap-able over keys)."""
  settings = scan_settings(num_steps=num_steps, batch_size=batch_size, beta=beta,
                           clip_norm=clip_norm,
                           noise_std=_increment_std(noise_multiplier, clip_norm, batch_size),
                           radius=radius, srg=srg, noise=noise, accelerated=accelerated,
                           z_scale=z_scale, learning_rate=learning_rate, averaging=averaging,
                           debug=debug, mf=mf, epochs=epochs)
  return _compiled_runner(loss_fn, settings, None, None)(data, params0, key,
                                                       _mask_for(data, user_mask), None)


def _run_settings(plan: SRGDPlan, **run) -> tuple:
  """The plan's scan settings with this run's own knobs, sorted."""
  return tuple(sorted({**dict(plan.settings), **run}.items()))


def run_compiled(plan: SRGDPlan, loss_fn: Callable, data: PyTree, params0: PyTree,
                 key: jax.Array, *, user_mask: jax.Array | None = None, debug: bool = False,
                 mesh: Mesh | None = None, hparams: dict | None = None,
                 progress: ProgressFn | None = None) -> tuple[PyTree, PyTree, dict]:
  """Executes ``plan`` (see :func:`run_srgd`). ``mesh``: each batch's examples are sharded over
  its ``"users"`` axis (same noise as one device). ``hparams``: ``{"beta", "learning_rate"}``
  as traced arguments (a grid sweep). ``progress``: reports of the steps done."""
  settings = _run_settings(plan, debug=check_bool(debug, "debug"))
  mask = _mask_for(data, user_mask)
  users = None
  if hparams is not None:
    if mesh is not None:
      raise ValueError("a grid sweep of step sizes runs on one device (no mesh)")
    settings = tuple((k, "traced" if k in ("beta", "learning_rate") else v)
                     for k, v in settings)
  elif mesh is not None:
    data, mask, users = _batches_on_mesh(data, mask, plan.params.period,
                                         plan.params.batch_size, mesh)
  with progress_session(progress, plan.params.num_steps) as session:
    runner = _compiled_runner(loss_fn, settings, users, session.report)
    return runner(data, params0, key, mask, None, hparams, session.tick())


def srgd_releases(plan: SRGDPlan, loss_fn: Callable, data: PyTree, params0: PyTree,
                  key: jax.Array, *, user_mask: jax.Array | None = None,
                  points: PyTree | None = None, add_noise: bool = True) -> dict:
  """Audit hook: the per-step privatized releases of ``plan`` on ``data`` with ``key``.

  Returns ``{"release": [T, ...], "query": [T, ...]}``: the noisy prefix sum (SRG variants) or
  noisy increment (DP-SGD variants) of step ``t`` and the point ``x_t`` its gradients were
  taken at; everything after the releases is post-processing. ``user_mask`` builds a zero-out
  neighbour; ``add_noise=False`` is the test hook without noise; ``points`` (leaves ``[T,
  ...]``) replays the run at given query points. Nothing is charged to any ledger."""
  std = plan.noise_std if check_bool(add_noise, "add_noise") else 0.0
  settings = _run_settings(plan, noise_std=std, releases=True)
  _, _, outs = _compiled_runner(loss_fn, settings, None, None)(
      data, params0, key, _mask_for(data, user_mask), points)
  return outs


def _step_hparams(plan: SRGDPlan, problem) -> dict | None:
  """``beta`` and the projected-SGD ``learning_rate`` (default ``1/beta``) as a grid sweep traces
  them; ``None`` in a run of its own."""
  if not traced_hparams(problem):
    return None
  beta = plan.params.beta
  lr = 1.0 / beta if plan.learning_rate is None else plan.learning_rate
  return {"beta": hparam(problem, "beta", beta),
          "learning_rate": hparam(problem, "learning_rate", lr)}


def _record(plan: SRGDPlan) -> dict:
  prm = plan.params
  record = dict(num_steps=prm.num_steps, batch_size=prm.batch_size,
                examples_used=prm.period * prm.batch_size, beta=prm.beta,
                clip_norm=prm.clip_norm, noise_multiplier=prm.noise_multiplier,
                tree_levels=plan.levels, srg=plan.srg, noise=plan.noise,
                accelerated=plan.accelerated, z_scale=plan.z_scale, preset=prm.preset,
                variant=prm.variant, relation=plan.relation)
  if plan.mf:
    record.update(mf_strategy=plan.mf_source, mf_sensitivity=plan.mf_sensitivity)
  if plan.epochs != 1:
    record.update(epochs=plan.epochs, period=prm.period,
                  stream_sensitivity=plan.stream_sensitivity)
  if prm.paper is not None:
    record["paper_params"] = prm.paper
  return record


# ----------------------------------------------------------------------------- the drivers
# A grid sweep over the step (beta, learning_rate) traces them; the noise depends on neither.
# Under preset: theory both are the theorem's: a grid of identical runs.
_STEP_GRID = Grid(frozenset({"learning_rate", "beta", "beta_scale"}), ("beta", "learning_rate"))


def _algorithm(name: str) -> Callable:
  def fn(plan: Any, problem, key: jax.Array) -> Result:
    p: SRGDPlan = plan.detail
    debug = bool(plan.config.debug)
    released, _, diags = run_compiled(p, problem.loss_fn, problem.data, problem.init_params(),
                                      key, debug=debug, mesh=getattr(problem, "mesh", None),
                                      hparams=_step_hparams(p, problem),
                                      progress=getattr(problem, "progress", None))
    debug_out = {k: np.asarray(v).tolist() for k, v in diags.items()} if debug else None
    return Result(params=released, privacy=plan.privacy,
                  gradient_evaluations=(2 if p.srg else 1) * p.params.num_steps
                  * p.params.batch_size * int(problem.m), record=_record(p), debug=debug_out)
  fn.__name__ = fn.__qualname__ = name
  srg, noise, acc = VARIANTS[name]
  fn.__doc__ = (f"{name} (paper 003; srg={srg}, noise={noise!r}, accelerated={acc}): runs "
                "its plan (dpsco_jax.Plan); relations zero_out (default) / replace_one; see "
                "dpsco_jax.algorithms.srgd.driver.")
  return register(name, config=SrgdConfig, paper="003", planner=srgd_planner(name),
                  # users sharded over the mesh's "users" axis (_batches_on_mesh)
                  mesh=True, batched=True, grid=_STEP_GRID)(fn)


accelerated_dp_srgd = _algorithm("accelerated_dp_srgd")
dp_srgd_unaccelerated = _algorithm("dp_srgd_unaccelerated")
accelerated_dp_srgd_independent_noise = _algorithm("accelerated_dp_srgd_independent_noise")
accelerated_dp_sgd = _algorithm("accelerated_dp_sgd")
single_epoch_dp_sgd = _algorithm("single_epoch_dp_sgd")
