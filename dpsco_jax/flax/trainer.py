"""DP training of Flax nnx models with our chains: Poisson-sampled DP-SGD, accounted as it goes,
checkpointed and resumed bit-identically.

One step (user level: ``n`` users with ``m`` items each; item level: ``m = 1``):

1. Poisson sampling: user ``u`` joins the step with probability ``q``
   (``bernoulli(fold_in(sample_key, t), q)``, so step ``t``'s batch is a function of the key and
   the counter only). The realized batch is processed in padded chunks of static size
   ``batch_capacity`` (with ``user_mask``), so any realized size is handled exactly and never
   truncated.
2. Clipping: per-user gradients (mean over the user's items) clipped to ``C`` and summed —
   :class:`~dpsco_jax.flax.fast_clip.FastClippedGrad` (``method="fast"``, no per-example
   gradients) or the core's ``per_user_grads`` + ``clip_and_aggregate`` (``method="vmap"``);
   both give the same aggregate.
3. The shared chain: divide by the fixed ``D = q n`` (core ``aggregate`` semantics; sensitivity
   ``C/D`` under add/remove), core ``add_gaussian_noise(z C / D)``, then the caller's
   ``optimizer`` (any optax transformation, e.g. ``projected_sgd``), which sees only the
   privatized gradient (post-processing).

Accounting: each step is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (Abadi et al. 2016;
Mironov et al. 2019), composed by the core :class:`~dpsco_jax.privacy.ledger.PrivacyLedger`
(PLD). A block of steps is paid for with ``ledger.spend`` *before* it runs, so an exhausted
budget raises before anything is released; provenance ``accountant``.

Checkpoints (orbax, optional extra ``dpsco_jax[flax]``) hold the params, the whole chain state
(noise key and counter, optimizer state), the sampling key, the step, the ledger's events and a
fingerprint of the privacy configuration. A resumed run is bit-identical to an uninterrupted
one; restoring never rolls the ledger back (a trainer that already spent refuses to restore).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, NamedTuple

import attr
import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive, check_probability)
from dpsco_jax.flax.fast_clip import FastClippedGrad, LossFn
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance,
                                      calibrate_noise_multiplier)
from dpsco_jax.transforms.noise import add_gaussian_noise

PyTree = Any


class TrainState(NamedTuple):
  """Everything a step depends on. Secret: ``opt_state`` holds the noise key, ``sample_key``
  the sampling key; neither is ever logged."""
  params: PyTree
  opt_state: PyTree
  sample_key: jax.Array
  step: jax.Array


# ---- orbax and ledger serialization --------------------------------------------------------


def _require_orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("checkpointing needs orbax-checkpoint: pip install 'dpsco_jax[flax]'"
                      ) from e
  return ocp


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _data_to_keys(tree, like):
  return jax.tree.map(lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t))
                      if _is_key(t) else x, tree, like)


def _flat_arrays(tree) -> dict:
  """Leaves by position: orbax never sees nnx/optax node types, only a flat dict."""
  return {f"leaf_{i:05d}": x for i, x in enumerate(jax.tree.leaves(_keys_to_data(tree)))}


def _unflat_arrays(flat: dict, like):
  leaves = [flat[f"leaf_{i:05d}"] for i in range(len(flat))]
  return _data_to_keys(jax.tree.unflatten(jax.tree.structure(like), leaves), like)


def _encode_event(x):
  if isinstance(x, dp_accounting.DpEvent):
    return {"__dp_event__": type(x).__name__,
            "fields": {f.name: _encode_event(getattr(x, f.name)) for f in attr.fields(type(x))}}
  if isinstance(x, (list, tuple)):
    return [_encode_event(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  return x


def _decode_event(x):
  if isinstance(x, dict) and "__dp_event__" in x:
    cls = getattr(dp_accounting, x["__dp_event__"])
    return cls(**{k: _decode_event(v) for k, v in x["fields"].items()})
  if isinstance(x, list):
    return [_decode_event(v) for v in x]
  return x


def ledger_to_json(ledger: PrivacyLedger) -> dict:
  """The ledger's configuration and every recorded event, as JSON-able data."""
  return {"delta": ledger.delta, "epsilon_budget": ledger.epsilon_budget,
          "relation": ledger.relation, "accountant": ledger.accountant,
          "events": [{"label": l, "event": _encode_event(e), "group": g, "count": c}
                     for l, e, g, c in ledger.events]}


