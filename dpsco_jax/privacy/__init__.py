"""Privacy pillar: noise samplers, closed-form calibrations, and the accountant ledger."""

from dpsco_jax.privacy.ledger import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport,
                                      PureDpEvent,
                                      Provenance, calibrate_noise_multiplier, epsilon_of,
                                      pure_dp_event)
from dpsco_jax.privacy.mechanisms import (gaussian_sigma_analytic, gaussian_sigma_classic,
                                          laplace)
