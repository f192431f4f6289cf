"""Empirical privacy auditing: canaries, neighbouring datasets, lower bounds, broken twins.

``audit_mechanism`` audits any ``release(key, dataset) -> per-step releases`` and returns an
:class:`AuditResult`; ``build_driver`` (``harness.build``) gives the ready spec of any
registered stage or driver audit, or of its broken twins; ``python -m dpsco_jax audit`` prints
the table.
"""

from dpsco_jax.audit.bounds import (clopper_pearson_upper, epsilon_lower_bound, gdp_epsilon,
                                    gdp_mu_lower_bound)
from dpsco_jax.audit.canary import RELATIONS, UserBatch, dirac_canary, neighbouring_pair
from dpsco_jax.audit.drivers import DRIVERS, build_driver
from dpsco_jax.audit.harness import (AuditResult, AuditSpec, audit_mechanism, run_audit,
                                     sample_scores)
from dpsco_jax.audit import matrix_factorization, numerics  # noqa: F401  (register their audits)

__all__ = [
    "AuditResult", "AuditSpec", "DRIVERS", "RELATIONS", "UserBatch", "audit_mechanism",
    "build_driver",
    "clopper_pearson_upper", "dirac_canary", "epsilon_lower_bound", "gdp_epsilon",
    "gdp_mu_lower_bound", "neighbouring_pair", "run_audit", "sample_scores",
]
