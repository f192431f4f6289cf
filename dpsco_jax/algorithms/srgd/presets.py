"""Paper 003 presets: the paper's own parameters (``theory``) and a laptop-scale schedule.

Choquette-Choo, Ganesh, Thakurta (2024); spec 003 §2.3 and §7.4. A preset maps the public
facts (``n``, ``p``, ``L``, ``M``, ``R``) to ``(T, B)``, ``beta`` and the clip ``C``, without
data. ``theory`` also carries the paper's node noise (Cor. 5.7 / 5.11), whose privacy the plan
then *accounts* (:mod:`dpsco_jax.algorithms.srgd.plan`)."""

from __future__ import annotations

import dataclasses
import math

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_positive)
from dpsco_jax.privacy.sensitivity import clipped_mean_sensitivity, noise_multiplier_for_std

VARIANTS = ("interior", "constrained")
PRESETS = ("practical", "theory")


@dataclasses.dataclass(frozen=True)
class SRGDParams:
  """Every number a run needs (all public). ``noise_multiplier`` ``z``: node (or step) std
  ``z C / B``, ``None`` until the plan calibrates it; ``paper``: the theory preset's own
  formulas; ``num_steps``: the whole run's ``T``, ``epochs`` passes of ``period`` steps."""
  num_steps: int
  batch_size: int
  beta: float
  clip_norm: float
  noise_multiplier: float | None
  preset: str
  variant: str | None = None
  paper: dict | None = None
  epochs: int = 1

  @property
  def period(self) -> int:
    """Steps per epoch ``P``: an example's consecutive participations are ``P`` apart."""
    return self.num_steps // self.epochs


def interior_c_dp(n: int, delta: float) -> float:
  """``c_DP = 4 sqrt2 log2^{3/2}(n) sqrt(ln(2n/delta)) ln(2.5/delta)`` (Eq. 19; log2 for the
  paper's ``log``, ln where it writes ``ln``, AMBIG-6). Eq. (19) then sets
  ``T = c_DP n^{1/4}``, which exceeds n for every practical n (spec §2.3 table)."""
  n = check_int(n, "n", minimum=2)
  delta = check_delta(delta)
  return (4 * math.sqrt(2) * math.log2(n) ** 1.5 * math.sqrt(math.log(2 * n / delta))
          * math.log(2.5 / delta))


def _interior(n: int, p: int, L: float, R: float, eps: float, delta: float,
              batch_size: int | None, where: str) -> tuple[int, int, float, float, float, dict]:
  """Eq. (19) / Cor. 5.7 / Thm 5.8 (x-dagger in C)."""
  if batch_size is not None:
    raise ValueError(f"{where}: batch_size is fixed by Eq. (19) (B = n/T); leave it unset")
  if delta > 1.0 / n:
    raise ValueError(f"{where} (Thm 5.8): needs delta <= 1/n = {1 / n:.3g}, got "
                     f"delta={delta:g}")
  if p > eps ** 2 * n ** 2:
    raise ValueError(f"{where} (Thm 5.8): needs p <= eps^2 n^2 = {eps ** 2 * n ** 2:.3g}, "
                     f"got p={p}")
  c_dp = interior_c_dp(n, delta)
  T = math.ceil(c_dp * n ** 0.25)
  if T > n:
    raise ValueError(
        f"{where} (Eq. 19): T = c_DP n^(1/4) = {T:.3g} exceeds n = {n} (c_DP = {c_dp:.3g}), "
        f"so the batch size n/T < 1 and the single-epoch schedule does not exist — the "
        f"paper's constants are vacuous at this n (spec 003 §2.3); use preset='practical'")
  B = n // T
  ln25 = math.log(2.5 / delta)
  beta = c_dp ** 2 * L * max(1.0, math.sqrt(p) / (eps * math.sqrt(n))) / R   # Eq. (19)
  clip = c_dp * L                                                             # Cor. 5.7 proof
  node_std = c_dp * L * math.sqrt(max(math.log2(T), 1.0) * ln25) / (eps * B)  # Cor. 5.7 x beta
  paper = dict(c_DP=c_dp, sigma_b_units=node_std / beta,
               b_max=c_dp ** 2 * L * math.sqrt(p) / (eps * B * beta),       # Lemma 5.4
               mu_paper=eps / math.sqrt(2 * ln25), reference="Eq. (19), Cor. 5.7, Thm 5.8")
  return T, B, beta, clip, node_std, paper


