"""Checkpoints of :class:`~dpsco_jax.flax.trainer.DPTrainer` that cannot roll privacy back.

``directory/step_<t>`` (orbax) holds the state's arrays as a flat dict and, as JSON, the
privacy fingerprint, the ledger's :meth:`~dpsco_jax.privacy.PrivacyLedger.state_dict`, the
step, the history and the data facts, sealed by an ``integrity`` block over all of it and the
arrays' SHA-256: a plain SHA-256 by default (detects accidents, *not forgery*), or with
``hmac_key`` (bytes the user holds) an HMAC-SHA256 that cannot be recomputed without the key.

Restoring refuses a checkpoint whose seal does not match; whose ledger differs from the
trainer's configuration or from what its step count implies; whose privacy fingerprint or data
facts (:func:`data_facts`) differ from the trainer's. A crash mid-save leaves only orbax's
temporary folder: :func:`latest_checkpoint` takes complete ``step_<8 digits>`` folders only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from dpsco_jax._checks import ArgumentTypeError, check_bool
from dpsco_jax.privacy import LedgerIntegrityError, PrivacyLedger
from dpsco_jax.privacy.events import event_key

__all__ = ["latest_checkpoint", "save_checkpoint", "load_checkpoint", "check_ledger_matches",
           "seal", "verify_seal", "data_facts", "check_data_facts", "read_meta",
           "check_clipping"]

PyTree = Any
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def require_orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("checkpointing needs orbax-checkpoint: pip install 'dpsco_jax[flax]'"
                      ) from e
  return ocp


def _orbax(path: str, save: dict | None = None, **restore: Any) -> dict | None:
  """Writes the ``save`` items to ``path``, or reads the ``restore`` items from it."""
  ocp = require_orbax()
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
    if save is not None:
      return ckpt.save(path, ocp.args.Composite(**save), force=True)
    return ckpt.restore(path, ocp.args.Composite(**restore))


def is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flat_arrays(tree) -> dict:
  """Leaves by position (keys as their data): orbax sees a flat dict, no nnx/optax nodes."""
  data = jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)
  return {f"leaf_{i:05d}": x for i, x in enumerate(jax.tree.leaves(data))}


def _unflat_arrays(flat: dict, like):
  """:func:`_flat_arrays` undone into ``like``'s structure, keys and dtypes."""
  leaves = [flat[f"leaf_{i:05d}"] for i in range(len(flat))]
  return jax.tree.map(lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t))
                      if is_key(t) else jnp.asarray(x, dtype=t.dtype),
                      jax.tree.unflatten(jax.tree.structure(like), leaves), like)


MIN_HMAC_KEY_BYTES = 16


def check_hmac_key(key: Any) -> bytes | None:
  """``None`` (unkeyed) or bytes of at least :data:`MIN_HMAC_KEY_BYTES` (not a ``str``)."""
  if key is None:
    return None
  if not isinstance(key, (bytes, bytearray)):
    raise ArgumentTypeError(f"hmac_key must be bytes (e.g. secrets.token_bytes(32)), got "
                            f"{type(key).__name__}")
  if len(key) < MIN_HMAC_KEY_BYTES:
    raise ValueError(f"hmac_key must be at least {MIN_HMAC_KEY_BYTES} bytes, got {len(key)}")
  return bytes(key)


def arrays_digest(flat: dict) -> str:
  """SHA-256 over the flat arrays (name, dtype, shape and bytes of each, in name order)."""
  h = hashlib.sha256()
  for name in sorted(flat):
    a = np.ascontiguousarray(np.asarray(flat[name]))
    h.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _message(meta: dict, scheme: str, arrays: str) -> bytes:
  body = {k: v for k, v in meta.items() if k != "integrity"}
  return json.dumps({"meta": body, "scheme": scheme, "arrays_sha256": arrays},
                    sort_keys=True).encode()


def _mac(message: bytes, key: bytes | None) -> str:
  if key is None:
    return hashlib.sha256(message).hexdigest()
  return hmac.new(key, message, hashlib.sha256).hexdigest()


def seal(meta: dict, arrays: str, hmac_key: bytes | None = None) -> dict:
  """``meta`` (JSON-canonical) with its ``integrity`` block over itself and ``arrays``."""
  key = check_hmac_key(hmac_key)
  meta = json.loads(json.dumps({k: v for k, v in meta.items() if k != "integrity"}))
  scheme = "sha256" if key is None else "hmac-sha256"
  return {**meta, "integrity": {"scheme": scheme, "arrays_sha256": arrays,
                                "digest": _mac(_message(meta, scheme, arrays), key)}}


