"""DP training of Flax nnx models with our chains: Poisson-sampled DP-SGD, planned before it
touches data, accounted as it goes, checkpointed and resumed bit-identically.

**Neighbouring relation and what is public** (see :mod:`dpsco_jax.privacy.relations`):

* ``relation="add_remove"`` (default): one user (item, at item level) is added or removed; the
  number of users ``n`` is private. The sampling rate ``q`` (``sampling_rate``) and the
  denominator ``D`` (``expected_batch_size``) are **declared public constants** and must both
  be given; nothing is derived from ``len(data)`` (the ``D = q n`` of earlier versions made the
  noise scale depend on the private ``n``, issue 11.2). Pick ``D = q * N`` with ``N`` a public
  estimate of the number of users; any positive ``D`` is sound, a good one gives an unbiased
  gradient.
* ``relation="zero_out"`` / ``"replace_one"``: ``n`` is public; ``D`` defaults to ``q n``.

Plan (data-free, at construction): ``q``, ``D``, the noise multiplier ``z`` (given, or
calibrated by :func:`~dpsco_jax.privacy.calibrate_poisson_sgd`, memoized, to ``target_epsilon``
over ``num_steps``), the per-step event ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` and the
noise stddev ``z C / D``. A ``target_epsilon`` is a budget: an explicit ``noise_multiplier``
whose ``num_steps`` exceed it raises before anything is released, and the ledger is created
with ``epsilon_budget = min(target_epsilon, epsilon_budget)``.

One step (user level: leaves ``[n, m, ...]``, a user's gradient is the mean over its ``m``
items; item level: leaves ``[n, ...]``):

1. Poisson sampling: user ``u`` joins step ``t`` iff ``bernoulli(fold_in(sample_key, t), q)[u]``.
   The trainer itself gathers the sampled users into padded micro-batches of static size and
   builds their ``user_mask``, so a padded slot is never counted (a padded batch without mask
   cannot reach the clipper through the trainer). Every realized batch is processed exactly.
2. Clipping: per-user (mean) gradients clipped to ``C`` and summed, by
   :class:`~dpsco_jax.flax.fast_clip.FastClippedGrad` (``method="fast"`` or ``"vmap"``). The
   clipped sums of the micro-batches are accumulated (``accumulation_steps=k``: micro-batches
   of ``ceil(batch_capacity / k)`` users), then
3. noise is added once per logical batch: ``sum / D + N(0, (z C / D)^2)`` (core
   ``add_gaussian_noise``), and the caller's ``optimizer`` sees only the privatized gradient
   (post-processing). ``optax.MultiSteps`` or ``optax.apply_every`` in ``optimizer`` is
   refused: they average (sum) noisy gradients, not accumulate clipped sums; use
   ``accumulation_steps``.

Sensitivity: removing (zeroing) one user moves the clipped sum by at most ``C``, the released
mean by ``C / D``; under replace-one by ``2C`` (the accountant doubles it).

Accounting: each step is one event (Abadi et al. 2016; Mironov et al. 2019), composed by the
core :class:`~dpsco_jax.privacy.PrivacyLedger` (PLD by default); provenance ``accountant``.
:meth:`DPTrainer.train` checks the whole planned run against the budget once, before its first
step, then charges each block of ``report_every`` steps before running it; the epsilon it
reports per block is the ledger's cached upper bound, labelled ``epsilon_kind:
"upper_bound"`` in the history (exact: :meth:`DPTrainer.epsilon`).

Cyclic schedule and correlated noise (issue #27): ``sampling="cyclic"`` with
``noise_mechanism="independent" | "banded" | "blt"`` runs ``dp_sgd_user``'s cyclic plan (same
keys, batches, noise stage and events; :mod:`dpsco_jax.flax.trainer_noise`). Poisson sampling
with MF noise is refused (no banded amplification is implemented).

Adaptive clipping (issue 48.2; Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021):
``clip_norm="adaptive"`` with ``initial_clip_norm`` (and ``target_quantile``,
``clip_learning_rate``, ``count_stddev``: ``dp_sgd_user``'s keys). The clipper clips at the
``C_t`` of the noise state (:func:`~dpsco_jax.transforms.adaptive_clipping.adaptive_noise`,
``state.opt_state[0]``); the micro-batches accumulate the clipped sums and the centred count of
unclipped users; the one noise draw of the step adds ``z_Delta C_t / D`` to the mean and
``sigma_b`` to the count, and ``C_t`` takes the geometric step. ``z_Delta`` and ``sigma_b`` are
DP-SGD's adaptive plan (:func:`~dpsco_jax.algorithms.dpsgd.plan.adaptive_plan`), so the pair is
one Gaussian of multiplier ``z``: the event, the ledger and the epsilon are a fixed clip's.
Fast clipping honours ``C_t``: its certified bounds ``N_u`` do not depend on ``C``, so every
user still adds at most ``w_u N_u <= C_t``. Refused with MF noise (the plan's reason). ``C_t``
is public (post-processing of the noisy counts): ``history`` records it per block.

Many devices (issue 24.2): ``mesh=`` shards each step's users over a ``"users"`` axis, same
plan, keys and ledger (:mod:`dpsco_jax.flax.trainer_mesh`).

Audit hook: :meth:`DPTrainer.release_fn` returns a pure ``release(key, dataset)`` giving the
per-step privatized gradients (issue 12's harness interface). Checkpoints:
:mod:`dpsco_jax.flax.checkpoint`. Timing is not protected (the number of micro-batches of a
step depends on its realized batch size).
"""

from __future__ import annotations

import math
import os
import types
from typing import Any, Callable, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpsco_jax._checks import (ArgumentTypeError, check_bool, check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive, check_probability,
                               check_seed_or_key)