def ledger_from_json(data: dict) -> PrivacyLedger:
  """Rebuilds a ledger with every event of :func:`ledger_to_json` composed (already spent)."""
  ledger = PrivacyLedger(delta=data["delta"], epsilon_budget=data["epsilon_budget"],
                         relation=data["relation"], accountant=data["accountant"])
  for e in data["events"]:
    ledger.compose(_decode_event(e["event"]), label=e["label"], group=e["group"],
                   count=e["count"])
  return ledger


# ---- the trainer ---------------------------------------------------------------------------


class DPTrainer:
  """Differentially private training of an nnx model (user- or item-level DP-SGD).

  Args:
    model: the ``nnx.Module`` to train (its ``nnx.Param`` leaves; other state is fixed).
    loss_fn: ``loss_fn(model, example) -> scalar`` for one item.
    optimizer: the data-independent step stage(s) applied to the privatized gradient, e.g.
      ``dpsco_jax.transforms.steps.projected_sgd(lr, radius=R)`` or ``optax.sgd(lr)``.
    data: pytree with leaves ``[n_users, m, ...]`` (``level="user"``) or ``[n, ...]``.
    clip_norm: ``C``, per-user (per-example) L2 clip of the (mean) gradient.
    sampling_rate: Poisson rate ``q`` in (0, 1].
    delta: the delta of the reported guarantee.
    noise_multiplier: ``z`` (noise stddev ``z C / D``). Give it, or ``target_epsilon`` and
      ``num_steps`` to calibrate it with the ledger's accountant.
    epsilon_budget: optional hard cap; a block of steps that would exceed it raises
      ``PrivacyBudgetExceeded`` before running.
    level: ``"user"`` or ``"item"``.
    method: ``"fast"`` (taps) or ``"vmap"`` (core per-user gradients).
    batch_capacity: static chunk size for the sampled users (default: ``q n`` + 4 sd).
    key: PRNG key; split once into the sampling and noise keys.
    debug: keep data-dependent diagnostics (realized batch sizes) in ``self.debug``.
  """

  def __init__(self, model: nnx.Module, loss_fn: LossFn, optimizer: optax.GradientTransformation,
               *, data: PyTree, clip_norm: float, sampling_rate: float, delta: float,
               noise_multiplier: float | None = None, target_epsilon: float | None = None,
               num_steps: int | None = None, epsilon_budget: float | None = None,
               level: str = "user", method: str = "fast", batch_capacity: int | None = None,
               key: jax.Array | int = 0, accountant: str = "pld", debug: bool = False):
    self.level = check_choice(level, "level", ("user", "item"))
    self.clip_norm = check_positive(clip_norm, "clip_norm")
    self.q = check_probability(sampling_rate, "sampling_rate")
    self.delta = check_delta(delta)
    leaves = jax.tree.leaves(data)
    if not leaves:
      raise ValueError("data must contain at least one array")
    self.n = int(leaves[0].shape[0])
    if any(int(x.shape[0]) != self.n for x in leaves):
      raise ValueError("data leaves disagree on the leading (user) axis")
    if level == "user" and any(x.ndim < 2 for x in leaves):
      raise ValueError("data leaves must be [n_users, m, ...] for level='user'")
    self.denominator = self.q * self.n
    if noise_multiplier is None:
      if target_epsilon is None or num_steps is None:
        raise ValueError("give noise_multiplier, or target_epsilon and num_steps to calibrate it")
      check_epsilon(target_epsilon, "target_epsilon")
      steps = check_int(num_steps, "num_steps")
      noise_multiplier = calibrate_noise_multiplier(
          lambda z: dp_accounting.SelfComposedDpEvent(self._step_event(z), steps),
          epsilon=target_epsilon, delta=delta, accountant=accountant)
    self.noise_multiplier = check_nonnegative(noise_multiplier, "noise_multiplier")
    if self.noise_multiplier == 0:
      raise ValueError("noise_multiplier must be > 0 for a DP guarantee")
    self.event = self._step_event(self.noise_multiplier)
    self.ledger = PrivacyLedger(delta=delta, epsilon_budget=epsilon_budget,
                                relation="add_remove", accountant=accountant)
    self.clipper = FastClippedGrad(model, loss_fn, clip_norm=clip_norm, level=level,
                                   method=method)
    self.sensitivity = self.clipper.sensitivity(mode="mean", denominator=self.denominator)
    self.noise_stddev = self.noise_multiplier * self.sensitivity
    if batch_capacity is None:
      mean = self.q * self.n
      batch_capacity = int(min(self.n, math.ceil(mean + 4 * math.sqrt(mean * (1 - self.q)) + 1)))
    self.batch_capacity = check_int(batch_capacity, "batch_capacity")
    self.debug: dict | None = {"batch_sizes": []} if debug else None
    self.history: list[dict] = []

    key = jax.random.key(key) if isinstance(key, int) else key
    sample_key, noise_key = jax.random.split(key)
    self.chain = optax.chain(add_gaussian_noise(self.noise_stddev, noise_key), optimizer)
    params = self.clipper.params
    self.state = TrainState(params=params, opt_state=self.chain.init(params),
                            sample_key=sample_key, step=jnp.zeros((), jnp.int32))
    self.data = data
    self._build()

  def _step_event(self, z: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(self.q, dp_accounting.GaussianDpEvent(z))

  def _build(self):
    clipper, chain, denom, q, n = self.clipper, self.chain, self.denominator, self.q, self.n

    @jax.jit
    def sample(sample_key, step):
      return jax.random.bernoulli(jax.random.fold_in(sample_key, step), q, (n,))

    @jax.jit
    def clipped_chunk(params, data, idx, mask, total):
      batch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), data)
      summed, _ = clipper.clipped_sum(params, batch, mask)
      return summed if total is None else jax.tree.map(jnp.add, total, summed)

    @jax.jit
    def apply(state: TrainState, summed):
      grad = jax.tree.map(lambda s: s / denom, summed)  # fixed denominator: aggregate("mean")
      updates, opt_state = chain.update(grad, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      return TrainState(params, opt_state, state.sample_key, state.step + 1)

    self._sample, self._clipped_chunk, self._apply = sample, clipped_chunk, apply

  # ---- stepping ----------------------------------------------------------------------------

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  @property
  def params(self) -> PyTree:
    return self.state.params

  @property
  def model(self) -> nnx.Module:
    """A fresh nnx model holding the current parameters."""
    c = self.clipper
    return nnx.merge(c.graphdef, self.state.params, c.rest)

  def _one_step(self):
    st = self.state
    chosen = np.flatnonzero(np.asarray(self._sample(st.sample_key, st.step)))
    if self.debug is not None:
      self.debug["batch_sizes"].append(int(chosen.size))
    cap = self.batch_capacity
    total = None
    for start in range(0, max(chosen.size, 1), cap):
      part = chosen[start:start + cap]
      idx = np.zeros((cap,), np.int32)
      idx[:part.size] = part
      mask = np.arange(cap) < part.size
      total = self._clipped_chunk(st.params, self.data, jnp.asarray(idx), jnp.asarray(mask),
                                  total)
    self.state = self._apply(st, total)

  def train(self, num_steps: int, *, report_every: int = 10,
            checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
            log_fn: Callable[[dict], None] | None = None) -> list[dict]:
    """Runs ``num_steps`` DP steps in blocks of ``report_every``.

    Each block is paid for (``ledger.spend(event, count=block)``) before it runs, then
    ``{"step", "epsilon", "delta"}`` is appended to ``self.history`` (and passed to
    ``log_fn``). With ``checkpoint_dir``, a checkpoint is written every ``checkpoint_every``
    steps (a multiple of ``report_every``) and at the end.
    """
    check_int(num_steps, "num_steps")
    check_int(report_every, "report_every")
    if checkpoint_every is not None:
      check_int(checkpoint_every, "checkpoint_every")
      if checkpoint_every % report_every:
        raise ValueError("checkpoint_every must be a multiple of report_every (checkpoints "
                         "are written at accounting-block boundaries)")
    done = 0
    while done < num_steps:
      block = min(report_every, num_steps - done)
      eps = self.ledger.spend(self.event, label="dp-sgd step (poisson gaussian)", count=block)
      for _ in range(block):
        self._one_step()
      done += block
      rec = {"step": self.step_count, "epsilon": eps, "delta": self.delta}
      self.history.append(rec)
      if log_fn is not None:
        log_fn(rec)
      if checkpoint_dir is not None and (
          done == num_steps or (checkpoint_every and self.step_count % checkpoint_every == 0)):
        self.save(checkpoint_dir)
    return self.history

  def epsilon(self) -> float:
    return self.ledger.epsilon()

  def privacy_report(self) -> PrivacyReport:
    """``accountant`` provenance: PLD composition of the Poisson-sampled Gaussian steps."""
    return self.ledger.report(
        provenance=Provenance.ACCOUNTANT, level=self.level,
        mechanisms=(f"poisson(q={self.q:g}) gaussian(z={self.noise_multiplier:.4g}) x "
                    f"{self.step_count} steps, clip C={self.clip_norm:g} ({self.level})",),
        notes="DP-SGD with fixed denominator q*n; fast per-user clipping"
        if self.clipper.method == "fast" else "DP-SGD with fixed denominator q*n")

  # ---- checkpointing -----------------------------------------------------------------------

  def _fingerprint(self) -> dict:
    return {"n": self.n, "q": self.q, "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm, "denominator": self.denominator, "level": self.level,
            "delta": self.delta}

  def save(self, directory: str | os.PathLike) -> str:
    """Writes ``directory/step_<t>`` (orbax) and returns its path."""
    ocp = _require_orbax()
    path = os.path.join(os.path.abspath(os.fspath(directory)), f"step_{self.step_count:08d}")
    meta = {"fingerprint": self._fingerprint(), "ledger": ledger_to_json(self.ledger),
            "history": self.history}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
      ckpt.save(path, ocp.args.Composite(
          state=ocp.args.StandardSave(_flat_arrays(self.state)),
          meta=ocp.args.JsonSave(meta)), force=True)
    return path

  @staticmethod
  def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    d = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(d):
      return None
    steps = sorted(p for p in os.listdir(d) if p.startswith("step_"))
    return os.path.join(d, steps[-1]) if steps else None

  def restore(self, path: str | os.PathLike) -> "DPTrainer":
    """Loads a checkpoint (a ``step_*`` folder, or a directory: its latest) into this
    trainer, which must be fresh (nothing spent): the ledger is never rolled back."""
    ocp = _require_orbax()
    if self.ledger.events or self.step_count:
      raise ValueError("restore into a fresh trainer: this one already spent privacy budget, "
                       "and a restore must never roll the ledger back")
    path = os.path.abspath(os.fspath(path))
    if not os.path.basename(path).startswith("step_"):
      latest = self.latest_checkpoint(path)
      if latest is None:
        raise ValueError(f"no checkpoint under {path!r}")
      path = latest
    template = _flat_arrays(self.state)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
      got = ckpt.restore(path, ocp.args.Composite(
          state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
    meta = got["meta"]
    mine = json.loads(json.dumps(self._fingerprint()))
    if meta["fingerprint"] != mine:
      raise ValueError(f"checkpoint privacy configuration {meta['fingerprint']} does not match "
                       f"this trainer's {mine}")
    restored = _unflat_arrays(got["state"], self.state)
    ledger = ledger_from_json(meta["ledger"])
    if self.ledger.epsilon_budget is not None:  # this trainer's cap, if it sets one
      ledger.epsilon_budget = self.ledger.epsilon_budget
    self.state = jax.tree.map(lambda r, t: jnp.asarray(r, dtype=t.dtype)
                              if not _is_key(t) else r, restored, self.state)
    self.ledger = ledger
    self.history = list(meta["history"])
    return self
