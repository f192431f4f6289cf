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
from dpsco_jax.grads import per_user_grads
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
  """Indices ``[capacity]`` of the users of one step and the mask of real slots.

  * ``poisson``: each user independently with probability ``rate`` (a declared public number;
    default ``batch / n``, which is public only when ``n`` is). User ``i``'s coin is the
    ``i``-th uniform of one draw of shape ``[n]``, so with JAX's partitionable threefry
    (the default) removing the last user leaves every other user's coin unchanged;
  * ``fixed``: a uniformly random ``batch``-subset (without replacement);
  * ``full``: every user.

  ``n_real`` (default ``n``): rows from ``n_real`` on are padding (a mesh pads the user axis to
  a multiple of its devices); they are never sampled and the real users' draws are the ones of
  an unpadded run (the same partitionable-threefry property, and ``fixed`` draws over
  ``n_real``). Slots past ``batch`` (``fixed``) or past the users (``full``) are masked.

  ``shard`` (a mesh's users sharding): the ``[n]`` Poisson coins are drawn sharded, each device
  hashing the counters of its own users only (partitionable threefry gives the same values as
  the unsharded draw), instead of every device drawing all ``n`` coins every step; only the
  ``[n]`` booleans are then gathered for the slot indices.
  """
  n_real = n if n_real is None else n_real
  if sampling == "full":
    return jnp.arange(capacity) % n, jnp.arange(capacity) < n_real
  if sampling == "fixed":
    idx = jax.random.choice(key, n_real, (batch,), replace=False)
    pad = capacity - batch
    return (jnp.concatenate([idx, jnp.zeros((pad,), idx.dtype)]),
            jnp.arange(capacity) < batch)
  chosen = jax.random.bernoulli(key, batch / n_real if rate is None else rate, (n,))
  chosen = chosen & (jnp.arange(n) < n_real)
  if shard is not None:
    return _sharded_slots(jax.lax.with_sharding_constraint(chosen, shard), shard, capacity)
  (idx,) = jnp.nonzero(chosen, size=capacity, fill_value=0)
  mask = jnp.arange(capacity) < jnp.sum(chosen)
  return idx, mask


def _sharded_slots(chosen: jax.Array, shard: NamedSharding, capacity: int
                   ) -> tuple[jax.Array, jax.Array]:
  """``jnp.nonzero(chosen, size=capacity, fill_value=0)`` and the real-slot mask, for coins
  sharded over one mesh axis, in O(n / devices + capacity) work per device: each device finds
  its own chosen users, places them at its offset (the chosen count of the devices before it)
  and the slot vectors are summed across the axis. The result is the global one, slot for slot
  (the first ``capacity`` chosen users in index order), so the truncation at ``capacity`` and
  the gathered batch are those of the one-device run."""
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
  """``mask`` over the ``n`` real rows (``None``: all of them), extended with ``False`` over
  a mesh's ``n_rows - n`` padding rows (:func:`_on_mesh`), so the padding is in no sum; the
  real rows' entries (and any draw that made them) are unchanged. ``mask`` itself when there
  is no padding."""
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


def _with_total(progress: ProgressFn, total: int, step: int) -> None:
  progress(step, total)


