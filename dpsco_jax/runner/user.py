"""Your model, loss and data in a YAML sweep: the runner's ``user`` problem.

A ``problem:`` section names your code by import path (a ``factory`` building the whole
problem, or a ``model`` and a ``loss``) and your data by file
(:mod:`dpsco_jax.runner.datafiles`); the keys: ``docs/guides/model_and_data.md``. Records
carry your metrics instead of ``excess_risk``; metrics on the training users are a diagnostic
outside the guarantee, and only ``eval_data`` declared public may be scored by a private
selection (:func:`check_selection_metric`). Everything is checked before any run
(:func:`check`), each error one :class:`ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np

from dpsco_jax.config.families import (CONFIG_ONLY_ALGORITHMS, USER_PROBLEM, DPTrainerConfig,
                                       RunnerKeys, UserProblemKeys)
from dpsco_jax.config.types import ConfigError
from dpsco_jax.smoothing import num_params
from dpsco_jax.runner.datafiles import load_data_file, parse_data_file
from dpsco_jax.runner.usercode import (CONSTANT_KEYS, as_callable, call_with_run_args,
                                       check_call_args, import_object, metric_table,
                                       static_metrics)

__all__ = ["UserProblem", "USER_PROBLEM", "check", "check_loss_finite", "check_metrics",
           "check_selection_metric", "make_problem", "plan_run", "run", "cache_key",
           "static_metrics", "load_data_file"]


@dataclasses.dataclass
class UserProblem:
  """What a factory returns (or a mapping of these fields).

  Attributes:
    loss: ``loss(model_or_params, example) -> scalar``, one item.
    model: an ``nnx.Module`` or a params pytree (the initial point; never modified: each
      run trains a copy).
    data: the training :class:`~dpsco_jax.data.UserData`.
    eval_data: what the metrics read (default: ``data``).
    metrics: ``{field: metric(trained, eval_data) -> float}``.
    constants: declared constants of the loss class (``lipschitz``, ``smoothness``,
      ``radius``, ``strong_convexity``).
    n_users: the declared public number of users (read under ``add_remove``).
    eval_data_public: ``eval_data`` is declared public (not the training users, not covered
      by the guarantee): a private selection may score on it.
    source: the factory or model path, for messages and records.
  """
  loss: Callable
  model: Any
  data: Any
  eval_data: Any = None
  metrics: dict = dataclasses.field(default_factory=dict)
  constants: dict = dataclasses.field(default_factory=dict)
  n_users: int | None = None
  eval_data_public: bool = False
  source: str = ""
  # set by check_loss_finite: rows that share this problem probe it once
  loss_checked: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

  @property
  def is_module(self) -> bool:
    from flax import nnx
    return isinstance(self.model, nnx.Module)


def check(cfg: dict) -> None:
  """Checks a validated ``user`` run config before anything runs: the imports, the
  arguments, the data files and their columns, and that the algorithm can run on your code.
  Raises :class:`ConfigError` (one line)."""
  from dpsco_jax.api import READS_M, UNSUPPORTED
  algorithm = cfg["algorithm"]
  if algorithm in UNSUPPORTED:
    raise ConfigError(f"{algorithm} cannot run on your model and data: "
                      f"{UNSUPPORTED[algorithm]}")
  prob = UserProblemKeys.of(cfg)
  args = prob.args or {}
  if prob.factory is not None:
    given = [k for k in ("model", "loss", "data", "eval_data") if prob[k] is not None]
    if given:
      raise ConfigError(f"problem.{given[0]}: a factory builds the whole problem; give "
                        "factory (with args), or model, loss and data, not both")
    check_call_args(import_object(prob.factory, "problem.factory"), args, "problem.factory")
  else:
    missing = [k for k in ("model", "loss", "data") if prob[k] is None]
    if missing:
      raise ConfigError("the user problem needs factory, or model, loss and data (missing: "
                        f"{', '.join(missing)})")
    check_call_args(import_object(prob.model, "problem.model"), args, "problem.model")
    import_object(prob.loss, "problem.loss")
    data = parse_data_file(prob.data, "problem.data")
    if prob.eval_data is not None:
      parse_data_file(prob.eval_data, "problem.eval_data")
    elif prob.eval_data_public:
      raise ConfigError(NO_PUBLIC_EVAL_DATA)
    if algorithm in READS_M and data.max_items_per_user is None:
      raise ConfigError(f"{algorithm}'s guarantee reads m, the items per user: declare it in "
                        "the data file's mapping (data: {path: ..., max_items_per_user: m}); a "
                        "measured m is a function of the private data")
  if algorithm in CONFIG_ONLY_ALGORITHMS:
    trainer = DPTrainerConfig.of(cfg)
    if (prob.factory is None and trainer.sampling == "poisson"
        and trainer.expected_batch_size is None
        and trainer.get("relation", "add_remove") == "add_remove" and prob.n_users is None):
      raise ConfigError(f"{algorithm} under relation add_remove needs expected_batch_size "
                        "or a declared n_users (problem section): the number of users is "
                        "private")
    _check_trainer(trainer, algorithm)
  metric_table(prob.metric, "problem.metric", as_callable)


def _check_trainer(trainer: DPTrainerConfig, name: str) -> None:
  """``flax.DPTrainer``'s interdependent keys (sampling, noise, ``clip_norm`` and the adaptive
  keys), refused before any run with the DPTrainer's and DP-SGD's adaptive plan's own checks."""
  from dpsco_jax.algorithms.dpsgd.config import ADAPTIVE_KEYS
  from dpsco_jax.algorithms.dpsgd.plan import SAMPLING_RELATIONS, adaptive_plan, check_mf_sampling
  from dpsco_jax.flax.trainer import check_clip_args
  from dpsco_jax.flax.trainer_noise import check_cyclic_args
  from dpsco_jax.privacy import calibrate_poisson_sgd
  try:
    check_mf_sampling(trainer.noise_mechanism, trainer.sampling, allowed=("cyclic",))
    if trainer.sampling == "cyclic":
      check_cyclic_args(trainer.sampling_rate, trainer.expected_batch_size)
    first = check_clip_args(trainer.clip_norm, {k: trainer[k] for k in ADAPTIVE_KEYS})
    if trainer.clip_norm == "adaptive":
      z = trainer.noise_multiplier
      if z is None and trainer.count_stddev is not None and trainer.sampling == "poisson":
        # the run's own calibration (memoized): a count noise too small for it is refused now
        z = calibrate_poisson_sgd(trainer.sampling_rate, trainer.num_steps,
                                  epsilon=trainer.epsilon, delta=trainer.delta,
                                  relation=trainer.get("relation", "add_remove"),
                                  accountant=trainer.accountant)
      # D only sets the default count std, which never refuses: any D > 0 checks the rest
      adaptive_plan(trainer, z or 0.0, first, 1.0, level=trainer.level,
                    noise=trainer.noise_mechanism)
  except ValueError as err:
    raise ConfigError(f"{name}: {err}") from None
  if trainer.sampling == "poisson":
    if trainer.sampling_rate is None:
      raise ConfigError(f"{name} with sampling poisson needs sampling_rate (the declared "
                        "Poisson rate q)")
    if trainer.batch_size is not None:
      raise ConfigError(f"{name}: batch_size is the cyclic schedule's (sampling: cyclic); "
                        "Poisson sampling takes sampling_rate and expected_batch_size")
    return
  if trainer.batch_size is None:
    raise ConfigError(f"{name} with sampling cyclic needs batch_size (users per step B)")
  supported = SAMPLING_RELATIONS["cyclic"]
  if trainer.relation is not None and trainer.relation not in supported:
    raise ConfigError(f"{name}: relation {trainer.relation} is not supported with sampling "
                      f"cyclic (its batches are by slot, n public): use "
                      f"{' or '.join(supported)}")


