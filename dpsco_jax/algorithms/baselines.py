"""Baselines every paper algorithm is compared against, as chains over the same engine.

* ``nonprivate_sgd`` — projected minibatch SGD with iterate averaging (no privacy).
* ``dp_sgd_item`` — item-level DP-SGD: every item is a row, clipped at ``clip``.
* ``dp_sgd_user`` — user-level DP-SGD: each sampled user's *mean* gradient is clipped at
  ``clip`` (Levy et al. 2021; paper 000's main baseline). Poisson (default), fixed-size
  without replacement, or full-batch user sampling.
* ``dp_sgd_group`` — item-level DP-SGD made user-level by group privacy: run at
  ``(eps/m, delta / (m e^{(m-1) eps/m}))`` item-level so that a group of ``m`` items gets
  ``(eps, delta)`` (Dwork & Roth 2014, Thm 2.2 extended to (eps, delta)).

Chain: ``clip_per_user(C) -> aggregate("mean", D) -> add_gaussian_noise(z C / D) ->
projected_sgd(lr, R, averaging="uniform")``. The aggregate's add/remove sensitivity is
``C/D`` (replace-one ``2C/D``, which the accountant's neighbouring relation accounts for);
``D`` is the nominal batch size. The noise multiplier ``z`` is calibrated with the ledger to the
target (epsilon, delta): provenance ``accountant``. Poisson sampling uses a static capacity of
slots; the probability that it truncates is added to delta.

Config keys: ``epsilon, delta, clip, lr, steps | epochs, batch_users, sampling, relation,
averaging``.
"""

from __future__ import annotations

import math

import dp_accounting
import jax
import optax

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int,
                               check_nonnegative, check_positive)
from dpsco_jax.algorithms.common import (cfg_get, poisson_truncation_probability, run_chain,
                                         sampling_setup)
from dpsco_jax.privacy import (PrivacyLedger, PrivacyReport, Provenance,
                                      calibrate_noise_multiplier)
from dpsco_jax.problems import SCOProblem
from dpsco_jax.result import Result
from dpsco_jax.transforms.clipping import aggregate, clip_and_aggregate
from dpsco_jax.transforms.noise import add_gaussian_noise
from dpsco_jax.transforms.steps import projected_sgd

_NONPRIVATE = PrivacyReport(epsilon=math.inf, delta=1.0 - 1e-12, provenance="none",
                            level="none", notes="non-private (reference or noise switched off)")


def dp_sgd_event(noise_multiplier: float, *, sampling: str, q: float, n: int, batch: int,
                 steps: int) -> dp_accounting.DpEvent:
  """The DpEvent of ``steps`` DP-SGD steps with the given user sampling."""
  gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
  if sampling == "poisson":
    one = dp_accounting.PoissonSampledDpEvent(q, gauss)
  elif sampling == "fixed":
    one = dp_accounting.SampledWithoutReplacementDpEvent(n, batch, gauss)
  else:
    one = gauss
  return dp_accounting.SelfComposedDpEvent(one, steps)


def dp_sgd_chain(h: dict, denominator: float, averaging: str) -> optax.GradientTransformation:
  """clip -> fixed-denominator mean (fused) -> Gaussian noise -> projected SGD."""
  return optax.chain(
      clip_and_aggregate(h["clip"], "mean", denominator),
      add_gaussian_noise(h["stddev"], h["noise_key"]),
      projected_sgd(h["lr"], radius=h["radius"], averaging=averaging))


def sgd_chain(h: dict, denominator: float, averaging: str) -> optax.GradientTransformation:
  """Non-private: mean -> projected SGD."""
  return optax.chain(aggregate("mean", denominator=denominator),
                     projected_sgd(h["lr"], radius=h["radius"], averaging=averaging))


def _steps(cfg: dict, n: int, batch: int) -> int:
  if cfg.get("steps") is not None:
    return check_int(cfg["steps"], "steps")
  epochs = check_positive(cfg_get(cfg, "epochs", 1.0), "epochs")
  return max(1, int(round(epochs * n / batch)))


def _relation(cfg: dict, sampling: str) -> str:
  relation = cfg_get(cfg, "relation", "replace_one" if sampling == "fixed" else "add_remove")
  if sampling == "fixed" and relation != "replace_one":
    raise ValueError("relation must be 'replace_one' with sampling='fixed' (dp_accounting "
                     "supports sampling without replacement only under replace-one)")
  return relation