from dpsco_jax.flax import checkpoint as ckpt
from dpsco_jax.flax.fast_clip import FastClippedGrad, LossFn
from dpsco_jax.flax import trainer_mesh as tm
from dpsco_jax.flax import trainer_noise as tn
from dpsco_jax.flax.trainer_data import check_data, from_user_data
from dpsco_jax.algorithms.dpsgd.config import ADAPTIVE, check_adaptive_keys
from dpsco_jax.algorithms.dpsgd.plan import (NOISES, AdaptivePlan, adaptive_plan,
                                             check_mf_sampling, config_view)
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance, PUBLIC,
                               calibrate_poisson_sgd, check_relation, epsilon_of)
from dpsco_jax.privacy.ledger import Epsilon, epsilon_lower_bound
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity
from dpsco_jax.transforms.adaptive_clipping import unclipped_centred_count
from dpsco_jax.transforms.noise import add_gaussian_noise

PyTree = Any
_REDACTED = "<redacted>"
_LABEL = "dp-sgd step (poisson gaussian)"


class TrainState(NamedTuple):
  """Everything a step depends on. SECRET: ``opt_state`` (holds the noise key) and
  ``sample_key``; both are redacted in repr/str (the arrays stay accessible).

  Attributes:
    params: the model's parameters.
    opt_state: the optimizer and noise state (secret: holds the noise key).
    sample_key: the sampling key (secret).
    step: the steps taken.
  """
  params: PyTree
  opt_state: PyTree
  sample_key: jax.Array
  step: jax.Array

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda x: f"{jnp.result_type(x)}{list(jnp.shape(x))}", self.params)
    return (f"TrainState(params={shapes}, opt_state={_REDACTED}, sample_key={_REDACTED}, "
            f"step={int(self.step)})")

  __str__ = __repr__


def _optional(x: Any, check: Callable, name: str) -> Any:
  return None if x is None else check(x, name)


#: optax's gradient-accumulation wrappers, by the state type they leave in the optimizer state
#: (found however deep in a chain): they average or sum noisy gradients over several steps
_ACCUMULATORS = {optax.MultiStepsState: "optax.MultiSteps", optax.ApplyEvery: "optax.apply_every"}


def _accumulator(tree: Any) -> str | None:
  """The name of the first accumulation wrapper whose state is in ``tree`` (else None)."""
  kinds = tuple(_ACCUMULATORS)
  found = [x for x in jax.tree.leaves(tree, is_leaf=lambda y: isinstance(y, kinds))
           if isinstance(x, kinds)]
  return _ACCUMULATORS[type(found[0])] if found else None


def check_clip_args(clip_norm: Any, adaptive_keys: dict) -> float:
  """The fixed ``C``, or with ``clip_norm="adaptive"`` the checked ``C_0``; the other adaptive
  arguments (``target_quantile``, ``clip_learning_rate``, ``initial_clip_norm``,
  ``count_stddev``, given as ``adaptive_keys``, None where not given) are range-checked here,
  before anything is built, and refused without ``"adaptive"`` (they would be ignored). The
  runner's pre-run check of ``flax.DPTrainer`` calls it too.

  Args:
    clip_norm: a number > 0, or ``"adaptive"``.
    adaptive_keys: the four adaptive arguments by name.

  Returns:
    ``C``, or ``C_0``.

  Raises:
    ValueError: a bad value, an adaptive argument without ``"adaptive"``, or ``"adaptive"``
      without ``initial_clip_norm``.
  """
  if clip_norm != ADAPTIVE:
    if isinstance(clip_norm, str):
      raise ArgumentTypeError(f"clip_norm must be a number > 0 or 'adaptive', got "
                              f"{clip_norm!r}")
    check_adaptive_keys(types.SimpleNamespace(clip_norm=clip_norm, **adaptive_keys))
    return check_positive(clip_norm, "clip_norm")
  if adaptive_keys["initial_clip_norm"] is None:
    raise ValueError("clip_norm='adaptive' needs initial_clip_norm (C_0 > 0, the first step's "
                     "clip norm): DPTrainer has no Lipschitz constant to default to")
  _optional(adaptive_keys["target_quantile"], check_delta, "target_quantile")  # (0, 1)
  _optional(adaptive_keys["clip_learning_rate"], check_positive, "clip_learning_rate")
  _optional(adaptive_keys["count_stddev"], check_nonnegative, "count_stddev")
  return check_positive(adaptive_keys["initial_clip_norm"], "initial_clip_norm")


