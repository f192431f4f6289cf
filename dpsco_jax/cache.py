"""The one cache of the library: compiled programs, the loss wrappers they close over, and the
numbers the accountant solves for. Every memoized factory uses :func:`bounded_cache`: bounded
(a sweep's fresh ``loss_fn`` closures are evicted, not held with their data), keyed by static
arguments only (data is an argument of the program, never a key), and cleared all at once by
:func:`clear` (:func:`stats`: hits / misses / size per cache).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Default bound: enough for a sweep's distinct (loss, structure, shape) programs to stay warm.
DEFAULT_MAXSIZE = 64
_CACHES: dict[str, Any] = {}


def bounded_cache(maxsize: int = DEFAULT_MAXSIZE) -> Callable[[F], F]:
  """Memoizes a factory on its (hashable) arguments, keeping at most ``maxsize`` entries
  (least recently used evicted) and registering it with :func:`clear` / :func:`stats`."""
  if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
    raise ValueError(f"maxsize must be a positive int (every cache is bounded), got "
                     f"{maxsize!r}")

  def wrap(fn: F) -> F:
    cached = functools.lru_cache(maxsize=maxsize)(fn)
    _CACHES[f"{fn.__module__}.{fn.__qualname__}"] = cached
    return cached  # type: ignore[return-value]
  return wrap


class ByKey:
  """An argument hashed and compared by ``key`` alone (public numbers, e.g. events' canonical
  JSON), carrying ``value``, which cannot be a key itself, to the memoized function."""
  __slots__ = ("value", "key")

  def __init__(self, value: Any, key: Any):
    self.value, self.key = value, key
    hash(key)   # an unhashable key is the caller's bug: raise here, not inside the cache

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ByKey) and other.key == self.key


def clear() -> None:
  """Empties every cache of the library (compiled programs are rebuilt on next use)."""
  for cached in _CACHES.values():
    cached.cache_clear()


def stats() -> dict[str, dict[str, int]]:
  """``{cache name: {"hits", "misses", "size", "maxsize"}}`` of every registered cache."""
  out = {}
  for name, cached in sorted(_CACHES.items()):
    info = cached.cache_info()
    out[name] = {"hits": info.hits, "misses": info.misses, "size": info.currsize,
                 "maxsize": info.maxsize}
  return out
