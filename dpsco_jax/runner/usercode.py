"""Your code named in a config: ``module:function`` resolved, its arguments checked, called
with the run's seed, and your metrics. Every failure is one
:class:`~dpsco_jax.config.types.ConfigError` line (the CLI exits 2).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable

import jax

from dpsco_jax.config.families import UserProblemKeys
from dpsco_jax.config.types import ConfigError

__all__ = ["CONSTANT_KEYS", "import_object", "check_call_args", "call_with_run_args",
           "metric_table", "as_callable", "static_metrics", "one_line_error"]

CONSTANT_KEYS = ("lipschitz", "smoothness", "radius", "strong_convexity")
#: record fields a metric may not be named after
_RECORD_FIELDS = frozenset({
    "algorithm", "problem", "source", "n_users", "m", "d", "epsilon", "epsilon_kind", "delta",
    "target_epsilon", "provenance", "privacy_level", "relation", "paper_epsilon",
    "excess_risk", "gradient_evaluations", "wall_time_s", "seed", "status", "error", "label",
    "config", "phase", "user_metrics", "debug", "privacy_notes", "fallback", *CONSTANT_KEYS})
_RUN_ARGS = ("seed", "key", "rngs")  # passed by the runner, never in args


def one_line_error(err: BaseException) -> str:
  """``"Type: message"`` on one line: a failure of your code or file inside a ConfigError."""
  return " ".join(f"{type(err).__name__}: {err}".split())


def _ensure_cwd_on_path() -> None:
  # `python -m dpsco_jax` has the current directory on sys.path; the `dpsco` script does not
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.insert(0, cwd)


def import_object(path: Any, where: str) -> Callable:
  """The callable at ``module:attribute`` (one line on any failure)."""
  if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
    raise ConfigError(f"{where} must be 'module:function' (e.g. my_pkg.models:make_model), "
                      f"got {path!r}")
  mod_name, attr = path.split(":")
  _ensure_cwd_on_path()
  try:
    module = importlib.import_module(mod_name)
  except Exception as err:  # noqa: BLE001 - any failure of the user's module is a config error
    raise ConfigError(f"{where}: cannot import module {mod_name!r} "
                      f"({one_line_error(err)})") from None
  obj: Any = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = [n for n in dir(obj) if not n.startswith("_")]
      hint = difflib.get_close_matches(part, names, n=1)
      raise ConfigError(f"{where}: module {mod_name!r} has no {attr!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    obj = getattr(obj, part)
  if not callable(obj):
    raise ConfigError(f"{where}: {path!r} is a {type(obj).__name__}, not a callable")
  return obj


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
  """``fn``'s parameters; a class's are its ``__init__``'s without ``self`` (an nnx.Module's
  metaclass hides them behind ``*args, **kwargs``)."""
  try:
    if isinstance(fn, type) and fn.__init__ is not object.__init__:
      return dict(list(inspect.signature(fn.__init__).parameters.items())[1:])
    return dict(inspect.signature(fn).parameters)
  except (TypeError, ValueError):  # a builtin without a signature
    return None


def check_call_args(fn: Callable, args: dict, where: str) -> None:
  """``args`` names parameters of ``fn``, and none that the runner passes itself."""
  for name in args:
    if name in _RUN_ARGS:
      raise ConfigError(f"{where}.args.{name}: the runner passes {name} itself (from the run's "
                        "seed); remove it from args")
  params = _parameters(fn)
  if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return
  for name in args:
    if name not in params:
      hint = difflib.get_close_matches(name, list(params), n=1)
      raise ConfigError(f"{where}.args: {getattr(fn, '__name__', fn)!s} takes no argument "
                        f"{name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; it takes: {', '.join(params) or '(none)'}")
  missing = [n for n, p in params.items() if p.default is p.empty and n not in args
             and n not in _RUN_ARGS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  if missing:
    raise ConfigError(f"{where}.args: {getattr(fn, '__name__', fn)!s} needs {', '.join(missing)}"
                      " (give them in args)")


def call_with_run_args(fn: Callable, args: dict, seed: int, key: jax.Array) -> Any:
  """``fn(**args)`` plus the run's ``seed`` / ``key`` / ``rngs`` where ``fn`` names them."""
  params = _parameters(fn) or {}
  extra: dict[str, Any] = {k: v for k, v in (("seed", seed), ("key", key)) if k in params}
  if "rngs" in params:
    from flax import nnx
    extra["rngs"] = nnx.Rngs(seed)
  return fn(**args, **extra)


def metric_table(value: Any, where: str, resolve: Callable[[Any, str], Callable]
                  ) -> dict[str, Callable]:
  """``{field: metric}`` of a metric given as one callable / path or a mapping of them."""
  if value is None:
    return {}
  if isinstance(value, Mapping):
    items = list(value.items())
  else:
    fn = resolve(value, where)
    items = [(getattr(fn, "__name__", None), fn)]
  out = {}
  for name, v in items:
    if not isinstance(name, str) or not name.isidentifier():
      raise ConfigError(f"{where}: a metric needs a field name (an identifier), got {name!r}; "
                        "write {field: module:function}")
    if name in _RECORD_FIELDS:
      raise ConfigError(f"{where}: {name!r} is a field every record has; name the metric "
                        "otherwise ({field: module:function})")
    out[name] = resolve(v, f"{where}.{name}")
  return out


def as_callable(v: Any, where: str) -> Callable:
  """A metric given as ``module:function`` (imported) or a callable (as is)."""
  if isinstance(v, str):
    return import_object(v, where)
  if not callable(v):
    raise ConfigError(f"{where}: a metric must be callable, got {type(v).__name__}")
  return v


def static_metrics(cfg: dict) -> set[str] | None:
  """The metric fields a user run's records will have (None when a factory may add some)."""
  prob = UserProblemKeys.of(cfg)
  if prob.factory is not None:
    return None
  return set(metric_table(prob.metric, "problem.metric", as_callable))

