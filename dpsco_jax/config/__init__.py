"""The one config vocabulary: :mod:`~dpsco_jax.config.types` (``ConfigError``, the type
check), :mod:`~dpsco_jax.config.families` (the shared frozen schemas; each algorithm family's
is its package's ``config.py``), :mod:`~dpsco_jax.config.schema` (a whole run validated).
"""
