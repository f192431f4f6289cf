"""Many processes: user- and item-level DP-SGD under ``jax.distributed``.

The same program runs on every process (JAX's multi-controller model)::

    from dpsco_jax import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=i)   # first
    data = UserData.open(store).shard(jax.process_index(), jax.process_count())
    result = dpsco_jax.fit("dp_sgd_user", config, loss_fn, params, data, key)

``dpsco_jax.run`` / ``fit`` take this path when ``jax.process_count() > 1`` or the data is a
shard (``distributed=`` forces it on or off). What holds:

* **One plan.** A shard's ``spec`` is the whole dataset's and Poisson DP-SGD reads the
  *declared* ``n_users``, so every process makes the one-process plan.
* **A handshake before the first step** (:func:`handshake`): a process that disagrees on the
  config, plan, guarantee, key, initial params, data facts or shard, or could not plan, makes
  every process raise :class:`DistributedMismatch` before anything is released.
* **One sampling law.** Every process draws the *global* Poisson sample from the shared key
  (the one-process host run's draw) and keeps its users' part.
* **One reduction, one noise.** The clipped sums are all-reduced and the noise from the
  replicated key added once; the record's ``ledger_digest`` is :func:`privacy_digest`.

So the release equals the one-process ``data_placement="host"`` run with the same key to float
tolerance. Ready (``DISTRIBUTED_READY``): ``dp_sgd_user`` and ``dp_sgd_item`` with Poisson
sampling and independent noise; anything else is refused. CPU processes use gloo collectives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from types import ModuleType
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.data.user_data import ShardInfo, UserData
from dpsco_jax.smoothing import num_params

__all__ = ["DISTRIBUTED_READY", "DistributedMismatch", "initialize", "users_mesh",
           "privacy_digest", "handshake", "run", "fit"]

#: Algorithms that run under ``jax.distributed`` (the others are refused).
DISTRIBUTED_READY = frozenset(n for n, e in algorithms().items() if e.distributed)
_WORDS = 4   # int64 words kept of a SHA-256 digest (the whole digest)


class DistributedMismatch(ValueError):
  """The processes of a ``jax.distributed`` run disagree (raised on every process, before the
  first step)."""


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: int = 60) -> None:
  """``jax.distributed.initialize`` with gloo CPU collectives on (processes without
  accelerators can all-reduce). Call it before any other JAX work."""
  if jax.config.values.get("jax_cpu_collectives_implementation") in (None, "", "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=int(num_processes), process_id=int(process_id),
                             initialization_timeout=int(timeout_s))


def users_mesh(axis: str = "users") -> Mesh:
  """A 1-D mesh over every process's devices (each process's adjacent)."""
  return Mesh(np.array(jax.devices()), (axis,))


def _canonical(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, default=repr).encode()


def _words(data: bytes) -> np.ndarray:
  return np.frombuffer(hashlib.sha256(data).digest(), np.int64).copy()


def privacy_digest(report: Any) -> str:
  """SHA-256 of a :class:`~dpsco_jax.privacy.PrivacyReport`: equal guarantees, equal digests."""
  return hashlib.sha256(_canonical(dataclasses.asdict(report))).hexdigest()


#: (name, words, what a mismatch means); the digests are compared, the ints shown
_FIELDS = (("ok", 1, "could plan the run"),
           ("config", _WORDS, "algorithm and config"),
           ("config_len", 1, ""),
           ("n_users", 1, "declared n_users"),
           ("plan", _WORDS, "plan (schedule, noise, capacity)"),
           ("privacy", _WORDS, "privacy guarantee (ledger)"),
           ("key", _WORDS, "PRNG key (not shown)"),
           ("params", _WORDS, "initial params (values, shapes, dtypes)"),
           ("data", _WORDS, "data facts (m, item shapes, layout, total users)"),
           ("process", 2, "shard index / count"))


def _allgather(x: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  out = np.asarray(multihost_utils.process_allgather(x))
  return out.reshape((jax.process_count(),) + x.shape)


def handshake(facts: dict[str, Any], config: dict | None) -> None:
  """All-gathers ``facts`` (the :data:`_FIELDS`) and raises :class:`DistributedMismatch` on
  every process if any differs or could not plan. Every process reads the same table, so all
  take the same branches and collectives."""
  row = np.concatenate([np.asarray(facts[name], np.int64).reshape(k) for name, k, _ in _FIELDS])
  table = _allgather(row)
  cols, at = {}, 0
  for name, k, _ in _FIELDS:
    cols[name], at = table[:, at:at + k], at + k
  bad = [p for p in range(table.shape[0]) if cols["ok"][p, 0] != 1]
  if bad:
    raise DistributedMismatch(f"process(es) {bad} refused the run before the first step (their "
                              "own error names why); nothing was released")
  count, problems = table.shape[0], []
  expect = {"process": np.stack([np.arange(count), np.full(count, count)], 1)}  # shard p on p
  for name, _, what in _FIELDS:
    col = cols[name]
    if name in ("ok", "config_len") or (col == expect.get(name, col[0])).all():
      continue
    if name == "n_users":
      what += ": " + ", ".join(f"process {p}: {'undeclared' if v < 0 else v}"
                               for p, v in enumerate(col[:, 0]))
    elif name == "process":
      what += ": " + ", ".join(f"process {p}: {i}/{c}" for p, (i, c) in enumerate(col))
    elif name == "config":
      what += ": " + _config_diff(config, int(cols["config_len"].max()))
    problems.append(what)
  if problems:
    raise DistributedMismatch("the processes disagree before the first step (nothing was "
                              "released): " + "; ".join(problems))


def _config_diff(config: dict | None, length: int) -> str:
  """The config keys (public hyper-parameters) that differ, with their values: a second,
  fixed-shape gather of every process's canonical config."""
  mine = _canonical(config or {})
  buf = np.zeros(length, np.uint8)
  buf[:len(mine)] = np.frombuffer(mine, np.uint8)
  rows = _allgather(buf)
  configs = [json.loads(bytes(r).rstrip(b"\0") or b"{}") for r in rows]
  keys = sorted({k for c in configs for k in c if any(c.get(k) != o.get(k) for o in configs)})
  return ", ".join(f"{k} (" + ", ".join(f"process {p}: {c.get(k, '<unset>')!r}"
                                        for p, c in enumerate(configs)) + ")" for k in keys)


