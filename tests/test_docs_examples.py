"""Every code block of the README and of docs/guides, docs/tutorials and docs/papers runs.

* A page's ```python blocks run in order in one namespace (a later block may use an earlier
  block's names), from the repository root (so ``experiments.*`` imports as in the pages).
* A block fenced ```python no-run is skipped only when the line before it states why
  (``<!-- no-run: REASON -->``); a no-run block without a reason fails the page.
* Every ```yaml block is a whole run config and is validated as ``dpsco run`` validates one
  before anything runs (sections, phases, compare, every expanded run against its schema).
* docs/guides/yaml_reference.md names every key of every schema (generated from the schemas
  here, so a key added to a schema and not to the page fails).

Run ``python tests/test_docs_examples.py`` to print the block counts per page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(
    p for sub in ("guides", "tutorials", "papers") for p in (DOCS / sub).glob("*.md"))
# a fence opens with ```lang [no-run]; the reason is the line before
FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
NO_RUN_REASON = re.compile(r"<!--\s*no-run:\s*\S.*-->")


@dataclasses.dataclass(frozen=True)
class Block:
  page: pathlib.Path
  line: int
  lang: str
  options: str
  code: str
  reason_line: str

  @property
  def where(self) -> str:
    return f"{self.page.name}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
  text = page.read_text()
  out = []
  for match in FENCE.finditer(text):
    line = text.count("\n", 0, match.start()) + 1
    before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
    out.append(Block(page, line, match.group(1), match.group(2).strip(), match.group(3), before))
  return out


def _id(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


@contextlib.contextmanager
def _at(root: pathlib.Path):
  # pages import experiments.* and write nothing outside their own temporary directories
  old, old_path = os.getcwd(), list(sys.path)
  os.chdir(root)
  sys.path.insert(0, str(root))
  try:
    yield
  finally:
    os.chdir(old)
    sys.path[:] = old_path


def run_python(page: pathlib.Path, root: pathlib.Path = ROOT) -> int:
  """Runs the page's python blocks in one namespace from ``root``; returns how many ran."""
  namespace: dict = {"__name__": f"docs_{page.stem}"}
  ran = 0
  with _at(root):
    for block in blocks(page):
      if block.lang != "python":
        continue
      if block.options == "no-run":
        assert NO_RUN_REASON.search(block.reason_line), (
            f"{block.where}: a python no-run block needs <!-- no-run: REASON --> on the line "
            "before it")
        continue
      assert not block.options, f"{block.where}: unknown fence option {block.options!r}"
      # the page's own line numbers in a traceback
      code = "\n" * block.line + block.code
      exec(compile(code, str(block.page), "exec"), namespace)  # noqa: S102
      ran += 1
  return ran


def validate_yaml(text: str, where: str) -> int:
  """Validates one YAML config as the CLI does before any run; returns the runs it expands to."""
  import yaml
  from dpsco_jax import runner
  from dpsco_jax.config import schema
  config = yaml.load(text, Loader=runner.yaml_loader())  # noqa: S506 (a SafeLoader subclass)
  assert isinstance(config, dict), f"{where}: a yaml block is a whole config (a mapping)"
  runner.check_runner_keys(config)
  runner.parse_compare(config)
  phases = runner.tuning.parse_phases(config)
  runs = runner.expand(phases.config)
  for run in runs:
    schema.validate(run)
  return len(runs)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_python_blocks_run(page):
  run_python(page)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_yaml_blocks_validate(page):
  for block in blocks(page):
    if block.lang == "yaml":
      assert validate_yaml(block.code, block.where) >= 1, block.where


def test_every_page_in_the_list_exists():
  names = {str(p.relative_to(DOCS)) for p in PAGES[1:]}
  expected = {f"guides/{n}.md" for n in (
      "model_and_data", "sweeps_and_selection", "privacy_contract", "correlated_noise",
      "scale", "auditing", "checkpoints", "adding_an_algorithm", "yaml_reference")}
  expected |= {f"tutorials/{n}.md" for n in ("digits", "paper_beats_dpsgd", "multi_device")}
  expected |= {f"papers/{n}.md" for n in (
      "000_user_level_filter", "001_output_perturbation", "002_resque", "003_accelerated_srgd",
      "004_bilevel")}
  assert expected <= names, sorted(expected - names)


