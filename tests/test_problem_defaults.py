"""Issue 25: a problem's literal defaults are written once, in its schema
(:data:`dpsco_jax.config.families.PROBLEM_SCHEMAS`), and the factories and Python builders
read them from there. Before, ``hinge`` ran with 3000 evaluation features while its schema
(and ``dpsco keys``) said 20000."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import jax
import pytest

from dpsco_jax.config.families import PROBLEM_SCHEMAS
from dpsco_jax.problems import problems
from dpsco_jax.problems.synthetic import make
from dpsco_jax.problems.user_level import corrupt_users, hinge_problem

PROBLEMS = pathlib.Path(__file__).resolve().parents[1] / "dpsco_jax" / "problems"


def _literal_defaults() -> list[str]:
  """``cfg.get(name, <literal>)`` in a problem module: a second copy of a schema default."""
  out = []
  for path in sorted(PROBLEMS.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "get" and isinstance(node.func.value, ast.Name)
          and node.func.value.id == "cfg" and len(node.args) == 2
          and isinstance(node.args[1], ast.Constant)):
        out.append(f"{path.name}:{node.lineno} cfg.get({ast.unparse(node.args[0])}, ...)")
  return out


def test_no_problem_module_writes_a_literal_default_of_a_config_key():
  assert _literal_defaults() == []


@pytest.mark.parametrize("fn,schema,names", [
    (make, "least_squares", ("radius", "noise", "heterogeneity", "n_eval")),
    (hinge_problem, "hinge", ("radius", "n_eval")),
])
def test_python_builders_default_to_the_schema(fn, schema, names):
  sig = inspect.signature(fn)
  fields = {f.name: f.default for f in dataclasses.fields(PROBLEM_SCHEMAS[schema])}
  assert {k: sig.parameters[k].default for k in names} == {k: fields[k] for k in names}


def test_corrupt_users_defaults_to_the_schema():
  sig = inspect.signature(corrupt_users)
  fields = {f.name: f.default for f in dataclasses.fields(PROBLEM_SCHEMAS["logistic_corrupted"])}
  assert sig.parameters["mode"].default == fields["corruption_mode"]
  assert sig.parameters["scale"].default == fields["corruption_scale"]


def test_a_factory_left_to_its_defaults_builds_what_the_schema_declares():
  # the schema's declared value, not a copy in the factory: changing the config to the
  # declared default builds the same problem, and the declared default is what is used
  key = jax.random.key(0)
  hinge = problems()["hinge"]
  default = hinge({"n_users": 8, "m": 2, "d": 3}, key)
  spelled = hinge({"n_users": 8, "m": 2, "d": 3,
                   "n_eval": PROBLEM_SCHEMAS["hinge"].n_eval}, key)
  assert float(default.risk_fn(default.x_opt)) == float(spelled.risk_fn(spelled.x_opt))
  ill = problems()["ill_conditioned_least_squares"]
  p = ill({"n_users": 4}, key)
  assert p.d == PROBLEM_SCHEMAS["ill_conditioned_least_squares"].d
  assert p.m == PROBLEM_SCHEMAS["ill_conditioned_least_squares"].m
  # a null key means the default, as in YAML
  q = ill({"n_users": 4, "d": None}, key)
  assert q.d == p.d
