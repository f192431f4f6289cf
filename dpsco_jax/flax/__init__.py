"""Flax nnx integration: fast exact per-user clipping and a DP training helper."""

from dpsco_jax.flax.fast_clip import ClipInfo, FastClippedGrad, FastClipPlan
from dpsco_jax.flax.checkpoint import latest_checkpoint
from dpsco_jax.flax.trainer import DPTrainer, TrainState
from dpsco_jax.flax.bridge import fit_model, params_loss

__all__ = ["ClipInfo", "FastClippedGrad", "FastClipPlan", "DPTrainer", "TrainState",
           "latest_checkpoint", "fit_model", "params_loss"]
