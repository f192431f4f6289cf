"""The one config vocabulary (issue 25, DESIGN.md's layout).

* :mod:`dpsco_jax.config.types` — ``ConfigError`` and the strict type check; imports nothing
  of the package but ``_checks``, so every layer may raise its errors.
* :mod:`dpsco_jax.config.families` — the typed, frozen config dataclasses shared across the
  algorithms: the runner's keys, every problem's, ``AlgorithmKeys`` (the base of every
  algorithm's config) and the Flax trainer's: every key, its type, its default and its
  meaning, written once. Each algorithm family's own schema is its package's ``config.py``
  (``dpsco_jax/algorithms/<package>/config.py``), named where its driver registers. An
  instance is what a planner, a driver or a problem factory reads (``Schema.of``).
* :mod:`dpsco_jax.config.schema` — validation of a whole run (algorithm + problem + runner
  keys) against those schemas, with "did you mean" suggestions; reads the registry.

The package itself imports nothing: its modules sit in three layers
(``tests/test_package_graph.py``).
"""
