"""Sphinx configuration of the dpsco_jax documentation site (`make docs`).

Sphinx + MyST Markdown, the JAX stack's convention (optax, flax, jax_privacy): pages are
Markdown, the API reference is autodoc over the docstrings (Google style, napoleon). The build
is offline and runs with -W (warnings are errors), so a docstring Sphinx cannot parse fails it.
"""

import logging
import os
import sys

# The package is installed editable in .venv; the path makes a plain checkout build too.
sys.path.insert(0, os.path.abspath(".."))

project = "dpsco_jax"
author = "dpsco_jax authors"
copyright = "dpsco_jax authors"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: $...$ math, ::: fences, and heading anchors so pages can link to sections.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings are Google style (Args: / Returns: / Raises:); some use NumPy-free plain text.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes: as field lists: a :members: class documents its fields as objects already
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# no "members" key: a default of False overrides every directive's :members: (methods vanish)
autodoc_default_options = {"show-inheritance": False}
# Documented objects are listed by hand in docs/api/*.md (tests/test_docs_build.py checks the
# lists cover every public name), so autosummary writes no stub pages into the tree.
autosummary_generate = False
# Unresolved cross-references are not warnings (nitpicky off): docstrings name jax / optax /
# numpy types that have no inventory offline (intersphinx would need the network).
nitpicky = False

html_theme = "furo"
html_title = "dpsco_jax"
# No favicon / logo / external fonts: the build and the site are offline.
html_static_path = []


class _EmptyPageFolder(logging.Filter):
  """Drops the 'glob pattern didn't match' warning for the page folders, and only for them.

  guides/, tutorials/ and papers/ fill as their pages land; until a folder has a page its
  toctree glob matches nothing, which Sphinx reports as a warning without a type (so
  suppress_warnings cannot name it). Every other warning still fails the -W build.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not (getattr(record, "subtype", None) == "empty_glob"
                and record.args and record.args[0] in PAGE_FOLDER_GLOBS)


PAGE_FOLDER_GLOBS = ("guides/*", "tutorials/*", "papers/*")


def setup(app):
  logging.getLogger("sphinx.sphinx.directives.other").addFilter(_EmptyPageFolder())
  return {"parallel_read_safe": True}
