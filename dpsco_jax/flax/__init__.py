"""Flax nnx integration: fast exact per-user clipping and a DP training helper."""

from dpsco_jax.flax.fast_clip import ClipInfo, FastClippedGrad, FastClipPlan

__all__ = ["ClipInfo", "FastClippedGrad", "FastClipPlan"]
from dpsco_jax.flax.trainer import (DPTrainer, TrainState, ledger_from_json,  # noqa: E402
                                    ledger_to_json)

__all__ += ["DPTrainer", "TrainState", "ledger_from_json", "ledger_to_json"]
