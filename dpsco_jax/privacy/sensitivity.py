"""Sensitivity travels with its stage; the one place a Gaussian noise std is formed.

Every noise-adding stage of the library is built from a :class:`GaussianStage`: the noise
multiplier ``z`` and the :class:`Sensitivity` of what the stage perturbs (a clipped mean's
``C / D``, FILTER's coupled shift, an output-perturbation minimizer's ``2G/(mu n)``). Its
standard deviation is :func:`gaussian_noise_std` (``z`` times the sensitivity), computed here
and nowhere else, so no driver multiplies by 2 for replace-one or re-derives a sensitivity by
hand (``tests/test_sensitivity_stages.py`` greps the drivers for it).

Convention (:mod:`dpsco_jax.privacy.relations`): a :class:`Sensitivity` is stored in the
accountant's unit, the *add/remove-equivalent* bound (``C / D`` for a mean of sums clipped at
``C``); :meth:`Sensitivity.under` gives the bound under a relation (replace-one: twice it, by
:func:`~dpsco_jax.privacy.relations.gaussian_sensitivity_factor`, the one place the factor is
coded). The noise std is ``z`` times the add/remove-equivalent bound under *every* relation:
the accountant, told the relation, prices the doubled shift of replace-one itself. A bound a
paper states under replace-one (a shift ``Delta`` between two datasets of the same size)
enters through :meth:`Sensitivity.from_replace_one` (``Delta / 2``).

The bound is kept as a numerator and a denominator, and the std is formed as
``z * bound / denominator`` (left to right), which is the float arithmetic every driver used
before this module: moving the formula here changed no released number.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpsco_jax._checks import check_nonnegative, check_positive
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
    """A bound a paper states under replace-one (``Delta``, the largest shift between two
    datasets of the same size that differ in one user): its add/remove-equivalent is
    ``Delta / 2``, the unit the accountant doubles back under replace-one.

    Args:
      shift: the replace-one bound ``Delta``, >= 0.
      what: a description of the bound (for reports).

    Returns:
      The :class:`Sensitivity` of bound ``Delta / 2``.

    Raises:
      ValueError: ``shift`` is negative or not finite.
    """
    check_nonnegative(shift, "replace-one shift")
    return cls(shift / gaussian_sensitivity_factor("replace_one"), 1.0, what)

  @property
  def value(self) -> float:
    """The add/remove-equivalent bound ``bound / denominator`` (the std's unit)."""
    return self.bound / self.denominator

  def under(self, relation: str) -> float:
    """The L2 bound under ``relation``: ``C / D`` under add/remove and zero-out, ``2 C / D``
    under replace-one (the paper formulas' ``Delta``). The factor multiplies the quotient: a
    power of two, so it is exact, and no intermediate ``2 C`` can overflow.

    Args:
      relation: ``add_remove``, ``replace_one`` or ``zero_out``.

    Returns:
      The L2 bound, a float.

    Raises:
      ValueError: an unknown relation.
    """
    return gaussian_sensitivity_factor(check_relation(relation)) * self.value


def clipped_mean_sensitivity(clip_norm: float, denominator: float = 1.0) -> Sensitivity:
  """The stage ``clip_per_user(C) -> aggregate(mean, D)`` (or ``sum``, ``D = 1``): ``C / D``
  (:func:`dpsco_jax.transforms.clipping.aggregation_sensitivity` under add/remove, kept as a
  numerator and a denominator).

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

  ``z`` is the library's noise multiplier (``sigma / C`` with ``C`` the add/remove-equivalent
  sensitivity; the accountant applies the relation). A ``z`` of 0 (a non-private reference
  run) gives 0.

  Args:
    noise_multiplier: ``z``.
    sensitivity: the stage's :class:`Sensitivity`.

  Returns:
    The noise std, in the units of what the stage perturbs.

  Raises:
    TypeError: ``sensitivity`` is not a :class:`Sensitivity`.
  """
  if not isinstance(sensitivity, Sensitivity):
    raise TypeError(f"sensitivity must be a Sensitivity (the stage's own), got "
                    f"{type(sensitivity).__name__}")
  return noise_multiplier * sensitivity.bound / sensitivity.denominator


def noise_multiplier_for_std(std: float, sensitivity: Sensitivity) -> float:
  """The inverse of :func:`gaussian_noise_std`: the ``z`` of a std a paper prescribes (its
  own closed-form sigma), whose epsilon the accountant then reports. Formed as
  ``std * denominator / bound`` (the float order the presets used).

  Args:
    std: the prescribed noise std.
    sensitivity: the stage's :class:`Sensitivity`.

  Returns:
    The noise multiplier ``z``.

  Raises:
    TypeError: ``sensitivity`` is not a :class:`Sensitivity`.
  """
  if not isinstance(sensitivity, Sensitivity):
    raise TypeError(f"sensitivity must be a Sensitivity (the stage's own), got "
                    f"{type(sensitivity).__name__}")
  return std * sensitivity.denominator / sensitivity.bound


@dataclasses.dataclass(frozen=True)
class GaussianStage:
  """One Gaussian noise stage: its multiplier and the sensitivity of what it perturbs.

  ``std`` is :func:`gaussian_noise_std`; a driver builds its noise transform from ``std`` and
  never from ``z`` and a clip of its own. ``name`` says which stage (``"step"``,
  ``"outer"``, ``"phase 2"``).

  Attributes:
    noise_multiplier: ``z``, the stage's noise multiplier.
    sensitivity: the :class:`Sensitivity` of what the stage perturbs.
    name: the stage's name (default ``"gaussian"``).
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

    Raises:
      ValueError: an unknown relation.
    """
    return self.sensitivity.under(relation)


# ------------------------------------------------------ adaptive clipping: the pair's split

#: Add/remove sensitivity of the centred count ``sum_i (b_i - 1/2)`` of unclipped users
#: (Andrew et al. 2021, §3): adding or removing one user moves it by 1/2.
COUNT_SENSITIVITY = 0.5


@dataclasses.dataclass(frozen=True)
class AdaptiveClipSplit:
  """How adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
  Learning with Adaptive Clipping", NeurIPS 2021, Algorithm 1 and Theorem 1) shares one
  Gaussian mechanism of multiplier ``z`` between its two releases of a step:

  * the clipped sum, sensitivity ``C_t``, noise ``z_Delta C_t`` (:meth:`sum_stage`);
  * the centred count of unclipped users ``sum_i (b_i - 1/2)``, sensitivity ``1/2``, noise
    ``sigma_b`` (:meth:`count_stage`: multiplier ``2 sigma_b``).

  With ``z_Delta^-2 + (2 sigma_b)^-2 = z^-2`` the pair is one Gaussian mechanism of multiplier
  ``z`` on the stacked vector (its whitened shift is ``sqrt(z_Delta^-2 + (2 sigma_b)^-2)``
  under add/remove, twice that under replace-one), so the step's event is DP-SGD's at ``z``.
  Build it with :func:`adaptive_clip_split`.

  Attributes:
    noise_multiplier: ``z``, the pair's multiplier (what the accountant prices).
    sum_multiplier: ``z_Delta``, the clipped sum's multiplier.
    count_stddev: ``sigma_b``, the count's std (in users).
  """
  noise_multiplier: float   # z: the pair's, what the accountant prices
  sum_multiplier: float     # z_Delta: the clipped sum's
  count_stddev: float       # sigma_b: the count's std (in users)

  @property
  def count_multiplier(self) -> float:
    """``2 sigma_b``: the count's multiplier on its sensitivity 1/2."""
    return self.count_stddev / COUNT_SENSITIVITY

  def sum_stage(self, clip_norm: Any, denominator: float = 1.0) -> "GaussianStage":
    """The sum's stage at the current clip norm ``C_t`` (a float or a traced scalar): std
    ``z_Delta C_t / D``.

    Args:
      clip_norm: ``C_t``, the current clip norm.
      denominator: ``D``, the mean's denominator (default 1).

    Returns:
      The sum's :class:`GaussianStage`.
    """
    return GaussianStage(self.sum_multiplier, clipped_mean_sensitivity(clip_norm, denominator),
                         "adaptive clipped sum")

  def count_stage(self) -> "GaussianStage":
    """The centred count's stage: std ``sigma_b``.

    Returns:
      The count's :class:`GaussianStage` (sensitivity 1/2).
    """
    return GaussianStage(self.count_multiplier,
                         Sensitivity(COUNT_SENSITIVITY, 1.0, "centred unclipped count"),
                         "adaptive count")


def adaptive_clip_split(noise_multiplier: float, count_stddev: float) -> AdaptiveClipSplit:
  """The sum's multiplier ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021,
  Theorem 1) for the pair's ``z`` and the count's std ``sigma_b``.

  ``z = 0`` (a non-private reference) gives ``z_Delta = 0``. Otherwise ``2 sigma_b`` must
  exceed ``z``: the count alone would spend more than the whole budget and ``z_Delta`` would
  be imaginary, so such a ``count_stddev`` is refused, naming it.

  Args:
    noise_multiplier: ``z``, the step's multiplier, >= 0.
    count_stddev: ``sigma_b``, the count's noise std in users, >= 0.

  Returns:
    The :class:`AdaptiveClipSplit`.

  Raises:
    ValueError: a negative argument, or ``2 count_stddev <= noise_multiplier`` with ``z > 0``.
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
