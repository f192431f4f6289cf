"""Sensitivity travels with its stage; the one place a Gaussian noise std is formed.

Every noise-adding stage is a :class:`GaussianStage`: the noise multiplier ``z`` and the
:class:`Sensitivity` of what it perturbs (a clipped mean's ``C / D``, FILTER's coupled shift, an
output-perturbation minimizer's ``2G/(mu n)``), stored in the accountant's add/remove-equivalent
unit under *every* relation (the accountant prices replace-one's doubled shift itself:
:mod:`dpsco_jax.privacy.relations`). Its std is :func:`gaussian_noise_std`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpsco_jax._checks import _traced, check_nonnegative, check_positive
from dpsco_jax.privacy.relations import check_relation, gaussian_sensitivity_factor

__all__ = ["Sensitivity", "GaussianStage", "gaussian_noise_std", "noise_multiplier_for_std",
           "clipped_mean_sensitivity", "AdaptiveClipSplit", "adaptive_clip_split"]


@dataclasses.dataclass(frozen=True)
class Sensitivity:
  """The L2 sensitivity a stage declares, in the accountant's (add/remove) unit.

  Attributes:
    bound: the numerator (the clip ``C`` of a clipped sum, or a whole bound).
    denominator: the public, data-independent divisor of a mean (1 for a sum).
    what: a short description for reports (``"clipped mean C/D"``).
  """
  bound: float
  denominator: float = 1.0
  what: str = ""

  def __post_init__(self):
    check_nonnegative(self.bound, "sensitivity bound")
    check_positive(self.denominator, "sensitivity denominator")

  @classmethod
  def from_replace_one(cls, shift: float, what: str = "") -> "Sensitivity":
    """A bound ``Delta`` a paper states under replace-one, as its add/remove-equivalent.

    Args:
      shift: ``Delta``, the largest shift between two same-size datasets that differ in one
        user, >= 0.
      what: a description of the bound (for reports).

    Returns:
      The :class:`Sensitivity` of bound ``Delta / 2`` (the accountant doubles it back).
    """
    check_nonnegative(shift, "replace-one shift")
    return cls(shift / gaussian_sensitivity_factor("replace_one"), 1.0, what)

  @property
  def value(self) -> float:
    """The add/remove-equivalent bound ``bound / denominator`` (the std's unit)."""
    return self.bound / self.denominator

  def under(self, relation: str) -> float:
    """The L2 bound under ``relation``.

    Args:
      relation: ``add_remove``, ``replace_one`` or ``zero_out``.

    Returns:
      ``C / D``, or ``2 C / D`` under replace-one (the factor multiplies the quotient: exact).
    """
    return gaussian_sensitivity_factor(check_relation(relation)) * self.value


def clipped_mean_sensitivity(clip_norm: float, denominator: float = 1.0) -> Sensitivity:
  """The sensitivity ``C / D`` of ``clip_per_user(C) -> aggregate(mean, D)`` (sum: ``D = 1``).

  Args:
    clip_norm: ``C``, the per-user clip norm.
    denominator: ``D``, the mean's denominator (default 1: a sum).

  Returns:
    The stage's :class:`Sensitivity`.
  """
  return Sensitivity(clip_norm, denominator,
                     "clipped sum C" if denominator == 1 else "clipped mean C/D")


def gaussian_noise_std(noise_multiplier: float, sensitivity: Sensitivity) -> float:
  """The one place a Gaussian noise std is formed: ``z * bound / denominator``.

  Args:
    noise_multiplier: ``z`` (``sigma / C``, ``C`` the add/remove-equivalent sensitivity; 0 for
      a non-private reference run).
    sensitivity: the stage's :class:`Sensitivity`.

  Returns:
    The noise std, in the units of what the stage perturbs.
  """
  _check_sensitivity(sensitivity)
  z = check_nonnegative(noise_multiplier, "noise_multiplier")   # a traced z passes as it is
  bound, denominator = _wide(sensitivity)
  return z * bound / denominator


def _wide(sensitivity: Sensitivity) -> tuple[Any, Any]:
  """The bound and denominator as python floats where concrete: a product of float16 /
  bfloat16 numbers rounds the std (by up to 0.4%) below ``z C / D``. Traced ones (a clip norm
  of a jitted step) pass as they are."""
  return tuple(x if _traced(x) else float(x)
               for x in (sensitivity.bound, sensitivity.denominator))


def _check_sensitivity(sensitivity: Any) -> None:
  if not isinstance(sensitivity, Sensitivity):
    raise TypeError(f"sensitivity must be a Sensitivity (the stage's own), got "
                    f"{type(sensitivity).__name__}")


def noise_multiplier_for_std(std: float, sensitivity: Sensitivity) -> float:
  """The ``z`` of a std a paper prescribes, whose epsilon the accountant then reports.

  Args:
    std: the prescribed noise std.
    sensitivity: the stage's :class:`Sensitivity`.

  Returns:
    ``std * denominator / bound``.
  """
  _check_sensitivity(sensitivity)
  std = check_nonnegative(std, "std")
  bound, denominator = _wide(sensitivity)
  if bound == 0:
    raise ValueError(f"sensitivity bound 0 ({sensitivity.what or 'a constant release'}): no "
                     "noise multiplier corresponds to a std, the release needs no noise")
  return std * denominator / bound


@dataclasses.dataclass(frozen=True)
class GaussianStage:
  """One Gaussian noise stage; a driver builds its noise from ``std``, never from a clip.

  Attributes:
    noise_multiplier: ``z``, the stage's noise multiplier.
    sensitivity: the :class:`Sensitivity` of what the stage perturbs.
    name: the stage's name (default ``"gaussian"``; e.g. ``"step"``, ``"phase 2"``).
  """
  noise_multiplier: float
  sensitivity: Sensitivity
  name: str = "gaussian"

  @property
  def std(self) -> float:
    return gaussian_noise_std(self.noise_multiplier, self.sensitivity)

  def sensitivity_under(self, relation: str) -> float:
    """The stage's L2 sensitivity under ``relation`` (:meth:`Sensitivity.under`).

    Args:
      relation: ``add_remove``, ``replace_one`` or ``zero_out``.

    Returns:
      The sensitivity, a float.
    """
    return self.sensitivity.under(relation)


#: Add/remove sensitivity of the centred count ``sum_i (b_i - 1/2)`` of unclipped users
#: (Andrew et al. 2021, §3): adding or removing one user moves it by 1/2.
COUNT_SENSITIVITY = 0.5


@dataclasses.dataclass(frozen=True)
class AdaptiveClipSplit:
  """How adaptive clipping shares one Gaussian mechanism of multiplier ``z`` between a step's
  two releases (Andrew et al., NeurIPS 2021, Algorithm 1 and Theorem 1): the clipped sum
  (sensitivity ``C_t``, noise ``z_Delta C_t``) and the centred count of unclipped users
  (sensitivity ``1/2``, noise ``sigma_b``). With ``z_Delta^-2 + (2 sigma_b)^-2 = z^-2`` the pair
  is one Gaussian mechanism of multiplier ``z``: the step's event is DP-SGD's at ``z``.

  Attributes:
    noise_multiplier: ``z``, the pair's multiplier (what the accountant prices).
    sum_multiplier: ``z_Delta``, the clipped sum's multiplier.
    count_stddev: ``sigma_b``, the count's std (in users).
  """
  noise_multiplier: float
  sum_multiplier: float
  count_stddev: float

  @property
  def count_multiplier(self) -> float:
    """``2 sigma_b``: the count's multiplier on its sensitivity 1/2."""
    return self.count_stddev / COUNT_SENSITIVITY

  def sum_stage(self, clip_norm: Any, denominator: float = 1.0) -> "GaussianStage":
    """The sum's stage at the current clip norm: std ``z_Delta C_t / D``.

    Args:
      clip_norm: ``C_t``, the current clip norm (a float or a traced scalar).
      denominator: ``D``, the mean's denominator (default 1).

    Returns:
      The sum's :class:`GaussianStage`.
    """
    return GaussianStage(self.sum_multiplier, clipped_mean_sensitivity(clip_norm, denominator),
                         "adaptive clipped sum")

  def count_stage(self) -> "GaussianStage":
    """Returns:
      The centred count's :class:`GaussianStage`: sensitivity 1/2, std ``sigma_b``.
    """
    return GaussianStage(self.count_multiplier,
                         Sensitivity(COUNT_SENSITIVITY, 1.0, "centred unclipped count"),
                         "adaptive count")


def adaptive_clip_split(noise_multiplier: float, count_stddev: float) -> AdaptiveClipSplit:
  """The split with ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al., Theorem 1).

  Args:
    noise_multiplier: ``z``, the step's multiplier, >= 0 (0, a non-private reference, gives
      ``z_Delta = 0``).
    count_stddev: ``sigma_b``, the count's noise std in users, >= 0.

  Returns:
    The :class:`AdaptiveClipSplit`.

  Raises:
    ValueError: ``2 sigma_b <= z`` with ``z > 0`` (the count alone would spend the budget).
  """
  z = check_nonnegative(noise_multiplier, "noise_multiplier")
  sigma_b = check_nonnegative(count_stddev, "count_stddev")
  if z == 0:
    return AdaptiveClipSplit(0.0, 0.0, sigma_b)
  if not 2.0 * sigma_b > z:
    raise ValueError(f"count_stddev={count_stddev!r} is too small for noise_multiplier "
                     f"z={z:.4g}: adaptive clipping needs 2 count_stddev > z (the count's "
                     "multiplier 2 sigma_b and the sum's z_Delta share z: z_Delta = "
                     "(z^-2 - (2 sigma_b)^-2)^(-1/2) would be imaginary); raise count_stddev "
                     "(the paper suggests D / 20)")
  ratio = z / (2.0 * sigma_b)
  return AdaptiveClipSplit(z, z / math.sqrt((1.0 - ratio) * (1.0 + ratio)), sigma_b)
