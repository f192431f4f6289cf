"""FILTER's radial-band pair counts (``dpsco_jax/transforms/filter_bands.py``): every count is
the canonical one, whichever branch runs.

The banded branch is forced (``BAND_FRACTION`` raised, so the run-time ``cond`` takes it) and
its counts compared, user by user and radius by radius, with the brute-force canonical matrix
of ``pairwise_sq_distances`` on inputs built to break a radial shortcut: a cluster with huge
outliers (FILTER's case), points on a shell around the centre (every band the whole set),
duplicates, a common offset of 1e4, pairs exactly at the radius on a grid, masked users. The
fallback returns -1 everywhere, so a run that silently fell back would fail. A broken twin
whose triangle certificates lack the canonical margins (``rho = r``) miscounts pairs at
exactly the radius: the comparison has power. The run-time choice is by cost (clustered data
bands, a shell falls back), and ``filter_points`` above ``BAND_MIN_USERS`` releases bitwise
what the Gram path releases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.transforms import filter_bands as fb
from dpsco_jax.transforms import filter_pairs as fp
from dpsco_jax.transforms.filtering import filter_points, pairwise_sq_distances

RADII = (0.4, 0.8)


def _brute(x: np.ndarray, mask: np.ndarray, radii) -> list[np.ndarray]:
  geo = fp.pair_geometry([fp.pair_rows(jnp.asarray(x))])
  d = np.asarray(pairwise_sq_distances(jnp.asarray(x)))
  out = []
  for r in radii:
    t = float(fp.close_threshold(jnp.float32(r), geo))
    close = ((d <= t) | np.eye(len(mask), dtype=bool)) & mask[None, :]
    out.append(np.where(mask, close.sum(axis=1), 0))
  return out


def _banded(x: np.ndarray, mask: np.ndarray, radii) -> list[np.ndarray]:
  u = x.shape[0]
  shape = fp.pair_layout(u)

  def f(x, mask):
    rows = [fp.pair_rows(x)]
    geo = fp.pair_geometry(rows)
    ts = tuple(fp.close_threshold(jnp.float32(r), geo) for r in radii)
    return fb.banded_close_counts(rows, mask, ts, geo,
                                  lambda: tuple(jnp.full(shape, -1, jnp.int32) for _ in ts),
                                  shape)
  return [np.asarray(c).reshape(-1)[:u] for c in jax.jit(f)(jnp.asarray(x), jnp.asarray(mask))]


def _inputs():
  rng = np.random.default_rng(0)
  cluster = rng.normal(size=(1200, 5)) * 0.05
  cluster[:60] *= 300                                             # 5% huge users
  v = rng.normal(size=(900, 5))
  shell = 0.5 * v / np.linalg.norm(v, axis=1, keepdims=True)      # every a_i the same
  dups = np.repeat(rng.normal(size=(100, 5)) * 0.3, 9, axis=0)
  offset = rng.normal(size=(1000, 5)) * 0.1 + 1e4
  g = np.stack(np.meshgrid(*[np.arange(4) * 0.4] * 3, indexing="ij"), -1).reshape(-1, 3)
  grid = np.tile(np.concatenate([g, np.zeros((len(g), 2))], axis=1), (12, 1))
  line = np.repeat([[-0.2], [0.0], [0.2]], 300, axis=0) * np.eye(5)[0]   # centre 0
  return {"cluster": cluster, "shell": shell, "dups": dups, "offset": offset, "grid": grid,
          "line": line}


@pytest.mark.parametrize("name", list(_inputs()))
def test_forced_bands_count_exactly_the_canonical_pairs(name, monkeypatch):
  monkeypatch.setattr(fb, "BAND_FRACTION", 1e9)
  x = _inputs()[name].astype(np.float32)
  mask = np.random.default_rng(1).random(len(x)) > 0.05
  radii = RADII if name != "grid" else (0.4, 0.4 * np.sqrt(2), 0.4 * np.sqrt(3))
  got, want = _banded(x, mask, radii), _brute(x, mask, radii)
  for r, g, w in zip(radii, got, want):
    assert (g >= 0).all(), f"{name}: the banded branch was not taken"
    np.testing.assert_array_equal(g, w, err_msg=f"{name}, r = {r}")


def test_a_twin_without_the_canonical_margins_miscounts_pairs_at_the_radius(monkeypatch):
  """Points at -0.2, 0 and 0.2 (centre 0): the outer pairs are exactly 0.4 apart, and
  ``a_i + a_j = 0.4``. Canonically they are far at r = 0.4 (``T(r) < r^2``); a twin that takes
  the computed norms as exact and tests ``a_i + a_j <= r`` certifies them close."""
  monkeypatch.setattr(fb, "BAND_FRACTION", 1e9)
  x = _inputs()["line"].astype(np.float32)
  mask = np.ones(len(x), bool)
  want = _brute(x, mask, (0.4,))[0]
  np.testing.assert_array_equal(_banded(x, mask, (0.4,))[0], want)
  radial = fb._radial
  monkeypatch.setattr(fb, "_radial", lambda *a: (radial(*a)[0],) * 3)
  monkeypatch.setattr(fb, "_radii", lambda t, geo: (jnp.float32(0.4),) * 2)
  monkeypatch.setattr(fb, "_down", lambda v: v)
  monkeypatch.setattr(fb, "_up", lambda v: v)
  assert (_banded(x, mask, (0.4,))[0] != want).any()


def test_the_branch_is_chosen_by_the_band_sizes():
  """Clustered data (FILTER's case) take the bands; a shell, where every band is the whole
  set, and a real row whose norm overflows, fall back to the Gram path."""
  inp = _inputs()
  mask = np.ones(1200, bool)
  assert (_banded(inp["cluster"].astype(np.float32), mask, RADII)[0] >= 0).all()
  assert (_banded(inp["shell"].astype(np.float32), np.ones(900, bool), RADII)[0] == -1).all()
  over = inp["cluster"].astype(np.float32)
  over[7] = 3e38
  assert (_banded(over, mask, RADII)[0] == -1).all()


def test_filter_points_above_the_threshold_releases_what_the_gram_path_releases(monkeypatch):
  """At ``BAND_MIN_USERS`` users (clustered, 5% huge, some masked) the kernel takes the bands;
  its counts, score, kept set and mean equal the Gram path's (``BAND_MIN_USERS`` raised)."""
  rng = np.random.default_rng(2)
  u = fb.BAND_MIN_USERS
  x = rng.normal(size=(u, 5)).astype(np.float32) * 0.05
  x[: u // 20] *= 300
  pts = {"w": jnp.asarray(x[:, :3]), "b": jnp.asarray(x[:, 3:])}
  mask = jnp.asarray(rng.random(u) > 0.02)
  key = jax.random.key(3)
  run = lambda: jax.jit(lambda p, m: filter_points(p, key, score_radius=0.3,
                                                   degree_radius=0.6, user_mask=m))(pts, mask)
  banded = run()
  monkeypatch.setattr(fb, "BAND_MIN_USERS", 10 ** 9)
  gram = run()
  for a, b in zip(jax.tree.leaves(banded), jax.tree.leaves(gram)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert 0 < int(banded.num_kept) < u
