"""The package graph (issue 25): no import cycles and no upward imports.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` /
``from ... import`` statement of every module under ``dpsco_jax/``, at module level or inside a
function (a function-level import is an edge like any other, so it cannot hide a cycle), and
every ``importlib.import_module("dpsco_jax...")`` with a literal name. The implicit import of a
parent package (``dpsco_jax/__init__.py`` runs before any submodule) is not an edge.

The layers follow ``../shared/DESIGN.md``'s architecture, lowest first: a module may import
its own layer and the layers below it, never one above.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpsco_jax"

#: Lowest first. A prefix names a module and everything under it (``privacy`` is
#: ``dpsco_jax.privacy`` and its submodules); ``config!`` is the package ``dpsco_jax.config``
#: alone (its three modules sit in three layers).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # argument checks, the guarantee's matmul precision, the one cache, and the config error /
    # type check every layer may raise
    ("base", ("_checks", "precision", "config!", "config.types", "cache")),
    # relations, events, the ledger, the calibrator, mechanisms
    ("privacy", ("privacy",)),
    # what an algorithm is built from: data, per-user gradients, the optax stages, the
    # problems, the Result type and the typed configs (the schemas the drivers register with)
    ("mechanics", ("data", "grads", "smoothing", "transforms", "problems", "result",
                   "config.families")),
    # one package per paper + the baselines, the registration table and the registry
    ("algorithms", ("algorithms",)),
    # the user-facing entry points over the algorithms: plan / run / fit, validation of a whole
    # run against the registry, batched seed sweeps, many processes, the Flax integration,
    # private selection over plans
    ("entry", ("api", "sweep", "distributed", "planners", "config.schema", "flax", "tuning")),
    # tools on top: the YAML runner and CLI, the audits, the curated package namespace
    ("tools", ("runner", "audit", "__main__", "")),
)

#: The lower layers the issue names: they import nothing from the upper ones.
LOWER = ("transforms", "privacy", "data", "grads")
UPPER = ("algorithms", "runner", "api", "flax")


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
  mods = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
      parts = parts[:-1]
    mods[".".join(parts)] = (path, is_pkg)
  return mods


def _resolve(name: str, mods) -> str | None:
  """The module ``name`` refers to: itself, or (an attribute of a module) its nearest
  enclosing module."""
  while name and name not in mods:
    name = name.rpartition(".")[0]
  return name or None


def import_graph() -> dict[str, set[str]]:
  """``module -> modules it imports`` for every module of the package (full dotted names)."""
  mods = _modules()
  graph = {m: set() for m in mods}
  for mod, (path, is_pkg) in mods.items():
    here = mod if is_pkg else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
          frm = ".".join(base + ([node.module] if node.module else []))
        else:
          frm = node.module or ""
        # ``from pkg import sub`` imports the submodule when there is one
        targets = [f"{frm}.{a.name}" for a in node.names]
      elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        targets = [node.args[0].value]
      for target in targets:
        if target.split(".")[0] != "dpsco_jax":
          continue
        hit = _resolve(target, mods)
        if hit is not None and hit != mod:
          graph[mod].add(hit)
  # the registry's one computed import: every algorithm package's driver (found on disk)
  graph[REGISTRY] |= set(discovered_drivers()) & set(mods)
  return graph


REGISTRY = "dpsco_jax.algorithms.registry"


def discovered_drivers() -> tuple[str, ...]:
  """What the registry imports by discovery, computed here from the source tree the same way
  (so the graph carries those edges without trusting the module under test)."""
  root = PACKAGE / "algorithms"
  return tuple(f"dpsco_jax.algorithms.{d.name}.driver" for d in sorted(root.iterdir())
               if (d / "__init__.py").is_file() and (d / "driver.py").is_file())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter[0]
    counter[0] += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      v, children = work[-1]
      for w in children:
        if w not in index:
          index[w] = low[w] = counter[0]
          counter[0] += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
          break
        if w in on_stack:
          low[v] = min(low[v], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == index[v]:
          comp = []
          while True:
            w = stack.pop()
            on_stack.discard(w)
            comp.append(w)
            if w == v:
              break
          if len(comp) > 1:
            out.append(sorted(comp))
  return out


def _matches(module: str, prefix: str) -> bool:
  rel = module.removeprefix("dpsco_jax").removeprefix(".")
  if prefix == "":
    return rel == ""
  if prefix.endswith("*"):
    return "." not in rel and rel.startswith(prefix[:-1])
  if prefix.endswith("!"):   # a package's own __init__ only, not its submodules
    return rel == prefix[:-1]
  return rel == prefix or rel.startswith(prefix + ".")


def layer_of(module: str) -> int:
  hits = [i for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if _matches(module, p)]
  assert len(hits) == 1, f"{module} is in {len(hits)} layers: add it to LAYERS once"
  return hits[0]


def test_the_graph_sees_known_edges():
  """The parser finds module-level, function-level and package-relative imports."""
  graph = import_graph()
  assert "dpsco_jax.algorithms.registration" in graph["dpsco_jax.algorithms.dpsgd.driver"]
  assert "dpsco_jax.config.types" in graph["dpsco_jax.config.families"]
  # a function-level import (the schemas read the registry on first access)
  assert "dpsco_jax.algorithms.registry" in graph["dpsco_jax.config.schema"]
  assert "dpsco_jax.algorithms.output_perturbation.base" in graph[
      "dpsco_jax.algorithms.output_perturbation.naive"]
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  # the registry's discovery edges, and the registry finds what the graph adds
  from dpsco_jax.algorithms.registry import ALGORITHM_MODULES
  assert set(ALGORITHM_MODULES) == set(discovered_drivers()) <= graph[REGISTRY]
  assert len(ALGORITHM_MODULES) == 6


def test_no_import_cycles():
  cycles = _cycles(import_graph())
  assert not cycles, "import cycles (strongly connected components):\n" + "\n".join(
      " <-> ".join(c) for c in cycles)


def test_every_module_has_one_layer_and_imports_no_higher_layer():
  graph = import_graph()
  upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
            for m in sorted(graph) for t in sorted(graph[m]) if layer_of(t) > layer_of(m)]
  assert not upward, "upward imports:\n" + "\n".join(upward)


def test_lower_layers_import_nothing_from_the_upper_ones():
  """The issue's statement, checked on its own names (independent of LAYERS)."""
  graph = import_graph()
  bad = [(m, t) for m in graph for t in graph[m]
         if any(_matches(m, p) for p in LOWER) and any(_matches(t, p) for p in UPPER)]
  assert not bad, bad


def test_no_computed_imports_below_the_tools():
  """A computed module name (``importlib.import_module(name)``) is invisible to the graph: an
  old registry imported its drivers that way and hid a cycle. Only the runner may do it (it
  imports *your* code, named in a config), and the registry, whose discovered edges
  ``import_graph`` adds itself (``discovered_drivers``)."""
  computed = []
  for mod, (path, _) in _modules().items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
          and not (node.args and isinstance(node.args[0], ast.Constant))
          and layer_of(mod) < len(LAYERS) - 1 and mod != REGISTRY):
        computed.append(mod)
  assert not computed, computed


def test_every_name_in_an_all_exists():
  """``from module import *`` fails on a name that ``__all__`` lists and the module lacks (a
  re-export whose import was dropped when its user moved): every module's ``__all__`` names
  attributes the module has."""
  import importlib
  missing = []
  for mod in _modules():
    if mod.endswith("__main__"):
      continue
    module = importlib.import_module(mod)
    missing += [(mod, n) for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
  assert not missing, missing
