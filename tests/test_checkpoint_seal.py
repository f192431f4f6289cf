"""Issue 23 part 5, checkpoints: the seal covers ledger, step, history and arrays; an HMAC with
a key the user holds stops a consistent forgery that the plain SHA-256 cannot."""

import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("orbax.checkpoint")
from flax import nnx  # noqa: E402

from dpsco_jax.flax import DPTrainer  # noqa: E402
from dpsco_jax.flax import checkpoint as ckpt  # noqa: E402
from dpsco_jax.privacy import LedgerIntegrityError  # noqa: E402
from test_flax_trainer import _tamper as _edit_meta  # noqa: E402  (edits a saved metadata file)

KEY = b"k" * 32


def _trainer() -> DPTrainer:
  x = np.random.default_rng(0).standard_normal((16, 3, 3)).astype(np.float32)
  data = (jnp.asarray(x), jnp.asarray((x[..., 0] > 0).astype(np.int32)))
  loss = lambda model, ex: optax.softmax_cross_entropy_with_integer_labels(model(ex[0]), ex[1])
  return DPTrainer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), loss, optax.sgd(0.5), data=data,
                   clip_norm=1.0, sampling_rate=0.4, delta=1e-5, expected_batch_size=6.4,
                   noise_multiplier=1.2, key=7, accountant="rdp")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 4-step trainer saved with the key and without it."""
  root = tmp_path_factory.mktemp("ck")
  tr = _trainer()
  tr.train(4, report_every=2)
  return tr, tr.save(root / "keyed", hmac_key=KEY), tr.save(root / "plain")


def test_keyed_checkpoint_restores_with_its_key_only(trained):
  tr, keyed, plain = trained
  back = _trainer().restore(keyed, hmac_key=KEY)
  assert back.step_count == 4 and back.history == tr.history
  with pytest.raises(LedgerIntegrityError, match="wrong key, or forged"):
    _trainer().restore(keyed, hmac_key=b"x" * 32)
  with pytest.raises(LedgerIntegrityError, match="pass hmac_key"):
    _trainer().restore(keyed)
  with pytest.raises(LedgerIntegrityError, match="not keyed"):
    _trainer().restore(plain, hmac_key=KEY)  # a plain seal proves nothing about the key
  assert _trainer().restore(plain).step_count == 4  # unkeyed: accidents only, still works


def test_a_consistent_forgery_passes_the_plain_digest_but_not_the_hmac(trained, tmp_path):
  """The attack of issue 23: parameters trained 4 steps, ledger/step/digests of 2 steps."""
  tr, _, _ = trained
  forger = _trainer()
  forger.train(2, report_every=2)
  forger.state = forger.state._replace(params=tr.state.params)  # the 4-step parameters
  forged = forger.save(tmp_path / "forged")  # every unkeyed digest recomputed consistently
  looks = _trainer().restore(forged)
  assert looks.epsilon() < tr.epsilon()  # what a plain SHA-256 cannot stop
  with pytest.raises(LedgerIntegrityError, match="not keyed"):
    _trainer().restore(forged, hmac_key=KEY)
  forger.save(tmp_path / "forged_wrong_key", hmac_key=b"attacker" * 4)
  with pytest.raises(LedgerIntegrityError, match="wrong key, or forged"):
    _trainer().restore(tmp_path / "forged_wrong_key", hmac_key=KEY)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["history"][0].update(epsilon=0.01), "digest"),  # the history is covered
    (lambda m: m["history"].pop(), "digest"),
    (lambda m: m.update(step=2), "digest"),
    (lambda m: m["integrity"].update(arrays_sha256="0" * 64), "arrays"),
    (lambda m: m.pop("integrity"), "no integrity seal"),
])
def test_edits_of_the_json_are_caught_by_the_plain_seal(trained, tmp_path, edit, match):
  _, _, plain = trained
  path = str(tmp_path / "step_00000004")
  shutil.copytree(plain, path)
  _edit_meta(path, edit)
  with pytest.raises(LedgerIntegrityError, match=match):
    _trainer().restore(path)


def test_a_resealed_json_step_must_match_the_arrays(trained, tmp_path):
  _, _, plain = trained
  path = str(tmp_path / "step_00000004")
  shutil.copytree(plain, path)
  _edit_meta(path, lambda m: m.update(ckpt.seal({**m, "step": 2},
                                                m["integrity"]["arrays_sha256"])))
  with pytest.raises(LedgerIntegrityError, match="step 2 differs"):
    _trainer().restore(path)


@pytest.mark.parametrize("key,err", [("a string key", TypeError), (b"short", ValueError)])
def test_bad_hmac_keys_are_refused(trained, tmp_path, key, err):
  tr, keyed, _ = trained
  with pytest.raises(err, match="hmac_key"):
    tr.save(tmp_path / "x", hmac_key=key)
  with pytest.raises(err, match="hmac_key"):
    _trainer().restore(keyed, hmac_key=key)


def test_train_seals_its_checkpoints_with_the_key(tmp_path):
  tr = _trainer()
  tr.train(2, report_every=2, checkpoint_dir=tmp_path, hmac_key=KEY)
  assert _trainer().restore(tmp_path, hmac_key=KEY).step_count == 2
  with pytest.raises(LedgerIntegrityError, match="pass hmac_key"):
    _trainer().restore(tmp_path)
