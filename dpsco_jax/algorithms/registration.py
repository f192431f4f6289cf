"""The one algorithm interface: the registration decorator and the table it fills.

::

    @register("dp_sgd_user", config=DpSgdConfig, paper="baseline", planner=plan_user,
              batched=True)
    def dp_sgd_user(plan, problem, key) -> Result: ...

An algorithm is three objects, all in its own package: its frozen config dataclass (an
:class:`~dpsco_jax.config.families.AlgorithmKeys` subclass, the vocabulary its planner reads),
a data-free ``planner(facts, cfg) -> Planned`` (what :func:`dpsco_jax.plan` returns before any
data is read) and its ``run(plan, problem, key) -> Result``, which executes the plan it is
handed (:class:`dpsco_jax.Plan`: its validated ``config``, its guarantee ``privacy`` and the
family's plan object ``detail``, a :class:`FamilyPlan`) and never plans, calibrates or
validates again. Everything the entry points need to know about it is a keyword of
:func:`register` (its :class:`AlgorithmEntry`), read from the table by :mod:`dpsco_jax.api`,
the runner, the sweeps, the many-process path and the tests; adding an algorithm touches its
own package only (:mod:`dpsco_jax.algorithms.registry` finds it; a user's module that calls
:func:`register` adds its algorithm by being imported).

Every driver module imports this module and nothing imports the drivers from here (the
registry, one level up, does), so the import graph has no cycle through the table.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
  from dpsco_jax.privacy.ledger import PrivacyReport
  from dpsco_jax.privacy.sensitivity import GaussianStage

__all__ = ["AlgorithmEntry", "FamilyPlan", "PLAN_MEMBERS", "missing_plan_members", "Grid",
           "Planned", "register", "registered", "PAPERS", "LEVELS"]

#: Where an algorithm comes from, in the table's order (the README's algorithm table order).
PAPERS = ("baseline", "000", "001", "002", "003", "004")
#: The rows an algorithm's gradient step clips: users (user level) or items (item level).
LEVELS = ("user", "item")


class Grid(NamedTuple):
  """What the runs of one algorithm may differ in and still run as one program (a grid sweep:
  :func:`dpsco_jax.run_grid`, the runner's ``batch_seeds``).

  ``keys``: the config keys (besides the seed) whose values may differ across the runs;
  ``hparams``: the numbers the driver then takes as traced values (each read through
  :func:`dpsco_jax.algorithms.common.hparam` with the value the run would use alone). A key
  is here only if it enters the jitted step as a number and nowhere else: not the privacy
  plan, the noise multiplier, the schedule, the shapes or the structure of the chain."""
  keys: frozenset
  hparams: tuple


@runtime_checkable
class FamilyPlan(Protocol):
  """The one protocol of a family's plan object (``Plan.detail``), the thing a run executes.

  * ``stages``: its Gaussian noise stages in the order a run applies them, each a
    :class:`~dpsco_jax.privacy.GaussianStage` carrying its multiplier and the
    :class:`~dpsco_jax.privacy.Sensitivity` of what it perturbs; a run reads a stage's ``std``
    from here and forms none of its own (``()`` for a non-private plan).
  * ``events``: the ``dp_accounting`` events the plan's releases compose (``()`` for a
    non-private plan).
  * ``charge()``: checks the budget and charges a fresh ledger with the events before anything
    is released (:class:`~dpsco_jax.privacy.PrivacyBudgetExceeded` over the budget); returns
    the guarantee. A plan's ``privacy`` is ``detail.charge()`` and a run reports the plan's,
    so the spent guarantee is the planned one by construction
    (``tests/test_plan_protocol.py``).
  """

  @property
  def stages(self) -> tuple[GaussianStage, ...]: ...

  @property
  def events(self) -> tuple[Any, ...]: ...

  def charge(self) -> PrivacyReport: ...


#: the members of :class:`FamilyPlan`, in the order a refusal names them
PLAN_MEMBERS = ("stages", "events", "charge")


def missing_plan_members(detail: Any) -> list[str]:
  """The :class:`FamilyPlan` members ``detail`` lacks, looked up on its type or instance dict
  (``isinstance(detail, FamilyPlan)`` would evaluate its properties).

  Args:
    detail: a planner's plan object.

  Returns:
    The missing member names (empty when ``detail`` follows the protocol).
  """
  return [m for m in PLAN_MEMBERS
          if not (hasattr(type(detail), m) or m in getattr(detail, "__dict__", {}))]


class Planned(NamedTuple):
  """What a planner returns (:func:`dpsco_jax.plan` wraps it in a ``Plan``): the privacy
  report a fresh ledger charged with the plan's events gives, the (first) calibrated noise
  multiplier if the family has one, the public schedule numbers, and the family's own plan
  object."""
  privacy: Any
  noise_multiplier: float | None
  schedule: dict
  detail: Any


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
  """One registered algorithm (see the module docstring; every field is a :func:`register`
  keyword).

  Attributes:
    name, driver, config, paper: the registered name, the plan's runner ``driver(plan,
      problem, key) -> Result`` (it reads ``plan.detail`` and reports ``plan.privacy``), the
      typed config class, the source (one of :data:`PAPERS`).
    planner: ``planner(facts, cfg) -> Planned`` (required; ``facts`` is a
      :class:`~dpsco_jax.data.PublicFacts`, or the built-in problem itself).
    level: ``"item"`` if the gradient step's rows are items (the item view of the data),
      else ``"user"``.
    item_guarantee: the guarantee is item level, so it holds only if every item is kept
      (default: ``level == "item"``; ``dp_sgd_group`` lifts its item curve to users).
    reads_m: the guarantee reads ``m``, the items per user (a measured ``m`` is refused).
    mesh: ``True`` if the per-user gradient step shards users over a mesh, else the reason
      it refuses one.
    batched: the driver runs a group of seeds as one ``vmap``-ed program.
    grid: the step-size keys its runs may also differ in within one program (``None``: none).
    host_streaming: the driver can sample rows on the host and move only theirs to the
      device (``dpsco_jax.run(..., data_placement="host")``, a memory-mapped table).
    distributed: the driver runs under ``jax.distributed`` on each process's shard.
    unsupported: why it cannot run on a ``loss_fn`` and ``UserData`` (``None``: it can).
  """
  name: str
  driver: Callable[..., Any]
  config: type
  paper: str
  planner: Callable[..., Planned] | None = None
  level: str = "user"
  item_guarantee: bool = False
  reads_m: bool = False
  mesh: bool | str = "not sharded yet"
  batched: bool = False
  unsupported: str | None = None
  host_streaming: bool = False
  distributed: bool = False
  grid: Grid | None = None

  @property
  def mesh_ready(self) -> bool:
    return self.mesh is True


_REGISTRY: dict[str, AlgorithmEntry] = {}


def _check(name: str, entry: AlgorithmEntry) -> None:
  """The entry is complete: each algorithm says what it can do, or why not."""
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"register({name!r}): the name must be an identifier")
  if entry.level not in LEVELS:
    raise ValueError(f"register({name!r}): level must be one of {LEVELS}, got {entry.level!r}")
  if entry.planner is None:   # every run executes a plan (unsupported: only not on UserData)
    raise ValueError(f"register({name!r}): give a planner(facts, cfg) -> Planned (its data-free "
                     "plan; every algorithm has one)")
  if not callable(entry.planner):
    raise TypeError(f"register({name!r}): planner must be callable, got {entry.planner!r}")
  if not (entry.mesh is True or (isinstance(entry.mesh, str) and entry.mesh.strip())):
    raise ValueError(f"register({name!r}): mesh must be True or the reason it refuses one")
  for flag in ("item_guarantee", "reads_m", "batched",
               "host_streaming", "distributed"):
    if not isinstance(getattr(entry, flag), bool):
      raise TypeError(f"register({name!r}): {flag} must be a bool")
  if entry.grid is not None and (not isinstance(entry.grid, Grid) or not entry.batched):
    raise ValueError(f"register({name!r}): grid must be a Grid, on a batched driver (a grid "
                     "sweep is a seed batch whose runs also differ in step sizes)")


def register(name: str, *, config: type, paper: str,
             planner: Callable[..., Planned] | None = None, level: str = "user",
             item_guarantee: bool | None = None, reads_m: bool = False,
             mesh: bool | str = "not sharded yet",
             batched: bool = False, unsupported: str | None = None,
             host_streaming: bool = False, distributed: bool = False,
             grid: Grid | None = None) -> Callable[[Callable], Callable]:
  """Decorator: registers ``driver`` under ``name`` with the traits above (a second
  registration of a name with another driver is a bug and raises; an incomplete entry raises)
  and returns the driver unchanged."""
  from dpsco_jax.config.families import AlgorithmKeys
  if not (isinstance(config, type) and dataclasses.is_dataclass(config)
          and issubclass(config, AlgorithmKeys)):
    raise TypeError(f"register({name!r}): config must be a frozen config dataclass subclassing "
                    "dpsco_jax.config.families.AlgorithmKeys (the typed schema its planner and "
                    f"driver read, with the declared n_users and debug), got {config!r}")

  def deco(driver: Callable) -> Callable:
    entry = AlgorithmEntry(name, driver, config, str(paper), planner, level,
                           level == "item" if item_guarantee is None else item_guarantee,
                           reads_m, mesh, batched, unsupported,
                           host_streaming, distributed, grid)
    _check(name, entry)
    old = _REGISTRY.get(name)
    if old is not None and old.driver is not driver:
      raise ValueError(f"algorithm {name!r} is registered twice ({old.driver.__module__} and "
                       f"{driver.__module__})")
    _REGISTRY[name] = entry
    return driver

  return deco


def registered() -> dict[str, AlgorithmEntry]:
  """The algorithms registered so far, baselines first, then by paper (registration order
  within a paper; any other source last), whatever order their modules were imported in.
  Read the whole table through :func:`dpsco_jax.algorithms.registry.algorithms`."""
  order = {name: i for i, name in enumerate(_REGISTRY)}
  rank = {p: i for i, p in enumerate(PAPERS)}
  return {e.name: e for e in sorted(_REGISTRY.values(),
                                    key=lambda e: (rank.get(e.paper, len(PAPERS)),
                                                   order[e.name]))}
