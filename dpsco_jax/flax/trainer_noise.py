"""DPTrainer's cyclic schedule and its noise: independent, banded or BLT.

``DPTrainer(sampling="cyclic", ...)`` takes the plan of ``dp_sgd_user`` with ``sampling:
cyclic`` (:func:`~dpsco_jax.algorithms.dpsgd.plan.plan_dp_sgd`: ``P = ceil(n / B)`` steps per
epoch, participations, MF strategy, sensitivity, ``z``), so the trainer and the driver cannot
price the same run differently, and the driver's keys and noise stage: order ``fold_in(key,
2)`` (:func:`~dpsco_jax.algorithms.dpsgd.driver.cyclic_slots`; step ``t`` runs batch ``t mod
P``, ``D = B``), noise ``fold_in(key, 1)``, on the *raveled* gradient (``dp.fit``'s layout).

Accounting: the first ``t`` steps are one Gaussian of multiplier ``z / sens_t``
(``plan.event_after(t)``). Before a block ending at step ``t`` runs, the ledger is charged a
Gaussian of ``mu^2 = mu_t^2 - (mu^2 already charged)``; Gaussians compose exactly (Dong, Roth
& Su 2019), so the ledger's epsilon is the prefix's exact epsilon (``pld`` / ``auto``; ``rdp``
is refused). Stepping past the planned ``T`` is refused.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dpsco_jax._checks import check_choice, check_int
from dpsco_jax.algorithms.dpsgd.driver import _noise_stage, cyclic_slots
from dpsco_jax.algorithms.dpsgd.plan import AdaptivePlan, DpSgdPlan, plan_dp_sgd
from dpsco_jax.privacy import PUBLIC, LedgerIntegrityError, PrivacyLedger
from dpsco_jax.privacy.ledger import Epsilon
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit
from dpsco_jax.transforms.adaptive_clipping import adaptive_noise

PyTree = Any
LABEL = "dp-sgd block (cyclic, gaussian mu^2 increment)"


def raveled(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` applied to the raveled update vector, unraveled after."""

  def init_fn(params):
    return inner.init(ravel_pytree(params)[0])

  def update_fn(updates, state, params=None, *, centred_count=None, **extra):
    del extra  # the mask is the clipper's business; noise is data-independent
    flat, unravel = ravel_pytree(updates)
    # adaptive clipping's stage also takes the (already clipped) centred count
    count = {} if centred_count is None else {"centred_count": centred_count}
    out, state = inner.update(flat, state, None if params is None else ravel_pytree(params)[0],
                              **count)
    return unravel(out), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mu2(event: Any) -> float:
  if not isinstance(event, dp_accounting.GaussianDpEvent):  # every cyclic event is one
    raise TypeError(f"expected a GaussianDpEvent, got {event}")
  return 1.0 / float(event.noise_multiplier) ** 2


def ledger_mu2(ledger: PrivacyLedger) -> float:
  """``sum count / z^2`` of a ledger of ungrouped Gaussians (else LedgerIntegrityError)."""
  total = 0.0
  for _, event, group, count in ledger.events:
    if group is not None or not isinstance(event, dp_accounting.GaussianDpEvent):
      raise LedgerIntegrityError(f"a cyclic trainer's ledger holds ungrouped Gaussians only; "
                                 f"found {event} (group {group!r}): it was edited")
    total += count * _mu2(event)
  return total


