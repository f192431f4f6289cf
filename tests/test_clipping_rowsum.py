"""The weighted sum over users of ``aggregate`` / ``clip_and_aggregate``
(``dpsco_jax/transforms/clipping.py``: ``_weighted_row_sum``).

On CPU it takes the HIGHEST dot of the per-user rows as they are for leaves that hold one
vector per user (no zeroed copy of the ``[U, ...]`` gradients: that copy was half of
``clip_and_aggregate``'s time on a 1024 x 1024 GLM) and falls back to zeroing dropped rows
first when the result is not finite (a block of rows at a time: no second ``[U, D]`` buffer).
Here: the result equals the zeroed form's, bit for bit when a block is the whole leaf (and to
rounding over several blocks), whatever dropped rows hold (finite, huge, NaN, Inf), kept non-finite rows still poison the sum as before, and the dot reads the rows
directly (flattened to ``[U, -1]``: a size-1 trailing axis, as a GLM's ``[U, D, 1]`` kernel
gradients have, made XLA:CPU copy them into the ``cond``'s layout; bench_cost_rowsum.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.transforms import clipping as cl

U, D = 12, 5


def _rows(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((U, D, 2)), jnp.float32),   # a matrix per user
          "v": jnp.asarray(rng.standard_normal((U, D, 1)), jnp.float32),   # a GLM's kernel
          "b": jnp.asarray(rng.standard_normal((U, 3)), jnp.float32)}


CASES = {
    "all kept": ({}, []),
    "masked finite rows": ({}, [1, 4]),
    "masked huge rows": ({1: 3e38}, [1]),
    "masked NaN row": ({2: np.nan}, [2]),
    "masked Inf rows": ({2: np.inf, 7: -np.inf}, [2, 7]),
    "kept NaN row": ({3: np.nan}, []),
    "masked NaN and kept Inf": ({2: np.nan, 5: np.inf}, [2]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_row_sum_equals_the_zeroed_form(case):
  fill, dropped = CASES[case]
  rows = _rows()
  for u, v in fill.items():
    rows = jax.tree.map(lambda x, u=u, v=v: x.at[u, 0].set(v), rows)
  keep = jnp.ones((U,), bool).at[jnp.asarray(dropped, jnp.int32)].set(False)
  w = jnp.asarray(np.random.default_rng(1).uniform(0.1, 1.0, U), jnp.float32)
  got = jax.jit(cl._weighted_row_sum)(rows, w, keep)
  want = dict(zip(rows, jax.jit(cl._zeroed_row_sum)(list(rows.values()), w, keep)))
  # CPU's form holds the zeroed rows behind a barrier, accelerators' fuse them into the dot:
  # the same terms in the same dot
  held = dict(zip(rows, jax.jit(lambda *a: cl._zeroed_row_sum(*a, barrier=True))(
      list(rows.values()), w, keep)))
  for k in rows:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    np.testing.assert_array_equal(np.asarray(held[k]), np.asarray(want[k]))
    # and the float64 sum over kept rows (NaN where a kept row is non-finite)
    x = np.asarray(rows[k], np.float64)
    with np.errstate(invalid="ignore"):
      ref = np.einsum("u,u...->...", np.where(keep, w, 0.0),
                      np.where(np.asarray(keep).reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0))
    np.testing.assert_array_equal(np.isfinite(got[k]), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(np.asarray(got[k])[fin], ref[fin], rtol=1e-5, atol=1e-6)


def test_aggregate_and_clip_and_aggregate_drop_masked_non_finite_rows():
  rows = _rows()
  rows = jax.tree.map(lambda x: x.at[2].set(jnp.nan).at[6].set(jnp.inf), rows)
  mask = jnp.ones((U,), bool).at[2].set(False).at[6].set(False)
  agg = cl.aggregate("sum")
  fused = cl.clip_and_aggregate(1.0, "sum")
  out_agg = jax.jit(lambda r, m: agg.update(r, agg.init(None), user_mask=m)[0])(rows, mask)
  out_fused = jax.jit(lambda r: fused.update(r, fused.init(None))[0])(rows)  # dropped: NaN/Inf
  clean = jax.tree.map(lambda x: np.asarray(x, np.float64)[np.asarray(mask)], rows)
  norms = np.sqrt(sum(np.sum(x.reshape(x.shape[0], -1) ** 2, 1)
                      for x in jax.tree.leaves(clean)))
  f = np.minimum(1.0, 1.0 / norms)
  for k in rows:
    np.testing.assert_allclose(out_agg[k], clean[k].sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_fused[k], np.einsum("u,u...->...", f, clean[k]),
                               rtol=1e-5, atol=1e-6)


def test_cpu_dot_reads_vector_rows_directly_at_highest():
  """The CPU form's dot takes the stacked rows of one-vector-per-user leaves themselves (no
  ``where`` copy in between: only a reshape, a bitcast), matrix leaves take the zeroed form
  (its ``where`` absorbs their layout change), and every dot, in both branches of the
  ``cond``, runs at HIGHEST."""
  rows = _rows()
  leaves = list(rows.values())
  w, keep = jnp.ones((U,)), jnp.ones((U,), bool)
  jaxpr = jax.make_jaxpr(cl._guarded_row_sum)(leaves, w, keep)
  invars = [str(v) for v in jaxpr.jaxpr.invars[:len(leaves)]]
  source = {str(e.outvars[0]): str(e.invars[0]) for e in jaxpr.jaxpr.eqns
            if e.primitive.name == "reshape"}
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  direct = {source.get(str(e.invars[1]), str(e.invars[1])) for e in dots}
  assert direct & set(invars) == {invars[1], invars[2]}, (direct, invars)  # "v" and "b"
  text = str(jaxpr)
  assert text.count("dot_general[") == 1 + 2 * 2  # "w" zeroed; "v", "b" direct + in the cond
  for chunk in text.split("dot_general[")[1:]:
    assert re.search(r"precision=([^\n]*)", chunk).group(1).count("HIGHEST") == 2, chunk


def _step_costs(loss, params, batch, monkeypatch, zeroed: bool):
  """(temp bytes, bytes accessed) of per-user gradients + clip_and_aggregate, compiled."""
  from dpsco_jax.grads import per_user_grads  # noqa: PLC0415
  if zeroed:  # the form every backend used before, for comparison
    monkeypatch.setattr(cl, "_guarded_row_sum", cl._zeroed_row_sum)
  chain = cl.clip_and_aggregate(1.0, "mean", 64.0)
  fn = lambda p, b: chain.update(per_user_grads(loss, p, b), chain.init(p), p)[0]
  c = jax.jit(fn).lower(params, batch).compile()
  monkeypatch.undo()
  ca = c.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return c.memory_analysis().temp_size_in_bytes, ca["bytes accessed"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the guarded form is CPU's")
def test_cpu_form_costs_no_more_than_the_zeroed_form_in_a_step(monkeypatch):
  """In a compiled step (per-user gradients produced in the same program): on a GLM the
  guarded form accesses fewer bytes than the zeroed form (no copy of the [U, D] gradients),
  and on an MLP, whose [U, p, q] kernel gradients come out of the backward pass in the
  batched matmul's layout, it costs neither more temporaries nor more bytes (guarding every
  leaf cost 40% more temporaries on bench_cost's transformer)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 4, 256)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 2, (64, 4)), jnp.float32)
  glm = {"w": jnp.zeros((256, 1)), "b": jnp.zeros((1,))}
  glm_loss = lambda p, ex: jnp.square(ex[0] @ p["w"] + p["b"] - ex[1]).sum()
  mlp = {"w1": jnp.ones((256, 32)) / 16, "b1": jnp.zeros((32,)), "w2": jnp.ones((32, 8)) / 6}
  mlp_loss = lambda p, ex: jnp.sum(jnp.tanh(ex[0] @ p["w1"] + p["b1"]) @ p["w2"]) * ex[1]
  for name, loss, params in (("glm", glm_loss, glm), ("mlp", mlp_loss, mlp)):
    temp, moved = _step_costs(loss, params, (x, y), monkeypatch, zeroed=False)
    temp0, moved0 = _step_costs(loss, params, (x, y), monkeypatch, zeroed=True)
    # at most the vector leaves' gradients more (the cond's fallback buffer: b1's 64 x 32)
    assert temp <= temp0 + 64 * 32 * 4 + 4096, (name, temp, temp0)
    assert moved <= moved0 * 1.001, (name, moved, moved0)
    if name == "glm":
      assert moved < moved0 - 64 * 256 * 4, (moved, moved0)  # at least one pass fewer


