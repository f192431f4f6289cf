"""What every algorithm driver returns."""

from __future__ import annotations

import dataclasses
from typing import Any

from dpsco_jax.privacy.ledger import PrivacyReport


@dataclasses.dataclass
class Result:
  """A released model and the guarantee that covers it.

  Attributes:
    params: the released parameters (the only data-dependent output).
    privacy: the (epsilon, delta) guarantee and its provenance.
    gradient_evaluations: per-item gradient evaluations spent (a compute measure).
    record: extra JSON-serializable, data-independent fields for the runner's records
      (e.g. ``num_steps``, calibrated noise multipliers).
    debug: data-dependent diagnostics (kept counts, scores, norms, certificate flags). They are
      NOT covered by the privacy guarantee, so drivers fill this only when the config sets
      ``debug: true``; otherwise it is None.
  """
  params: Any
  privacy: PrivacyReport
  gradient_evaluations: int
  record: dict = dataclasses.field(default_factory=dict)
  debug: dict | None = None