class CyclicSchedule:
  """The cyclic plan of one trainer: batches, noise stage, accounting."""

  def __init__(self, *, n: int, level: str, clip_norm: float, delta: float,
               relation: str | None, batch_size: Any, num_steps: Any,
               noise_multiplier: float | None, target_epsilon: float | None,
               noise_mechanism: str, bands: Any, buffers: Any, mf_strategy: str,
               accountant: str, adaptive_keys: dict | None = None):
    if accountant == "rdp":
      raise ValueError("accountant='rdp' with sampling='cyclic': its events are plain "
                       "Gaussians, which the ledger converts exactly (pld / auto); RDP would "
                       "only loosen the epsilon the plan calibrated for")
    if num_steps is None:
      raise ValueError("sampling='cyclic' needs num_steps: the planned horizon T that the "
                       "participation schema and the MF strategy are priced for")
    cfg = {"sampling": "cyclic", "delta": delta, "clip_norm": clip_norm,
           "batch_size": check_int(batch_size, "batch_size") if batch_size is not None
           else None, "num_steps": check_int(num_steps, "num_steps"),
           "noise_mechanism": noise_mechanism, "mf_strategy": mf_strategy,
           "epsilon": target_epsilon, "noise_multiplier": noise_multiplier,
           "relation": relation, "bands": bands, "buffers": buffers,
           # the plan's SGD step is never used: the trainer's optimizer steps
           "learning_rate": 1.0, "averaging": "none",
           # clip_norm="adaptive": the plan's split and refusals (its clip_norm is then C_0)
           **({} if adaptive_keys is None else {**adaptive_keys, "clip_norm": "adaptive",
                                                 "initial_clip_norm": clip_norm})}
    if cfg["batch_size"] is None:
      raise ValueError("sampling='cyclic' needs batch_size B (users per step)")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    self.plan: DpSgdPlan = plan_dp_sgd(cfg, level=level, realized_rows=n, rows_per_user=1,
                                       default_clip=clip_norm, radius=math.inf)
    if self.plan.event is None:
      raise ValueError("noise_multiplier must be > 0")
    self.n, self.period = n, -(-n // self.plan.batch)
    self._slots: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

  def keys_and_noise(self, key: jax.Array, stddev: float, noise: bool = True
                     ) -> tuple[jax.Array, optax.GradientTransformation]:
    """(order key, noise stage): the driver's ``fold_in(key, 2)`` / ``fold_in(key, 1)``."""
    if self.plan.adaptive is not None:
      return jax.random.fold_in(key, 2), raveled(adaptive_stage(
          self.plan.adaptive, self.plan.denominator, jax.random.fold_in(key, 1), noise=noise))
    spec = ("independent",) if self.plan.mf is None else self.plan.mf.stage_spec()
    stage = _noise_stage({"stddev": stddev, "noise_key": jax.random.fold_in(key, 1)}, spec,
                         self.plan.steps)
    return jax.random.fold_in(key, 2), raveled(stage)

  def chosen(self, order_key: jax.Array, step: int) -> np.ndarray:
    """Row indices of step ``step`` (public: a function of the order key and ``step``)."""
    tag = np.asarray(jax.random.key_data(order_key)).tobytes()
    if tag not in self._slots:
      self._slots[tag] = tuple(map(np.asarray, cyclic_slots(order_key, self.n,
                                                            self.plan.batch)))
    slots, real = self._slots[tag]
    lo = (step % self.period) * self.plan.batch
    return slots[lo:lo + self.plan.batch][real[lo:lo + self.plan.batch]]

  def batch_of(self, order_key: jax.Array, dataset: PyTree) -> Any:
    """Traceable ``t -> (rows, mask)`` of step ``t`` (one masked batch of ``B`` slots), as
    :meth:`chosen` selects them; for :meth:`DPTrainer.release_fn`."""
    batch = self.plan.batch
    slots, real = cyclic_slots(order_key, jax.tree.leaves(dataset)[0].shape[0], batch)

    def rows(t):
      lo = (t % self.period) * batch
      idx = jax.lax.dynamic_slice(slots, (lo,), (batch,))
      mask = jax.lax.dynamic_slice(real, (lo,), (batch,))
      return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), dataset), mask

    return rows

  def prefix_mu2(self, steps: int) -> float:
    """``mu_t^2`` of the first ``steps`` steps (the plan's event for that prefix)."""
    return 0.0 if steps == 0 else _mu2(self.plan.event_after(steps))

  def _increment(self, ledger: PrivacyLedger, steps: int) -> Any:
    if steps > self.plan.steps:
      raise ValueError(f"the cyclic plan covers num_steps={self.plan.steps} steps (its MF "
                       f"strategy and participation schema); step {steps} is past it: build "
                       "a trainer with a longer horizon")
    extra = self.prefix_mu2(steps) - ledger_mu2(ledger)
    if extra <= 1e-12 * self.prefix_mu2(steps):
      return None  # this block adds no sensitivity (or only rounding)
    return dp_accounting.GaussianDpEvent(1.0 / math.sqrt(extra))

  def check_run(self, ledger: PrivacyLedger, end: int) -> Epsilon:
    """Budget check of the run up to step ``end``; records nothing."""
    event = self._increment(ledger, end)
    return (ledger.epsilon(exact=True) if event is None
            else ledger.check(event, label=LABEL))

  def charge(self, ledger: PrivacyLedger, end: int) -> Epsilon:
    """Charges the block ending at ``end`` (before it runs); the exact epsilon after it."""
    event = self._increment(ledger, end)
    if event is not None:
      ledger.compose(event, label=LABEL)
    return ledger.epsilon(exact=True)

  def check_ledger(self, ledger: PrivacyLedger, steps: int) -> None:
    """A restored ledger must hold exactly the prefix's ``mu^2`` (else it was edited)."""
    got, want = ledger_mu2(ledger), self.prefix_mu2(steps)
    if abs(got - want) > 1e-9 * max(want, 1e-300):
      raise LedgerIntegrityError(f"checkpoint ledger records mu^2 = {got:.6g}, but its step "
                                 f"count {steps} implies {want:.6g}: the ledger was edited")

  def fingerprint(self) -> dict:
    p = self.plan
    fp = {"sampling": "cyclic", "batch_size": p.batch, "num_steps": p.steps,
          "noise_mechanism": p.noise, "n": self.n}
    if p.mf is not None:
      fp.update(mf_source=p.mf.source, mf_sensitivity=p.mf.sensitivity,
                mf_coefs=[float(c) for c in p.mf.coefs[:64]])
    return fp

  def mechanism(self, steps: int, clip: str, level: str) -> str:
    p = self.plan
    noise = "independent" if p.mf is None else (
        f"{p.noise} MF ({p.mf.source}, sensitivity factor {p.mf.sensitivity:.4g} over "
        f"{p.steps} steps)")
    return (f"cyclic(B={p.batch}, P={self.period}) gaussian(z={p.noise_multiplier:.4g}) "
            f"{noise} x {steps} of {p.steps} steps, {clip} ({level}), "
            f"denominator D={p.denominator:g}")

  def notes(self, method: str) -> str:
    p = self.plan
    return (f"DP-SGD, relation {p.relation}; public: {PUBLIC[p.relation]} (B={p.batch}, "
            f"permutation from the key); participation: at most {p.participations} per user, "
            f">= {p.min_sep} steps apart; the run's prefix is one Gaussian (plan.event_after),"
            f" charged per block as mu^2 increments; clipping: {method}")


