"""ReSQue private SCO accounting (paper 002, Section 4; spec 002 §4): the approximate-RDP
charge of one Alg. 3/4 call (Lemma 7), the Theorem 3 parameters and preconditions.

Relation: replace-one, item level (``n`` public). The sensitivity of Alg. 3/4 holds only with
high probability: given the multiset of sampled indices, phase ``i``'s release moves by at most
``sqrt(1500) b_i eta_i L`` when one item is replaced (Lemma 5, ``b_i`` = the number of draws of
that item in phase ``i``; ``sigma_i = L eta_i / beta``), and ``b = sum b_i <= 2 log(2/delta)``
except with probability ``delta/2`` (Chernoff). Subsampling with replacement then amplifies
(Lemma 6, Prop. 7). The standard subsampled-Gaussian accountant therefore does NOT apply: each
call is an :class:`~dpsco_jax.privacy.ApproxRdpEvent` ``(alpha, alpha tau, delta_call,
delta')`` that the library's one :class:`~dpsco_jax.privacy.PrivacyLedger` sums (Lemma 3) and
converts once (Corollary 1, ``delta' = delta/3``, spec §8 item 12).
"""

from __future__ import annotations

import math

from dpsco_jax._checks import check_delta, check_epsilon, check_int, check_positive
from dpsco_jax.privacy.events import ApproxRdpEvent

RELATION = "replace_one"  # item level: one example replaced (n public)
DELTA_PRIME_FRAC = 1.0 / 3.0  # Corollary 1's delta' = delta/3 (spec §8 item 12)
ACCOUNTANT_DELTA_SHARE = 1e-3  # the ledger's own delta (no accountant events here)
LEMMA5_DRIFT = math.sqrt(1500.0)  # per-phase release drift / (b_i eta_i L), eq. (25)


class PrivacyPreconditionError(ValueError):
  """A precondition of a ReSQue privacy statement (Lemma 7, Props 6/8/10, Thm 3) fails."""


def alg4_rdp(*, T: int, n: int, beta: float, delta: float, alpha: float, rho_over_r: float,
             constants: str = "explicit", c_priv: float = 60.0) -> tuple[float, dict]:
  """RDP charge ``alpha * tau`` of one Alg. 3/4 call (Lemma 7) and its preconditions.

  Returns ``(eps_rdp, conditions)``; ``conditions`` maps a condition's text to whether it
  holds. ``explicit`` uses the proof constants (spec 002 §4 items 2-5):
  ``tau = 13 s^2 tau0``, ``s = 1.2 T/n``, ``tau0 = 6000 beta^2 log^2(2/delta)``.
  """
  check_int(T, "T")
  check_int(n, "n")
  check_positive(beta, "beta")
  check_delta(delta, "delta")
  check_positive(alpha, "alpha")
  if constants == "explicit":
    tau0 = 6000.0 * beta ** 2 * math.log(2.0 / delta) ** 2
    s = 1.2 * T / n
    tau = 13.0 * s * s * tau0
    cond = {
        "T/n <= 1/60 (Lemma 6)": T / n <= 1.0 / 60.0,
        "s = 1.2T/n < 1/40 (Prop. 7)": s < 1.0 / 40.0,
        "tau0 = 6000 beta^2 log^2(2/delta) <= 1/3 (Prop. 7)": tau0 <= 1.0 / 3.0,
        "alpha < 3/tau0 (Prop. 7)": alpha < 3.0 / tau0,
        "delta < 1/6 (Lemma 7)": delta < 1.0 / 6.0,
        "rho/r >= 1728 log^2(log2 T/delta) (Lemma 5)":
            rho_over_r >= 1728.0 * math.log(max(math.log2(max(T, 2)), 1.0) / delta) ** 2,
    }
  elif constants == "c_priv":
    lg = math.log(1.0 / delta)
    tau = c_priv * (beta * lg * T / n) ** 2
    cond = {
        "T/n <= 1/C_priv": T / n <= 1.0 / c_priv,
        "beta^2 log^2(1/delta) <= 1/C_priv": beta ** 2 * lg ** 2 <= 1.0 / c_priv,
        "alpha < 1/(C_priv beta^2 log^2(1/delta))": alpha < 1.0 / (c_priv * beta ** 2 * lg ** 2),
        "delta < 1/6": delta < 1.0 / 6.0,
        "rho/r >= C_priv log^2(log2 T/delta)":
            rho_over_r >= c_priv * math.log(max(math.log2(max(T, 2)), 1.0) / delta) ** 2,
        "C_priv is the paper's unspecified universal constant (not a proof constant)": False,
    }
  else:
    raise ValueError(f"constants must be 'explicit' or 'c_priv', got {constants!r}")
  return alpha * tau, cond