@pytest.mark.parametrize("u", [37, 40])
def test_blocked_fallback_counts_each_kept_row_once(u, monkeypatch):
  """The fallback over several blocks (8 rows of 5 floats per block: 5 blocks for 37 rows,
  the last one overlapping the fourth, whose rows it must not count twice): the float64 sum
  of the kept rows, with NaN / Inf in dropped rows of the first, an inner and the overlapped
  last block; a kept NaN still poisons its column."""
  monkeypatch.setattr(cl, "ZEROED_BLOCK_BYTES", 8 * 5 * 4)
  rng = np.random.default_rng(u)
  g = rng.standard_normal((u, 5)).astype(np.float32)
  w = rng.uniform(0.1, 1.0, u).astype(np.float32)
  keep = rng.uniform(size=u) > 0.3
  for r in (1, 17, u - 2):            # dropped, non-finite
    keep[r] = False
    g[r, r % 5] = np.nan if r % 2 else np.inf
  ref = np.einsum("u,ud->d", np.where(keep, w, 0.0).astype(np.float64),
                  np.where(keep[:, None], g, 0.0).astype(np.float64))
  got = jax.jit(cl._weighted_row_sum)({"v": jnp.asarray(g)}, jnp.asarray(w),
                                      jnp.asarray(keep))["v"]
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)
  blocked = jax.jit(cl._blocked_zeroed_sum)(jnp.asarray(g), jnp.asarray(w), jnp.asarray(keep))
  if jax.default_backend() == "cpu":  # CPU's guarded form took the blocked branch: bit for bit
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(got))
  else:  # other backends sum the zeroed rows in one dot: the same sum to rounding (an H100
    # differed in the last bit of 2 of 5 entries)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(got), rtol=1e-6, atol=1e-6)
  g[5, 2], keep[5] = np.nan, True     # a kept NaN row
  got = jax.jit(cl._weighted_row_sum)({"v": jnp.asarray(g)}, jnp.asarray(w),
                                      jnp.asarray(keep))["v"]
  assert np.isnan(np.asarray(got)[2]) and np.isfinite(np.delete(np.asarray(got), 2)).all()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the guarded form is CPU's")
