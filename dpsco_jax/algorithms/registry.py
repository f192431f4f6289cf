"""The algorithm registry: every algorithm registers itself where it is defined.

::

    @register("dp_sgd_user", config=DpSgdConfig, paper="baseline")
    def dp_sgd_user(problem, cfg, key) -> Result: ...

The decorator and its table live one level down, in
:mod:`dpsco_jax.algorithms.registration` (the drivers import that); this module imports every
algorithm module, so :func:`algorithms` returns the whole table and the runner, the CLI's
``dpsco list``, :func:`dpsco_jax.fit` and the tests all read one table. The imports are plain
module-level imports: the package graph shows them (``tests/test_package_graph.py``), and a
module that fails to import is a bug that raises here (it is never skipped).
"""

from __future__ import annotations

from dpsco_jax.algorithms.registration import AlgorithmEntry, register, registered

# registration order is the table's order: keep the order these modules have always had
from dpsco_jax.algorithms.dpsgd import driver as _dpsgd  # noqa: I001
from dpsco_jax.algorithms.user_level_filter import driver as _user_level_filter
from dpsco_jax.algorithms.output_perturbation import driver as _output_perturbation
from dpsco_jax.algorithms.resque import driver as _resque
from dpsco_jax.algorithms.srgd import driver as _srgd
from dpsco_jax.algorithms.bilevel import driver as _bilevel
from dpsco_jax.algorithms.bilevel import localized_gd as _localized_gd

__all__ = ["AlgorithmEntry", "register", "algorithms", "ALGORITHM_MODULES"]

#: Modules that define algorithms (each registers its drivers when imported, above).
ALGORITHM_MODULES: tuple[str, ...] = tuple(m.__name__ for m in (
    _dpsgd, _user_level_filter, _output_perturbation, _resque, _srgd, _bilevel,
    _localized_gd))


def algorithms() -> dict[str, AlgorithmEntry]:
  """Every registered algorithm."""
  return registered()