def call_event(T: int, beta: float, *, n: int, delta_call: float, alpha: float,
               delta_prime: float, ratio: float, constants: str, c_priv: float
               ) -> tuple[ApproxRdpEvent, dict]:
  """One Alg. 3/4 call of ``T`` steps at noise level ``beta`` as an :class:`ApproxRdpEvent`
  (Lemma 7) and :func:`alg4_rdp`'s conditions."""
  e, cond = alg4_rdp(T=T, n=n, beta=beta, delta=delta_call, alpha=alpha, rho_over_r=ratio,
                     constants=constants, c_priv=c_priv)
  return ApproxRdpEvent(alpha, e, delta_call, delta_prime), cond


def approx_rdp_events(plan: list[tuple[int, float]], *, beta: float, **kw
                      ) -> list[ApproxRdpEvent]:
  """The planned Alg. 4 calls ``[(T, beta factor)]`` as :class:`ApproxRdpEvent` s (Lemma 7)
  at noise level ``beta`` (call ``j`` runs at ``beta_j = factor_j * beta``); ``kw``:
  :func:`call_event`'s."""
  return [call_event(t, b * beta, **kw)[0] for t, b in plan]


def theorem3_params(*, n: int, d: int, epsilon: float, delta: float, lipschitz: float = 1.0,
                    radius: float = 1.0, C: float = 1.0, c_ba: float = 1.0) -> dict:
  """Eqs. (30)-(34) (ceilings added, spec §8 item 12). ``C`` and ``c_ba`` are the paper's
  unspecified universal constants."""
  check_int(n, "n")
  check_int(d, "d")
  eps, dl = check_epsilon(epsilon), check_delta(delta)
  L, R = lipschitz, radius
  lnd = math.log(n / dl)
  eps_opt = C * L * R * (1 / math.sqrt(n) + math.sqrt(d * math.log(1 / dl)) * lnd ** 1.5
                         * math.log(n) / (n * eps))
  kappa = L * R / eps_opt
  rho = eps_opt / (L * math.sqrt(d))
  r = rho / (math.sqrt(C) * lnd ** 2)
  alpha = 4 * math.log(2 / dl) / eps
  beta = eps / (C * lnd * math.sqrt(math.log(1 / dl)))
  K = (R / r) ** (2 / 3)
  lk = math.log(max(kappa, math.e))
  lam_star = eps_opt * K ** 2 * lk ** 2 / R ** 2
  t1 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta * lk ** 2)
                       + kappa ** 2 / (K * lk ** 3 * lnd))
  t2 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta * math.sqrt(lk))
                       + kappa ** 2 / (K * lk))
  t3 = math.sqrt(C) * (kappa * math.sqrt(d) / (math.sqrt(K) * beta) + kappa ** 2 / K)
  zeta = 1 / (kappa * c_ba * K * lk)
  return {"eps_opt": eps_opt, "kappa": kappa, "rho": rho, "r": r, "alpha": alpha, "beta": beta,
          "K": K, "lam_star": lam_star, "T1": int(math.ceil(t1)), "T2": int(math.ceil(t2)),
          "T3": int(math.ceil(t3)), "zeta": zeta, "iterations": int(math.ceil(c_ba * K * lk))}


def check_theorem3_preconditions(p: dict, *, n: int, epsilon: float, delta: float,
                                 c_priv: float = 60.0) -> None:
  """Raises :class:`PrivacyPreconditionError` naming the first violated condition of
  Theorem 3 / Props 6-10 for the parameters of :func:`theorem3_params`."""
  checks = [
      ("epsilon < 1 (Theorem 3)", epsilon < 1),
      ("delta < 1/6 (Theorem 3)", delta < 1 / 6),
      ("eps_opt <= L R (Prop. 1: kappa >= 1)", p["kappa"] >= 1),
      ("T1 <= n / C_priv (Prop. 10)", p["T1"] <= n / c_priv),
      ("T2 <= n / C_priv (Prop. 8)", p["T2"] <= n / c_priv),
      ("T3 <= n / (2 C_priv) (Alg. 6 input)", p["T3"] <= n / (2 * c_priv)),
      ("beta^2 log^2(log log n / delta) <= 1/C_priv (Lemma 10)",
       p["beta"] ** 2 * math.log(max(math.log(max(math.log(n), 1.0)), 1e-9) / delta) ** 2
       <= 1 / c_priv),
      ("rho/r >= C_priv log^2(log T / delta) (Lemma 5)",
       p["rho"] / p["r"] >= c_priv * math.log(math.log(max(p["T3"], 3)) / delta) ** 2),
  ]
  for name, ok in checks:
    if not ok:
      raise PrivacyPreconditionError(f"theory preset: precondition violated: {name}")
