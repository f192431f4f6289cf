"""Host-side Poisson sampling (issue 24): the sampled set has the law the accountant assumes
(sizes ~ Binomial(n, q), each user included with probability q, independently across steps),
every step draws fresh randomness, and the gathered batch equals the device view's rows."""

import jax
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.data import PoissonSampler, UserData, gather_batch, iter_batches
from dpsco_jax.data.sampling import poisson_indices

N, Q, STEPS = 2000, 0.05, 4000


def _size_pvalue(sizes: np.ndarray, n: int, q: float) -> float:
  """Chi-square goodness of fit of sample sizes to Binomial(n, q) (bins with >= 5 expected
  counts; the tails are merged into the end bins)."""
  lo, hi = stats.binom.ppf([1e-4, 1 - 1e-4], n, q).astype(int)
  edges = np.arange(lo, hi + 2)
  cdf = stats.binom.cdf(edges - 1, n, q)
  probs = np.diff(np.concatenate([[0.0], cdf[1:-1], [1.0]]))
  observed = np.histogram(np.clip(sizes, lo, hi), bins=edges)[0]
  expected = probs * sizes.size
  # merge bins until every expected count is >= 5
  keep_o, keep_e, acc_o, acc_e = [], [], 0.0, 0.0
  for o, e in zip(observed, expected):
    acc_o, acc_e = acc_o + o, acc_e + e
    if acc_e >= 5:
      keep_o.append(acc_o), keep_e.append(acc_e)
      acc_o = acc_e = 0.0
  keep_o[-1] += acc_o
  keep_e[-1] += acc_e
  return float(stats.chisquare(keep_o, keep_e).pvalue)


def _inclusion_pvalue(samples: list[np.ndarray], n: int, q: float) -> float:
  """Chi-square of per-user inclusion counts against T q (each Binomial(T, q))."""
  counts = np.bincount(np.concatenate(samples), minlength=n)
  t = len(samples)
  chi2 = float(np.sum((counts - t * q) ** 2) / (t * q * (1 - q)))
  return float(stats.chi2.sf(chi2, n))


@pytest.fixture(scope="module")
def samples():
  sampler = PoissonSampler(N, Q, capacity=N, seed=11)
  return [sampler.sample(t) for t in range(STEPS)]


def test_sample_sizes_are_binomial_and_a_wrong_rate_is_rejected(samples):
  sizes = np.array([s.size for s in samples])
  assert _size_pvalue(sizes, N, Q) > 1e-4
  # power: the same test rejects a rate 10% too high and a fixed-size sample of q n users
  rng = np.random.default_rng(0)
  wrong = np.array([poisson_indices(rng, N, 1.1 * Q).size for _ in range(STEPS)])
  assert _size_pvalue(wrong, N, Q) < 1e-8
  assert _size_pvalue(np.full(STEPS, int(N * Q)), N, Q) < 1e-8


def test_each_user_is_included_with_probability_q(samples):
  assert _inclusion_pvalue(samples, N, Q) > 1e-4
  # the edge users too (an off-by-one at either end would show here)
  counts = np.bincount(np.concatenate(samples), minlength=N)
  sd = np.sqrt(STEPS * Q * (1 - Q))
  assert abs(counts[0] - STEPS * Q) < 5 * sd and abs(counts[-1] - STEPS * Q) < 5 * sd
  # power: users of the first half at 1.1 q, of the second at 0.9 q: rejected
  rng = np.random.default_rng(1)
  half = N // 2
  skewed = [np.concatenate([poisson_indices(rng, half, 1.1 * Q),
                            half + poisson_indices(rng, half, 0.9 * Q)])
            for _ in range(STEPS)]
  assert _inclusion_pvalue(skewed, N, Q) < 1e-8


def test_samples_are_sorted_distinct_and_independent_across_steps(samples):
  for s in samples[:50]:
    assert np.all(np.diff(s) > 0) and (s.size == 0 or (s[0] >= 0 and s[-1] < N))
  sizes = np.array([s.size for s in samples], float)
  # consecutive steps uncorrelated (|r| < 4 / sqrt(T))
  assert abs(np.corrcoef(sizes[:-1], sizes[1:])[0, 1]) < 4 / np.sqrt(STEPS)
  # two steps share a user with probability q, not more
  overlap = np.mean([np.isin(samples[t], samples[t + 1]).sum() for t in range(STEPS - 1)])
  assert abs(overlap - N * Q * Q) < 0.5


