"""DP training of Flax nnx models (:class:`DPTrainer`): user- or item-level DP-SGD, planned
before it touches data, accounted as it goes, checkpointed and resumed bit-identically.

A Poisson step: user ``u`` joins step ``t`` iff ``bernoulli(fold_in(sample_key, t), q)[u]``;
the sampled users are clipped and summed in padded micro-batches of static size
(:class:`~dpsco_jax.flax.fast_clip.FastClippedGrad`; a padded slot is never counted), and the
sum is noised once, ``sum / D + N(0, (z C / D)^2)``, before the optimizer sees it. Each step is
one ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (Abadi et al. 2016; Mironov et al. 2019)
in the core :class:`~dpsco_jax.privacy.PrivacyLedger`. Cyclic sampling and correlated noise:
:mod:`~dpsco_jax.flax.trainer_noise`; meshes: :mod:`~dpsco_jax.flax.trainer_mesh`;
checkpoints: :mod:`~dpsco_jax.flax.checkpoint`. Timing is not protected (a step's number of
micro-batches depends on its realized batch size).
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

from dpsco_jax._checks import (ArgumentTypeError, check_bool, check_choice, check_delta,
                               check_epsilon, check_int, check_nonnegative, check_positive,
                               check_probability, check_seed_or_key)
from dpsco_jax.flax import checkpoint as ckpt
from dpsco_jax.flax.fast_clip import FastClippedGrad, LossFn
from dpsco_jax.flax import trainer_mesh as tm
from dpsco_jax.flax import trainer_noise as tn
from dpsco_jax.flax.trainer_data import check_data, from_user_data
from dpsco_jax.algorithms.dpsgd.config import ADAPTIVE, DpSgdConfig
from dpsco_jax.algorithms.dpsgd.plan import (NOISES, adaptive_plan, check_mf_sampling,
                                             config_view)
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance, PUBLIC,
                               calibrate_poisson_sgd, check_relation, epsilon_of)
from dpsco_jax.privacy.ledger import Epsilon, epsilon_lower_bound
from dpsco_jax.config.types import check_read_only_with
from dpsco_jax.privacy.sensitivity import GaussianStage, clipped_mean_sensitivity
from dpsco_jax.transforms.adaptive_clipping import unclipped_centred_count
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.tree_noise import wide_zeros

PyTree = Any
_REDACTED = "<redacted>"
_LABEL = "dp-sgd step (poisson gaussian)"


class TrainState(NamedTuple):
  """Everything a step depends on; ``opt_state`` (holds the noise key) and ``sample_key`` are
  SECRET and redacted in repr/str (the arrays stay accessible).

  Attributes:
    params: the model's parameters.
    opt_state: ``(noise state, optimizer state)`` (secret: holds the noise key).
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


def _optional(x: Any, check: Callable, name: str) -> Any:
  return None if x is None else check(x, name)


#: optax's gradient-accumulation wrappers, by their state type: they average noisy gradients
_ACCUMULATORS = {optax.MultiStepsState: "optax.MultiSteps", optax.ApplyEvery: "optax.apply_every"}


