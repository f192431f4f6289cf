"""The algorithm registry (issue 13, item 5): drivers register themselves with
``@register(name, config=..., paper=...)``; every algorithm a config file or the README names
is registered, and every registered algorithm has a config class and is in the README."""

import dataclasses
import pathlib
import re

import pytest

from dpsco_jax import runner
from dpsco_jax.config import families as config_families, schema as config_schema
from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
from dpsco_jax.algorithms import registry
from dpsco_jax.problems import problems

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted([*(ROOT / "configs").glob("*.yaml"),
                  *(ROOT / "experiments" / "configs_eval").glob("*.yaml")])
PAPERS = {"baseline", "000", "001", "002", "003", "004"}


@pytest.fixture(scope="module")
def entries():
  return registry.algorithms()


def _readme() -> str:
  return (ROOT / "README.md").read_text()


def _readme_table_algorithms() -> set[str]:
  """Backticked names in the first cell of the README's algorithm table (``flax.DPTrainer``,
  a class rather than a registered driver, is skipped: it has a dot)."""
  section = _readme().split("## Algorithms", 1)[1].split("\n## ", 1)[0]
  names = set()
  for line in section.splitlines():
    if line.startswith("| `"):
      names.update(n for n in re.findall(r"`([^`]+)`", line.split("|")[1]) if "." not in n)
  return names


def _config_runs():
  for path in CONFIGS:
    for cfg in runner.expand(runner.load_config(str(path))):
      yield path, cfg


def test_every_config_file_names_registered_algorithms_and_problems(entries):
  """Registered names, or the config-only ones: the ``user`` problem (your factory / model +
  loss + data) and ``flax.DPTrainer``, which runs only on it."""
  known_problems = {*problems(), config_families.USER_PROBLEM}
  seen = set()
  for path, cfg in _config_runs():
    if cfg["algorithm"] in config_families.CONFIG_ONLY_ALGORITHMS:
      assert cfg["problem"] == config_families.USER_PROBLEM, (path.name, cfg["algorithm"])
    else:
      assert cfg["algorithm"] in entries, (path.name, cfg["algorithm"])
    assert cfg["problem"] in known_problems, (path.name, cfg["problem"])
    seen.add(cfg["algorithm"])
  assert len(seen) >= 15, seen


def test_every_readme_algorithm_is_registered(entries):
  readme = _readme_table_algorithms()
  assert len(readme) >= 20, readme
  assert readme <= set(entries), f"in README, not registered: {sorted(readme - set(entries))}"


def test_every_registered_algorithm_is_in_the_readme_with_a_config_class(entries):
  table = _readme_table_algorithms()
  assert set(entries) <= table, f"registered, not in README: {sorted(set(entries) - table)}"
  for name, entry in entries.items():
    assert entry.name == name and callable(entry.driver)
    assert dataclasses.is_dataclass(entry.config) and entry.config.__dataclass_params__.frozen
    assert issubclass(entry.config, config_families.Schema), (name, entry.config)
    # the shared vocabulary, or the algorithm's own package (its config is one of its objects)
    package = entry.driver.__module__.rpartition(".")[0]
    assert (entry.config.__module__ == "dpsco_jax.config.families"
            or entry.config.__module__.startswith(package + ".")), (name, entry.config)
    assert entry.paper in PAPERS, (name, entry.paper)


def _kinds(annotation: str) -> set[str]:
  """The basic kinds a schema annotation accepts (a number, a string, a bool, ...)."""
  words = set(re.findall(r"[A-Za-z_]+", annotation))
  kinds = {"number" for w in words if w in ("int", "float")}
  kinds |= {"string" for w in words if w in ("str", "Literal", "Relation", "Preset", "Averaging")}
  kinds |= {w for w in words if w in ("bool", "dict", "list", "tuple")}
  return kinds


def test_one_config_vocabulary(entries):
  """A key means the same kind of value in every algorithm that reads it (``epsilon`` is a
  number everywhere; an algorithm may narrow it, e.g. make it required, never change it)."""
  seen: dict[str, list[tuple[str, set[str]]]] = {}
  for name, entry in entries.items():
    for f in dataclasses.fields(entry.config):
      if not f.metadata.get("refused"):
        seen.setdefault(f.name, []).append((name, _kinds(str(f.type))))
  shared = {k: v for k, v in seen.items() if len(v) > 1}
  assert {"epsilon", "delta", "clip_norm", "learning_rate", "relation"} <= set(shared)
  for key, uses in shared.items():
    common = set.intersection(*(kinds for _, kinds in uses))
    assert common, (key, uses)
  assert _kinds("Optional[Union[bool, float]]") == {"number", "bool"}
  assert _kinds("Optional[Literal['poisson', 'fixed']]") == {"string"}


