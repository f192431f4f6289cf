"""The algorithm registry (issue 13, item 5): drivers register themselves with
``@register(name, config=..., paper=...)``; every algorithm a config file or the README names
is registered, and every registered algorithm has a config class and is in the README."""

import dataclasses
import pathlib
import re

import pytest

from dpsco_jax import runner
from dpsco_jax.config import families as config_families, schema as config_schema
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
    assert entry.config.__module__ == "dpsco_jax.config.families", (name, entry.config)
    assert entry.paper in PAPERS, (name, entry.paper)


def test_papers_and_config_classes_of_some_entries(entries):
  assert entries["dp_sgd_user"].paper == "baseline"
  assert entries["dp_sgd_user"].config is config_families.DpSgdConfig
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
  with pytest.raises(ValueError, match="registered twice"):
    registry.register(name, config=config_families.DpSgdConfig, paper="baseline")(
        lambda problem, cfg, key: None)
  with pytest.raises(TypeError, match="config dataclass"):
    registry.register("zzz_new", config=dict, paper="baseline")
  assert "zzz_new" not in registry.algorithms()


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
