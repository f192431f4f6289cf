"""Canary audit of private selection (best of ``K`` runs), with a broken twin.

The candidate ``Q`` is the simplest private run: a count released with Gaussian noise
(sensitivity 1, add/remove: ``D`` holds the canary, count 1; ``D'`` does not, count 0). The
selection runs ``Q`` ``K ~ law`` times on the same dataset and releases the best output, the
score being the output itself (a public score: it reads nothing but the output). The audit's
test statistic is the released maximum. ``K`` is drawn inside the jitted release by inverting
the law's CDF (:meth:`~dpsco_jax.privacy.selection.SelectionLaw.cdf_table`, float32: a tail
of mass below ~6e-8 is cut, immaterial at the audit's trial counts) and the maximum of ``K``
i.i.d. Gaussians exactly, as ``Phi^-1(U^(1/K))``.

* honest: the claim is the library's guarantee of training and selection
  (:func:`~dpsco_jax.privacy.selection.selection_report`, Theorem 2);
* ``cost_left_out``: the same release, its report claiming one candidate's epsilon only (a
  selection whose cost was not accounted). The best of ``K`` moves the low tail of the maximum
  much further than one run moves it, so the audit's lower bound exceeds that claim.

Defaults (``sigma = 1``, geometric ``gamma = 0.1``, ``delta = 0.1``): a large delta keeps the
claims small enough that the twin's violation shows at ~5e4 trials per side (seconds on a CPU).
"""

from __future__ import annotations

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.audit.harness import AuditSpec
from dpsco_jax.privacy.ledger import epsilon_of
from dpsco_jax.privacy.selection import SelectionLaw, selection_report

__all__ = ["BROKEN", "selection_audit"]

BROKEN = ("cost_left_out",)


def _release(law: SelectionLaw, sigma: float):
  cdf = jnp.asarray(law.cdf_table(), jnp.float32)

  def release(key, data):
    k_key, u_key = jax.random.split(key)
    k = jnp.searchsorted(cdf, jax.random.uniform(k_key), side="right") + 1
    u = jax.random.uniform(u_key, minval=jnp.finfo(jnp.float32).tiny)
    tail = -jnp.expm1(jnp.log(u) / k)       # 1 - U^(1/K), accurate when it is tiny
    return data["count"] + sigma * -jax.scipy.special.ndtri(tail)
  return release


def selection_audit(broken: str | None = None, *, law: SelectionLaw | None = None,
                    sigma: float = 1.0, delta: float = 0.1) -> AuditSpec:
  """The audit spec of best-of-``K`` over a Gaussian count (module docstring); ``broken``:
  ``None`` (honest claim) or ``cost_left_out`` (one candidate's epsilon claimed)."""
  if broken is not None and broken not in BROKEN:
    raise ValueError(f"broken must be None or one of {BROKEN}, got {broken!r}")
  law = law if law is not None else SelectionLaw("geometric", 0.1, 1.0)
  event = dp_accounting.GaussianDpEvent(sigma)
  if broken is None:
    claim, source = selection_report(law, [event], delta=delta).epsilon, "selection_report"
  else:
    claim, source = epsilon_of(event, delta=delta), "epsilon_of(one candidate)"
  d_in = {"count": jnp.float32(1.0)}
  d_out = {"count": jnp.float32(0.0)}
  return AuditSpec(f"private_selection[{broken or 'honest'}]", "add_remove",
                   _release(law, sigma), d_in, d_out, lambda r: r, float(claim), delta,
                   f"{source} of Gaussian(z={sigma:g}), {law.distribution}"
                   f"(gamma={law.gamma:g})")
