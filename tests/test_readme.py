"""The README: short, its two commands, its algorithm table complete, and every measured number
read from the record it names. (Its python blocks run in tests/test_docs_examples.py.)"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "experiments" / "results"
# a measured row: | what | numbers | `FILE` <!-- LIST key=value ... : field field ... --> |
ROW = re.compile(r"^\|[^|]*\|([^|]*)\|\s*`([\w.]+)`\s*<!--\s*(\w+)((?:\s+\w+=\S+)*)\s*:"
                 r"((?:\s+\w+)+)\s*-->\s*\|\s*$", re.M)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def measured_rows(text: str) -> list[tuple[list[str], str, str, dict, list[str]]]:
  rows = []
  for shown, file, table, selector, fields in ROW.findall(text):
    pairs = dict(kv.split("=", 1) for kv in selector.split())
    rows.append((NUMBER.findall(shown), file, table, pairs, fields.split()))
  return rows


def _matches(value, wanted: str) -> bool:
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value) == float(wanted)
  return str(value) == wanted


def record_row(file: str, table: str, selector: dict) -> dict:
  data = json.loads((RESULTS / file).read_text())
  hits = [r for r in data[table] if all(_matches(r.get(k), v) for k, v in selector.items())]
  assert len(hits) == 1, f"{file} {table} {selector}: {len(hits)} rows match, not one"
  return hits[0]


def agrees(shown: str, value: float) -> bool:
  """``shown`` is ``value`` rounded to the digits shown (half a unit of its last digit)."""
  mantissa, _, exponent = shown.lower().partition("e")
  decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
  unit = 10.0 ** (-decimals + (int(exponent) if exponent else 0))
  return math.isfinite(value) and abs(float(shown) - value) <= unit / 2 * (1 + 1e-9)


def test_readme_is_short():
  assert len(README.read_text().splitlines()) <= 250


def test_readme_quick_start_commands():
  text = README.read_text()
  assert "make run" in text and "make test" in text


def test_every_measured_number_is_its_record():
  rows = measured_rows(README.read_text())
  assert len(rows) >= 8, "the README's measured table lost its record references"
  for shown, file, table, selector, fields in rows:
    assert len(shown) == len(fields), (file, selector, shown, fields)
    record = record_row(file, table, selector)
    for number, field in zip(shown, fields):
      assert agrees(number, record[field]), f"{file} {selector} {field}: README {number}, " \
                                            f"record {record[field]}"


def test_no_interval_outside_the_measured_table():
  # a mean [lo, hi] typed anywhere else would be a number no record backs
  lines = [line for line in README.read_text().splitlines()
           if re.search(r"\[\s*-?\d[\d.e-]*,\s*-?\d[\d.e-]*\]", line) and "<!--" not in line]
  assert not lines, lines


def test_agrees_rounds_to_the_digits_shown():
  assert agrees("0.834", 0.8338) and agrees("1.19e-3", 0.0011865) and agrees("0.20", 0.2047)
  assert not agrees("0.834", 0.8331) and not agrees("1.2e-3", 0.00126)
  assert not agrees("0.5", float("nan"))


def test_a_number_off_its_record_fails():
  text = ("| a | 0.900 [0.817, 0.851] | `digits_user_level.json` <!-- rows "
          "algorithm=dp_sgd_user : test_accuracy_mean ci95_lo ci95_hi --> |\n")
  (shown, file, table, selector, fields), = measured_rows(text)
  record = record_row(file, table, selector)
  assert not agrees(shown[0], record[fields[0]]) and agrees(shown[1], record[fields[1]])


def test_algorithm_table_lists_every_registered_algorithm_with_its_paper():
  from dpsco_jax.algorithms.registry import algorithms
  text = README.read_text()
  for name, entry in algorithms().items():
    row = next((line for line in text.splitlines()
                if line.startswith("|") and f"`{name}`" in line.split("|")[1]), None)
    assert row is not None, f"{name} is not in the README's algorithm table"
    assert row.split("|")[2].strip() == entry.paper, (name, entry.paper)


@pytest.mark.parametrize("stale", ["13.4 s vs 51.5 s", "5.3e-8 on all 100",
                                   "better single-epoch method in every cell"])
def test_claims_that_did_not_survive_are_gone(stale):
  assert stale not in " ".join(README.read_text().split())   # across line breaks too