NO_PUBLIC_EVAL_DATA = ("problem.eval_data_public declares eval_data public, but the problem has "
                       "no eval_data (its metrics would read the training users): add "
                       "eval_data (held-out users) or remove eval_data_public")


def check_selection_metric(problem: UserProblem, metric: str) -> None:
  """A private selection reads only one of ``problem``'s metrics on ``eval_data`` declared
  public; else a :class:`ConfigError` line."""
  if problem.eval_data is None:
    raise ConfigError("select.private on a user problem scores each candidate on its "
                      "eval_data declared public, and this problem has no eval_data (its "
                      "metrics read the training users): add eval_data (held-out users) and "
                      "eval_data_public: true")
  if not problem.eval_data_public:
    raise ConfigError("select.private on a user problem: problem.eval_data is not declared "
                      "public; if its users are not the training users, say so with "
                      "eval_data_public: true (they are not covered by the guarantee)")
  if metric not in problem.metrics:
    raise ConfigError(f"select.metric: {metric!r} is not one of the problem's metrics ("
                      + (", ".join(sorted(problem.metrics)) or "none: add metric: "
                         "module:function to the problem") + ")")


def check_metrics(runs: list[dict], metrics: tuple[tuple[str, str], ...]) -> None:
  """``excess_risk`` as a ``select`` / ``compare`` metric of a user problem (no known optimum)
  is refused before any run where the config lists its metrics (no factory)."""
  for cfg in runs:
    known = static_metrics(cfg) if cfg["problem"] == USER_PROBLEM else None
    for where, metric in metrics:
      if known is not None and metric == "excess_risk":
        raise ConfigError(f"{where} is excess_risk (the default), but your problem has no "
                          "known optimum: name one of its metrics ("
                          + (", ".join(sorted(known)) or "none yet: add metric: "
                             "module:function to the problem") + ")")