class _ShardSampler:
  """The global Poisson draw of step ``t`` cut to this process's users: ``(local idx, mask)``
  of a slot count every process computes alike from the global draw."""

  def __init__(self, sampler: Any, info: ShardInfo, small: int, large: int,
               per_user: int = 1):
    self.sampler, self.info, self.per_user = sampler, info, int(per_user)
    # the rows iter_batches checks against the shard: users, or item slots (m per user)
    self.n_users = info.size() * self.per_user
    self.small, self.large = small, large

  def __call__(self, t: int) -> tuple[np.ndarray, np.ndarray]:
    idx, mask = self.sampler(t)            # global, truncated at the plan's capacity
    chosen = idx[mask]
    # a row is a user, or item slot r % m of user r // m (the item view's rows)
    users, slot = np.divmod(chosen, self.per_user)
    owner = self.info.owner(users)
    counts = np.bincount(owner, minlength=self.info.count)
    slots = self.small if counts.max() <= self.small else self.large
    here = owner == self.info.index
    mine = self.info.local(users[here]) * self.per_user + slot[here]
    out = np.zeros(slots, np.int64)
    out[:mine.size] = mine
    return out, np.arange(slots) < mine.size


def _round_up(x: int, k: int) -> int:
  return -(-int(x) // k) * k


def _global_put(mesh: Mesh, axis: str) -> Callable[[Any], Any]:
  """Process-local rows (the same count on every process) -> one array sharded on ``axis``."""
  count = jax.process_count()

  def put_leaf(x):
    x = np.asarray(x)
    spec = PartitionSpec(axis, *([None] * (x.ndim - 1)))
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x,
                                                  (count * x.shape[0],) + x.shape[1:])
  return lambda tree: jax.tree.map(put_leaf, tree)


def _replicate(tree: Any, mesh: Mesh) -> Any:
  """Equal host values on every process -> fully replicated global arrays."""
  rep = NamedSharding(mesh, PartitionSpec())

  def leaf(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, rep, lambda index: x[index])
  return jax.tree.map(leaf, tree)


