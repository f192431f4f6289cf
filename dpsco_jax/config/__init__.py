"""The one config vocabulary, in three layers (``tests/test_package_graph.py``).

* :mod:`dpsco_jax.config.types`: ``ConfigError`` and the strict type check (imports nothing of
  the package but ``_checks``, so every layer may raise its errors).
* :mod:`dpsco_jax.config.families`: the shared typed, frozen config dataclasses (each algorithm
  family's own is its package's ``config.py``); an instance is what a driver reads.
* :mod:`dpsco_jax.config.schema`: a whole run validated against those schemas.
"""
