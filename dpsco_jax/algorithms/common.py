"""Pieces shared by the algorithm drivers: config access, user sampling, the scan loop."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dpsco_jax._checks import check_choice, check_delta, check_int, check_probability
from dpsco_jax.cache import bounded_cache
from dpsco_jax.config.types import ConfigError
from dpsco_jax.grads import per_user_grads, shard_users
from dpsco_jax.transforms.steps import released_params

SAMPLINGS = ("poisson", "fixed", "full")


def poisson_capacity(n: int, q: float) -> int:
  """Static slot count for Poisson sampling: mean + 8 standard deviations + 16."""
  return int(min(n, math.ceil(q * n + 8.0 * math.sqrt(q * n * (1 - q)) + 16)))


def poisson_truncation_probability(n: int, q: float, capacity: int, steps: int) -> float:
  """Union bound on the chance that some step samples more than ``capacity`` users.

  Truncated Poisson sampling differs from the accounted mechanism only on that event, so it is
  added to delta (a total-variation argument)."""
  if capacity >= n:
    return 0.0
  from scipy.stats import binom
  return float(min(1.0, steps * binom.sf(capacity, n, q)))


def sample_users(key: jax.Array, n: int, *, sampling: str, batch: int,
                 capacity: int, rate: float | None = None,
                 n_real: int | None = None,
                 shard: NamedSharding | None = None) -> tuple[jax.Array, jax.Array]:
  """Indices ``[capacity]`` of one step's users and the mask of real slots.

  ``poisson``: each user with probability ``rate`` (declared; default ``batch / n``, public
  only when ``n`` is); user ``i``'s coin is the ``i``-th uniform of one ``[n]`` draw, so with
  partitionable threefry (the default) removing the last user leaves every other coin
  unchanged. ``fixed``: a uniform ``batch``-subset; ``full``: every user. Rows from ``n_real``
  on are a mesh's padding, never sampled (the real users' draws are the unpadded run's).
  ``shard``: the coins are drawn sharded (same values), each device hashing its own users.
  """
  n_real = n if n_real is None else n_real
  if sampling == "full":
    return jnp.arange(capacity) % n, jnp.arange(capacity) < n_real
  if sampling == "fixed":
    idx = jax.random.choice(key, n_real, (batch,), replace=False)
    return jnp.pad(idx, (0, capacity - batch)), jnp.arange(capacity) < batch
  chosen = jax.random.bernoulli(key, batch / n_real if rate is None else rate, (n,))
  chosen = chosen & (jnp.arange(n) < n_real)
  if shard is not None:
    return _sharded_slots(jax.lax.with_sharding_constraint(chosen, shard), shard, capacity)
  (idx,) = jnp.nonzero(chosen, size=capacity, fill_value=0)
  return idx, jnp.arange(capacity) < jnp.sum(chosen)


def _sharded_slots(chosen: jax.Array, shard: NamedSharding, capacity: int
                   ) -> tuple[jax.Array, jax.Array]:
  """``jnp.nonzero(chosen, size=capacity, fill_value=0)`` and the slot mask for coins sharded
  over one axis, in O(n / devices + capacity) per device: each device places its chosen users
  at its offset and the slots are summed, slot for slot the one-device result."""
  (axis,) = shard.spec[0] if isinstance(shard.spec[0], tuple) else (shard.spec[0],)
  mesh = shard.mesh

  def local(c):
    size = c.shape[0]
    me = jax.lax.axis_index(axis)
    mine = jnp.sum(c, dtype=jnp.int32)
    counts = jax.lax.all_gather(mine, axis)
    offset = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < me, counts, 0))
    (li,) = jnp.nonzero(c, size=min(size, capacity), fill_value=0)
    j = jnp.arange(li.shape[0])
    slot = jnp.where(j < counts[me], offset + j, capacity)      # capacity: dropped
    idx = jnp.zeros((capacity,), jnp.int32).at[slot].set(
        (me * size + li).astype(jnp.int32), mode="drop")
    return jax.lax.psum(idx, axis), jax.lax.psum(mine, axis)

  idx, total = jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(axis),
                             out_specs=(PartitionSpec(), PartitionSpec()))(chosen)
  return idx, jnp.arange(capacity) < total


def real_rows_mask(mask: jax.Array | None, n: int, n_rows: int) -> jax.Array | None:
  """``mask`` over ``n`` real rows (``None``: all) padded with ``False`` over a mesh's
  ``n_rows - n`` padding rows (:func:`_on_mesh`), so the padding is in no sum."""
  if n_rows == n:
    return mask
  return jnp.pad(jnp.ones((n,), bool) if mask is None else mask, (0, n_rows - n))


def gather_users(data: Any, idx: jax.Array) -> Any:
  return jax.tree.map(lambda x: x[idx], data)


#: host callbacks of the runs in flight, by id: the compiled loop carries only the id, so one
#: executable serves every run (a closure in the cache key would compile once per fit)
_PROGRESS: dict[int, Callable[[int], None]] = {}
#: a driver's progress function: ``progress(steps_done, total_steps)`` on the host
ProgressFn = Callable[[int, int], None]
_PROGRESS_IDS = itertools.count(1)


def _report_progress(run_id, step) -> None:
  fn = _PROGRESS.get(int(run_id))
  if fn is not None:
    fn(int(step))


def progress_points(steps: int, reports: int = 20) -> int:
  """Every how many steps a run reports progress (about ``reports`` times per run)."""
  return max(1, -(-int(steps) // reports))


def progress_due(done: Any, total: int) -> Any:
  """Whether a run of ``total`` steps reports after ``done`` (an int or a traced int): every
  :func:`progress_points` steps and at the last one."""
  return (done % progress_points(total) == 0) | (done == total)


class ProgressSession:
  """One run's progress: ``report`` the static part a compiled loop is built with (``None``:
  nothing compiled in), :meth:`tick` the traced part (run id, steps before this loop)."""

  def __init__(self, run_id: int, total: int):
    self.run_id, self.total = run_id, int(total)
    self.report = None if run_id == 0 else self.total

  def tick(self, offset: int = 0) -> jax.Array | None:
    return None if self.report is None else jnp.asarray([self.run_id, offset], jnp.int32)


@contextlib.contextmanager
def progress_session(progress: ProgressFn | None, total: int) -> Iterator[ProgressSession]:
  """Registers ``progress(steps_done, total)`` (``None``: no reports) for a run's compiled
  loops (which call :func:`emit_progress`); on leaving, waits for every report and
  unregisters it."""
  run_id = next(_PROGRESS_IDS) if progress is not None else 0
  if progress is not None:
    _PROGRESS[run_id] = lambda step: progress(step, int(total))
  try:
    yield ProgressSession(run_id, total)
    if progress is not None:
      jax.effects_barrier()   # every callback has run before the run returns
  finally:
    _PROGRESS.pop(run_id, None)


def emit_progress(report: int | None, tick: jax.Array | None, t: jax.Array) -> None:
  """At a compiled loop's step ``t``: reports the steps done to the host when
  :func:`progress_due` (the step count only, never a data-dependent value)."""
  if report is None:
    return
  done = tick[1] + t + 1
  jax.lax.cond(progress_due(done, report),
               lambda: jax.debug.callback(_report_progress, tick[0], done), lambda: None)


@bounded_cache(64)
def _compiled_loop(loss_fn: Callable, tx_factory: Callable, static: tuple, steps: int,
                   sampling: str, batch: int, capacity: int, rate: float | None,
                   record: Callable | None, n_real: int | None = None,
                   users: NamedSharding | None = None, report: int | None = None):
  """One jitted scan per (loss, chain shape, schedule): hyper-parameters and data are
  arguments, so a sweep compiles once. ``users``: the sampled users' sharding over a mesh
  (each device clips its own users, XLA reduces the sums; key and noise are replicated)."""

  @jax.jit
  def loop(params, key, hparams, data, tick):
    n = jax.tree.leaves(data)[0].shape[0]

    def batch_of(t):
      return sample_users(jax.random.fold_in(key, t), n, sampling=sampling, batch=batch,
                          capacity=capacity, rate=rate, n_real=n_real, shard=users)
    return scan_slot_batches(loss_fn, tx_factory(hparams, *static), params, data, batch_of,
                             steps, record, report, tick, users)

  return loop


def mesh_users_axis(mesh: Mesh, axis: str = "users") -> int:
  """The number of devices on ``mesh``'s ``axis`` (a clear error if it lacks one)."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh has no {axis!r} axis (its axes: {tuple(mesh.axis_names)}): users "
                     f"are sharded over an axis named {axis!r}, e.g. "
                     f"jax.sharding.Mesh(jax.devices(), ('{axis}',))")
  return int(mesh.shape[axis])