def verify_seal(meta: dict, arrays: str, hmac_key: bytes | None = None) -> None:
  """Raises :class:`LedgerIntegrityError` unless ``meta``'s seal matches it and ``arrays``
  under the scheme ``hmac_key`` asks for."""
  key = check_hmac_key(hmac_key)
  block = meta.get("integrity") if isinstance(meta, dict) else None
  if not isinstance(block, dict) or not {"scheme", "arrays_sha256", "digest"} <= set(block):
    raise LedgerIntegrityError("checkpoint has no integrity seal (written by an older version, "
                               "or removed): refusing to restore it")
  want = "sha256" if key is None else "hmac-sha256"
  if block["scheme"] != want:
    raise LedgerIntegrityError(
        "checkpoint is sealed with an HMAC key: pass hmac_key to restore it" if key is None
        else "checkpoint is not keyed (plain SHA-256, which anyone can recompute): refusing to "
             "restore it with hmac_key")
  if block["arrays_sha256"] != arrays:
    raise LedgerIntegrityError("checkpoint arrays do not match their digest: they were edited "
                               "or the restoring trainer's model differs")
  if not hmac.compare_digest(str(block["digest"]), _mac(_message(meta, want, arrays), key)):
    raise LedgerIntegrityError(
        f"checkpoint does not match its {'HMAC (wrong key, or forged)' if key else 'digest'}: "
        "its ledger, step, history or fingerprint was edited")


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
  """The complete ``step_<8 digits>`` folder with the largest step (never a partial one).

  Args:
    directory: the checkpoints' folder.

  Returns:
    The path, or None when ``directory`` is missing or holds no complete checkpoint.
  """
  d = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(d):
    return None
  steps = sorted(p for p in os.listdir(d)
                 if _STEP_DIR.match(p) and os.path.isdir(os.path.join(d, p)))
  return os.path.join(d, steps[-1]) if steps else None


def check_no_later_checkpoint(directory: str | os.PathLike, step: int) -> None:
  """Raises ``FileExistsError`` when ``directory`` holds a checkpoint after ``step``, and
  ``NotADirectoryError`` when it is a file (else the save fails after the steps ran)."""
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise NotADirectoryError(f"checkpoint_dir {os.fspath(directory)!r} is a file, not a "
                             "directory: give a directory for the checkpoints")
  latest = latest_checkpoint(directory)
  if latest is not None and int(_STEP_DIR.match(os.path.basename(latest)).group(1)) > step:
    raise FileExistsError(f"checkpoint_dir {os.path.dirname(latest)} holds {latest} (a later "
                          f"step than this trainer's {step}): restore from it, or write to "
                          "another directory")


def save_checkpoint(directory: str | os.PathLike, state: PyTree, step: int, meta: dict, *,
                    hmac_key: bytes | None = None, overwrite: bool = False) -> str:
  """Writes the sealed ``directory/step_<step>`` and returns its path (an existing one only
  with ``overwrite``)."""
  ocp = require_orbax()
  check_bool(overwrite, "overwrite")
  path = os.path.join(os.path.abspath(os.fspath(directory)), f"step_{step:08d}")
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"checkpoint {path} already exists: pass overwrite=True to replace "
                          "it, or save to another directory")
  flat = _flat_arrays(state)
  sealed = seal({**meta, "step": int(step)}, arrays_digest(jax.device_get(flat)), hmac_key)
  _orbax(path, {"state": ocp.args.StandardSave(flat), "meta": ocp.args.JsonSave(sealed)})
  return path


