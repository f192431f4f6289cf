"""Checkpoints of :class:`~dpsco_jax.flax.trainer.DPTrainer` that cannot roll privacy back.

A checkpoint ``directory/step_<t>`` (orbax) holds the params, the whole chain state (noise key
and counter, optimizer state), the sampling key and the step as a flat dict of arrays, and as
JSON the privacy fingerprint, the ledger's :meth:`~dpsco_jax.privacy.PrivacyLedger.state_dict`
(configuration + entries + SHA-256 digest) and the reported history.

Restoring refuses (``LedgerIntegrityError``, a ``ValueError``) a checkpoint

* whose ledger does not match its digest (events removed, a count lowered, by hand);
* whose ledger configuration differs from the restoring trainer's (a raised budget, another
  accountant, relation or delta);
* whose ledger is not exactly what its step count implies (``t`` steps of the trainer's one
  event): the digest is not keyed, so an edit that also recomputes it is still caught unless
  the step counter is edited consistently (which then also changes the noise-key counter the
  resumed run would continue from);
* whose privacy fingerprint (sampling rate, denominator, noise multiplier, clip norm, level,
  relation) differs.

Orbax writes into ``step_<t>.orbax-checkpoint-tmp-*`` and renames on success, so a crash leaves
a partial temporary folder; :func:`latest_checkpoint` only considers complete ``step_<8 digits>``
folders, so an intact earlier checkpoint is restored.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from dpsco_jax.privacy import LedgerIntegrityError, PrivacyLedger
from dpsco_jax.privacy.events import event_key

__all__ = ["latest_checkpoint", "save_checkpoint", "load_checkpoint", "check_ledger_matches"]

PyTree = Any
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def require_orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("checkpointing needs orbax-checkpoint: pip install 'dpsco_jax[flax]'"
                      ) from e
  return ocp


def is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def _data_to_keys(tree, like):
  return jax.tree.map(lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t))
                      if is_key(t) else x, tree, like)


def _flat_arrays(tree) -> dict:
  """Leaves by position: orbax never sees nnx/optax node types, only a flat dict."""
  return {f"leaf_{i:05d}": x for i, x in enumerate(jax.tree.leaves(_keys_to_data(tree)))}


def _unflat_arrays(flat: dict, like):
  leaves = [flat[f"leaf_{i:05d}"] for i in range(len(flat))]
  return _data_to_keys(jax.tree.unflatten(jax.tree.structure(like), leaves), like)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
  """The complete ``step_<8 digits>`` folder with the largest step, or None. Orbax's partial
  ``*.orbax-checkpoint-tmp*`` folders (a crash mid-save) are never chosen."""
  d = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(d):
    return None
  steps = sorted(p for p in os.listdir(d)
                 if _STEP_DIR.match(p) and os.path.isdir(os.path.join(d, p)))
  return os.path.join(d, steps[-1]) if steps else None


def save_checkpoint(directory: str | os.PathLike, state: PyTree, step: int, meta: dict) -> str:
  """Writes ``directory/step_<step>`` (arrays of ``state`` + JSON ``meta``); returns its path."""
  ocp = require_orbax()
  path = os.path.join(os.path.abspath(os.fspath(directory)), f"step_{step:08d}")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    ckpt.save(path, ocp.args.Composite(state=ocp.args.StandardSave(_flat_arrays(state)),
                                       meta=ocp.args.JsonSave(meta)), force=True)
  return path


def load_checkpoint(path: str | os.PathLike, like: PyTree) -> tuple[str, PyTree, dict]:
  """Reads a ``step_*`` folder (or a directory's latest) into the structure of ``like``;
  returns ``(path, state, meta)`` with the state cast to ``like``'s dtypes."""
  ocp = require_orbax()
  path = os.path.abspath(os.fspath(path))
  if not _STEP_DIR.match(os.path.basename(path)):
    latest = latest_checkpoint(path)
    if latest is None:
      raise ValueError(f"no complete checkpoint (step_<8 digits>) under {path!r}")
    path = latest
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    got = ckpt.restore(path, ocp.args.Composite(
        state=ocp.args.StandardRestore(_flat_arrays(like)), meta=ocp.args.JsonRestore()))
  restored = _unflat_arrays(got["state"], like)
  state = jax.tree.map(lambda r, t: r if is_key(t) else jnp.asarray(r, dtype=t.dtype),
                       restored, like)
  return path, state, got["meta"]


def check_ledger_matches(ledger: PrivacyLedger, event: Any, steps: int) -> None:
  """Raises unless ``ledger`` holds exactly ``steps`` compositions of ``event`` (ungrouped)."""
  want = [] if steps == 0 else [(event_key(event), None, steps)]
  got = [(event_key(e), g, c) for _, e, g, c in ledger.events]
  if got != want:
    counts = [c for _, _, c in got]
    raise LedgerIntegrityError(
        f"checkpoint ledger records {len(got)} entries with counts {counts}, but its step "
        f"count implies exactly {steps} trainer steps of one event: the ledger was edited")