def cache_key(cfg: dict) -> tuple:
  """Runs with this key share one built problem (the algorithm's keys excluded)."""
  fields = [f.name for f in dataclasses.fields(UserProblemKeys)]
  return (USER_PROBLEM, repr(cfg.get("seed", 0))) + tuple(repr(cfg.get(k)) for k in fields)


def _normalize(out: Any, source: str) -> Any:
  """A factory's return value as a :class:`UserProblem` (a problem object as is)."""
  if isinstance(out, UserProblem) or (hasattr(out, "excess_risk") and hasattr(out, "loss_fn")):
    return out
  if isinstance(out, (tuple, list)) and len(out) in (3, 4):
    loss, model, data = out[:3]
    return UserProblem(loss, model, data, metrics=metric_table(
        out[3] if len(out) == 4 else None, f"{source} metric", as_callable))
  if isinstance(out, Mapping):
    fields = {f.name for f in dataclasses.fields(UserProblem) if f.init} - {"source"} | {"metric"}
    unknown = [k for k in out if k not in fields]
    if unknown:
      hint = difflib.get_close_matches(str(unknown[0]), sorted(fields), n=1)
      raise ConfigError(f"{source} returned the key {unknown[0]!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; a problem mapping has: {', '.join(sorted(fields))}")
    missing = [k for k in ("loss", "model", "data") if k not in out]
    if missing:
      raise ConfigError(f"{source} returned a mapping without {', '.join(missing)}")
    metrics = {**metric_table(out.get("metric"), f"{source} metric", as_callable),
               **metric_table(out.get("metrics"), f"{source} metrics", as_callable)}
    return UserProblem(out["loss"], out["model"], out["data"], out.get("eval_data"), metrics,
                       dict(out.get("constants") or {}), out.get("n_users"),
                       bool(out.get("eval_data_public", False)))
  raise ConfigError(f"{source} returned a {type(out).__name__}; expected a mapping {{loss, "
                    "model, data, ...}}, a (loss, model_or_params, data[, metric]) tuple, a "
                    "UserProblem, or a problem object with excess_risk")