def check_clip_args(clip_norm: Any, adaptive_keys: dict) -> float:
  """The fixed ``C``, or with ``clip_norm="adaptive"`` the checked ``C_0``; the adaptive
  arguments (``adaptive_keys``, None where not given) are range-checked, and refused without
  ``"adaptive"`` (also the runner's pre-run check)."""
  if clip_norm != ADAPTIVE:
    if isinstance(clip_norm, str):
      raise ArgumentTypeError(f"clip_norm must be a number > 0 or 'adaptive', got "
                              f"{clip_norm!r}")
    check_read_only_with(DpSgdConfig, types.SimpleNamespace(clip_norm=clip_norm, **adaptive_keys))
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

  **Neighbouring relation and what is public** (:mod:`dpsco_jax.privacy.relations`): under
  ``relation="add_remove"`` (Poisson's default) one user (item, at item level) is added or
  removed and ``n`` is private, so ``q`` and the denominator ``D`` are declared public
  constants, never derived from the data (e.g. ``D = q N``, ``N`` a public estimate of ``n``;
  any ``D > 0`` is sound); under ``"zero_out"`` / ``"replace_one"`` ``n`` is public. One user
  moves the clipped sum by at most ``C`` (``2C`` under replace-one, priced by the accountant).
  The plan (``q``, ``D``, ``z``, the event, the noise std ``z C / D``) is made at construction,
  before any data is read; :meth:`train` checks the whole run against the budget first.

  Args:
    model: the ``nnx.Module`` to train (its ``nnx.Param`` leaves; other state is fixed).
    loss_fn: ``loss_fn(model, example) -> scalar`` for ONE item (checked before any step).
    optimizer: applied to the privatized gradient: an optax transformation (not
      ``optax.MultiSteps`` / ``apply_every``: use ``accumulation_steps``), or an
      ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, continued from and written back. ``model``
      is updated in place by :meth:`train` / :meth:`restore`.
    data: a :class:`~dpsco_jax.data.UserData`, or a pytree with leaves ``[n_users, m, ...]``
      (``level="user"``) or ``[n, ...]`` (``level="item"``); the layout is checked.
    clip_norm: ``C``, per-user (per-item) L2 clip of the (mean) gradient, or ``"adaptive"``:
      ``C_t`` follows the ``target_quantile`` of the users' norms (Andrew et al. 2021; public,
      in ``history``), its noise pair DP-SGD's split of one Gaussian of multiplier ``z`` (the
      event and ledger are a fixed clip's).
    sampling_rate: Poisson rate ``q`` in (0, 1], a declared public constant (Poisson only).
    delta: the delta of the reported guarantee.
    expected_batch_size: the public denominator ``D``: required under ``add_remove``, else
      ``q n`` by default.
    relation: ``"add_remove"`` (Poisson's default), ``"zero_out"`` (cyclic's default) or
      ``"replace_one"``.
    noise_multiplier: ``z``. Give it, or ``target_epsilon`` and ``num_steps``.
    target_epsilon: the epsilon of ``num_steps`` steps; also a budget of the ledger.
    epsilon_budget: optional hard cap of the ledger.
    num_steps: the planned run's steps (needed with ``target_epsilon`` and cyclic sampling).
    level: ``"user"`` or ``"item"``.
    method: ``"fast"`` (taps), ``"vmap"``, or ``"auto"`` (the lower predicted cost at the
      micro-batch shape; shapes only, see ``clipper.autotune_report``).
    batch_capacity: static size of the users processed at once (default ``D`` + 4 sd).
    accumulation_steps: ``k``: micro-batches of ``ceil(batch_capacity / k)`` users whose
      clipped sums are accumulated before the one noise draw.
    key: PRNG key or int seed; split once into the sampling and noise keys.
    accountant: ``"pld"`` (default), ``"rdp"`` or ``"auto"``.
    debug: a real bool; keeps realized batch sizes (data-dependent) in ``self.debug``.
    sampling: ``"poisson"`` (default) or ``"cyclic"`` (``batch_size`` users a step in a public
      order, each once per epoch; :mod:`dpsco_jax.flax.trainer_noise`).
    noise_mechanism: ``"independent"``, or with cyclic sampling ``"banded"`` or ``"blt"``.
    batch_size: users per step under cyclic sampling.
    bands: the bands of ``noise_mechanism="banded"``.
    buffers: the buffers of ``noise_mechanism="blt"``.
    mf_strategy: how the correlated-noise strategy is chosen (default ``"auto"``).
    mesh: a ``jax.sharding.Mesh`` with a ``"users"`` axis (default: ``jax.set_mesh``'s):
      users sharded over it, same plan and ledger (:mod:`dpsco_jax.flax.trainer_mesh`).
    target_quantile: adaptive: the fraction in (0, 1) of users left unclipped (default 0.5).
    clip_learning_rate: adaptive: the step ``eta_C > 0`` of the clip norm (default 0.2).
    initial_clip_norm: adaptive: ``C_0 > 0`` (required).
    count_stddev: adaptive: the unclipped count's noise std in users (default ``max(D / 20,
      z)``); twice it must exceed ``z``.

  Raises:
    ValueError: a bad or inconsistent argument, named in the message.
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
    self.cyclic = None if self.sampling != "cyclic" else tn.CyclicSchedule(
        n=self.n, level=self.level, clip_norm=self.clip_norm, delta=self.delta,
        relation=relation, batch_size=batch_size, num_steps=num_steps,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
        noise_mechanism=noise_mechanism, bands=bands, buffers=buffers, mf_strategy=mf_strategy,
        accountant=self.accountant, adaptive_keys=self._adaptive_keys)
    self._plan(expected_batch_size, noise_multiplier, target_epsilon, num_steps,
               epsilon_budget)
    self._size_batches(batch_capacity, method, data)
    self._start(model, optimizer, key)
    self.data = self._mesh.place_data(data)
    self.debug: dict | None = {"batch_sizes": []} if debug else None
    self.history: list[dict] = []
    self._build()

  def _start(self, model: nnx.Module, optimizer: Any, key: jax.Array) -> None:
    """The optimizer (an ``nnx.Optimizer`` is driven: its tx, its state, written back), the
    keys and noise stage, and the initial :class:`TrainState`."""
    params = self.clipper.params
    self._user_model, self._nnx_opt = model, None
    if isinstance(optimizer, nnx.Optimizer):
      self._nnx_opt, optimizer = optimizer, optimizer.tx
    self.optimizer = optimizer
    inner = optimizer.init(params)
    kinds = tuple(_ACCUMULATORS)
    found = [x for x in jax.tree.leaves(inner, is_leaf=lambda y: isinstance(y, kinds))
             if isinstance(x, kinds)]
    if found:
      raise ValueError(f"optimizer must not contain {_ACCUMULATORS[type(found[0])]}: it would "
                       "accumulate noisy gradients over steps instead of accumulating clipped "
                       "sums under one noise draw; use DPTrainer(accumulation_steps=k)")
    sample_key, self._noise = self._keys_and_noise(key)
    self._initial_params = params
    if self._nnx_opt is not None:  # continue from the nnx.Optimizer's current state
      inner = jax.tree.unflatten(jax.tree.structure(inner),
                                 [v.value for v in self._opt_vars()])
    self.state = self._mesh.place(TrainState(params=params, opt_state=(
        self._noise.init(params), inner), sample_key=sample_key, step=jnp.zeros((), jnp.int32)))

  def _keys_and_noise(self, key: jax.Array, noise: bool = True
                      ) -> tuple[jax.Array, optax.GradientTransformation]:
    """The sampling (cyclic: order) key and the noise stage of a run keyed by ``key`` (cyclic:
    the DP-SGD driver's, on the raveled gradient); ``noise=False``: a noiseless stage."""
    stddev = self.noise_stddev if noise else 0.0
    if self.cyclic is not None:
      return self.cyclic.keys_and_noise(key, stddev, noise)
    sample_key, noise_key = jax.random.split(key)
    return sample_key, (add_gaussian_noise(stddev, noise_key) if self.adaptive is None else
                        tn.adaptive_stage(self.adaptive, self.denominator, noise_key,
                                          noise=noise))

  def _size_batches(self, batch_capacity: int | None, method: str, data: PyTree) -> None:
    """The static slots of a step and of a micro-batch (rounded up to the mesh's devices),
    then the clipping method for that shape (public: chosen on a zero stand-in)."""
    cap = batch_capacity if batch_capacity is not None else (
        self.denominator if self.cyclic else
        math.ceil(self.denominator + 4 * math.sqrt(self.denominator) + 1))
    self.batch_capacity = min(check_int(cap, "batch_capacity"), self.n)
    self.micro_batch = self._mesh.micro_batch(math.ceil(self.batch_capacity /
                                                        self.accumulation_steps))
    if method != "auto" and self._mesh.mesh is None:
      return
    stand_in = jax.tree.map(lambda x: jnp.zeros((self.micro_batch, *x.shape[1:]), x.dtype),
                            data)
    if method == "auto":
      self.clipper.autotune(self.clipper.params, stand_in)
    self._mesh.check_clipper(self.clipper, stand_in)

  def _opt_vars(self) -> list:
    vs = jax.tree.leaves(self._nnx_opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(vs) != len(jax.tree.leaves(self.optimizer.init(self.clipper.params))):
      raise ValueError("optimizer: this nnx.Optimizer's state does not match its tx on the "
                       "model's nnx.Param leaves (build it with wrt=nnx.Param)")
    return vs

  def _sync_model(self, steps_taken: int) -> None:
    """Writes the params into the user's model (in place) and, with an ``nnx.Optimizer``, its
    state and step counter."""
    nnx.update(self._user_model, self.state.params)
    if self._nnx_opt is not None:
      for var, value in zip(self._opt_vars(), jax.tree.leaves(self.state.opt_state[1]),
                            strict=True):
        var.value = value
      self._nnx_opt.step.value = self._nnx_opt.step.value + steps_taken

  def _plan(self, expected_batch_size, noise_multiplier, target_epsilon, num_steps,
            epsilon_budget) -> None:
    if self.cyclic is not None:  # the DP-SGD driver's plan, the whole run checked now
      p = self.cyclic.plan
      self.relation, self.q, self.denominator = p.relation, p.sampling_rate, p.denominator
      self.noise_multiplier, self.event, self.adaptive = p.noise_multiplier, p.event, p.adaptive
      self._open_ledger(*(_optional(b, check_epsilon, "epsilon")
                          for b in (target_epsilon, epsilon_budget)))
      self.cyclic.check_run(self.ledger, p.steps)
      return self._set_stage()
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
      noise_multiplier = calibrate_poisson_sgd(   # of self.event below, memoized
          self.q, steps, epsilon=target, delta=self.delta, relation=self.relation,
          accountant=self.accountant)
    self.noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    self.event = dp_accounting.PoissonSampledDpEvent(
        self.q, dp_accounting.GaussianDpEvent(self.noise_multiplier))
    self.adaptive = None if self._adaptive_keys is None else adaptive_plan(
        # DP-SGD's adaptive plan (defaults, split, refusals) at this trainer's z, C_0, D
        config_view({"delta": self.delta, "noise_multiplier": self.noise_multiplier,
                     "clip_norm": ADAPTIVE, **self._adaptive_keys}),
        self.noise_multiplier, self.clip_norm, self.denominator, level=self.level,
        noise=self.noise_mechanism)
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

  def _open_ledger(self, *caps: float | None) -> None:
    """The run's ledger; its budget is the tightest of the ``caps`` given."""
    caps = [c for c in caps if c is not None]
    self.ledger = PrivacyLedger(delta=self.delta, epsilon_budget=min(caps) if caps else None,
                                relation=self.relation, accountant=self.accountant)

  def _set_stage(self) -> None:
    """Noise stage: ``z`` on the clipped mean's ``C / D`` (add/remove under any relation: the
    ledger prices replace-one); the std is formed in ``privacy.sensitivity``, as the plan's."""
    self.sensitivity = self.clipper.sensitivity(mode="mean", denominator=self.denominator)
    self.stage = (GaussianStage(self.noise_multiplier,
                                clipped_mean_sensitivity(self.clip_norm, self.denominator), "step")
                  if self.adaptive is None   # adaptive: z_Delta on C_0 / D (the first step's)
                  else self.adaptive.split.sum_stage(self.clip_norm, self.denominator))
    self.noise_stddev = self.stage.std

  def _clip_of(self, opt_state: tuple) -> jax.Array | None:
    """Adaptive clipping's ``C_t`` (in the noise state), else None (the fixed ``C``)."""
    return None if self.adaptive is None else opt_state[0].clip_norm

  def _clipped(self, params: PyTree, rows: PyTree, mask: jax.Array,
               clip: jax.Array | None) -> Any:
    """A step's SECRET *total*: the clipped sum, or under adaptive clipping ``(clipped sum at
    C_t, centred unclipped count)``."""
    summed, info = self.clipper.clipped_sum(params, rows, mask, clip_norm=clip)
    return summed if clip is None else (summed, unclipped_centred_count(info.norms, clip, mask))

  _zeros = staticmethod(wide_zeros)  # the clipped sum's accumulator, float32 or wider

  def _zero_total(self, params: PyTree) -> Any:
    """The zero *total* (:meth:`_clipped`)."""
    zeros = self._zeros(params)
    return zeros if self.adaptive is None else (zeros, jnp.zeros((), jnp.float32))

  def _privatize(self, total: Any, opt_state: tuple, params: PyTree, noise_tx=None):
    """``sum / D`` -> noise -> optimizer: ``(privatized gradient, updates, opt_state)``."""
    noise_tx = self._noise if noise_tx is None else noise_tx
    summed, extra = ((total, {}) if self.adaptive is None
                     else (total[0], {"centred_count": total[1]}))
    noise_state, inner = opt_state
    grad = jax.tree.map(lambda s: s / self.denominator, summed)
    noisy, noise_state = noise_tx.update(grad, noise_state, params, **extra)
    updates, inner = self.optimizer.update(noisy, inner, params)
    return noisy, updates, (noise_state, inner)

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

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  @property
  def params(self) -> PyTree:
    return self.state.params

  @property
  def current_clip_norm(self) -> float:
    """The next step's clip norm: ``C_t`` under adaptive clipping (public), else ``C``."""
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

    The whole run is checked against the budget before the first step; each block is charged
    before it runs and appends ``{"step", "epsilon", "epsilon_kind", "delta"}`` (adaptive: and
    ``"clip_norm"``) to ``self.history``, ``epsilon`` being in general an upper bound (exact:
    :meth:`epsilon`).

    Args:
      num_steps: the steps to run, an integer >= 1.
      report_every: the steps of one accounting block (default 10).
      checkpoint_dir: where to write checkpoints (default none).
      checkpoint_every: steps between checkpoints, a multiple of ``report_every`` (default:
        only at the end, when ``checkpoint_dir`` is given).
      log_fn: called with each history entry (default none).
      hmac_key: the key that seals checkpoints (bytes; default: a plain SHA-256 seal).

    Returns:
      ``self.history``: one entry per block.

    Raises:
      PrivacyBudgetExceeded: the whole run would exceed the budget (nothing runs).
      ValueError: a bad argument.
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
    done = 0
    try:
      while done < num_steps:
        block = min(report_every, num_steps - done)
        if self.cyclic is not None:  # exact: the prefix's Gaussian (trainer_noise)
          eps = self.cyclic.charge(self.ledger, self.step_count + block)
        else:  # compose, not spend: a prefix of the checked run cannot exceed the budget
          self.ledger.compose(self.event, label=_LABEL, count=block)
          eps = self.ledger.epsilon(exact=False)
          if eps > planned:  # the whole run's checked epsilon bounds every prefix of it
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
    finally:  # the user's model reflects every step taken, also after an interruption
      self._sync_model(self.step_count - start)
    return self.history

  def epsilon(self, *, exact: bool = True) -> float:
    """Epsilon of every step charged so far.

    Args:
      exact: the exact epsilon (default) or the grid upper bound.

    Returns:
      The epsilon at the trainer's delta.
    """
    return self.ledger.epsilon(exact=exact)

  def privacy_report(self) -> PrivacyReport:
    """``accountant`` provenance: the composition of the steps taken (cyclic: the Gaussian of
    the run's prefix).

    Returns:
      The :class:`~dpsco_jax.privacy.PrivacyReport` of the steps taken.
    """
    if self.cyclic is not None:
      mechanism = self.cyclic.mechanism(self.step_count, self._clip_text(), self.level)
      notes = self.cyclic.notes(self.clipper.method)
    else:
      mechanism = (f"poisson(q={self.q:g}) gaussian(z={self.noise_multiplier:.4g}) x "
                   f"{self.step_count} steps, {self._clip_text()} ({self.level}), "
                   f"denominator D={self.denominator:g}")
      notes = (f"DP-SGD, relation {self.relation}; public: {PUBLIC[self.relation]} "
               f"(q={self.q:g}, D={self.denominator:g} declared); clipping: "
               f"{self.clipper.method}")
    adaptive = "" if self.adaptive is None else "; " + self.adaptive.note()
    return self.ledger.report(provenance=Provenance.ACCOUNTANT, level=self.level,
                              mechanisms=(mechanism,), notes=notes + adaptive)

  def __repr__(self) -> str:
    return (f"DPTrainer(level={self.level!r}, relation={self.relation!r}, "
            f"sampling={self.sampling!r}, noise={self.noise_mechanism!r}, q={self.q:g}, "
            f"D={self.denominator:g}, z={self.noise_multiplier:.4g}, {self._clip_text()}, "
            f"steps={self.step_count}, state={self.state!r})")

  def release_fn(self, num_steps: int, *, noise: bool = True
                 ) -> Callable[[jax.Array, PyTree], PyTree]:
    """``release(key, dataset) -> per-step privatized gradients`` (leaves ``[T, ...]``).

    The mechanism of :meth:`train` from the *initial* params and plan, keys split as the
    trainer's, one masked batch a step (equal up to float rounding). Pure and static-shaped;
    it neither touches ``self.state`` nor charges ``self.ledger``: its outputs carry the
    plan's guarantee (``T`` steps of :attr:`event`), for audits on canary datasets.

    Args:
      num_steps: ``T``, the steps released, an integer >= 1.
      noise: add the noise (default True; False is a TEST HOOK: the noiseless
        ``clipped_sum / D``).

    Returns:
      ``release(key, dataset)``, a pure function returning the ``[T, ...]`` releases.

    Raises:
      ValueError: ``num_steps`` is not an integer >= 1 (cyclic: or past the plan's).
    """
    steps = check_int(num_steps, "num_steps")
    noise = check_bool(noise, "noise")
    if self.cyclic is not None and steps > self.cyclic.plan.steps:
      raise ValueError(f"release_fn: {steps} steps > the plan's {self.cyclic.plan.steps}")

    def release(key: jax.Array, dataset: PyTree) -> PyTree:
      sample_key, noise_tx = self._keys_and_noise(key, noise)
      n = jax.tree.leaves(dataset)[0].shape[0]
      batch_of = (self.cyclic.batch_of(sample_key, dataset) if self.cyclic is not None else
                  lambda t: (dataset, jax.random.bernoulli(jax.random.fold_in(sample_key, t),
                                                           self.q, (n,))))
      params0 = self._initial_params

      def step(carry, t):
        params, opt_state = carry
        rows, mask = batch_of(t)
        total = self._clipped(params, rows, mask, self._clip_of(opt_state))
        total = jax.tree.map(lambda s, z: s.astype(z.dtype), total, self._zero_total(params))
        noisy, updates, opt_state = self._privatize(total, opt_state, params, noise_tx)
        return (optax.apply_updates(params, updates), opt_state), noisy

      opt0 = (noise_tx.init(params0), self.optimizer.init(params0))
      return jax.lax.scan(step, (params0, opt0), jnp.arange(steps))[1]

    return release

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
    """Writes a sealed ``directory/step_<t>`` (:mod:`dpsco_jax.flax.checkpoint`): an HMAC
    with ``hmac_key`` (bytes you hold: detects forgery), else a plain SHA-256 (accidents only).

    Args:
      directory: the checkpoints' folder.
      hmac_key: the sealing key, bytes (default: a plain SHA-256 seal).
      overwrite: replace an existing checkpoint of this step (default: refuse).

    Returns:
      The path of the ``step_<t>`` folder written.

    Raises:
      FileExistsError: a checkpoint of this step exists and ``overwrite`` is False.
      ValueError: ``hmac_key`` is not bytes of at least 16.
      ImportError: orbax-checkpoint is not installed.
    """
    meta = {"fingerprint": self._fingerprint(), "ledger": self.ledger.state_dict(),
            "history": self.history, "data": self._data_facts}
    return ckpt.save_checkpoint(directory, self.state, self.step_count, meta,
                                hmac_key=hmac_key, overwrite=overwrite)

  latest_checkpoint = staticmethod(ckpt.latest_checkpoint)

  def restore(self, path: str | os.PathLike, *, hmac_key: bytes | None = None
              ) -> "DPTrainer":
    """Loads a checkpoint into this trainer, which must be fresh (the ledger is never rolled
    back); refusals: :mod:`dpsco_jax.flax.checkpoint`.

    Args:
      path: a ``step_*`` folder, or a folder of them (its latest complete one).
      hmac_key: the key the checkpoint was sealed with (default none).

    Returns:
      This trainer, at the checkpoint's step.

    Raises:
      ValueError: the trainer already spent budget; no complete checkpoint under ``path``; its
        privacy configuration or data differs from this trainer's; a bad ``hmac_key``.
      LedgerIntegrityError: a broken seal (a wrong HMAC), or an edited ledger or arrays.
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