def test_no_run_needs_a_reason(tmp_path):
  # the harness itself: a reasonless no-run block fails, a stated one is skipped
  page = tmp_path / "p.md"
  page.write_text("text\n```python no-run\nraise SystemExit\n```\n")
  with pytest.raises(AssertionError, match="no-run"):
    run_python(page, tmp_path)
  page.write_text("<!-- no-run: needs a GPU -->\n```python no-run\nraise SystemExit\n```\n"
                  "```python\nx = 1\n```\n")
  assert run_python(page, tmp_path) == 1


def test_yaml_validation_refuses_a_bad_key():
  # the YAML check is the CLI's: a misspelt key in a page's config would fail the page
  from dpsco_jax.config.types import ConfigError
  good = ("problem: logistic\nn_users: 100\nm: 2\nd: 3\nalgorithm: dp_sgd_user\n"
          "epsilon: 1.0\ndelta: 1.0e-5\nclip_norm: 1.0\nsampling_rate: 0.1\n")
  assert validate_yaml(good, "good") == 1
  with pytest.raises(ConfigError, match="epsilonn"):
    validate_yaml(good.replace("epsilon:", "epsilonn:"), "bad")


# ------------------------------------------------------------------ the YAML reference page

YAML_REFERENCE = DOCS / "guides" / "yaml_reference.md"
TOP_LEVEL = (  # the runner's own top-level keys (dpsco_jax.runner.config.RUNNER_ONLY, SECTIONS)
    ("experiments", "list of mappings, each merged over the top-level keys (one row each)"),
    ("name", "title of the config file's table"),
    ("description", "free text"),
    ("problem", "the problem: a registered name, or a section `{name: ..., key: value}`; without "
                "`name` and with `factory` / `model` / `loss` / `data`, your own problem (`user`)"),
    ("data", "another word for the `problem` section (a mapping without `path`)"),
    ("algorithm", "the algorithm: a registered name or a section `{name: ..., key: value}`"),
    ("label", "a row's name in the table and its records"),
    ("compare", "`{baseline, metric, better, resamples, seed}`: paired ratios to a baseline row"),
    ("select", "`{metric, over, rule, private}`: pick `over` fields on the tuning seeds (not "
               "covered by the privacy guarantee), or with `private` the best of a random number "
               "of candidate runs on the evaluation seeds, inside the guarantee"),
    ("tuning_seeds", "seeds of the selection phase"),
    ("eval_seeds", "seeds of the evaluation phase (disjoint from `tuning_seeds`)"),
    ("batch_seeds", "`false`: run every seed alone instead of one vmapped program"),
    ("devices", "`N` or `all`: shard every run's users over N local devices"))
INTRO = """# YAML reference

Every key a config file can hold, by where it lives. This page is generated from the schemas
(`dpsco_jax.config.families`, each algorithm package's `config.py`; the same lines as
`dpsco_jax.config.schema.describe(algorithm, problem)` prints) by
`python tests/test_docs_examples.py --write-yaml-reference`, and `tests/test_docs_examples.py`
fails when it differs from what the schemas say. The syntax (sweeps, sections,
`experiments:`) is in [sweeps and selection](sweeps_and_selection.md); Python configs
(`dp.plan`, `dp.fit`) use the algorithm keys below.

```python
from dpsco_jax.config import schema
print(schema.describe("dp_sgd_user", "logistic"))   # one run's keys: runner, problem, algorithm
```
"""