class DPTrainer:
  """Differentially private training of an nnx model (user- or item-level DP-SGD).

  Args:
    model: the ``nnx.Module`` to train (its ``nnx.Param`` leaves; other state is fixed).
    loss_fn: ``loss_fn(model, example) -> scalar`` for ONE item (checked before any step).
    optimizer: the data-independent step applied to the privatized gradient: an optax
      transformation, e.g. ``optax.sgd(lr)`` (not ``optax.MultiSteps`` / ``apply_every``: see
      ``accumulation_steps``), or an ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, which is
      then driven: training continues from its state and writes its state and step back.
      Either way ``model`` is updated in place at the end of :meth:`train` / :meth:`restore`.
    data: a :class:`~dpsco_jax.data.UserData` (users with uneven item counts; its padding
      is weighted out), or a pytree with leaves ``[n_users, m, ...]`` (``level="user"``,
      every user exactly ``m`` real items) or ``[n, ...]`` (``level="item"``); the declared
      level and the layout must agree (checked).
    clip_norm: ``C``, per-user (per-item) L2 clip of the (mean) gradient, or ``"adaptive"``:
      the clip norm ``C_t`` follows the ``target_quantile`` of the users' norms (Andrew et al.
      2021; :mod:`dpsco_jax.transforms.adaptive_clipping`), carried in the noise state
      (``state.opt_state[0].clip_norm``), checkpointed with it; same event and ledger as a
      fixed clip at ``z`` (the pair's split of DP-SGD's adaptive plan).
    sampling_rate: Poisson rate ``q`` in (0, 1], a declared public constant (Poisson only).
    delta: the delta of the reported guarantee.
    expected_batch_size: the fixed denominator ``D`` (public). Required under ``add_remove``;
      defaults to ``q n`` under ``zero_out`` / ``replace_one`` (``n`` public there).
    relation: ``"add_remove"`` (Poisson's default), ``"zero_out"`` (cyclic's default) or
      ``"replace_one"``.
    noise_multiplier: ``z`` (noise stddev ``z C / D``). Give it, or ``target_epsilon`` and
      ``num_steps`` to calibrate it.
    target_epsilon: the epsilon of ``num_steps`` steps; also a budget of the ledger.
    epsilon_budget: optional hard cap; a run that would exceed it raises
      ``PrivacyBudgetExceeded`` before its first step.
    num_steps: the planned run's steps (needed with ``target_epsilon`` and for cyclic
      sampling).
    level: ``"user"`` or ``"item"``.
    method: ``"fast"`` (taps), ``"vmap"``, or ``"auto"``:
      the one with the lower predicted cost at the micro-batch shape (per-layer cost model,
      shapes only: the choice never depends on the data; see ``clipper.autotune_report``).
    batch_capacity: static size of the users processed at once (default ``D`` + 4 sd).
    accumulation_steps: ``k``: micro-batches of ``ceil(batch_capacity / k)`` users whose
      clipped sums are accumulated before the one noise draw of the logical batch.
    key: PRNG key or int seed; split once into the sampling and noise keys.
    accountant: ``"pld"`` (default), ``"rdp"`` or ``"auto"``.
    debug: a real bool; keeps realized batch sizes (data-dependent) in ``self.debug``.
    sampling: ``"poisson"`` (default) or ``"cyclic"`` (``batch_size`` users a step in a public
      fixed order, each once per epoch of ``ceil(n / B)`` steps; needs ``num_steps``).
    noise_mechanism: ``"independent"``, or with ``sampling="cyclic"`` ``"banded"`` (``bands``)
      or ``"blt"`` (``buffers``), strategy ``mf_strategy`` (``dp_sgd_user``'s keys).
    batch_size: users per step under ``sampling="cyclic"`` (refused with Poisson sampling).
    bands: the bands of ``noise_mechanism="banded"``.
    buffers: the buffers of ``noise_mechanism="blt"``.
    mf_strategy: how the correlated-noise strategy is chosen (default ``"auto"``).
    mesh: a ``jax.sharding.Mesh`` with a ``"users"`` axis (default: the one set with
      ``jax.set_mesh``, if any): each device clips its own users of a step, the sums are
      reduced, the noise drawn once; same plan and ledger (:mod:`~dpsco_jax.flax.trainer_mesh`).
    target_quantile: ``clip_norm="adaptive"``: the fraction ``gamma`` in (0, 1) of users left
      unclipped (default 0.5).
    clip_learning_rate: ``clip_norm="adaptive"``: the step ``eta_C > 0`` of
      ``C <- C exp(-eta_C (b - gamma))`` (default 0.2).
    initial_clip_norm: ``clip_norm="adaptive"``: ``C_0 > 0`` (required: the trainer has no
      Lipschitz constant to default to).
    count_stddev: ``clip_norm="adaptive"``: the unclipped count's noise std ``sigma_b`` in
      users (default ``max(D / 20, z)``); ``2 sigma_b`` must exceed ``z``.

  Raises:
    ValueError: a bad or inconsistent argument, named in the message (e.g. neither
      ``noise_multiplier`` nor ``target_epsilon`` with ``num_steps``; ``batch_size`` with
      Poisson sampling; an optimizer that accumulates noisy updates; data whose layout is not
      the declared ``level``; an adaptive key without ``clip_norm="adaptive"``, or adaptive
      clipping with correlated noise, a target quantile outside (0, 1), a non-positive
      initial norm or step, or a count noise too small for ``z``).
    PrivacyBudgetExceeded: the planned run would exceed ``epsilon_budget``.
  """

  def __init__(self, model: nnx.Module, loss_fn: LossFn, optimizer: optax.GradientTransformation,
               *, data: PyTree, clip_norm: float | str, sampling_rate: float | None = None,
               delta: float, expected_batch_size: float | None = None,
               relation: str | None = None,
               noise_multiplier: float | None = None, target_epsilon: float | None = None,
               num_steps: int | None = None, epsilon_budget: float | None = None,
               level: str = "user", method: str = "fast", batch_capacity: int | None = None,
               accumulation_steps: int = 1, key: jax.Array | int = 0, accountant: str = "pld",
               debug: bool = False, sampling: str = "poisson", batch_size: int | None = None,
               noise_mechanism: str = "independent", bands: int | None = None,
               buffers: int | None = None, mf_strategy: str = "auto",
               mesh: jax.sharding.Mesh | None = None, target_quantile: float | None = None,
               clip_learning_rate: float | None = None, initial_clip_norm: float | None = None,
               count_stddev: float | None = None):
    self._mesh = tm.UsersMesh(mesh)  # identity without a mesh (argument or jax.set_mesh)
    self.sampling, self.noise_mechanism = tn.check_sampling(sampling), noise_mechanism
    check_mf_sampling(check_choice(noise_mechanism, "noise_mechanism", NOISES), self.sampling,
                      allowed=("cyclic",))  # the DP-SGD plan's refusal and reason
    if self.sampling == "poisson":
      self.relation = check_relation("add_remove" if relation is None else relation,
                                     mechanism="DPTrainer (Poisson DP-SGD)")
      self.q = check_probability(sampling_rate, "sampling_rate")
      if batch_size is not None:
        raise ValueError("batch_size is the cyclic schedule's (sampling='cyclic'); Poisson "
                         "sampling takes sampling_rate and expected_batch_size")
    else:
      tn.check_cyclic_args(sampling_rate, expected_batch_size)
    self.level = check_choice(level, "level", ("user", "item"))
    adaptive_keys = {"target_quantile": target_quantile, "clip_learning_rate":
                     clip_learning_rate, "initial_clip_norm": initial_clip_norm,
                     "count_stddev": count_stddev}
    self.clip_norm = check_clip_args(clip_norm, adaptive_keys)  # C, or adaptive: C_0
    self._adaptive_keys = ({k: v for k, v in adaptive_keys.items() if v is not None}
                           if clip_norm == ADAPTIVE else None)
    self.adaptive: AdaptivePlan | None = None   # set by the plan
    self.delta = check_delta(delta)
    self.accountant = check_choice(accountant, "accountant", ("pld", "rdp", "auto"))
    self.accumulation_steps = check_int(accumulation_steps, "accumulation_steps")
    debug = check_bool(debug, "debug")
    key = check_seed_or_key(key, "key")
    self._data_facts = ckpt.data_facts(data)  # of what this trainer reads: checkpoints record it
    loss_fn, data = from_user_data(loss_fn, data, self.level)
    self.clipper = FastClippedGrad(model, loss_fn, clip_norm=self.clip_norm, level=level,
                                   method=method)
    self.n = check_data(self.clipper, data, self.level)  # public: zero_out / replace_one only
    self.cyclic: tn.CyclicSchedule | None = None
    if self.sampling == "cyclic":
      self.cyclic = tn.CyclicSchedule(
          n=self.n, level=self.level, clip_norm=self.clip_norm, delta=self.delta,
          relation=relation, batch_size=batch_size, num_steps=num_steps,
          noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
          noise_mechanism=noise_mechanism, bands=bands, buffers=buffers,
          mf_strategy=mf_strategy, accountant=self.accountant,
          adaptive_keys=self._adaptive_keys)
    self._plan(expected_batch_size, noise_multiplier, target_epsilon, num_steps,
               epsilon_budget)
    self._size_batches(batch_capacity, method, data)

    params = self.clipper.params
    self._user_model, self._nnx_opt = model, None
    if isinstance(optimizer, nnx.Optimizer):  # drive it: its tx, its state, written back
      self._nnx_opt, optimizer = optimizer, optimizer.tx
    self.optimizer = optimizer
    accumulator = _accumulator(optimizer.init(params))
    if accumulator is not None:
      raise ValueError(f"optimizer must not contain {accumulator}: it would accumulate noisy "
                       "gradients over steps instead of accumulating clipped sums under one "
                       "noise draw; use DPTrainer(accumulation_steps=k)")
    if self.cyclic is None:
      sample_key, noise_key = jax.random.split(key)
      self._noise = (add_gaussian_noise(self.noise_stddev, noise_key) if self.adaptive is None
                     else tn.adaptive_stage(self.adaptive, self.denominator, noise_key))
    else:  # the DP-SGD driver's order / noise keys and noise stage (on the raveled gradient)
      sample_key, self._noise = self.cyclic.keys_and_noise(key, self.noise_stddev)
    self._initial_params = params
    inner = optimizer.init(params)
    if self._nnx_opt is not None:  # continue from the nnx.Optimizer's current state
      inner = jax.tree.unflatten(jax.tree.structure(inner),
                                 [v.value for v in self._opt_vars()])
    self.state = self._mesh.place(TrainState(params=params, opt_state=(
        self._noise.init(params), inner), sample_key=sample_key, step=jnp.zeros((), jnp.int32)))
    self.data = self._mesh.place_data(data)
    self.debug: dict | None = {"batch_sizes": []} if debug else None
    self.history: list[dict] = []
    self._build()

  def _size_batches(self, batch_capacity: int | None, method: str, data: PyTree) -> None:
    """The static slots of a step (``batch_capacity``: the cyclic batch, or the Poisson
    mean + 4 sd + 1) and of a micro-batch (rounded up to the mesh's device count), then the
    clipping method for that shape (public: chosen on a zero stand-in)."""
    cap = batch_capacity if batch_capacity is not None else (
        self.denominator if self.cyclic else
        math.ceil(self.denominator + 4 * math.sqrt(self.denominator) + 1))
    self.batch_capacity = min(check_int(cap, "batch_capacity"), self.n)
    self.micro_batch = self._mesh.micro_batch(math.ceil(self.batch_capacity /
                                                        self.accumulation_steps))
    if method == "auto":  # a zero stand-in of the micro-batch shape: the choice is public
      stand_in = jax.tree.map(lambda x: jnp.zeros((self.micro_batch, *x.shape[1:]), x.dtype),
                              data)
      self.clipper.autotune(self.clipper.params, stand_in,
                            jnp.ones((self.micro_batch,), bool))
    self._mesh.check_clipper(self.clipper, data, self.micro_batch)

  def _opt_vars(self) -> list:
    vs = jax.tree.leaves(self._nnx_opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(vs) != len(jax.tree.leaves(self.optimizer.init(self.clipper.params))):
      raise ValueError("optimizer: this nnx.Optimizer's state does not match its tx on the "
                       "model's nnx.Param leaves (build it with wrt=nnx.Param)")
    return vs

  def _sync_model(self, steps_taken: int) -> None:
    """Writes the current params into the user's model (in place, as nnx users expect) and,
    when an ``nnx.Optimizer`` was given, its state and step counter."""
    nnx.update(self._user_model, self.state.params)
    if self._nnx_opt is not None:
      for var, value in zip(self._opt_vars(), jax.tree.leaves(self.state.opt_state[1]),
                            strict=True):
        var.value = value
      self._nnx_opt.step.value = self._nnx_opt.step.value + steps_taken

  # ---- the data-free plan --------------------------------------------------------------------

  def _plan(self, expected_batch_size, noise_multiplier, target_epsilon, num_steps,
            epsilon_budget) -> None:
    if self.cyclic is not None:
      return tn.plan_cyclic(self, target_epsilon, epsilon_budget)
    if expected_batch_size is None:
      if self.relation == "add_remove":
        raise ValueError(
            "expected_batch_size is required under relation='add_remove': the number of users "
            "is private there, so the denominator D must be a declared public constant (e.g. "
            "sampling_rate * a public estimate of n); or use relation='zero_out' if n is "
            "public")
      expected_batch_size = self.q * self.n
    self.denominator = check_positive(expected_batch_size, "expected_batch_size")
    target = _optional(target_epsilon, check_epsilon, "target_epsilon")
    budget = _optional(epsilon_budget, check_epsilon, "epsilon_budget")
    steps = _optional(num_steps, check_int, "num_steps")
    if noise_multiplier is None:
      if target is None or steps is None:
        raise ValueError("give noise_multiplier, or target_epsilon and num_steps to "
                         "calibrate it")
      noise_multiplier = calibrate_poisson_sgd(   # the event of _step_event, memoized
          self.q, steps, epsilon=target, delta=self.delta, relation=self.relation,
          accountant=self.accountant)
    self.noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    self.event = self._step_event(self.noise_multiplier)
    self.adaptive = self._adaptive_plan()
    if target is not None:
      if steps is None:
        raise ValueError("target_epsilon needs num_steps (the planned run it budgets)")
      # a tiny explicit z: refuse on a closed-form lower bound before a minutes-long PLD
      planned = epsilon_lower_bound(self.event, delta=self.delta, relation=self.relation,
                                    count=steps)
      if planned <= target * (1 + 1e-9):
        planned = epsilon_of(dp_accounting.SelfComposedDpEvent(self.event, steps),
                             delta=self.delta, relation=self.relation,
                             accountant=self.accountant)
      if planned > target * (1 + 1e-9):
        raise ValueError(f"noise_multiplier={self.noise_multiplier:g} over num_steps={steps} "
                         f"gives epsilon {planned:.4g} > target_epsilon={target:g}: a target "
                         "epsilon is a budget")
    self._open_ledger(target, budget)
    self.ledger.check(self.event, label=_LABEL)  # the accountant can honour it; one step fits
    self._set_stage()

  def _adaptive_plan(self) -> AdaptivePlan | None:
    """DP-SGD's adaptive plan at this trainer's ``z``, ``C_0`` and ``D`` (its defaults, split
    and refusals: the same ``z_Delta`` and ``sigma_b`` as ``dp_sgd_user`` at these numbers)."""
    if self._adaptive_keys is None:
      return None
    view = config_view({"delta": self.delta, "noise_multiplier": self.noise_multiplier,
                        "clip_norm": ADAPTIVE, **self._adaptive_keys})
    return adaptive_plan(view, self.noise_multiplier, self.clip_norm, self.denominator,
                         level=self.level, noise=self.noise_mechanism)

  def _open_ledger(self, *caps: float | None) -> None:
    """The run's ledger; its budget is the tightest of the checked ``caps`` given."""
    caps = [c for c in caps if c is not None]
    self.ledger = PrivacyLedger(delta=self.delta, epsilon_budget=min(caps) if caps else None,
                                relation=self.relation, accountant=self.accountant)

  def _set_stage(self) -> None:
    """Noise stage: ``z`` on the clipped mean's ``C / D`` (add/remove under any relation: the
    ledger prices replace-one), the DP-SGD plan's own stage, so the std (formed in
    ``privacy.sensitivity``, never here) is the plan's bit for bit."""
    self.sensitivity = self.clipper.sensitivity(mode="mean", denominator=self.denominator)
    self.stage = (GaussianStage(self.noise_multiplier,
                                clipped_mean_sensitivity(self.clip_norm, self.denominator), "step")
                  if self.adaptive is None   # adaptive: z_Delta on C_0 / D (the first step's)
                  else self.adaptive.split.sum_stage(self.clip_norm, self.denominator))
    self.noise_stddev = self.stage.std

  def _step_event(self, z: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(self.q, dp_accounting.GaussianDpEvent(z))

  # ---- jitted pieces ----------------------------------------------------------------------------

  def _clip_of(self, opt_state: tuple) -> jax.Array | None:
    """The clip norm of this step: adaptive clipping's ``C_t`` (in the noise state), else None
    (the clipper's fixed ``C``)."""
    return None if self.adaptive is None else opt_state[0].clip_norm

  def _clipped(self, params: PyTree, rows: PyTree, mask: jax.Array,
               clip: jax.Array | None) -> Any:
    """A step's *total*: the clipped sum at the fixed ``C`` (``clip`` None), or under adaptive
    clipping ``(clipped sum at C_t, centred unclipped count)`` (both SECRET until noised)."""
    summed, info = self.clipper.clipped_sum(params, rows, mask, clip_norm=clip)
    return summed if clip is None else (summed, unclipped_centred_count(info.norms, clip, mask))

  def _zero_total(self, params: PyTree) -> Any:
    """The zero *total* (:meth:`_clipped`), float32 or wider."""
    zeros = self._zeros(params)
    return zeros if self.adaptive is None else (zeros, jnp.zeros((), jnp.float32))

  def _privatize(self, total: Any, opt_state: tuple, params: PyTree, noise_tx=None):
    """``sum / D`` -> noise (adaptive: and the count's) -> optimizer: (privatized gradient,
    updates, new opt_state)."""
    noise_tx = self._noise if noise_tx is None else noise_tx
    summed, extra = ((total, {}) if self.adaptive is None
                     else (total[0], {"centred_count": total[1]}))
    noise_state, inner = opt_state
    grad = jax.tree.map(lambda s: s / self.denominator, summed)
    noisy, noise_state = noise_tx.update(grad, noise_state, params, **extra)
    updates, inner = self.optimizer.update(noisy, inner, params)
    return noisy, updates, (noise_state, inner)

  def _release_step(self, params: PyTree, opt_state: tuple, rows: PyTree, mask: jax.Array,
                    noise_tx) -> tuple[tuple[PyTree, tuple], PyTree]:
    """One step of :meth:`release_fn` (Poisson or cyclic) on the sampled ``rows``:
    ``((new params, opt_state), privatized gradient)``."""
    total = self._clipped(params, rows, mask, self._clip_of(opt_state))
    total = jax.tree.map(lambda s, z: s.astype(z.dtype), total, self._zero_total(params))
    noisy, updates, opt_state = self._privatize(total, opt_state, params, noise_tx)
    return (optax.apply_updates(params, updates), opt_state), noisy

  def _build(self):
    q, n = self.q, self.n

    @jax.jit
    def sample(sample_key, step):
      return jax.random.bernoulli(jax.random.fold_in(sample_key, step), q, (n,))

    @jax.jit
    def clipped_chunk(params, data, idx, mask, total, clip=None):
      batch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), data)
      batch, mask = self._mesh.spread((batch, mask))  # each device: its own users
      part = self._clipped(params, batch, mask, clip)
      return self._mesh.gather(jax.tree.map(lambda t, s: t + s.astype(t.dtype), total, part))

    @jax.jit
    def apply(state: TrainState, total):
      _, updates, opt_state = self._privatize(total, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      return TrainState(params, opt_state, state.sample_key, state.step + 1)

    self._sample, self._clipped_chunk, self._apply = sample, clipped_chunk, apply

  _zeros = staticmethod(tm.zeros_like_sum)  # float32 or wider, whatever the params' dtype

  # ---- stepping -----------------------------------------------------------------------------

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  @property
  def params(self) -> PyTree:
    return self.state.params

  @property
  def current_clip_norm(self) -> float:
    """The clip norm of the next step: ``C_t`` under adaptive clipping (public: a function of
    the released noisy counts), else the fixed ``C``."""
    return (self.clip_norm if self.adaptive is None
            else float(self.state.opt_state[0].clip_norm))

  def _clip_text(self) -> str:
    return (f"clip C={self.clip_norm:g}" if self.adaptive is None else
            f"adaptive clip (C_0={self.clip_norm:g}, gamma={self.adaptive.target_quantile:g})")

  @property
  def model(self) -> nnx.Module:
    """A fresh nnx model holding the current parameters."""
    c = self.clipper
    return nnx.merge(c.graphdef, self.state.params, c.rest)

  def _one_step(self):
    with self._mesh.context():   # over a caller's explicit-axes jax.set_mesh context
      self._step_on_mesh()

  def _step_on_mesh(self):
    st = self.state
    chosen = (self.cyclic.chosen(st.sample_key, int(st.step)) if self.cyclic else
              np.flatnonzero(np.asarray(self._sample(st.sample_key, st.step))))
    if self.debug is not None:
      self.debug["batch_sizes"].append(int(chosen.size))
    size = self.micro_batch
    total = self._zero_total(st.params)
    clip = self._clip_of(st.opt_state)
    # At least one micro-batch and at least accumulation_steps of them: the same compiled
    # shapes every step; empty ones are fully masked (contribute exactly zero).
    n_micro = max(self.accumulation_steps, -(-chosen.size // size))
    for b in range(n_micro):
      part = chosen[b * size:(b + 1) * size]
      idx = np.zeros((size,), np.int32)
      idx[:part.size] = part
      mask = np.arange(size) < part.size
      total = self._clipped_chunk(st.params, self.data, jnp.asarray(idx), jnp.asarray(mask),
                                  total, clip)
    self.state = self._apply(st, total)

  def train(self, num_steps: int, *, report_every: int = 10,
            checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
            log_fn: Callable[[dict], None] | None = None,
            hmac_key: bytes | None = None) -> list[dict]:
    """Runs ``num_steps`` DP steps in blocks of ``report_every``.

    The whole run is checked against the budget once, before the first step
    (``PrivacyBudgetExceeded``: nothing runs). Each block is then charged to the ledger before
    it runs, and ``{"step", "epsilon", "epsilon_kind", "delta"}`` is appended to
    ``self.history`` (and passed to ``log_fn``), ``epsilon`` being in general an upper bound
    (the ledger's cached grid bound, capped by the checked epsilon of the whole run; exact:
    :meth:`epsilon`), and ``epsilon_kind`` saying which (``"upper_bound"``, or ``"exact"``
    when no rounding was involved). Checkpoints are sealed with ``hmac_key`` when given
    (:meth:`save`). Charging a prefix of an
    already-checked run cannot exceed the budget, so blocks are recorded with
    ``ledger.compose`` (a per-block ``spend`` would recompute the exact epsilon every block
    once the grid bound nears the budget). With ``checkpoint_dir``, a checkpoint is written
    every ``checkpoint_every`` steps (a multiple of ``report_every``) and at the end.

    Args:
      num_steps: the steps to run, an integer >= 1.
      report_every: the steps of one accounting block (default 10).
      checkpoint_dir: where to write checkpoints (default none).
      checkpoint_every: steps between checkpoints, a multiple of ``report_every`` (default:
        only at the end, when ``checkpoint_dir`` is given).
      log_fn: called with each history entry (default none).
      hmac_key: the key that seals checkpoints (bytes; default: a plain SHA-256 seal).

    Returns:
      ``self.history``: one ``{"step", "epsilon", "epsilon_kind", "delta"}`` per block.

    Raises:
      PrivacyBudgetExceeded: the whole run would exceed the budget (nothing runs).
      ValueError: ``num_steps``, ``report_every`` or ``checkpoint_every`` is not an integer
        >= 1, or ``checkpoint_every`` is not a multiple of ``report_every``.
      FileExistsError: ``checkpoint_dir`` holds a checkpoint of a later step than this
        trainer's (another run's: restore from it, or use another directory).
    """
    num_steps = check_int(num_steps, "num_steps")
    report_every = check_int(report_every, "report_every")
    if checkpoint_every is not None:
      check_int(checkpoint_every, "checkpoint_every")
      if checkpoint_every % report_every:
        raise ValueError("checkpoint_every must be a multiple of report_every (checkpoints "
                         "are written at accounting-block boundaries)")
    start = self.step_count
    if checkpoint_dir is not None:   # refused before any step, not at the first save
      ckpt.check_no_later_checkpoint(checkpoint_dir, start)
    planned = (self.cyclic.check_run(self.ledger, start + num_steps) if self.cyclic else
               self.ledger.check(self.event, label=_LABEL, count=num_steps))
    try:
      self._train_blocks(num_steps, report_every, planned, checkpoint_dir, checkpoint_every,
                         log_fn, hmac_key)
    finally:  # the user's model reflects every step taken, also after an interruption
      self._sync_model(self.step_count - start)
    return self.history

  def _train_blocks(self, num_steps, report_every, planned, checkpoint_dir, checkpoint_every,
                    log_fn, hmac_key) -> None:
    done = 0
    while done < num_steps:
      block = min(report_every, num_steps - done)
      if self.cyclic is not None:  # exact: the prefix's Gaussian (trainer_noise)
        eps = self.cyclic.charge(self.ledger, self.step_count + block)
      else:
        self.ledger.compose(self.event, label=_LABEL, count=block)
        eps = self.ledger.epsilon(exact=False)
      # the whole run's checked epsilon bounds every prefix of it
      if self.cyclic is None and eps > planned:
        last = done + block == num_steps  # then the ledger holds exactly the checked run
        eps = planned if last else Epsilon(planned, "upper_bound")
      for _ in range(block):
        self._one_step()
      done += block
      rec = {"step": self.step_count, "epsilon": float(eps), "epsilon_kind": eps.kind,
             "delta": self.delta}
      if self.adaptive is not None:  # public: a function of the released noisy counts
        rec["clip_norm"] = self.current_clip_norm
      self.history.append(rec)
      if log_fn is not None:
        log_fn(rec)
      if checkpoint_dir is not None and (
          done == num_steps or (checkpoint_every and self.step_count % checkpoint_every == 0)):
        self.save(checkpoint_dir, hmac_key=hmac_key)

  def epsilon(self, *, exact: bool = True) -> float:
    """Epsilon of every step taken (charged) so far: exact by default (one accountant
    evaluation, cached); ``exact=False`` is the ledger's cheap grid upper bound.

    Args:
      exact: the exact epsilon (default) or the grid upper bound.

    Returns:
      The epsilon at the trainer's delta.
    """
    return self.ledger.epsilon(exact=exact)

  def privacy_report(self) -> PrivacyReport:
    """``accountant`` provenance: composition of the Poisson-sampled Gaussian steps (cyclic:
    the Gaussian of the run's prefix).

    Returns:
      The :class:`~dpsco_jax.privacy.PrivacyReport` of the steps taken.
    """
    adaptive = "" if self.adaptive is None else "; " + self.adaptive.note()
    if self.cyclic is not None:
      return self.ledger.report(
          provenance=Provenance.ACCOUNTANT, level=self.level,
          mechanisms=(self.cyclic.mechanism(self.step_count, self._clip_text(), self.level),),
          notes=self.cyclic.notes(self.clipper.method) + adaptive)
    return self.ledger.report(
        provenance=Provenance.ACCOUNTANT, level=self.level,
        mechanisms=(f"poisson(q={self.q:g}) gaussian(z={self.noise_multiplier:.4g}) x "
                    f"{self.step_count} steps, {self._clip_text()} ({self.level}), "
                    f"denominator D={self.denominator:g}",),
        notes=f"DP-SGD, relation {self.relation}; public: {PUBLIC[self.relation]} "
              f"(q={self.q:g}, D={self.denominator:g} declared); clipping: "
              f"{self.clipper.method}" + adaptive)

  def __repr__(self) -> str:
    return (f"DPTrainer(level={self.level!r}, relation={self.relation!r}, "
            f"sampling={self.sampling!r}, noise={self.noise_mechanism!r}, q={self.q:g}, "
            f"D={self.denominator:g}, z={self.noise_multiplier:.4g}, {self._clip_text()}, "
            f"steps={self.step_count}, state={self.state!r})")

  # ---- audit hook -------------------------------------------------------------------------------

  def release_fn(self, num_steps: int, *, noise: bool = True
                 ) -> Callable[[jax.Array, PyTree], PyTree]:
    """``release(key, dataset) -> per-step privatized gradients`` (leaves ``[T, ...]``).

    The same mechanism as :meth:`train` from this trainer's *initial* params and plan (``q``,
    ``D``, ``z C / D``, the optimizer): ``key`` is split like the trainer's key into the
    sampling and noise keys, step ``t`` samples ``bernoulli(fold_in(sample_key, t), q)`` over
    ``dataset``'s users (all of them in one masked batch instead of micro-batches; equal up to
    float rounding) and releases ``clipped_sum / D + noise``. Pure and static-shaped, so the
    audit harness can ``vmap`` it over keys. ``noise=False`` is a TEST HOOK returning the
    noiseless ``clipped_sum / D``. It neither touches ``self.state`` nor charges
    ``self.ledger``: its outputs carry the plan's guarantee (``T`` steps of :attr:`event`)
    and are meant for audits on canary datasets.

    Args:
      num_steps: ``T``, the steps released, an integer >= 1.
      noise: add the noise (default True; False is a test hook).

    Returns:
      ``release(key, dataset)``, a pure function returning the ``[T, ...]`` releases.

    Raises:
      ValueError: ``num_steps`` is not an integer >= 1.
      ArgumentTypeError: ``noise`` is not a bool.
    """
    steps = check_int(num_steps, "num_steps")
    noise = check_bool(noise, "noise")
    if self.cyclic is not None:
      return tn.cyclic_release_fn(self, steps, noise)
    stddev = self.noise_stddev if noise else 0.0
    params0 = self._initial_params

    def release(key: jax.Array, dataset: PyTree) -> PyTree:
      sample_key, noise_key = jax.random.split(key)
      noise_tx = (add_gaussian_noise(stddev, noise_key) if self.adaptive is None else
                  tn.adaptive_stage(self.adaptive, self.denominator, noise_key, noise=noise))
      n = jax.tree.leaves(dataset)[0].shape[0]
      opt0 = (noise_tx.init(params0), self.optimizer.init(params0))

      def step(carry, t):
        params, opt_state = carry
        mask = jax.random.bernoulli(jax.random.fold_in(sample_key, t), self.q, (n,))
        return self._release_step(params, opt_state, dataset, mask, noise_tx)

      _, out = jax.lax.scan(step, (params0, opt0), jnp.arange(steps))
      return out

    return release

  # ---- checkpointing ----------------------------------------------------------------------------

  def _fingerprint(self) -> dict:
    fp = {"q": self.q, "noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm,
          "denominator": self.denominator, "level": self.level, "relation": self.relation,
          "delta": self.delta}
    if self.relation != "add_remove":
      fp["n"] = self.n  # public under zero_out / replace_one only
    if self.cyclic is not None:
      fp.update(self.cyclic.fingerprint())
    if self.adaptive is not None:   # C_t itself is in the (sealed) state
      a = self.adaptive
      fp.update(clip_norm=ADAPTIVE, initial_clip_norm=a.initial_clip_norm,
                target_quantile=a.target_quantile, clip_learning_rate=a.clip_learning_rate,
                count_stddev=a.split.count_stddev, sum_multiplier=a.split.sum_multiplier)
    return fp

  def save(self, directory: str | os.PathLike, *, hmac_key: bytes | None = None,
           overwrite: bool = False) -> str:
    """Writes ``directory/step_<t>`` (see :mod:`dpsco_jax.flax.checkpoint`); returns it. The
    seal covers ledger, step, history, fingerprint and arrays; it is an HMAC with
    ``hmac_key`` (bytes you hold: detects forgery), else a plain SHA-256 (accidents only).

    Args:
      directory: the checkpoints' folder.
      hmac_key: the sealing key, bytes (default: a plain SHA-256 seal).
      overwrite: replace an existing checkpoint of this step (default: refuse).

    Returns:
      The path of the ``step_<t>`` folder written.

    Raises:
      FileExistsError: a checkpoint of this step exists and ``overwrite`` is False.
      ArgumentTypeError: ``hmac_key`` is not bytes.
      ValueError: ``hmac_key`` is too short.
      ImportError: orbax-checkpoint is not installed.
    """
    meta = {"fingerprint": self._fingerprint(), "ledger": self.ledger.state_dict(),
            "history": self.history, "data": self._data_facts}
    return ckpt.save_checkpoint(directory, self.state, self.step_count, meta,
                                hmac_key=hmac_key, overwrite=overwrite)

  @staticmethod
  def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The latest complete checkpoint under ``directory`` (:func:`latest_checkpoint`).

    Args:
      directory: the checkpoints' folder.

    Returns:
      The path of its ``step_*`` folder with the largest step, or None.
    """
    return ckpt.latest_checkpoint(directory)

  def restore(self, path: str | os.PathLike, *, hmac_key: bytes | None = None
              ) -> "DPTrainer":
    """Loads a checkpoint (a ``step_*`` folder, or a directory: its latest complete one) into
    this trainer, which must be fresh (nothing spent: the ledger is never rolled back). Refuses
    a broken seal (with ``hmac_key``: a missing or wrong HMAC, i.e. a forgery), an edited
    ledger, another budget / accountant / privacy configuration, or a ledger that is not what
    the checkpoint's step count implies, or other data than it was trained on
    (:mod:`dpsco_jax.flax.checkpoint`).

    Args:
      path: a ``step_*`` folder, or a folder of them (its latest complete one).
      hmac_key: the key the checkpoint was sealed with (default none).

    Returns:
      This trainer, at the checkpoint's step.

    Raises:
      ValueError: the trainer already spent budget; no complete checkpoint under ``path``; its
        privacy configuration or data differs from this trainer's; a bad ``hmac_key``.
      LedgerIntegrityError: a broken or missing seal (a wrong HMAC), an edited ledger or
        arrays, or a ledger that does not match the checkpoint's step.
    """
    if self.ledger.events or self.step_count:
      raise ValueError("restore into a fresh trainer: this one already spent privacy budget, "
                       "and a restore must never roll the ledger back")
    mine = self._fingerprint()
    # before the arrays: an adaptive run's noise state has other leaves than a fixed clip's
    ckpt.check_clipping(*ckpt.read_meta(path), mine)
    path, state, meta = ckpt.load_checkpoint(path, self.state, hmac_key=hmac_key)
    if meta.get("step") != int(state.step):
      raise ckpt.LedgerIntegrityError(f"checkpoint step {meta.get('step')} differs from its "
                                      f"arrays' step {int(state.step)}: it was edited")
    if meta.get("fingerprint") != mine:
      raise ValueError(f"checkpoint privacy configuration {meta.get('fingerprint')} does not "
                       f"match this trainer's {mine}")
    ckpt.check_data_facts(meta.get("data"), self._data_facts)
    ledger = PrivacyLedger.from_state_dict(meta["ledger"], expect_config=self.ledger.config())
    if self.cyclic is not None:
      self.cyclic.check_ledger(ledger, int(state.step))
    else:
      ckpt.check_ledger_matches(ledger, self.event, int(state.step))
    self.state, self.ledger = self._mesh.place(state), ledger
    self.history = list(meta["history"])
    self._sync_model(int(state.step))
    return self