def adaptive_stage(plan: AdaptivePlan, denominator: float, key: jax.Array, *,
                   noise: bool = True) -> optax.GradientTransformationExtraArgs:
  """Adaptive clipping's noise stage from DP-SGD's adaptive plan (``noise=False``: no noise)."""
  split = plan.split if noise else AdaptiveClipSplit(plan.split.noise_multiplier, 0.0, 0.0)
  return adaptive_noise(plan.initial_clip_norm, target_quantile=plan.target_quantile,
                        clip_learning_rate=plan.clip_learning_rate, denominator=denominator,
                        split=split, key=key)


def check_cyclic_args(sampling_rate: Any, expected_batch_size: Any) -> None:
  """Poisson-only arguments are refused under the cyclic schedule (it has neither)."""
  for name, v in (("sampling_rate", sampling_rate), ("expected_batch_size",
                                                     expected_batch_size)):
    if v is not None:
      raise ValueError(f"{name} is a Poisson-sampling argument; sampling='cyclic' takes "
                       "batch_size B (the denominator is D = B)")


def check_sampling(sampling: Any) -> str:
  if sampling == "banded_poisson":
    # its ledger would be k rounds of a Poisson-subsampled Gaussian; the cyclic ledger holds
    # plain Gaussians only
    raise ValueError("sampling='banded_poisson' (b-min-sep Poisson with amplified banded "
                     "noise) runs in dp_sgd_user / dp_sgd_item (dpsco_jax.fit / plan+run), not "
                     "in DPTrainer yet; DPTrainer takes 'poisson' (independent noise) or "
                     "'cyclic' (independent, banded or BLT noise)")
  return check_choice(sampling, "sampling", ("poisson", "cyclic"))