def _to_local(x: jax.Array) -> np.ndarray:
  """A replicated global array's value on this process."""
  if x.is_fully_addressable or x.sharding.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _refusal(p: Any, data: UserData, mesh: Any, placement: str) -> None:
  """Raises why this process cannot take part."""
  if not algorithms()[p.algorithm].distributed:
    raise ValueError(f"{p.algorithm} does not run under jax.distributed yet; ready: "
                     f"{', '.join(sorted(DISTRIBUTED_READY))}")
  sched = p.schedule or {}
  if sched.get("sampling") != "poisson" or (p.config.get("noise_mechanism") or
                                            "independent") != "independent":
    raise ValueError("a jax.distributed run samples users by Poisson sampling with "
                     "independent noise (got sampling="
                     f"{sched.get('sampling')!r}, noise_mechanism="
                     f"{p.config.get('noise_mechanism')!r})")
  if mesh is not None:
    raise ValueError("a jax.distributed run builds its own mesh over every process's devices: "
                     "leave mesh unset")
  if placement not in ("auto", "host"):
    raise ValueError("a jax.distributed run keeps each process's users on its host and moves "
                     f"only the sampled ones (data_placement='host'), got {placement!r}")
  info, count = data.shard_info, jax.process_count()
  if info is None and count > 1:
    raise ValueError("each process must hold only its own users: pass "
                     "data.shard(jax.process_index(), jax.process_count())")
  if info is not None and (info.count, info.index) != (count, jax.process_index()):
    raise ValueError(f"this data is shard {info.index} of {info.count}, but this is process "
                     f"{jax.process_index()} of {count}")


def fit(algorithm: str, config: Any, loss_fn: Callable, params: Any, data: UserData,
        key: jax.Array, *, api: ModuleType, constants: Any = None, **kwargs: Any) -> Any:
  """``run(plan(...), ...)``; a process that cannot plan still joins the handshake, so the
  others raise too instead of waiting. ``api``: :mod:`dpsco_jax.api` (see :func:`run`)."""
  try:
    p = api.plan(algorithm, config, data.spec, num_params=num_params(params),
                 constants=constants)
  except Exception as err:   # noqa: BLE001 - raised after the handshake, on this process
    return run(None, loss_fn, params, data, key, api=api, _error=err, **kwargs)
  return run(p, loss_fn, params, data, key, api=api, **kwargs)


def _prepare(p: Any, loss_fn: Callable, params: Any, data: UserData, key: jax.Array,
             mesh: Any, data_placement: str, api: ModuleType, facts: dict) -> tuple:
  """This process's checks, filling ``facts`` for the handshake: ``(config, plan, problem,
  shard info, initial params)``."""
  from dpsco_jax.data.problem import UserDataProblem

  if not isinstance(p, api.Plan):
    raise TypeError(f"run needs a Plan (dpsco_jax.plan(...)), got {type(p).__name__}")
  if not isinstance(data, UserData):
    raise TypeError(f"data must be a UserData, got {type(data).__name__}")
  _refusal(p, data, mesh, data_placement)
  level = algorithms()[p.algorithm].level
  problem = UserDataProblem(loss_fn, params, data, level=level, constants=p.constants)
  if problem.d != p.num_params:
    raise ValueError(f"the plan was made for {p.num_params} parameters, params has "
                     f"{problem.d}")
  api._check_data_for_plan(p, data, "the data")
  p.check_unchanged()
  plan = p.detail   # the DP-SGD plan, made from the spec's (global) facts, never a local count
  if plan.adaptive is not None:   # its stage would be replaced by a fixed clip at C_0
    raise ValueError("clip_norm: adaptive does not run across processes yet: use one process")
  rows = data.spec.n_users * (1 if level == "user" else data.spec.max_items_per_user)
  if plan.relation == "add_remove" and rows > plan.n_public:
    # not how many: the realized count is private under add_remove
    raise ValueError(f"the data has more {level} rows than the declared count "
                     f"({plan.n_public})")
  info = data.shard_info or ShardInfo(0, 1, data.n_users)
  w0 = np.asarray(problem.init_params())
  config = {"algorithm": p.algorithm, **p.config}
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):   # hashed: never sent in clear
    key = jax.random.key_data(key)
  facts.update(
      ok=1, config=_words(_canonical(config)), config_len=len(_canonical(config)),
      n_users=-1 if p.config.get("n_users") is None else int(p.config["n_users"]),
      plan=_words(_canonical([repr(plan), p.noise_multiplier, p.schedule])),
      privacy=_words(privacy_digest(p.privacy).encode()), key=_words(np.asarray(key).tobytes()),
      params=_words(w0.tobytes() + _canonical([w0.shape, str(w0.dtype)])),
      data=_words(_canonical([data.spec.max_items_per_user,
                              [list(s) for s in data.spec.item_shapes],
                              info.layout, info.n_users_total])),
      process=np.array([info.index, info.count]))
  return config, plan, problem, info, w0