def progress_points(steps: int, reports: int = 20) -> int:
  """Every how many steps a run reports progress (about ``reports`` times per run)."""
  return max(1, -(-int(steps) // reports))


def progress_due(done: Any, total: int) -> Any:
  """Whether a run of ``total`` steps reports after ``done`` of them: every
  :func:`progress_points` steps and at the last one (so the last report says the run is
  done). ``done`` is a Python int (host loops) or a traced int (a scan's body)."""
  return (done % progress_points(total) == 0) | (done == total)


class ProgressSession:
  """One run's progress reports: ``report`` is the static part a compiled loop is built with
  (``None``: no callback, nothing compiled in, so the program is the one without progress),
  :meth:`tick` the traced part it is called with (the run's id and the steps before this
  loop, for a run of several loops). Made by :func:`progress_session`."""

  def __init__(self, run_id: int, total: int):
    self.run_id, self.total = run_id, int(total)
    self.report = None if run_id == 0 else self.total

  def tick(self, offset: int = 0) -> jax.Array | None:
    return None if self.report is None else jnp.asarray([self.run_id, offset], jnp.int32)


@contextlib.contextmanager
def progress_session(progress: ProgressFn | None, total: int) -> Iterator[ProgressSession]:
  """The one way a driver's compiled loops report progress: registers ``progress`` (``None``:
  no reports) for a run of ``total`` steps, and, on leaving, waits until every report has run
  and unregisters it. Loops call :func:`emit_progress` in their body with the session's
  ``report`` and ``tick``; ``progress`` receives the steps done and ``total``."""
  run_id = next(_PROGRESS_IDS) if progress is not None else 0
  if progress is not None:
    _PROGRESS[run_id] = functools.partial(_with_total, progress, int(total))
  try:
    yield ProgressSession(run_id, total)
    if progress is not None:
      jax.effects_barrier()   # every callback has run before the run returns
  finally:
    _PROGRESS.pop(run_id, None)


def emit_progress(report: int | None, tick: jax.Array | None, t: jax.Array) -> None:
  """In a compiled loop's body at its step ``t`` (0-based): reports the run's steps done
  (``tick[1] + t + 1`` of ``report``) to the host when :func:`progress_due`. Only the step
  count reaches the host, never a data-dependent value; ``report`` ``None`` adds nothing."""
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
  arguments, so a sweep over seeds / epsilons / learning rates compiles once. ``users``: the
  sharding of a step's sampled users over a mesh (each device differentiates and clips its
  own users; XLA reduces the clipped sums across the axis; the key and the noise are
  replicated, so they are drawn once; the Poisson coins are drawn sharded, see
  :func:`sample_users`)."""

  def spread(tree):
    return tree if users is None else jax.lax.with_sharding_constraint(tree, users)

  @jax.jit
  def loop(params, key, hparams, data, tick):
    n = jax.tree.leaves(data)[0].shape[0]
    tx = tx_factory(hparams, *static)
    state = tx.init(params)

    def body(carry, t):
      params, state = carry
      idx, mask = sample_users(jax.random.fold_in(key, t), n, sampling=sampling, batch=batch,
                               capacity=capacity, rate=rate, n_real=n_real, shard=users)
      batch_data, mask = spread((gather_users(data, idx), mask))
      grads = per_user_grads(loss_fn, params, batch_data, user_mask=mask)
      updates, state = tx.update(grads, state, params, user_mask=mask)
      out = None if record is None else record(state)
      emit_progress(report, tick, t)   # the step count only
      return (optax.apply_updates(params, updates), state), out

    (params, state), records = jax.lax.scan(body, (params, state), jnp.arange(steps))
    if record is None:
      return released_params(state, params), state
    return released_params(state, params), state, records

  return loop


def mesh_users_axis(mesh: Mesh, axis: str = "users") -> int:
  """The number of devices on ``mesh``'s ``axis`` (a clear error if the mesh lacks it)."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh has no {axis!r} axis (its axes: {tuple(mesh.axis_names)}): users "
                     f"are sharded over an axis named {axis!r}, e.g. "
                     f"jax.sharding.Mesh(jax.devices(), ('{axis}',))")
  return int(mesh.shape[axis])


def auto_axes(mesh: Mesh | None) -> Mesh | None:
  """``mesh`` with every axis of type ``Auto`` (same devices, names and shape).

  ``jax.make_mesh`` makes ``Explicit`` axes (the default since JAX 0.7), on which
  ``with_sharding_constraint`` is an assertion and ``shard_map`` / ``device_put`` type the
  arrays with that mesh: the drivers place users with sharding constraints, so they run on
  this auto-typed twin, under :func:`mesh_context` (a caller's explicit ``jax.set_mesh``
  context would otherwise be the one their jitted code is traced in)."""
  if mesh is None or all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None) -> Iterator[None]:
  """``jax.set_mesh(mesh)`` (nothing for ``None``): the context a run on ``mesh`` is traced in;
  nested inside a caller's context, it is the one jitted code sees."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh):
    yield


def replicated_on(tree: Any, mesh: Mesh | None, caller: Mesh | None) -> Any:
  """``tree`` replicated over ``mesh`` when the ``caller``'s mesh has non-``Auto`` axes: a
  run's inputs made in the caller's explicit context (params, key) onto its
  :func:`auto_axes` twin, and the released params back onto the caller's mesh (JAX refuses an
  op whose operands are typed with another mesh than the context's). ``tree`` otherwise."""
  if caller is None or auto_axes(caller) is caller:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def _on_mesh(data: Any, mesh: Mesh, axis: str) -> tuple[Any, int]:
  """``data`` padded to a multiple of the axis' devices (copies of user 0, never sampled) and
  placed with its user axis sharded; returns it and the number of real users."""
  n_dev = mesh_users_axis(mesh, axis)
  n = jax.tree.leaves(data)[0].shape[0]
  pad = -n % n_dev
  if pad:
    data = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]), data)
  def put(x):
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(axis, *([None] * (x.ndim - 1)))))
  return jax.tree.map(put, data), n


