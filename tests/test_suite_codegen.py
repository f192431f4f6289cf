"""The suite's compile setting (tests/conftest.py): unoptimised code generation on a CPU-only
install, given to subprocesses through the environment, and the ``optimized_codegen``
fixture's opt-out restoring XLA's optimisation for its module only."""

import os

import jax
import jax.numpy as jnp
import pytest

from multidevice_users import accelerator_installed


def test_a_cpu_install_compiles_unoptimised_and_passes_it_to_subprocesses():
  if accelerator_installed():
    pytest.skip("a GPU/TPU jaxlib is installed: the suite keeps XLA's defaults")
  if os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") != "1":
    pytest.skip("the caller set JAX_DISABLE_MOST_OPTIMIZATIONS itself")
  assert jax.config.read("jax_disable_most_optimizations") is True


def test_accelerator_detection_honours_a_cpu_pin(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert accelerator_installed() is False


def test_optimized_codegen_opts_out_and_restores():
  from conftest import optimized_codegen
  gen = getattr(optimized_codegen, "__wrapped__", None)
  if gen is None:
    pytest.skip("this pytest does not expose the fixture's function")
  before = jax.config.read("jax_disable_most_optimizations")
  env_before = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
  steps = gen()
  next(steps)
  assert jax.config.read("jax_disable_most_optimizations") is False
  assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"
  assert float(jax.jit(lambda x: x * 2)(jnp.float32(3))) == 6.0
  with pytest.raises(StopIteration):
    next(steps)
  assert jax.config.read("jax_disable_most_optimizations") is before
  assert os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == env_before