def test_cpu_fallback_holds_a_block_not_a_second_copy_of_the_rows(monkeypatch):
  """A GLM's clipped sum compiled: with the fallback in blocks of 4 KiB, temporaries are the
  per-user gradients plus about a block, not twice the per-user gradients (the whole-leaf
  zeroed fallback: bench_cost's 4096 x 4096 GLM step held 128 MiB, now 65 MiB, optax 65)."""
  from dpsco_jax.grads import per_user_grads  # noqa: PLC0415
  u, d = 256, 1024
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((u, 2, d)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 2, (u, 2)), jnp.float32)
  params = {"w": jnp.zeros((d, 1)), "b": jnp.zeros((1,))}
  loss = lambda p, ex: jnp.square(ex[0] @ p["w"] + p["b"] - ex[1]).sum()
  chain = cl.clip_and_aggregate(1.0, "mean", 64.0)

  guarded = cl._guarded_row_sum

  def temp():
    # a fresh CPU branch: platform_dependent caches its branches' traces by function, so it
    # would give back a trace made before the patches below (jax.clear_caches() would too,
    # but it throws away every program the test process has compiled)
    monkeypatch.setattr(cl, "_guarded_row_sum", lambda *args: guarded(*args))
    fn = lambda p, b: chain.update(per_user_grads(loss, p, b), chain.init(p), p)[0]
    return jax.jit(fn).lower(params, (x, y)).compile().memory_analysis().temp_size_in_bytes
  rows = u * d * 4                                    # the per-user kernel gradients: 1 MiB
  monkeypatch.setattr(cl, "ZEROED_BLOCK_BYTES", 4096)
  blocked = temp()
  monkeypatch.setattr(cl, "_blocked_zeroed_sum",     # the whole-leaf zeroed fallback
                      lambda g, w, k: cl._zeroed_row_sum([g], w, k)[0])
  whole = temp()
  assert blocked < 1.2 * rows < 2 * rows <= whole, (blocked, whole, rows)