def test_papers_and_config_classes_of_some_entries(entries):
  assert entries["dp_sgd_user"].paper == "baseline"
  assert entries["dp_sgd_user"].config is DpSgdConfig
  assert entries["minibatch_sgd"].paper == "002"
  assert entries["nonprivate_penalty"].paper == "004"
  assert entries["dp_loc_gd"].paper == "004"
  assert {n for n, e in entries.items() if e.paper == "003"} == {
      "accelerated_dp_srgd", "dp_srgd_unaccelerated", "accelerated_dp_srgd_independent_noise",
      "accelerated_dp_sgd", "single_epoch_dp_sgd"}


def test_schemas_and_runner_read_the_registry(entries):
  assert dict(config_schema.ALGORITHM_SCHEMAS) == {n: e.config for n, e in entries.items()}
  algorithms, probs = runner.registry()
  assert algorithms == {n: e.driver for n, e in entries.items()}
  assert set(probs) == set(config_families.PROBLEM_SCHEMAS)


def test_register_refuses_a_second_driver_and_a_non_dataclass_config():
  name = next(iter(registry.algorithms()))
  planner = registry.algorithms()[name].planner
  with pytest.raises(ValueError, match="registered twice"):
    registry.register(name, config=DpSgdConfig, paper="baseline",
                      planner=planner)(lambda problem, cfg, key: None)
  with pytest.raises(TypeError, match="config dataclass"):
    registry.register("zzz_new", config=dict, paper="baseline")
  # a schema without the declared n_users and debug every planner may read
  plain = dataclasses.make_dataclass("Plain", [], bases=(config_families.Schema,), frozen=True)
  with pytest.raises(TypeError, match="AlgorithmKeys"):
    registry.register("zzz_new", config=plain, paper="baseline")
  assert "zzz_new" not in registry.algorithms()


@pytest.mark.parametrize("kwargs, match", [
    ({}, "give a planner"),                                                # no plan to run
    ({"unsupported": "why"}, "give a planner"),                            # a reason is no plan
    ({"planner": 3}, "planner must be callable"),
    ({"planner": len, "level": "group"}, "level must be one of"),
    ({"planner": len, "mesh": False}, "mesh must be True or the reason"),
    ({"planner": len, "mesh": "  "}, "mesh must be True or the reason"),
    ({"planner": len, "batched": 1}, "batched must be a bool"),
])
def test_register_refuses_an_incomplete_entry(kwargs, match):
  """Every algorithm says what it can do or why not: an entry that does not is refused."""
  with pytest.raises((ValueError, TypeError), match=match):
    registry.register("zzz_new", config=DpSgdConfig, paper="baseline",
                      **kwargs)(lambda problem, cfg, key: None)
  assert "zzz_new" not in registry.algorithms()


def test_the_table_order_does_not_depend_on_import_order(entries):
  """Baselines first, then papers 000 to 004 (the README's order), whatever the discovery's
  (alphabetical) import order was."""
  papers = [e.paper for e in entries.values()]
  assert papers == sorted(papers, key=["baseline", "000", "001", "002", "003", "004"].index)
  assert next(iter(entries)) == "dp_sgd_user"


def test_the_schemas_import_no_algorithm_module():
  """The schemas sit below the algorithms (the drivers register with them): nothing they
  import, directly or not, is an algorithm module (the registry reads them, not the other way
  round). Read from the source's import graph: importing any submodule runs the package's
  ``__init__``, which imports the whole library."""
  from test_package_graph import import_graph
  graph = import_graph()
  for schemas in ("dpsco_jax.config.families", "dpsco_jax.config.types"):
    seen, todo = set(), [schemas]
    while todo:
      for dep in graph[todo.pop()] - seen:
        seen.add(dep)
        todo.append(dep)
    assert not {m for m in seen if m.startswith("dpsco_jax.algorithms")}, (schemas, seen)