def _dp_sgd(problem: SCOProblem, cfg: dict, key: jax.Array, *, rows: dict, m_per_row: int,
            epsilon: float, delta: float, level: str, notes: str = "",
            report_eps: float | None = None, report_delta: float | None = None) -> Result:
  n = jax.tree.leaves(rows)[0].shape[0]
  sampling, batch, capacity, q = sampling_setup(cfg, n)
  steps = _steps(cfg, n, batch)
  clip = check_positive(cfg_get(cfg, "clip", problem.lipschitz), "clip")
  relation = _relation(cfg, sampling)
  make_event = lambda z: dp_sgd_event(z, sampling=sampling, q=q, n=n, batch=batch,
                                      steps=steps)
  if cfg.get("noise_multiplier") is not None:  # explicit z: account it instead of calibrating
    z = check_nonnegative(cfg["noise_multiplier"], "noise_multiplier")
  else:
    z = calibrate_noise_multiplier(make_event, epsilon=epsilon, delta=delta, relation=relation)
  lr = check_positive(cfg_get(cfg, "lr", problem.radius / (clip * math.sqrt(steps))), "lr")
  averaging = cfg_get(cfg, "averaging", "uniform")
  check_choice(averaging, "averaging", ("none", "uniform"))
  hparams = {"clip": clip, "stddev": z * clip / batch, "lr": lr, "radius": problem.radius,
             "noise_key": jax.random.fold_in(key, 1)}
  ledger = PrivacyLedger(delta=delta, relation=relation)
  if z > 0:
    ledger.spend(make_event(z), label=f"{level}-level DP-SGD ({sampling}, z={z:.4g})")
  params, _ = run_chain(problem.loss_fn, rows, problem.init_params(), dp_sgd_chain, hparams,
                        static=(float(batch), averaging), steps=steps,
                        key=jax.random.fold_in(key, 2), sampling=sampling, batch=batch,
                        capacity=capacity)
  record = {"noise_multiplier": z, "steps": steps, "batch_users": batch, "clip": clip,
            "lr": lr, "sampling": sampling}
  grad_evals = int(steps * batch * m_per_row)
  if z == 0:
    return Result(params=params, privacy=_NONPRIVATE, gradient_evaluations=grad_evals,
                  record=record)
  trunc = poisson_truncation_probability(n, q, capacity, steps) if sampling == "poisson" else 0
  report = ledger.report(provenance=Provenance.ACCOUNTANT, level="item" if level == "item" else "user",
                         notes=notes, extra_delta=trunc)
  if report_eps is not None:  # group privacy lifts the item-level report to user level
    report = type(report)(epsilon=report_eps, delta=report_delta + trunc * m_per_row,
                          provenance=report.provenance, level="user", relation=relation,
                          mechanisms=report.mechanisms, notes=notes)
  return Result(params=params, privacy=report, gradient_evaluations=grad_evals, record=record)


def _item_rows(problem: SCOProblem) -> dict:
  """Every item becomes its own row (a 'user' with one item)."""
  return jax.tree.map(lambda x: x.reshape((-1, 1) + x.shape[2:]), problem.data)


def dp_sgd_user(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """User-level DP-SGD with per-user clipping of the mean gradient."""
  eps, delta = check_epsilon(cfg["epsilon"]), check_delta(cfg["delta"])
  return _dp_sgd(problem, cfg, key, rows=problem.data, m_per_row=problem.m, epsilon=eps,
                 delta=delta, level="user")


def dp_sgd_item(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Item-level DP-SGD (per-example clipping); its guarantee is item-level only."""
  eps, delta = check_epsilon(cfg["epsilon"]), check_delta(cfg["delta"])
  return _dp_sgd(problem, cfg, key, rows=_item_rows(problem), m_per_row=1, epsilon=eps,
                 delta=delta, level="item")


def group_privacy_targets(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
  """Item-level (eps', delta') whose group-of-``k`` lift is (epsilon, delta):
  ``eps' = eps/k``, ``delta' = delta / (k e^{(k-1) eps'})``."""
  k = check_int(group_size, "group_size")
  eps_item = epsilon / k
  return eps_item, delta / (k * math.exp((k - 1) * eps_item))


def dp_sgd_group(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Item-level DP-SGD lifted to user level (groups of ``m`` items) by group privacy."""
  eps, delta = check_epsilon(cfg["epsilon"]), check_delta(cfg["delta"])
  eps_item, delta_item = group_privacy_targets(eps, delta, problem.m)
  notes = (f"item-level accountant at (eps={eps_item:.4g}, delta={delta_item:.3g}) lifted to "
           f"user level by group privacy over m={problem.m} items")
  return _dp_sgd(problem, cfg, key, rows=_item_rows(problem), m_per_row=1, epsilon=eps_item,
                 delta=delta_item, level="group", notes=notes, report_eps=eps,
                 report_delta=delta)


def nonprivate_sgd(problem: SCOProblem, cfg: dict, key: jax.Array) -> Result:
  """Projected minibatch SGD over users with iterate averaging; no privacy."""
  n = problem.n_users
  sampling, batch, capacity, _ = sampling_setup({**cfg, "sampling": cfg_get(
      cfg, "sampling", "fixed")}, n)
  steps = _steps(cfg, n, batch)
  lr = check_positive(cfg_get(cfg, "lr", problem.radius / (problem.lipschitz
                                                           * math.sqrt(steps))), "lr")
  averaging = check_choice(cfg_get(cfg, "averaging", "uniform"), "averaging", ("none", "uniform"))
  params, _ = run_chain(problem.loss_fn, problem.data, problem.init_params(), sgd_chain,
                        {"lr": lr, "radius": problem.radius}, static=(float(batch), averaging),
                        steps=steps, key=key, sampling=sampling, batch=batch, capacity=capacity)
  return Result(params=params, privacy=_NONPRIVATE,
                gradient_evaluations=int(steps * batch * problem.m),
                record={"steps": steps, "batch_users": batch, "lr": lr})


ALGORITHMS = {
    "nonprivate_sgd": nonprivate_sgd,
    "dp_sgd_item": dp_sgd_item,
    "dp_sgd_user": dp_sgd_user,
    "dp_sgd_group": dp_sgd_group,
}
