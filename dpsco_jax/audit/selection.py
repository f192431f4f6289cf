"""Canary audit of private selection (best of ``K`` runs), with a broken twin.

The candidate is a Gaussian count (1 on ``D``, 0 on ``D'``, add/remove), run ``K ~ law`` times
and the best output released: ``K`` from the law's float32 CDF table (a tail below ~6e-8 cut),
the maximum as ``Phi^-1(U^(1/K))``. Honest claim:
:func:`~dpsco_jax.privacy.selection.selection_report` (Theorem 2); twin ``cost_left_out``
claims one candidate's epsilon. ``delta = 0.1`` lets the twin show at ~5e4 trials.
"""

from __future__ import annotations

import dp_accounting
import jax
import jax.numpy as jnp

from dpsco_jax.audit.canary import check_broken
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
  """Best-of-``K`` over a Gaussian count; ``broken``: ``None`` or ``cost_left_out``."""
  check_broken(broken, BROKEN)
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
