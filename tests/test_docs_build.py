"""The documentation site: generated results pages equal their records, the API reference
covers every public name, and the Sphinx build passes with warnings as errors."""

from __future__ import annotations

import importlib
import inspect
import json
import math
import pathlib
import re
import shutil
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
sys.path.insert(0, str(ROOT / "docs"))
import gen_results  # noqa: E402  (docs/ is not a package)

# A table: its comment, one line that says what it is, a blank line, then the table's lines.
RECORD = re.compile(r"<!-- record: (\S+) (\S+) -->\n[^\n]*\n\n((?:\|[^\n]*\|\n)+)")
DERIVED = re.compile(r"<!-- derived: (\S+) -->\n[^\n]*\n\n((?:\|[^\n]*\|\n)+)")


def rows_of(md_table: str) -> tuple[list[str], list[list[str]]]:
  lines = md_table.strip().splitlines()
  split = lambda line: [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
  return split(lines[0]), [split(line) for line in lines[2:]]


def same(cell: str, value) -> bool:
  """A cell shows the record's value (3 significant digits, or 4 next to 1)."""
  if value is None:
    return cell == "—"
  if isinstance(value, (bool, int, str)):
    return cell == str(value)
  if isinstance(value, float) and math.isnan(value):
    return cell == "nan"
  return math.isclose(float(cell), value, rel_tol=5e-3, abs_tol=0.0)


def record_mismatches(page: str, load) -> list[str]:
  """Each cell of each record table that differs from the record it names."""
  bad, tables = [], RECORD.findall(page)
  for rel, pointer, md in tables:
    data = load(rel)
    entries = [data] if pointer == "." else (
        data[pointer] if "." not in pointer else gen_results.at(data, pointer))
    header, rows = rows_of(md)
    if len(rows) != len(entries):
      bad.append(f"{rel} {pointer}: {len(rows)} rows for {len(entries)} entries")
    for row, entry in zip(rows, entries):
      bad += [f"{rel} {pointer} {f}: {c!r} vs {entry.get(f)!r}"
              for f, c in zip(header, row) if not same(c, entry.get(f))]
  return bad


def load_record(rel: str):
  return json.loads((RESULTS / rel).read_text())


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
  out = tmp_path_factory.mktemp("results")
  gen_results.main(["--out", str(out)])
  return {p.stem: p.read_text() for p in out.glob("*.md")}


def test_every_record_table_equals_its_record(pages):
  assert set(pages) == {"study", "benchmarks"}
  counts = {name: len(RECORD.findall(page)) for name, page in pages.items()}
  assert counts["study"] >= 20 and counts["benchmarks"] >= 3, counts
  for page in pages.values():
    assert record_mismatches(page, load_record) == []


def test_a_changed_record_is_caught(pages):
  """The check fails when a record says something the page does not."""
  def edited(rel):
    data = load_record(rel)
    if rel == "study/srgd_scale.json":
      data["summary"][3]["excess_risk_mean"] *= 1.02
    return data
  bad = record_mismatches(pages["study"], edited)
  assert len(bad) == 1 and "excess_risk_mean" in bad[0], bad


def derived(page: str, name: str) -> tuple[list[str], list[list[str]]]:
  found = dict(DERIVED.findall(page))
  return rows_of(found[name])


def test_bilevel_gap_is_the_records_maximum(pages):
  header, rows = derived(pages["study"], "bilevel_gap")
  assert len(rows) == 8
  for row in rows:
    cell = dict(zip(header, row))
    gaps = {r["seed"]: r["excess_risk"] for r in load_record(cell["record"])["results"]
            if r["algorithm"] == "nonprivate_penalty" and r["n_users"] == int(cell["n_users"])}
    assert int(cell["seeds"]) == len(gaps)
    assert same(cell["max gap"], max(gaps.values()))
    assert int(cell["seeds above 5.3e-8"]) == sum(v > 5.3e-8 for v in gaps.values())


def test_srgd_epochs_ratios_pair_the_same_noise(pages):
  header, rows = derived(pages["study"], "srgd_epochs_pairs")
  runs: dict = {}
  for r in load_record("study/srgd_epochs.json")["results"]:
    if r["phase"] == "eval":
      key = (r["noise"], r["target_epsilon"], r["num_steps"] * r["batch_size"] // r["n_users"])
      runs.setdefault(key, []).append(r["excess_risk"])
  mean = lambda xs: sum(xs) / len(xs)
  assert len(rows) == 8
  for row in rows:
    c = dict(zip(header, row))
    key = (c["noise"], float(c["target_epsilon"]), int(c["epochs"]))
    assert same(c["ratio"], mean(runs[key]) / mean(runs[key[:2] + (1,)]))
    lo, hi = float(c["ratio lo"]), float(c["ratio hi"])
    assert c["reading"] == ("helps" if hi < 1 else "worse" if lo > 1 else "tie")
  blt2 = next(dict(zip(header, r)) for r in rows if r[:3] == ["blt", "1", "2"])
  assert blt2["paired seeds"] == "10"


def test_srgd_acc_unacc_cells_are_the_records(pages):
  header, rows = derived(pages["study"], "srgd_acc_unacc")
  regime = {(t["n"], t["epsilon"]): t["acc/unacc"] for t in load_record("srgd_regime.json")["table"]
            if t["problem"] == "least_squares"}
  pairs_line = (RESULTS / "study/srgd_scale_pairs.txt").read_text().splitlines()[-1]
  scale = {(int(re.search(r"n_users=(\d+)", k)[1]), float(re.search(r"target_epsilon=([\d.]+)", k)[1])): v
           for k, v in json.loads(pairs_line).items()
           if k.startswith("problem=least_squares") and k.endswith("accelerated_dp_srgd/dp_srgd_unaccelerated")}
  assert len(rows) == len(regime) + len(scale) == 18
  for row in rows:
    c = dict(zip(header, row))
    src = regime if c["record"] == "srgd_regime.json" else scale
    rec = src[(int(c["n"]), float(c["epsilon"]))]
    assert same(c["acc / unacc"], rec["ratio"]) and same(c["lo"], rec["ratio_ci95_lo"])
    assert same(c["hi"], rec["ratio_ci95_hi"])
  ties = [(r[1], r[2]) for r in rows if r[-1] == "tie"]
  assert ties == [("100000", "4"), ("1000000", "1"), ("1000000", "4")]


def public_names(modname: str) -> list[str]:
  mod = importlib.import_module(modname)
  names = getattr(mod, "__all__", None) or [
      n for n, v in vars(mod).items() if not n.startswith("_")]
  return [n for n in names if not isinstance(getattr(mod, n), types.ModuleType)]


def test_api_reference_documents_every_public_name():
  text = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
  documented = set(re.findall(r"\.\. (?:autofunction|autoclass|py:data):: (\S+)", text))
  missing = []
  for mod in ("dpsco_jax.flax", "dpsco_jax.transforms", "dpsco_jax.privacy", "dpsco_jax.audit",
              "dpsco_jax.data"):
    missing += [f"{mod}.{n}" for n in public_names(mod) if f"{mod}.{n}" not in documented]
  root = importlib.import_module("dpsco_jax")
  for n in public_names("dpsco_jax"):
    here = f"dpsco_jax.{n}"
    elsewhere = [d for d in documented if d.endswith(f".{n}") and d.count(".") == 2
                 and getattr(importlib.import_module(d.rsplit(".", 1)[0]), n) is getattr(root, n)]
    if here not in documented and not (elsewhere and f"`dpsco_jax.{n}`" in text):
      missing.append(here)
  assert missing == []


@pytest.mark.slow
def test_sphinx_build_passes_with_warnings_as_errors(tmp_path):
  """The whole site, -W, from a copy of docs/ (its results pages generated there): ~10 s of
  CPU (16 s on the shared 2-core box), within the ~60 s a test of the build may take."""
  sphinx_build = pytest.importorskip("sphinx.cmd.build")
  src = tmp_path / "docs"
  shutil.copytree(ROOT / "docs", src, ignore=shutil.ignore_patterns("_build", "results"))
  # a guide includes the toy algorithm's driver from the tests (../tests/toy_algorithm)
  shutil.copytree(ROOT / "tests" / "toy_algorithm", tmp_path / "tests" / "toy_algorithm",
                  ignore=shutil.ignore_patterns("__pycache__"))
  gen_results.main(["--out", str(src / "results")])
  rc = sphinx_build.build_main(["-W", "--keep-going", "-q", "-b", "html", str(src),
                                str(tmp_path / "html")])
  assert rc == 0
  assert (tmp_path / "html" / "results" / "study.html").exists()
  # a class's :members: renders its methods (an autodoc default of members=False hid them all)
  data_page = (tmp_path / "html" / "api" / "data.html").read_text()
  assert 'id="dpsco_jax.data.UserData.from_arrays"' in data_page


# Public callables exempt from a section, each with the reason a section makes no sense there.
# Exceptions are exempt from ``Args:`` as a kind (their constructor is ``BaseException``'s
# ``*args``: the message), see ``doc_section_gaps``.
DOC_SECTION_EXEMPT: dict[str, str] = {
    # an enum: Provenance("theorem") looks a member up; its members are the documentation
    "dpsco_jax.Provenance": "enum",
}
DOC_NAMESPACES = ("dpsco_jax", "dpsco_jax.flax", "dpsco_jax.transforms", "dpsco_jax.privacy",
                  "dpsco_jax.audit", "dpsco_jax.data")


def doc_section(doc: str, name: str) -> str | None:
  """The body of a Google-style section (``Args:``, ...) of ``doc``; None when it has none."""
  lines = inspect.cleandoc(doc or "").splitlines()
  for i, line in enumerate(lines):
    if line.strip() == f"{name}:":
      indent = len(line) - len(line.lstrip())
      body = []
      for nxt in lines[i + 1:]:
        if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
          break
        body.append(nxt)
      return "\n".join(body)
  return None


def documented_callables():
  """``(name, object, kind)`` for every public function, class and class method the API
  reference shows (each object once, under the first namespace that exports it)."""
  seen = set()
  for modname in DOC_NAMESPACES:
    mod = importlib.import_module(modname)
    for n in public_names(modname):
      obj = getattr(mod, n)
      if id(obj) in seen or not getattr(obj, "__module__", "").startswith("dpsco_jax"):
        continue
      seen.add(id(obj))
      if inspect.isclass(obj):
        yield f"{modname}.{n}", obj, "class"
        for mn, mv in vars(obj).items():
          fn = mv.__func__ if isinstance(mv, (classmethod, staticmethod)) else mv
          if not mn.startswith("_") and inspect.isfunction(fn):
            yield f"{modname}.{n}.{mn}", fn, "method"
      elif callable(obj):
        yield f"{modname}.{n}", obj, "function"


def doc_section_gaps(name: str, obj, kind: str) -> list[str]:
  """What ``obj``'s docstring lacks: ``Args:`` naming every parameter (``Attributes:`` may
  stand for it on a class), ``Returns:`` (``Yields:`` for a generator) unless it returns
  None or is a class."""
  doc, gaps = inspect.getdoc(obj) or "", []
  if kind == "class" and issubclass(obj, BaseException):
    params = []   # BaseException's *args: the message
  else:
    params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
  args = doc_section(doc, "Args")
  if args is None and kind == "class":
    args = doc_section(doc, "Attributes")
  if params and args is None:
    gaps.append(f"{name}: no Args:")
  elif params:
    gaps += [f"{name}: Args: lacks {p}" for p in params
             if not re.search(rf"^\s*\**{p}\b", args, re.M)]
  if kind != "class" and inspect.signature(obj).return_annotation not in (None, "None"):
    if doc_section(doc, "Yields" if inspect.isgeneratorfunction(obj) else "Returns") is None:
      gaps.append(f"{name}: no Returns:")
  return gaps


def test_public_callables_have_args_and_returns_sections():
  """Every public callable's docstring has ``Args:`` (each parameter named) and ``Returns:``,
  as the API reference shows them (napoleon, Google style)."""
  gaps = []
  for name, obj, kind in documented_callables():
    if name not in DOC_SECTION_EXEMPT:
      gaps += doc_section_gaps(name, obj, kind)
  assert gaps == [], f"{len(gaps)} gaps:\n" + "\n".join(gaps)


def test_doc_section_gaps_catches_a_missing_section():
  """The check itself: a function with a parameter and a result but no sections fails it."""
  def f(x: int) -> int:
    """Doubles ``x``."""
    return 2 * x
  assert doc_section_gaps("f", f, "function") == ["f: no Args:", "f: no Returns:"]