def load_checkpoint(path: str | os.PathLike, like: PyTree, *, hmac_key: bytes | None = None
                    ) -> tuple[str, PyTree, dict]:
  """``(path, state, meta)`` of a ``step_*`` folder (or a directory's latest), the state in
  ``like``'s structure and dtypes, after :func:`verify_seal`."""
  check_hmac_key(hmac_key)  # a bad key is refused before anything is read
  ocp = require_orbax()
  path = _step_path(path)
  # shapes only: orbax's mismatch errors print the target's values, and `like` holds keys
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None)), _flat_arrays(like))
  try:
    got = _orbax(path, state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
  except ValueError as e:
    raise ValueError(f"checkpoint {path} does not fit this trainer's state (its model's "
                     f"parameters or its optimizer differ from the run that wrote it): {e}"
                     ) from e
  state = _unflat_arrays(got["state"], like)
  verify_seal(got["meta"], arrays_digest(jax.device_get(_flat_arrays(state))), hmac_key)
  return path, state, got["meta"]


def _step_path(path: str | os.PathLike) -> str:
  """``path`` itself when it is a ``step_*`` folder, else its latest complete one."""
  path = os.path.abspath(os.fspath(path))
  if not _STEP_DIR.match(os.path.basename(path)):
    latest = latest_checkpoint(path)
    if latest is None:
      raise ValueError(f"no complete checkpoint (step_<8 digits>) under {path!r}")
    path = latest
  return path


def read_meta(path: str | os.PathLike) -> tuple[str, dict]:
  """``(step folder, its JSON meta)``, NOT verified: only for refusals due before the arrays
  are read (:func:`check_clipping`)."""
  ocp = require_orbax()
  path = _step_path(path)
  return path, _orbax(path, meta=ocp.args.JsonRestore())["meta"]


def check_clipping(path: str, meta: Any, mine: dict) -> None:
  """Raises ``ValueError`` when the checkpoint's run and this trainer disagree on adaptive
  clipping (an adaptive run's state carries ``C_t``: neither can resume the other)."""
  recorded = meta.get("fingerprint") if isinstance(meta, dict) else None
  if not isinstance(recorded, dict):
    return  # no fingerprint: load_checkpoint's seal and fingerprint checks refuse it
  was, am = recorded.get("clip_norm") == "adaptive", mine.get("clip_norm") == "adaptive"
  if was and not am:
    raise ValueError(f"checkpoint {path} is of a run with adaptive clipping (its clip norm "
                     "C_t is in its state); this trainer clips at a fixed clip_norm="
                     f"{mine.get('clip_norm')}: build it with clip_norm='adaptive' and the "
                     "run's adaptive arguments to resume")
  if am and not was:
    raise ValueError(f"checkpoint {path} is of a run with a fixed clip_norm="
                     f"{recorded.get('clip_norm')}; this trainer uses adaptive clipping: "
                     "build it with that clip_norm to resume (a fixed-clip run cannot continue "
                     "adaptively under its ledger)")


def data_facts(data: Any) -> dict:
  """What a checkpoint records of a trainer's data: its shapes and dtypes and a digest of the
  contents (a UserData's :attr:`fingerprint`), never the data itself."""
  from dpsco_jax.data import UserData
  from dpsco_jax.data.grouping import array_checksum, fingerprint
  if isinstance(data, UserData):
    spec = data.spec
    return {"n_users": spec.n_users, "max_items_per_user": spec.max_items_per_user,
            "item_shapes": [[p, list(s), d] for p, s, d in spec.item_shapes],
            "digest": data.fingerprint}
  leaves = jax.tree_util.tree_flatten_with_path(data)[0]
  return {"leaf_shapes": [[jax.tree_util.keystr(p), list(x.shape), str(x.dtype)]
                          for p, x in leaves],
          "digest": fingerprint([(jax.tree_util.keystr(p), array_checksum(x))
                                 for p, x in leaves], {})}


def check_data_facts(recorded: Any, mine: dict) -> None:
  """Raises ``ValueError`` unless the checkpoint's :func:`data_facts` are the trainer's (values
  shown for shapes only: the others can be private)."""
  if not isinstance(recorded, dict):
    raise ValueError("checkpoint records no data facts (written by an older version): it "
                     "cannot be checked against this trainer's data, so it is refused")
  differ = [k for k in sorted(set(recorded) | set(mine)) if recorded.get(k) != mine.get(k)]
  if differ:
    shapes = [f"{k}: checkpoint {recorded.get(k)}, this data {mine.get(k)}"
              for k in differ if k in ("item_shapes", "leaf_shapes")]
    raise ValueError(f"checkpoint was trained on other data: {', '.join(differ)} differ"
                     f"{' (' + '; '.join(shapes) + ')' if shapes else ''}; resume on the data "
                     "it was trained on")


def check_ledger_matches(ledger: PrivacyLedger, event: Any, steps: int) -> None:
  """Raises unless ``ledger`` holds exactly ``steps`` compositions of ``event`` (ungrouped)."""
  want = [] if steps == 0 else [(event_key(event), None, steps)]
  got = [(event_key(e), g, c) for _, e, g, c in ledger.events]
  if got != want:
    counts = [c for _, _, c in got]
    raise LedgerIntegrityError(
        f"checkpoint ledger records {len(got)} entries with counts {counts}, but its step "
        f"count implies exactly {steps} trainer steps of one event: the ledger was edited")
