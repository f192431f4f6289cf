"""Black-box harness: run a release function many times on ``D`` and ``D'``, score, bound.

A mechanism offers ``release(key, dataset) -> per-step releases`` (jittable, vmappable in
``key``, ``key`` its only randomness; ``dataset`` any pytree of static shapes). The harness
vmaps it over independent keys, jits it once, scores every run with ``score(releases) ->
scalar`` and bounds the two score samples. Trial ``i`` on side ``s`` uses
``fold_in(fold_in(key, s), i)``: no key is used twice. Drivers are audited through their audit
hooks (:mod:`dpsco_jax.audit.drivers`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit import bounds
from dpsco_jax.audit.canary import check_relation

__all__ = ["AUDITS", "AuditResult", "AuditSpec", "build", "sample_scores", "audit_mechanism",
           "run_audit"]

Release = Callable[[jax.Array, Any], Any]
Score = Callable[[Any], jax.Array]


class AuditResult(NamedTuple):
  """Outcome of one audit; ``violated`` when the distribution-free bound exceeds the claim.

  Attributes:
    claimed_epsilon: the epsilon audited.
    lower_bound: the distribution-free epsilon lower bound at ``delta``.
    confidence: the bound's confidence.
    trials: the runs per side.
    relation: the neighbouring relation of the pair.
    delta: the claim's delta.
    name: the audit's name.
    mu_lower_bound: the lower bound on ``mu`` (GDP).
    gdp_lower_bound: the epsilon at ``delta`` of ``mu_lower_bound`` (Gaussian claims only).
    threshold: the score threshold the bound was evaluated at.
  """
  claimed_epsilon: float
  lower_bound: float
  confidence: float
  trials: int
  relation: str
  delta: float
  name: str = ""
  mu_lower_bound: float = 0.0
  gdp_lower_bound: float = 0.0
  threshold: float = 0.0

  @property
  def violated(self) -> bool:
    return self.lower_bound > self.claimed_epsilon


@dataclasses.dataclass(frozen=True)
class AuditSpec:
  """One audit: the mechanism as ``release``, the neighbouring datasets, score and claim.

  Attributes:
    name: the audit's name.
    relation: the neighbouring relation of the pair.
    release: ``release(key, dataset) -> output``, the mechanism.
    dataset_in: the dataset with the canary.
    dataset_out: its neighbour.
    score: ``score(output) -> scalar`` (larger: more canary-like).
    claimed_epsilon: the epsilon claimed.
    delta: the claim's delta.
    claim_source: where the claim comes from (for reports).
    thresholds: a data-independent threshold grid (discrete scores), or None.
  """
  name: str
  relation: str
  release: Release
  dataset_in: Any
  dataset_out: Any
  score: Score
  claimed_epsilon: float
  delta: float
  claim_source: str = ""
  thresholds: tuple[float, ...] | None = None



#: Every registered audit, ``name -> (builder, relations, broken twins)``, filled by the modules
#: that define them (``mechanisms``, ``numerics``, ``matrix_factorization``, ``drivers``).
AUDITS: dict[str, tuple[Callable[..., AuditSpec], tuple[str, ...], tuple[str, ...]]] = {}

def _check_count(x, name: str) -> int:
  if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(x).__name__}")
  if x < 2:
    raise ValueError(f"{name} must be >= 2, got {x!r}")
  return int(x)


def _scorer(release: Release, score: Score) -> Callable:
  @jax.jit
  def run(keys, data):
    return jax.vmap(lambda k: jnp.asarray(score(release(k, data)), jnp.float32))(keys)
  return run


def _sample(run: Callable, dataset: Any, key: jax.Array, trials: int, batch: int
            ) -> np.ndarray:
  chunk = min(batch, trials)
  out = []
  for start in range(0, trials, chunk):
    # fixed chunk shape (the tail is computed in full and truncated): no recompiles
    idx = jnp.arange(start, start + chunk, dtype=jnp.uint32)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)
    out.append(np.asarray(run(keys, dataset), np.float64))
  return np.concatenate(out)[:trials]


def sample_scores(release: Release, dataset: Any, score: Score, key: jax.Array, trials: int,
                  *, batch: int = 20_000) -> np.ndarray:
  """``trials`` i.i.d. scores ``score(release(k_i, dataset))`` (float64), in jitted chunks.

  Args:
    release: ``release(key, dataset) -> output``.
    dataset: the dataset.
    score: ``score(output) -> scalar``.
    key: a JAX PRNG key.
    trials: the runs, an int >= 2.
    batch: the most trials per compiled chunk (default 20000).

  Returns:
    ``[trials]`` float64 scores (TypeError, ValueError: ``trials`` or ``batch`` not an int >= 2).
  """
  trials = _check_count(trials, "trials")
  batch = _check_count(batch, "batch")
  return _sample(_scorer(release, score), dataset, key, trials, batch)


def audit_mechanism(release: Release, dataset_in: Any, dataset_out: Any, *, score: Score,
                    claimed_epsilon: float, delta: float, relation: str, trials: int,
                    key: jax.Array | int = 0, confidence: float = 0.95,
                    name: str = "", batch: int = 20_000,
                    thresholds: Sequence[float] | None = None) -> AuditResult:
  """Audits ``release`` on the neighbouring pair ``(dataset_in, dataset_out)``.

  Without ``thresholds`` the threshold is chosen on a quarter of each side; a data-independent
  grid (natural for discrete scores) uses every trial, Bonferroni-corrected
  (:func:`dpsco_jax.audit.bounds.epsilon_lower_bound`).

  Args:
    release: ``release(key, dataset) -> output``, the mechanism (jit-able).
    dataset_in: the dataset with the canary.
    dataset_out: its neighbour under ``relation``.
    score: ``score(output) -> scalar``.
    claimed_epsilon: the epsilon claimed, finite and >= 0.
    delta: the claim's delta, in ``(0, 1)``.
    relation: ``add_remove``, ``replace_one`` or ``zero_out``.
    trials: runs per side, an int >= 2.
    key: a JAX PRNG key or an int seed (default 0).
    confidence: the bounds' confidence, in ``(0, 1)`` (default 0.95).
    name: the audit's name (default empty).
    batch: the most trials per compiled chunk (default 20000).
    thresholds: a data-independent threshold grid (default none: a split).

  Returns:
    The :class:`AuditResult`.

  Raises:
    TypeError, ValueError: ``claimed_epsilon`` not a finite number >= 0, ``key`` a bool,
      ``trials`` / ``batch`` not an int >= 2, an unknown ``relation``; as
      :func:`~dpsco_jax.audit.epsilon_lower_bound`.
  """
  check_relation(relation)
  if isinstance(claimed_epsilon, bool) or not isinstance(claimed_epsilon, (int, float)):
    raise TypeError(f"claimed_epsilon must be a number, got {type(claimed_epsilon).__name__}")
  if not math.isfinite(claimed_epsilon) or claimed_epsilon < 0:
    raise ValueError(f"claimed_epsilon must be finite and >= 0, got {claimed_epsilon!r}")
  if isinstance(key, bool):
    raise TypeError("key must be a jax.random key or an int seed, got bool")
  if isinstance(key, int):
    key = jax.random.key(key)
  trials = _check_count(trials, "trials")
  batch = _check_count(batch, "batch")
  run = _scorer(release, score)
  s_in = _sample(run, dataset_in, jax.random.fold_in(key, 0), trials, batch)
  s_out = _sample(run, dataset_out, jax.random.fold_in(key, 1), trials, batch)
  how = {"method": "split"} if thresholds is None else {"method": "bonferroni",
                                                         "thresholds": thresholds}
  eps = bounds.epsilon_lower_bound(s_in, s_out, delta=delta, confidence=confidence, **how)
  mu = bounds.gdp_mu_lower_bound(s_in, s_out, confidence=confidence, **how)
  return AuditResult(claimed_epsilon=float(claimed_epsilon), lower_bound=eps.value,
                     confidence=eps.confidence, trials=int(trials), relation=relation,
                     delta=float(delta), name=name, mu_lower_bound=mu.value,
                     gdp_lower_bound=bounds.gdp_epsilon(mu.value, delta),
                     threshold=eps.threshold)


def run_audit(spec: AuditSpec, *, trials: int, key: jax.Array | int = 0,
              confidence: float = 0.95) -> AuditResult:
  """:func:`audit_mechanism` on an :class:`AuditSpec`.

  Args:
    spec: the audit.
    trials: runs per side, an int >= 2.
    key: a JAX PRNG key or an int seed (default 0).
    confidence: in ``(0, 1)`` (default 0.95).

  Returns:
    The :class:`AuditResult` (errors as :func:`audit_mechanism`).
  """
  return audit_mechanism(spec.release, spec.dataset_in, spec.dataset_out, score=spec.score,
                         claimed_epsilon=spec.claimed_epsilon, delta=spec.delta,
                         relation=spec.relation, trials=trials, key=key,
                         confidence=confidence, name=spec.name, thresholds=spec.thresholds)


def build(name: str, relation: str, broken: str | None = None, **kwargs) -> AuditSpec:
  """The :class:`AuditSpec` of a registered audit (:data:`AUDITS`): a stage mechanism, an MF
  stage or a driver.

  Args:
    name: the audit's registered name.
    relation: the neighbouring relation to audit under.
    broken: a broken twin's name (default none: the real mechanism).
    **kwargs: the builder's own keyword arguments.

  Returns:
    The :class:`AuditSpec` (ValueError: an unknown ``name``, relation or broken twin).
  """
  if name not in AUDITS:
    raise ValueError(f"name must be one of {tuple(AUDITS)}, got {name!r}")
  return AUDITS[name][0](relation, broken, **kwargs)