def run(p: Any, loss_fn: Callable, params: Any, data: UserData, key: jax.Array, *,
        api: ModuleType, callback: Callable | None = None, mesh: Any = None,
        data_placement: str = "auto", _error: Exception | None = None) -> Any:
  """Executes plan ``p`` (made from ``data.spec``, the whole dataset's facts) on this
  process's shard with the other processes (module docstring); every process returns the
  same :class:`~dpsco_jax.result.Result`, params local. ``_error`` (:func:`fit`) is raised
  after the handshake refuses the run everywhere. ``api``: :mod:`dpsco_jax.api`, handed in by
  its ``run`` / ``fit`` (importing it would make the modules import each other)."""
  from dpsco_jax.algorithms.common import _compiled_step, poisson_capacity, progress_points
  from dpsco_jax.algorithms.dpsgd.driver import dp_sgd_chain
  from dpsco_jax.data.sampling import PoissonSampler, iter_batches
  from dpsco_jax.result import Result
  from dpsco_jax.transforms.steps import released_params

  facts: dict[str, Any] = {name: np.zeros(k, np.int64) for name, k, _ in _FIELDS}
  error, config = _error, None
  if error is None:
    try:
      config, plan, problem, info, w0 = _prepare(p, loss_fn, params, data, key, mesh,
                                                 data_placement, api, facts)
    except Exception as err:   # noqa: BLE001 - re-raised below, after the others learn of it
      error = err
  try:
    handshake(facts, config)
  finally:
    if error is not None:   # this process's own reason (the handshake refused it)
      raise error from None

  report = p.privacy      # the plan's guarantee (its ledger was charged when it was planned)
  mesh_ = users_mesh()
  local = len(jax.local_devices())
  per_user = 1 if plan.level == "user" else problem.m     # item level: rows are item slots
  n, q, cap = info.n_users_total * per_user, plan.sampling_rate, plan.capacity
  large = _round_up(cap, local)
  small = min(large, _round_up(poisson_capacity(-(-n // info.count), q), local))
  sampler = _ShardSampler(PoissonSampler(n, q, capacity=cap, seed=jax.random.fold_in(key, 2)),
                          info, small, large, per_user)
  hparams = {"clip": plan.clip, "stddev": plan.noise_std, "lr": plan.lr,
             "radius": problem.radius,
             "noise_key": jax.random.wrap_key_data(_replicate(
                 jax.random.key_data(jax.random.fold_in(key, 1)), mesh_))}
  static = (plan.denominator, plan.averaging, False)
  step = _compiled_step(problem.loss_fn, dp_sgd_chain, static, None)
  params_g = _replicate(w0, mesh_)
  state = jax.jit(lambda w, h: dp_sgd_chain(h, *static).init(w))(params_g, hparams)
  progress = api._progress(p, callback)
  every = progress_points(plan.steps)
  view = "user" if plan.level == "user" else "item_rows"
  for t, batch, mask in iter_batches(data, sampler, plan.steps, view=view,
                                     put=_global_put(mesh_, "users")):
    params_g, state, _ = step(params_g, state, hparams, batch, mask)
    if progress is not None and (t + 1) % every == 0:
      progress(t + 1)
  released = jax.numpy.asarray(_to_local(released_params(state, params_g)))
  record = {"noise_multiplier": plan.noise_multiplier, "num_steps": plan.steps,
            "batch_size": plan.batch, "denominator": plan.denominator,
            "sampling_rate": plan.sampling_rate, "noise_std": plan.noise_std,
            "clip_norm": plan.clip, "learning_rate": plan.lr, "sampling": plan.sampling,
            "relation": plan.relation, "noise_mechanism": plan.noise,
            "processes": info.count, "ledger_digest": privacy_digest(report)}
  result = Result(params=released, privacy=report,
                  gradient_evaluations=int(plan.steps * plan.batch * problem.m // per_user),
                  record=record)
  api.check_spent(p, result)
  return dataclasses.replace(result, params=problem.unflatten(result.params))