def run_chain(loss_fn: Callable, data: Any, params0: Any, tx_factory: Callable, hparams: dict,
              *, static: tuple = (), steps: int, key: jax.Array, sampling: str, batch: int,
              capacity: int, rate: float | None = None,
              record: Callable | None = None, mesh: Mesh | None = None,
              axis: str = "users",
              progress: ProgressFn | None = None) -> tuple[Any, ...]:
  """``steps`` iterations of: sample users -> per-user gradients -> chain -> apply.

  The chain is ``tx_factory(hparams, *static)``: ``hparams`` (a dict of scalars and keys,
  validated by the caller) are traced, ``static`` (hashable) fixes the chain's structure. The
  whole loop is one jitted ``lax.scan``. ``rate`` is the Poisson sampling rate (default
  ``batch / n``). Returns ``(released params, final state)``; with ``record`` (a hashable
  ``state -> pytree``, e.g. the release a stage keeps in its state) also the per-step
  records stacked along a leading ``[steps]`` axis.

  ``mesh``: users (the data's rows and each step's sampled slots) are sharded over its
  ``axis``; a user count that the devices do not divide is padded with masked users, and the
  slot capacity is rounded up to a multiple of the devices (extra slots are masked unless the
  Poisson draw fills them: a larger capacity only lowers the truncation the plan accounted).
  The draws are those of the one-device run, so the released params agree to float tolerance.

  ``progress``: a host function called with the steps done and ``steps``, about 20 times per
  run and at the last step (:func:`progress_session`; it receives step counts only).
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


def scan_slot_batches(loss_fn: Callable, tx: optax.GradientTransformation, params: Any,
                      data: Any, batch_of: Callable, steps: int, record: Callable | None,
                      report: int | None = None, tick: jax.Array | None = None):
  """The DP-SGD scan over a public schedule of user slots (cyclic batches, b-min-sep Poisson
  groups): step ``t`` differentiates the users ``idx`` of ``batch_of(t) = (idx, mask)`` (masked
  slots contribute zero) and applies the chain. Returns ``(released params, state)``, plus the
  per-step ``record(state)`` outputs when ``record`` is given. ``report`` / ``tick``: a
  :class:`ProgressSession`'s (progress reports, :func:`emit_progress`)."""
  def body(carry, t):
    params, state = carry
    idx, mask = batch_of(t)
    grads = per_user_grads(loss_fn, params, gather_users(data, idx), user_mask=mask)
    updates, state = tx.update(grads, state, params, user_mask=mask)
    out = None if record is None else record(state)
    emit_progress(report, tick, t)
    return (optax.apply_updates(params, updates), state), out

  (params, state), records = jax.lax.scan(body, (params, tx.init(params)), jnp.arange(steps))
  if record is None:
    return released_params(state, params), state
  return released_params(state, params), state, records


@bounded_cache(64)
def _compiled_step(loss_fn: Callable, tx_factory: Callable, static: tuple,
                   record: Callable | None):
  """One jitted step of the host-driven loop (the body of :func:`_compiled_loop`'s scan)."""
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, hparams, batch, mask):
    tx = tx_factory(hparams, *static)
    grads = per_user_grads(loss_fn, params, batch, user_mask=mask)
    updates, state = tx.update(grads, state, params, user_mask=mask)
    return (optax.apply_updates(params, updates), state,
            None if record is None else record(state))
  return step