def make_problem(cfg: dict, key: jax.Array) -> Any:
  """The runner's factory of the ``user`` problem: calls your factory (or model) for the
  run's seed, reads the data files, applies the config's metric / constants / n_users."""
  from dpsco_jax.data import UserData
  prob, seed = UserProblemKeys.of(cfg), int(RunnerKeys.of(cfg).seed)
  args = dict(prob.args or {})
  if prob.factory is not None:
    source = prob.factory
    factory = import_object(source, "problem.factory")
    problem = _normalize(call_with_run_args(factory, args, seed, key), f"factory {source}")
    if not isinstance(problem, UserProblem):
      return problem  # a problem object of its own: runs like the registered problems
  else:
    source = prob.model
    model = call_with_run_args(import_object(source, "problem.model"), args, seed, key)
    data = load_data_file(parse_data_file(prob.data, "problem.data"))
    eval_data = (None if prob.eval_data is None else
                 load_data_file(parse_data_file(prob.eval_data, "problem.eval_data")))
    problem = UserProblem(import_object(prob.loss, "problem.loss"), model, data, eval_data)
  problem = dataclasses.replace(problem, source=source)
  problem.metrics = {**problem.metrics,
                     **metric_table(prob.metric, "problem.metric", as_callable)}
  problem.constants = {**problem.constants,
                       **{k: prob[k] for k in CONSTANT_KEYS if prob[k] is not None}}
  if prob.n_users is not None:
    problem.n_users = prob.n_users
  if prob.eval_data_public:
    if problem.eval_data is None:   # a factory's problem: known once built
      raise ConfigError(NO_PUBLIC_EVAL_DATA)
    problem.eval_data_public = True
  for name, value in (("data", problem.data), ("eval_data", problem.eval_data)):
    if (name == "data" or value is not None) and not isinstance(value, UserData):
      raise ConfigError(f"{source}: {name} must be a dpsco_jax.data.UserData, got "
                        f"{type(value).__name__}")
  if not callable(problem.loss):
    raise ConfigError(f"{source}: loss must be callable, got {type(problem.loss).__name__}")
  return problem


def _metrics_data(problem: UserProblem) -> str:
  """What the record's metrics read (training users' metrics: the owner's diagnostic)."""
  if problem.eval_data is None:
    return ("the training users (a diagnostic for the data owner: not covered by the privacy "
            "guarantee)")
  return ("eval_data, declared public (not the training users)" if problem.eval_data_public
          else "eval_data (held-out users: not covered by the privacy guarantee)")


def _public_sizes(problem: UserProblem, relation: str) -> dict:
  """The record's ``n_users`` and ``m`` where the guarantee treats them as public (under
  ``add_remove`` only a declared ``n_users``; ``m`` only when declared)."""
  spec = problem.data.spec
  out = {}
  if relation != "add_remove":
    out["n_users"] = int(spec.n_users)
  elif problem.n_users is not None:
    out["n_users"] = int(problem.n_users)
  if spec.declared("max_items_per_user"):
    out["m"] = int(spec.max_items_per_user)
  return out


def _algorithm_config(cfg: dict, problem: UserProblem, typed: Any = None) -> Any:
  """The run's typed algorithm config (what ``fit`` plans and runs): ``typed``, the one
  validated with the run (built from ``cfg`` when none is given), with the problem's declared
  ``n_users``."""
  if typed is None:
    from dpsco_jax.config.schema import CONFIG_ALGORITHM_SCHEMAS
    typed = CONFIG_ALGORITHM_SCHEMAS[cfg["algorithm"]].of(cfg)
  if problem.n_users is None or typed.n_users == problem.n_users:
    return typed
  return dataclasses.replace(typed, n_users=int(problem.n_users))


def plan_run(problem: UserProblem, cfg: dict, typed: Any = None) -> Any:
  """The data-free plan :func:`run` executes for ``cfg`` (a registered algorithm; ``typed``:
  its validated config) on ``problem``, from its public facts (data spec, parameter count,
  declared constants).

  Raises:
    ConfigError: as :func:`dpsco_jax.plan` (a bad key, an undeclared fact).
  """
  from dpsco_jax.api import plan
  return plan(cfg["algorithm"], _algorithm_config(cfg, problem, typed), problem.data.spec,
              num_params=_num_params(problem.model), constants=problem.constants or None)


