"""Flax nnx integration: fast exact per-user clipping and a DP training helper."""

from dpsco_jax.flax.fast_clip import ClipInfo, FastClippedGrad, FastClipPlan

__all__ = ["ClipInfo", "FastClippedGrad", "FastClipPlan"]
from dpsco_jax.flax.checkpoint import latest_checkpoint  # noqa: E402
from dpsco_jax.flax.trainer import DPTrainer, TrainState  # noqa: E402

__all__ += ["DPTrainer", "TrainState", "latest_checkpoint"]
from dpsco_jax.flax.bridge import fit_model, params_loss  # noqa: E402

__all__ += ["fit_model", "params_loss"]