def auto_axes(mesh: Mesh | None) -> Mesh | None:
  """``mesh`` with every axis ``Auto`` (same devices, names, shape): the drivers place users
  with sharding constraints, which on ``jax.make_mesh``'s ``Explicit`` axes are assertions, so
  they run on this twin under :func:`mesh_context`."""
  if mesh is None or all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_context(mesh: Mesh | None) -> contextlib.AbstractContextManager:
  """``jax.set_mesh(mesh)`` (nothing for ``None``): the context a run on ``mesh`` is traced in."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def replicated_on(tree: Any, mesh: Mesh | None, caller: Mesh | None) -> Any:
  """``tree`` replicated over ``mesh`` when ``caller`` has non-``Auto`` axes (inputs onto the
  :func:`auto_axes` twin, the release back: JAX refuses operands typed with another mesh)."""
  if caller is None or auto_axes(caller) is caller:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def _on_mesh(data: Any, mesh: Mesh, axis: str) -> tuple[Any, int]:
  """``(data, n real users)``: padded to a multiple of the axis' devices (copies of user 0,
  never sampled), user axis sharded."""
  n_dev = mesh_users_axis(mesh, axis)
  n = jax.tree.leaves(data)[0].shape[0]
  pad = -n % n_dev
  if pad:
    data = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]), data)
  return shard_users(data, mesh, axis), n


def run_chain(loss_fn: Callable, data: Any, params0: Any, tx_factory: Callable, hparams: dict,
              *, static: tuple = (), steps: int, key: jax.Array, sampling: str, batch: int,
              capacity: int, rate: float | None = None,
              record: Callable | None = None, mesh: Mesh | None = None,
              axis: str = "users",
              progress: ProgressFn | None = None) -> tuple[Any, ...]:
  """``steps`` iterations of: sample users -> per-user gradients -> chain -> apply, as one
  jitted ``lax.scan``.

  The chain is ``tx_factory(hparams, *static)``: ``hparams`` (scalars and keys, validated by
  the caller) are traced, ``static`` (hashable) fixes its structure. ``rate``: the Poisson
  rate (default ``batch / n``). Returns ``(released params, final state)``, plus the per-step
  ``record(state)`` stacked on a leading ``[steps]`` axis when ``record`` is given. ``mesh``:
  users are sharded over ``axis``, padded with masked users, and the capacity rounded up to a
  multiple of the devices (a larger capacity only lowers the accounted truncation); the draws
  are the one-device run's. ``progress(steps_done, steps)``: about 20 host calls per run.
  """
  n_real, users = None, None
  if mesh is not None:
    data, n_real = _on_mesh(data, mesh, axis)
    n_dev = mesh_users_axis(mesh, axis)
    capacity = -(-int(capacity) // n_dev) * n_dev
    users = NamedSharding(mesh, PartitionSpec(axis))
  with progress_session(progress, steps) as session:
    loop = _compiled_loop(loss_fn, tx_factory, tuple(static), int(steps), sampling,
                          int(batch), int(capacity), None if rate is None else float(rate),
                          record, n_real, users, session.report)
    return loop(params0, key, hparams, data, session.tick())


def _sgd_step(loss_fn: Callable, tx: Any, params: Any, state: Any, batch: Any,
              mask: jax.Array) -> tuple[Any, Any]:
  grads = per_user_grads(loss_fn, params, batch, user_mask=mask)
  updates, state = tx.update(grads, state, params, user_mask=mask)
  return optax.apply_updates(params, updates), state


def scan_slot_batches(loss_fn: Callable, tx: optax.GradientTransformation, params: Any,
                      data: Any, batch_of: Callable, steps: int, record: Callable | None,
                      report: int | None = None, tick: jax.Array | None = None,
                      users: NamedSharding | None = None):
  """The DP-SGD scan: step ``t`` differentiates the users of ``batch_of(t) = (idx, mask)``
  (masked slots give zero) and applies ``tx``. Returns ``(released params, state)``, plus the
  stacked ``record(state)`` when given. ``report`` / ``tick``: a :class:`ProgressSession`'s;
  ``users``: the sharding the gathered batch is constrained to."""
  def body(carry, t):
    idx, mask = batch_of(t)
    batch = gather_users(data, idx)
    if users is not None:
      batch, mask = jax.lax.with_sharding_constraint((batch, mask), users)
    params, state = _sgd_step(loss_fn, tx, *carry, batch, mask)
    out = None if record is None else record(state)
    emit_progress(report, tick, t)
    return (params, state), out

  (params, state), records = jax.lax.scan(body, (params, tx.init(params)), jnp.arange(steps))
  if record is None:
    return released_params(state, params), state
  return released_params(state, params), state, records


@bounded_cache(64)
def _compiled_step(loss_fn: Callable, tx_factory: Callable, static: tuple,
                   record: Callable | None):
  """One jitted step of the host-driven loop."""
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, hparams, batch, mask):
    params, state = _sgd_step(loss_fn, tx_factory(hparams, *static), params, state, batch, mask)
    return params, state, None if record is None else record(state)
  return step


def run_chain_host(loss_fn: Callable, user_data: Any, params0: Any, tx_factory: Callable,
                   hparams: dict, *, static: tuple = (), steps: int, key: jax.Array,
                   rate: float, capacity: int, view: str = "user",
                   record: Callable | None = None,
                   progress: ProgressFn | None = None,
                   rows: int | None = None, mesh: Mesh | None = None,
                   axis: str = "users") -> tuple[Any, ...]:
  """:func:`run_chain` with Poisson sampling on the host: each step samples in ``O(q n)``
  (:class:`~dpsco_jax.data.PoissonSampler`, seeded by ``key``) and moves only the sampled rows
  to the device, so the table may stay in host memory or a memory map. Same law (rate
  ``rate``, truncated at ``capacity``), chain and noise keys as the scan (other users drawn).
  ``rows``: the rows sampled (default the users; ``view="item_rows"``: the ``U m`` item
  slots). ``mesh``: the slots are padded with masked ones to a multiple of the ``axis``
  devices and sharded over it (same rows as one device; only the reduction order differs)."""
  from dpsco_jax.data.sampling import PoissonSampler, iter_batches
  sampler = PoissonSampler(user_data.n_users if rows is None else rows, rate,
                           capacity=capacity, seed=key)
  put = jax.device_put
  if mesh is not None:
    pad = -int(capacity) % mesh_users_axis(mesh, axis)

    def put(tree):   # masked slots (the mask is padded with False like every leaf)
      return shard_users(jax.tree.map(lambda x: np.pad(
          np.asarray(x), [(0, pad)] + [(0, 0)] * (np.ndim(x) - 1)), tree), mesh, axis)
  state = jax.jit(lambda p, h: tx_factory(h, *static).init(p))(params0, hparams)
  step = _compiled_step(loss_fn, tx_factory, tuple(static), record)
  params = jax.tree.map(jnp.array, params0)   # donated below: never the caller's buffers
  records = []
  for t, batch, mask in iter_batches(user_data, sampler, steps, view=view, put=put):
    params, state, rec = step(params, state, hparams, batch, mask)
    if record is not None:
      records.append(rec)
    if progress is not None and progress_due(t + 1, steps):
      progress(t + 1, steps)
  out = (released_params(state, params), state)
  if record is None:
    return out
  return out + (jax.tree.map(lambda *r: jnp.stack(r), *records),)


def hparam(problem: Any, name: str, value: Any) -> Any:
  """The step size ``name`` as the jitted step reads it: ``value`` in a run of its own, the
  traced per-run number when ``problem`` is one point of a grid sweep
  (:func:`dpsco_jax.sweep.run_stacked`; :data:`dpsco_jax.sweep.GRID` lists such numbers)."""
  traced = getattr(problem, "traced_hparams", None)
  if traced is None or name not in traced.values:
    return value
  return traced.take(name, value)


def traced_hparams(problem: Any) -> bool:
  """Whether ``problem`` is one point of a grid sweep (its step sizes are traced)."""
  return getattr(problem, "traced_hparams", None) is not None


def required_delta(delta: float | None) -> float:
  """The config's target ``delta``, required by every private driver (no silent ``1/n^2``)."""
  if delta is None:
    raise ConfigError("delta is required: the target delta of the (epsilon, delta) guarantee "
                      "(e.g. delta: 1.0e-6); no default is assumed")
  return check_delta(delta)


def sampling_setup(sampling: str, batch_size: int | None, n: int
                   ) -> tuple[str, int, int, float]:
  """``(sampling, batch, capacity, q)`` of ``n`` rows from a schema's ``sampling`` and
  ``batch_size`` (``None``: ``round(sqrt(n))``)."""
  sampling = check_choice(sampling, "sampling", SAMPLINGS)
  batch = n if sampling == "full" else check_int(
      max(1, min(n, int(round(math.sqrt(n))))) if batch_size is None else batch_size,
      "batch_size")
  if batch > n:
    raise ValueError(f"batch_size ({batch}) must be <= n_users ({n})")
  q = check_probability(batch / n, "batch_size / n_users")
  capacity = {"poisson": poisson_capacity(n, q), "fixed": batch, "full": n}[sampling]
  return sampling, batch, capacity, q