def _train(problem: UserProblem, model: Any, v: DPTrainerConfig, key: jax.Array,
           progress: Callable | None) -> tuple[Any, dict, Any]:
  """``flax.DPTrainer`` from its config ``v``: (privacy report, record extras, debug); keys
  left out take the DPTrainer's defaults."""
  import optax
  from dpsco_jax.api import Progress
  from dpsco_jax.flax import DPTrainer
  if not problem.is_module:
    raise ConfigError("flax.DPTrainer trains an nnx.Module; this problem's model is a "
                      f"{type(problem.model).__name__} (params): run dp_sgd_user on it")
  lr, steps = v.learning_rate, v.num_steps
  optimizer = {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
               "adam": lambda: optax.adam(lr)}[v.optimizer]()
  denominator = v.expected_batch_size
  if (v.sampling == "poisson" and denominator is None
      and v.get("relation", "add_remove") == "add_remove"):
    if problem.n_users is None:
      raise ConfigError("flax.DPTrainer under relation add_remove needs expected_batch_size or "
                        "a declared n_users: the number of users is private")
    denominator = v.sampling_rate * problem.n_users   # derived: q x the declared n_users
  given = {k: v[k] for k in ("sampling_rate", "relation", "noise_multiplier", "epsilon_budget",
                             "batch_capacity", "batch_size", "bands", "buffers", "mf_strategy",
                             "target_quantile", "clip_learning_rate", "initial_clip_norm",
                             "count_stddev")
           if v[k] is not None}
  trainer = DPTrainer(
      model, problem.loss, optimizer, data=problem.data, clip_norm=v.clip_norm,
      delta=v.delta, expected_batch_size=denominator, target_epsilon=v.epsilon,
      num_steps=steps, level=v.level, method=v.method, sampling=v.sampling,
      noise_mechanism=v.noise_mechanism, accumulation_steps=v.accumulation_steps, key=key,
      accountant=v.accountant, debug=v.debug is True, **given)
  log_fn = None if progress is None else (
      lambda rec: progress(Progress(int(rec["step"]), steps, float(rec["epsilon"]))))
  trainer.train(steps, report_every=v.get("report_every", max(1, steps // 20)), log_fn=log_fn)
  extras = {"num_steps": steps, "noise_multiplier": float(trainer.noise_multiplier),
            "sampling": trainer.sampling, "sampling_rate": trainer.q,
            "expected_batch_size": float(trainer.denominator),
            "noise_mechanism": trainer.noise_mechanism, "clip_method": trainer.clipper.method}
  if trainer.adaptive is not None:  # public constants only, as dp_sgd_user's record
    a = trainer.adaptive
    extras.update(clip_norm="adaptive", initial_clip_norm=a.initial_clip_norm,
                  target_quantile=a.target_quantile, clip_learning_rate=a.clip_learning_rate,
                  count_stddev=a.split.count_stddev, sum_noise_multiplier=a.split.sum_multiplier)
  if trainer.cyclic is not None:  # the cyclic plan's schedule and MF noise, as dp_sgd_user's
    plan = trainer.cyclic.plan
    extras["batch_size"] = plan.batch
    if plan.mf is not None:
      extras.update(mf_strategy=plan.mf.source, mf_sensitivity=plan.mf.sensitivity,
                    **({"bands": len(plan.mf.coefs)} if plan.noise == "banded"
                       else {"buffers": len(plan.mf.buf_decay)}))
  return trainer.privacy_report(), extras, trainer.debug


# users per compiled call of the loss probe (bounded memory on a large table)
PROBE_USERS = 4096


def check_loss_finite(problem: UserProblem) -> None:
  """Before a run: your loss at the initial point on every training item. Not finite for
  every user (the run would release noise alone): :class:`~dpsco_jax.result.NonFiniteRelease`;
  for some: a warning with their count. Shown to you only, never recorded."""
  if problem.loss_checked:
    return
  import warnings
  import jax.numpy as jnp
  from dpsco_jax.result import NonFiniteRelease
  data = problem.data
  if problem.is_module:
    from flax import nnx
    graphdef, point = nnx.split(problem.model)
    loss = lambda state, ex: problem.loss(nnx.merge(graphdef, state), ex)  # noqa: E731
  else:
    point, loss = problem.model, problem.loss
  # the point is an argument, not a constant of the compiled probe
  finite = jax.jit(lambda p, ex: jax.vmap(jax.vmap(lambda e: jnp.isfinite(loss(p, e))))(ex))
  u = data.n_users
  width = min(PROBE_USERS, u)
  bad = 0
  for lo in range(0, u, width):
    rows = np.arange(lo, lo + width) % u   # one shape for every call (the last wraps)
    ok = np.asarray(finite(point, jax.tree.map(lambda x: np.asarray(x[rows]), data.examples)))
    real = np.asarray(data.item_mask[rows])
    bad += int(np.sum(~np.all(ok | ~real, axis=1)[: u - lo]))
  if bad == u:
    raise NonFiniteRelease(f"the loss is not finite (NaN or infinity) at the initial point for "
                           f"every one of the {u} users: a private run would release its "
                           "noise alone; check the loss and the data")
  if bad:
    warnings.warn(f"{bad} of {u} users have a loss that is not finite at the initial point: "
                  "each step drops such a user while its gradient stays non-finite",
                  stacklevel=2)
  problem.loss_checked = True


def _num_params(model: Any) -> int:
  """The parameter count of a params pytree or of an nnx.Module's ``nnx.Param`` state."""
  from flax import nnx
  return num_params(nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model)


def run_record(cfg: dict, *, sizes: dict, privacy: Any, scores: dict,
               gradient_evaluations: Any, wall: float, facts: dict, extras: dict,
               fallback: str | None, debug: Any) -> dict:
  """A run's record, one layout for every path: the run's names, ``sizes``, the guarantee
  ``privacy``, the released ``scores``, the work and time, the problem's public ``facts``, then
  the driver's ``extras`` (keys not already set), a fallback release said plainly, the privacy
  notes and (``debug: true`` only) the debug diagnostics."""
  record = {
      "algorithm": cfg["algorithm"], "problem": cfg["problem"], **sizes,
      "epsilon": privacy.epsilon, "epsilon_kind": getattr(privacy, "epsilon_kind", "exact"),
      "delta": privacy.delta, "target_epsilon": cfg.get("epsilon"),
      "provenance": privacy.provenance, "privacy_level": privacy.level,
      "relation": privacy.relation, "paper_epsilon": privacy.paper_epsilon, **scores,
      "gradient_evaluations": gradient_evaluations, "wall_time_s": wall,
      "seed": int(cfg.get("seed", 0)), **facts}
  record.update({k: v for k, v in extras.items() if k not in record})
  if fallback is not None:
    record["fallback"] = fallback
  if privacy.notes:
    record["privacy_notes"] = privacy.notes
  if cfg.get("debug") is True and debug is not None:
    record["debug"] = debug
  return record


def run(problem: UserProblem, cfg: dict, key: jax.Array,
        progress: Callable | None = None, typed: Any = None) -> dict:
  """Runs one validated config on a copy of the problem's model and returns its record: the
  privacy report, your metrics on the trained model, the work and time. ``progress``: a
  :class:`dpsco_jax.api.Progress` callback; ``typed``: the config's validated algorithm
  config (built from ``cfg`` when not given)."""
  from dpsco_jax.api import fit
  algorithm = cfg["algorithm"]
  model = problem.model
  if problem.is_module:
    from flax import nnx
    model = nnx.clone(model)  # rows sharing the problem each train their own copy
  d = _num_params(model)
  check_loss_finite(problem)
  start = time.perf_counter()
  gradient_evaluations, fallback = None, None
  acfg = _algorithm_config(cfg, problem, typed)
  if algorithm in CONFIG_ONLY_ALGORITHMS:
    privacy, extras, debug = _train(problem, model, acfg, key, progress)
    trained = model
    # the trainer's path does not pass dpsco_jax.run's check of the released params
    from flax import nnx
    from dpsco_jax.result import check_finite_params
    check_finite_params(nnx.state(model, nnx.Param), algorithm)
  else:
    constants = problem.constants or None
    if problem.is_module:
      from dpsco_jax.flax import fit_model
      result = fit_model(algorithm, acfg, model, problem.loss, problem.data, key,
                         constants=constants, callback=progress)
      trained = model
    else:
      result = fit(algorithm, acfg, problem.loss, model, problem.data, key,
                   constants=constants, callback=progress)
      trained = result.params
    jax.block_until_ready(jax.tree.leaves(result.params))
    privacy, extras, debug = result.privacy, dict(result.record), result.debug
    gradient_evaluations, fallback = int(result.gradient_evaluations), result.fallback
  wall = time.perf_counter() - start
  eval_data = problem.eval_data if problem.eval_data is not None else problem.data
  metrics = {name: float(fn(trained, eval_data)) for name, fn in problem.metrics.items()}
  sizes = {"source": problem.source, **_public_sizes(problem, privacy.relation), "d": d}
  scores = {**metrics, "user_metrics": list(metrics),
            "metrics_data": _metrics_data(problem) if metrics else None}
  constants = {k: v for k, v in problem.constants.items() if k in CONSTANT_KEYS}
  return run_record(cfg, sizes=sizes, privacy=privacy, scores=scores,
                    gradient_evaluations=gradient_evaluations, wall=wall, facts=constants,
                    extras=extras, fallback=fallback, debug=debug)
