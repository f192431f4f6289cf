"""Privacy pillar: noise samplers, closed-form calibrations, and the accountant ledger."""

from dpsco_jax.privacy.ledger import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport,
                                      PureDpEvent,
                                      Provenance, calibrate_noise_multiplier, epsilon_of,
                                      pure_dp_event)
from dpsco_jax.privacy.mechanisms import (gaussian_sigma_analytic, gaussian_sigma_classic,
                                          laplace)
from dpsco_jax.privacy.approx_rdp import ApproxRdpLedger
from dpsco_jax.privacy.discrete_laplace import tdlap_pmf, tdlap_sample
from dpsco_jax.privacy.ledger import for_accountant
from dpsco_jax.privacy.sparse_vector import (above_threshold_init, above_threshold_step,
                                             laplace_test)
