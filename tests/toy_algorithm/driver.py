"""Noisy full-batch gradient descent: a toy algorithm written as a new package would be.

Everything it needs is here, in its own package: its config (an ``AlgorithmKeys`` schema on the shared
vocabulary's keys), its data-free planner and its plan runner, built from the library's stages
(per-user clip + fixed-denominator mean, Gaussian noise, projected SGD) and its accountant.
``tests/test_algorithm_interface.py`` drops this directory into a copy of
``dpsco_jax/algorithms/`` (as ``toy/``) and finds it in ``dpsco list``, ``dpsco_jax.fit`` and a
YAML run, with no other file changed; it also imports it as a user's own module.

Guarantee: ``num_steps`` compositions of the Gaussian mechanism with multiplier ``z`` on the
clipped mean over the ``n`` users, under ``zero_out`` (``n`` is public: every step uses every
user's slot).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import dp_accounting
import jax
import optax

from dpsco_jax.algorithms.common import run_chain
from dpsco_jax.algorithms.registration import Planned, register
from dpsco_jax.config.families import AlgorithmKeys
from dpsco_jax.privacy import (GaussianStage, PrivacyLedger, PrivacyReport, Provenance,
                               clipped_mean_sensitivity)
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import clip_and_aggregate
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.steps import projected_sgd

NAME = "toy_noisy_full_gd"


@dataclasses.dataclass(frozen=True)
class ToyConfig(AlgorithmKeys):
  """The toy's keys: the shared vocabulary's names and kinds."""
  noise_multiplier: float = dataclasses.field(
      default=None, metadata={"doc": "Gaussian noise multiplier z", "required": True})
  delta: float = dataclasses.field(default=None, metadata={"doc": "target delta",
                                                           "required": True})
  num_steps: int = dataclasses.field(default=10, metadata={"doc": "full-batch steps",
                                                           "required": False})
  clip_norm: float = dataclasses.field(default=1.0, metadata={"doc": "per-user clip",
                                                              "required": False})
  learning_rate: float = dataclasses.field(default=0.5, metadata={"doc": "step size",
                                                                  "required": False})
  relation: Optional[str] = dataclasses.field(default=None, metadata={
      "doc": "zero_out only (n public)", "required": False})


class ToyPlan(NamedTuple):
  """The toy's plan object (``plan.detail``): the schedule its run reads and the one plan
  protocol (``FamilyPlan``): its noise stage, its events, ``charge()``."""
  num_steps: int
  learning_rate: float
  delta: float
  stage: GaussianStage   # z on the clipped mean's sensitivity C / n: the std is formed there

  @property
  def stages(self) -> tuple[GaussianStage, ...]:
    return (self.stage,)

  @property
  def events(self) -> tuple[dp_accounting.DpEvent, ...]:
    return (dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(self.stage.noise_multiplier), self.num_steps),)

  def charge(self) -> PrivacyReport:
    ledger = PrivacyLedger(delta=self.delta, relation="zero_out")
    for event in self.events:
      ledger.spend(event, label=f"{NAME} (z={self.stage.noise_multiplier})")
    return ledger.report(provenance=Provenance.ACCOUNTANT, level="user")


def planner(facts, cfg: ToyConfig) -> Planned:
  """Everything the run needs, from public facts: the noise stage (its std), the schedule and
  the guarantee (the plan's ``detail`` is what :func:`toy_noisy_full_gd` reads)."""
  c = cfg   # the validated ToyConfig
  if c.relation not in (None, "zero_out"):
    raise ValueError(f"{NAME} supports relation zero_out only, got {c.relation!r}")
  stage = GaussianStage(float(c.noise_multiplier),
                        clipped_mean_sensitivity(c.clip_norm, facts.n_users), "step")
  plan = ToyPlan(int(c.num_steps), float(c.learning_rate), float(c.delta), stage)
  return Planned(plan.charge(), stage.noise_multiplier,
                 {"num_steps": plan.num_steps, "noise_std": stage.std}, plan)


def _chain(h: dict, n: float) -> optax.GradientTransformation:
  return optax.chain(clip_and_aggregate(h["clip"], "mean", n),
                     add_gaussian_noise(h["stddev"], h["noise_key"]),
                     projected_sgd(h["lr"], radius=h["radius"]))


@register(NAME, config=ToyConfig, paper="baseline", planner=planner,
          mesh="a toy: it says why it refuses a mesh")
def toy_noisy_full_gd(plan, problem, key: jax.Array) -> Result:
  """Noisy full-batch GD (see the module docstring): runs ``plan`` (its ``detail``, its
  ``privacy``); it plans nothing again."""
  p = plan.detail
  n = int(problem.n_users)
  k_noise, k_run = jax.random.split(key)
  h = {"clip": p.stage.sensitivity.bound, "stddev": p.stage.std, "noise_key": k_noise,
       "lr": p.learning_rate, "radius": problem.radius}
  params, _ = run_chain(problem.loss_fn, problem.data, problem.init_params(), _chain, h,
                        static=(float(n),), steps=p.num_steps, key=k_run, sampling="full",
                        batch=n, capacity=n)
  return Result(params=params, privacy=plan.privacy,
                gradient_evaluations=p.num_steps * n * int(problem.m),
                record={"num_steps": p.num_steps})