def _constrained(n: int, p: int, L: float, M: float, R: float, eps: float, delta: float,
                 batch_size: int | None, where: str
                 ) -> tuple[int, int, float, float, float, dict]:
  """Thm 5.12 / Cor. 5.10-5.11 (no assumption on x-dagger), ``c_M = M R / L``."""
  c_m = M * R / L
  B = math.isqrt(n) if batch_size is None else check_int(batch_size, "batch_size")
  if B > math.sqrt(n):
    raise ValueError(f"{where} (Thm 5.12): needs batch_size <= sqrt(n) = "
                     f"{math.sqrt(n):.4g}, got {B}")
  T = n // B
  if T < 2:
    raise ValueError(f"{where} (Lemma 5.6): needs T = n/B >= 2, got T={T}")
  ln25 = math.log(2.5 / delta)
  beta = (16 * c_m + 8) * L * n ** 1.5 / (R * B ** 2)                       # Thm 5.12
  clip = (8 * c_m + 4) * L                                                  # Cor. 5.10
  log_t = math.log2(T)
  node_std = (16 * math.sqrt(2) * c_m + 8 * math.sqrt(2)) * L * math.sqrt(  # Cor. 5.11 x beta
      log_t * ln25) / (eps * B)
  p_max = (B ** 2 * beta ** 2 * eps ** 2
           / (32 * M ** 2 * log_t ** 3 * math.log(2 * T / delta) * ln25))   # Cor. 5.10
  if p > p_max:
    raise ValueError(
        f"{where} (Cor. 5.10/5.11): needs p <= B^2 beta^2 eps^2/(32 M^2 log^3 T ln(2T/delta) "
        f"ln(2.5/delta)) = {p_max:.3g}, got p={p}; the guarantee is vacuous here")
  paper = dict(c_M=c_m, sigma_b_units=node_std / beta, p_max=p_max,
               mu_paper=eps / math.sqrt(2 * ln25), reference="Thm 5.12, Cor. 5.10-5.11")
  return T, B, beta, clip, node_std, paper


def theory_params(n: int, p: int, *, lipschitz: float, smoothness: float, radius: float,
                  epsilon: float, delta: float, variant: str = "constrained",
                  batch_size: int | None = None) -> SRGDParams:
  """The paper's parameters, exactly, with its preconditions checked: ``variant="interior"``
  is Eq. (19) / Cor. 5.7 / Thm 5.8 (needs x-dagger in C, delta <= 1/n, p <= eps^2 n^2; clip
  ``c_DP L``, Lemma 5.5), ``variant="constrained"`` Thm 5.12 / Cor. 5.10-5.11 with
  ``c_M = M R / L`` (``B <= sqrt n``, default ``floor(sqrt n)``; clip ``(8 c_M + 4) L``,
  Lemma 5.9; its dimension condition). The paper's node std (its sigma times beta) becomes the
  multiplier ``z = node_std B / clip``; its (epsilon, delta) comes from the accountant, not
  the paper's classical conversion (which needs eps <= 1; AMBIG-7).

  Raises:
    ValueError: naming the violated condition when the setting is vacuous or outside the
      theorem (variant "interior" is vacuous for every practical n)."""
  n = check_int(n, "n", minimum=2)
  p = check_int(p, "p", minimum=1)
  L = check_positive(lipschitz, "lipschitz")
  M = check_positive(smoothness, "smoothness")
  R = check_positive(radius, "radius")
  eps = check_epsilon(epsilon)
  delta = check_delta(delta)
  check_choice(variant, "variant", VARIANTS)
  where = "theory preset, variant " + repr(variant)
  if variant == "interior":
    T, B, beta, clip, node_std, paper = _interior(n, p, L, R, eps, delta, batch_size, where)
    paper["c_M"] = M * R / L
  else:
    T, B, beta, clip, node_std, paper = _constrained(n, p, L, M, R, eps, delta, batch_size,
                                                     where)
  # the library's multiplier of the paper's node std on the increment's sensitivity C/B
  z = noise_multiplier_for_std(node_std, clipped_mean_sensitivity(clip, B))
  paper.update(T=T, B=B, beta=beta, clip=clip, sigma_node=node_std, noise_multiplier=z)
  return SRGDParams(num_steps=T, batch_size=B, beta=beta, clip_norm=clip, noise_multiplier=z,
                    preset="theory", variant=variant, paper=paper)


def practical_params(n: int, *, smoothness: float, clip_norm: float,
                     batch_size: int | None = None, num_steps: int | None = None,
                     beta: float | None = None, beta_scale: float = 1.0,
                     epochs: int = 1) -> SRGDParams:
  """The laptop-scale schedule (spec §7.4): ``B = floor(sqrt n)``, ``T = floor(n/B)``,
  ``beta = M max(1, beta_scale T)`` unless given (Thm 5.1 needs ``beta >= M``). With
  ``epochs = k > 1`` (outside paper 003) ``num_steps`` is one epoch's ``P`` and ``T = k P``.
  The noise multiplier is left to the plan."""
  n = check_int(n, "n", minimum=1)
  B = math.isqrt(n) if batch_size is None else check_int(batch_size, "batch_size")
  T = n // B if num_steps is None else check_int(num_steps, "num_steps")
  if T * B > n:
    raise ValueError(f"num_steps * batch_size = {T * B} exceeds n = {n}: a single epoch "
                     f"uses every example at most once")
  if T < 1:
    raise ValueError(f"batch_size={B} leaves no full batch of n={n} examples")
  epochs = check_int(epochs, "epochs")
  T *= epochs   # one period per epoch; epochs = 1 leaves T as it was
  if beta is None:
    # Thm 5.1 needs beta >= M whatever the scale: floor it there (matters for small T).
    M = check_positive(smoothness, "smoothness")
    beta = M * max(1.0, check_positive(beta_scale, "beta_scale") * T)
  beta = check_positive(beta, "beta")
  clip = check_positive(clip_norm, "clip_norm")
  return SRGDParams(num_steps=T, batch_size=B, beta=beta, clip_norm=clip,
                    noise_multiplier=None, preset="practical", epochs=epochs)