def run_chain_host(loss_fn: Callable, user_data: Any, params0: Any, tx_factory: Callable,
                   hparams: dict, *, static: tuple = (), steps: int, key: jax.Array,
                   rate: float, capacity: int, view: str = "user",
                   record: Callable | None = None,
                   progress: ProgressFn | None = None,
                   rows: int | None = None, mesh: Mesh | None = None,
                   axis: str = "users") -> tuple[Any, ...]:
  """:func:`run_chain` with Poisson sampling done on the host: each step samples users in
  ``O(q n)`` expected work (:class:`~dpsco_jax.data.PoissonSampler`, seeded by ``key``) and
  moves only their rows to the device (:func:`~dpsco_jax.data.iter_batches`, one step
  ahead), so the table stays in host memory or a memory map (``UserData.open``) and a step's
  cost does not grow with ``n``. Same law (each user with probability ``rate``, truncated at
  ``capacity``), same chain and noise keys as the scan; other users are drawn than by the
  device sampler with the same key. ``rows``: the number of rows sampled (default: the users;
  ``view="item_rows"`` samples the ``U m`` item slots).

  ``mesh``: each step's ``capacity`` slots are padded on the host with masked slots to a
  multiple of the ``axis`` devices and placed sharded over it, so each device receives and
  differentiates only its share of the sampled rows; XLA reduces the clipped sums across the
  axis and the noise (replicated state, one key) is drawn once. The sampled rows and their
  order are the one-device run's: only the reduction order differs."""
  from dpsco_jax.data.sampling import PoissonSampler, iter_batches
  sampler = PoissonSampler(user_data.n_users if rows is None else rows, rate,
                           capacity=capacity, seed=key)
  put = jax.device_put
  if mesh is not None:
    pad = -int(capacity) % mesh_users_axis(mesh, axis)

    def place(x):
      x = np.asarray(x)
      if pad:   # masked slots (the mask is padded with False like every leaf)
        x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
      spec = PartitionSpec(axis, *([None] * (x.ndim - 1)))
      return jax.device_put(x, NamedSharding(mesh, spec))

    def put(tree):
      return jax.tree.map(place, tree)
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
  """``value``, the number ``name`` (a step size) of this run, as the driver's jitted step
  should read it: ``value`` itself in a run of its own (nothing changes), the traced per-run
  number when ``problem`` is one point of a grid sweep (``problem.traced_hparams``, set by
  :func:`dpsco_jax.sweep.run_stacked` with a grid; ``value`` is then recorded as that
  point's number). A driver routes through this only numbers its step reads as numbers and
  nothing else (:data:`dpsco_jax.sweep.GRID` lists them)."""
  traced = getattr(problem, "traced_hparams", None)
  if traced is None or name not in traced.values:
    return value
  return traced.take(name, value)


def traced_hparams(problem: Any) -> bool:
  """Whether ``problem`` is one point of a grid sweep (its step sizes are traced)."""
  return getattr(problem, "traced_hparams", None) is not None


def cfg_get(cfg: dict, name: str, default: Any = None) -> Any:
  value = cfg.get(name, default)
  return default if value is None else value


def required_delta(delta: float | None) -> float:
  """The run's target ``delta`` (its config's field): every private driver requires it (no
  silent default such as ``1/n^2``); a missing one is a
  :class:`~dpsco_jax.config.schema.ConfigError` naming it."""
  if delta is None:
    raise ConfigError("delta is required: the target delta of the (epsilon, delta) guarantee "
                      "(e.g. delta: 1.0e-6); no default is assumed")
  return check_delta(delta)


def sampling_setup(cfg: dict, n: int) -> tuple[str, int, int, float]:
  """Reads ``sampling`` and ``batch_size`` from a config: (sampling, batch, capacity, q).
  ``sampling`` must be given: its default is the caller's schema's (``fixed`` for
  ``nonprivate_sgd``, ``poisson`` for DP-SGD), not a second copy here."""
  sampling = check_choice(cfg["sampling"], "sampling", SAMPLINGS)
  batch = n if sampling == "full" else check_int(
      cfg_get(cfg, "batch_size", max(1, min(n, int(round(math.sqrt(n)))))), "batch_size")
  if batch > n:
    raise ValueError(f"batch_size ({batch}) must be <= n_users ({n})")
  q = check_probability(batch / n, "batch_size / n_users")
  capacity = {"poisson": poisson_capacity(n, q), "fixed": batch, "full": n}[sampling]
  return sampling, batch, capacity, q