def _key_table(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
  """A schema's keys as the dataclass states them (annotation, default, metadata doc)."""
  rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
  private = getattr(cls, "private_requires", ())
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    meta = field.metadata
    default = ("required" if meta.get("required") else
               "required if private" if field.name in private else
               "derived" if field.default is None else f"`{field.default!r}`")
    kind = str(field.type).replace("|", "/")
    doc = str(meta.get("doc", "")).replace("|", "/")
    rows.append(f"| `{field.name}` | `{kind}` | {default} | {doc} |")
  return rows


def _first_line(cls: type) -> str:
  return ((cls.__doc__ or "").strip().splitlines() or [""])[0]


def yaml_reference() -> str:
  """The YAML reference page, from the schemas."""
  from dpsco_jax.config import families, schema
  out = [INTRO, "## Top level", "", "| key | meaning |", "|---|---|"]
  out += [f"| `{k}` | {doc} |" for k, doc in TOP_LEVEL]
  out += ["", "## Runner keys (every run)", "", *_key_table(families.RunnerKeys), "",
          "## Problems", ""]
  for name, cls in schema.PROBLEM_SCHEMAS.items():
    out += [f"### `{name}`", "", _first_line(cls), "", *_key_table(cls), ""]
  out += ["### A data file: `data` / `eval_data` of the `user` problem", "",
          "A path alone is `{path: PATH}`. Layouts: [your model and data](model_and_data.md).",
          "", *_key_table(families.DataFileKeys), "", "## Algorithms", "",
          "Every algorithm's schema also holds `n_users` (the problem's, declared) and `debug` "
          "(the runner's).", ""]
  groups: dict[type, list[str]] = {}
  for name, cls in schema.CONFIG_ALGORITHM_SCHEMAS.items():
    groups.setdefault(cls, []).append(name)
  for cls, names in groups.items():
    out += ["### " + ", ".join(f"`{n}`" for n in names), "", _first_line(cls), "",
            *_key_table(cls, skip=("n_users", "debug")), ""]
  return "\n".join(out).rstrip() + "\n"


def test_yaml_reference_is_the_schemas():
  assert YAML_REFERENCE.read_text() == yaml_reference(), (
      "docs/guides/yaml_reference.md is stale: python tests/test_docs_examples.py "
      "--write-yaml-reference")


def schema_keys() -> dict[str, set[str]]:
  """Every key a config can hold, by where it lives: read from the schemas."""
  from dpsco_jax.config import families, schema
  from dpsco_jax.runner import config as runner_config
  fields = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
  out = {"top level": set(runner_config.RUNNER_ONLY) | set(runner_config.SECTIONS) | {"label"},
         "runner": fields(families.RunnerKeys),
         "data file": fields(families.DataFileKeys)}
  for name, cls in schema.PROBLEM_SCHEMAS.items():
    out[f"problem {name}"] = fields(cls)
  for name, cls in schema.CONFIG_ALGORITHM_SCHEMAS.items():
    out[f"algorithm {name}"] = fields(cls)
  return out


def test_yaml_reference_names_every_key():
  page = (DOCS / "guides" / "yaml_reference.md").read_text()
  named = set(re.findall(r"`([A-Za-z_][\w.]*)`", page))
  missing = {where: sorted(keys - named) for where, keys in schema_keys().items()
             if keys - named}
  assert not missing, f"keys the YAML reference does not name: {missing}"


def test_yaml_reference_names_every_algorithm_and_problem():
  from dpsco_jax.config import schema
  page = (DOCS / "guides" / "yaml_reference.md").read_text()
  names = [*schema.CONFIG_ALGORITHM_SCHEMAS, *schema.PROBLEM_SCHEMAS]
  assert not [n for n in names if f"`{n}`" not in page]


if __name__ == "__main__":
  if "--write-yaml-reference" in sys.argv:
    YAML_REFERENCE.write_text(yaml_reference())
  total = 0
  for p in PAGES:
    bs = blocks(p)
    n = sum(b.lang == "python" and b.options != "no-run" for b in bs)
    y = sum(b.lang == "yaml" for b in bs)
    total += n + y
    print(f"{_id(p)}: {n} python, {y} yaml")
  print("total", total)