def test_same_seed_replays_other_seeds_and_steps_differ():
  a = PoissonSampler(10_000, 0.01, capacity=500, seed=3)
  b = PoissonSampler(10_000, 0.01, capacity=500, seed=3)
  c = PoissonSampler(10_000, 0.01, capacity=500, seed=4)
  k = PoissonSampler(10_000, 0.01, capacity=500, seed=jax.random.key(3))
  raw = PoissonSampler(10_000, 0.01, capacity=500, seed=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(a.sample(7), b.sample(7))
  np.testing.assert_array_equal(k.sample(7), raw.sample(7))   # typed and raw keys agree
  draws = [a.sample(7), a.sample(8), c.sample(7), k.sample(7), a.sample(2**40 + 7)]
  for i in range(len(draws)):
    for j in range(i):
      assert not np.array_equal(draws[i], draws[j]), (i, j)


def test_removing_the_last_user_leaves_the_other_users_coins():
  """The gaps do not depend on n: the sample of n - 1 users is the sample of n users without
  the last one (the coupling the device sampler's per-user coins give)."""
  for t in range(200):
    full = PoissonSampler(300, 0.2, capacity=300, seed=5).sample(t)
    less = PoissonSampler(299, 0.2, capacity=300, seed=5).sample(t)
    np.testing.assert_array_equal(less, full[full < 299])


def test_work_per_step_is_q_n_not_n():
  """The sampler draws about q n + O(sqrt(q n)) variates, whatever n: at n = 1e8 and
  q n = 100 a step takes well under a millisecond's worth of an O(n) pass."""
  import time
  sampler = PoissonSampler(10**8, 1e-6, capacity=200, seed=0)
  t0 = time.perf_counter()
  sizes = [sampler.sample(t).size for t in range(200)]
  per_step = (time.perf_counter() - t0) / 200
  assert 80 < np.mean(sizes) < 120
  assert per_step < 2e-3, per_step       # an O(n) coin draw at n = 1e8 takes ~0.5 s


def test_truncation_keeps_the_lowest_indices_and_pads_with_user_zero():
  sampler = PoissonSampler(1000, 0.5, capacity=20, seed=0)
  full = sampler.sample(3)
  idx, mask = sampler(3)
  assert full.size > 20 and mask.all()
  np.testing.assert_array_equal(idx, full[:20])
  roomy = PoissonSampler(1000, 0.01, capacity=60, seed=0)
  idx, mask = roomy(3)
  k = roomy.sample(3).size
  assert mask.sum() == k and not mask[k:].any() and np.all(idx[k:] == 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_users": 0}, "n_users"), ({"rate": 0.0}, "rate"), ({"rate": 1.5}, "rate"),
    ({"capacity": 0}, "capacity"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
])
def test_sampler_refuses_bad_arguments(kwargs, match):
  args = {"n_users": 10, "rate": 0.1, "capacity": 5, **kwargs}
  with pytest.raises((ValueError, TypeError), match=match):
    PoissonSampler(args.pop("n_users"), args.pop("rate"), **args)
  with pytest.raises(ValueError, match="step"):
    PoissonSampler(10, 0.1, capacity=5).sample(-1)


def _data(store=None):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 300, 2000)
  ex = {"x": rng.normal(size=(2000, 4)).astype(np.float32),
        "y": rng.integers(0, 2, 2000).astype(np.int32)}
  return UserData.from_arrays(ex, ids, max_items_per_user=6, store=store)


@pytest.mark.parametrize("view", ["user", "item"])
@pytest.mark.parametrize("on_disk", [False, True])
def test_gathered_batch_equals_the_device_views_rows(view, on_disk, tmp_path):
  data = _data(tmp_path / "s" if on_disk else None)
  full = data.user_view() if view == "user" else data.item_view()
  sampler = PoissonSampler(data.n_users, 0.1, capacity=50, seed=1)
  for t in range(5):
    idx, mask = sampler(t)
    got = gather_batch(data, idx, mask, view=view)
    want = jax.tree.map(lambda x: np.asarray(x)[idx], full)
    np.testing.assert_array_equal(got["example"]["x"], want["example"]["x"])
    np.testing.assert_array_equal(got["example"]["y"], want["example"]["y"])
    np.testing.assert_array_equal(got["weight"][mask], want["weight"][mask])
    assert not got["weight"][~mask].any()             # padded slots weigh nothing
    assert got["weight"].dtype == np.float32 and got["weight"].shape == (50, 6)


def test_gather_refuses_bad_indices():
  data = _data()
  with pytest.raises(IndexError):
    gather_batch(data, np.array([0, data.n_users]), np.array([True, True]))
  with pytest.raises(ValueError, match="capacity"):
    gather_batch(data, np.array([0, 1]), np.array([True]))
  with pytest.raises(ValueError, match="view"):
    gather_batch(data, np.array([0]), np.array([True]), view="rows")


def test_iter_batches_yields_the_sampler_and_gather_results_on_device():
  data = _data()
  sampler = PoissonSampler(data.n_users, 0.1, capacity=50, seed=2)
  seen = []
  for t, batch, mask in iter_batches(data, sampler, 4, start=10):
    idx, want_mask = sampler(t)
    want = gather_batch(data, idx, want_mask)
    assert isinstance(batch["weight"], jax.Array) and isinstance(mask, jax.Array)
    np.testing.assert_array_equal(np.asarray(mask), want_mask)
    np.testing.assert_array_equal(np.asarray(batch["example"]["x"]), want["example"]["x"])
    np.testing.assert_array_equal(np.asarray(batch["weight"]), want["weight"])
    seen.append(t)
  assert seen == [10, 11, 12, 13]
  with pytest.raises(ValueError, match="sampler is for"):
    next(iter_batches(data, PoissonSampler(5, 0.1, capacity=2), 1))
