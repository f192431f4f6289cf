"""Privacy pillar: relations, events, the one ledger, the one calibrator, noise samplers.

Everything that composes, converts or calibrates privacy lives here; drivers build events and
spend them.
"""

from dpsco_jax.privacy.relations import (PUBLIC, RELATIONS, check_relation,
                                         gaussian_sensitivity_factor)
from dpsco_jax.privacy.events import (ApproxDpEvent, ApproxRdpEvent, PureDpEvent,
                                      event_from_json, event_to_json, for_accountant,
                                      pure_dp_event, validate_event)
from dpsco_jax.privacy.ledger import (LedgerIntegrityError, PrivacyBudgetExceeded,
                                      PrivacyLedger, PrivacyReport, Provenance, epsilon_of)
from dpsco_jax.privacy.calibrate import (calibrate_noise_multiplier, calibrate_poisson_sgd,
                                        ledger_epsilon)
from dpsco_jax.privacy.group import GroupPrivacy, group_privacy_epsilon
from dpsco_jax.privacy.mechanisms import (gaussian_sigma_analytic, gaussian_sigma_classic,
                                          laplace)
from dpsco_jax.privacy.discrete_laplace import tdlap_pmf, tdlap_sample
from dpsco_jax.privacy.sparse_vector import (above_threshold_init, above_threshold_step,
                                             laplace_test)
from dpsco_jax.privacy.matrix_factorization import mf_event, participation_sensitivity
from dpsco_jax.privacy.sensitivity import (GaussianStage, Sensitivity, clipped_mean_sensitivity,
                                           gaussian_noise_std, noise_multiplier_for_std)
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit, adaptive_clip_split
from dpsco_jax.privacy.selection import SelectionLaw, selection_cost, selection_report
