"""Findings of an outside review at the edges (extreme and odd numbers through the Python API
and the privacy primitives): each test failed before its fix."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dpsco_jax import privacy
from dpsco_jax._checks import check_epsilon, check_positive


@pytest.mark.parametrize("number", [np.float16, np.float32, jnp.asarray])
@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0])
def test_gaussian_sigma_of_a_low_precision_number_is_the_float64_sigma(number, epsilon):
  # a float16 / float32 / 0-d jax sensitivity bisected (and returned) in its own precision:
  # np.float16 sensitivity 1 at epsilon 0.5 gave sigma 7.016 < the private 7.0318
  want = privacy.gaussian_sigma_analytic(1.0, epsilon, 1e-5)
  got = privacy.gaussian_sigma_analytic(number(1.0), epsilon, 1e-5)
  assert type(got) is float and got == want
  want = privacy.gaussian_sigma_classic(3.0, min(epsilon, 1.0), 1e-5)
  got = privacy.gaussian_sigma_classic(number(3.0), min(epsilon, 1.0), 1e-5)
  assert type(got) is float and got == want


@pytest.mark.parametrize("value", [jnp.asarray(2.0, jnp.bfloat16), ml_dtypes.bfloat16(2.0)])
def test_a_bfloat16_scalar_is_a_number(value):
  # a bfloat16 scalar (numpy kind "V") was refused as "must be a finite number > 0, got
  # Array(2, dtype=bfloat16)"; float16 / float32 scalars were accepted
  assert check_positive(value, "clip_norm") == 2.0
  assert check_epsilon(value) == 2.0
  assert privacy.gaussian_sigma_analytic(value, 1.0, 1e-5) == pytest.approx(
      2 * privacy.gaussian_sigma_analytic(1.0, 1.0, 1e-5))
  with pytest.raises(ValueError, match="clip_norm"):
    check_positive(jnp.asarray(math.nan, jnp.bfloat16), "clip_norm")


@pytest.mark.parametrize("scale", [1e-3, 1e-300])
def test_a_laplace_too_sharp_for_the_pld_grid_gets_a_finite_bound(scale):
  # PLD's grid could not hold the loss +-1/b: LaplaceDpEvent(1e-3) gave epsilon inf labelled
  # exact (6 s), LaplaceDpEvent(1e-300) crashed with numpy's "Maximum allowed size exceeded"
  import dp_accounting
  eps = privacy.epsilon_of(dp_accounting.LaplaceDpEvent(scale), delta=1e-5)
  assert eps.kind == "upper_bound" and 1.0 / scale <= eps <= 1.01 / scale


@pytest.mark.parametrize("accountant", ["rdp", "auto", "pld"])
def test_a_huge_gaussian_multiplier_composes_without_overflow(accountant):
  # dp_accounting's RDP squared z = 1e200 as a python float: OverflowError (34, 'Numerical
  # result out of range') under rdp, and under auto / pld beside a Laplace
  import dp_accounting
  huge = dp_accounting.GaussianDpEvent(1e200)
  assert privacy.epsilon_of(huge, delta=1e-5, accountant=accountant) == 0.0
  both = dp_accounting.ComposedDpEvent([huge, dp_accounting.LaplaceDpEvent(1.0)])
  alone = privacy.epsilon_of(dp_accounting.LaplaceDpEvent(1.0), delta=1e-5,
                             accountant="rdp" if accountant == "rdp" else "auto")
  got = privacy.epsilon_of(both, delta=1e-5, accountant=accountant)
  assert alone <= got <= alone * 1.01


def test_calibration_from_a_huge_lower_end_returns_it():
  # calibrate_noise_multiplier(lower=1e300) raised OverflowError from RDP's z**2
  import dp_accounting
  z = privacy.calibrate_noise_multiplier(dp_accounting.GaussianDpEvent, epsilon=1.0,
                                         delta=1e-5, lower=1e300)
  assert z == 1e300


def test_poisson_sgd_calibration_takes_numpy_and_jax_numbers():
  # steps=np.int64(100) was refused ("SelfComposedDpEvent.count must be a positive int"),
  # 0-d jax arrays crashed in the memo ("unhashable type: 'jaxlib._jax.ArrayImpl'")
  want = privacy.calibrate_poisson_sgd(0.5, 10, epsilon=2.0, delta=1e-5)
  assert privacy.calibrate_poisson_sgd(np.float64(0.5), np.int64(10), epsilon=np.float64(2.0),
                                       delta=np.float64(1e-5)) == want
  assert privacy.calibrate_poisson_sgd(jnp.asarray(0.5), jnp.asarray(10),
                                       epsilon=jnp.asarray(2.0), delta=1e-5) == want
  with pytest.raises(ValueError, match="steps"):
    privacy.calibrate_poisson_sgd(0.5, 0, epsilon=2.0, delta=1e-5)


def test_a_numpy_integer_count_is_a_count():
  # ledger.compose(count=np.int64(3)) and SelfComposedDpEvent(e, np.int64(3)) were refused
  # ("count must be a positive int, got np.int64(3)")
  import dp_accounting
  g = dp_accounting.GaussianDpEvent(2.0)
  want = privacy.PrivacyLedger(delta=1e-5).compose(g, label="g", count=3).epsilon(exact=True)
  ledger = privacy.PrivacyLedger(delta=1e-5).compose(g, label="g", count=np.int64(3))
  assert ledger.epsilon(exact=True) == want and ledger.events[0][3] == 3
  assert privacy.epsilon_of(dp_accounting.SelfComposedDpEvent(g, np.int64(3)),
                            delta=1e-5) == want
  assert privacy.PrivacyLedger.from_state_dict(ledger.state_dict()).epsilon(exact=True) == want


def test_an_approximate_rdp_block_with_a_subnormal_delta_prime_converts_finitely():
  # Corollary 1's log(1/delta') overflowed 1/5e-324 to inf: epsilon inf labelled exact
  # (the conversion is eps_rdp + 744.4 / (alpha - 1))
  ev = privacy.ApproxRdpEvent(alpha=1e3, epsilon_rdp=1.0, delta_tv=0.0, delta_prime=5e-324)
  eps = privacy.PrivacyLedger(delta=1e-5).compose(ev, label="r").epsilon()
  assert eps == pytest.approx(1.0 - math.log(5e-324) / 999.0) and eps.is_exact


@pytest.mark.parametrize("bad", [-1, 2.5, "5", None])
def test_plan_refuses_a_parameter_count_that_is_not_one_naming_it(bad):
  # plan(num_params=2.5) planned for int(2.5) = 2 parameters, -1 and "5" were planned for as
  # counts; the misfit surfaced only at run ("the plan was made for -1 parameters")
  import dpsco_jax as dp
  from dpsco_jax.data import DataSpec
  cfg = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.1,
         "num_steps": 2, "sampling_rate": 0.5, "n_users": 6}
  assert dp.plan("dp_sgd_user", cfg, DataSpec(6, 2), num_params=np.int64(5)).num_params == 5
  with pytest.raises((TypeError, ValueError), match="num_params"):
    dp.plan("dp_sgd_user", cfg, DataSpec(6, 2), num_params=bad)


def test_a_selection_over_a_huge_noise_multiplier_has_a_cost():
  # candidate_rdp composed GaussianDpEvent(1e200) into dp_accounting's RDP, which squares z:
  # OverflowError (34, 'Numerical result out of range')
  import dp_accounting
  from dpsco_jax.privacy.selection import SelectionLaw, selection_cost
  law = SelectionLaw("truncated_negative_binomial", 0.1)
  huge = selection_cost(law, [dp_accounting.GaussianDpEvent(1e200)], delta=1e-5)
  some = selection_cost(law, [dp_accounting.GaussianDpEvent(1e3)], delta=1e-5)
  assert 0 < huge.epsilon <= some.epsilon


@pytest.mark.parametrize("gamma", [1e-310, 5e-324])
def test_the_logarithmic_law_of_a_subnormal_gamma_has_a_mean(gamma):
  # (1/gamma - 1) / log(1/gamma) was inf / inf = nan, and the selection's cost then said
  # "the selection's epsilon is 0.0"
  from dpsco_jax.privacy.selection import SelectionLaw
  mean = SelectionLaw("truncated_negative_binomial", gamma).mean()
  assert mean == pytest.approx((1 - gamma) / (gamma * -math.log(gamma)), rel=1e-12)
  assert SelectionLaw("truncated_negative_binomial", 1e-300).mean() == pytest.approx(
      1e300 / (300 * math.log(10)), rel=1e-12)


def test_a_noise_std_is_formed_in_float64_and_checks_its_numbers():
  # z * C / D was formed in the inputs' precision: float16 / bfloat16 numbers could round the
  # std below z C / D; a NaN or negative z gave a NaN / negative std, a zero bound a
  # ZeroDivisionError in noise_multiplier_for_std
  for dtype in (np.float16, ml_dtypes.bfloat16):
    z, c, d = dtype(3.3), dtype(1.1), dtype(3.0)
    std = privacy.gaussian_noise_std(z, privacy.Sensitivity(c, d))
    assert type(std) is float and std == float(z) * float(c) / float(d)
    z_back = privacy.noise_multiplier_for_std(dtype(1.5), privacy.Sensitivity(c, d))
    assert type(z_back) is float and z_back == 1.5 * float(d) / float(c)
  for bad in (math.nan, -1.0):
    with pytest.raises(ValueError, match="noise_multiplier"):
      privacy.gaussian_noise_std(bad, privacy.Sensitivity(1.0))
    with pytest.raises(ValueError, match="std"):
      privacy.noise_multiplier_for_std(bad, privacy.Sensitivity(1.0))
  with pytest.raises(ValueError, match="bound 0"):
    privacy.noise_multiplier_for_std(1.0, privacy.Sensitivity(0.0))


@pytest.mark.parametrize("bad", [lambda p: p["w"], lambda p: "x"])
def test_private_select_names_a_score_that_is_not_one_number(bad):
  # a score returning an array or a string failed in float()'s words ("Only scalar arrays
  # can be converted to Python scalars"), not naming score
  import jax
  import dpsco_jax as dp
  from dpsco_jax.tuning import private_select
  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 4)).astype(np.float32)
  data = dp.UserData.from_arrays({"x": x, "y": (x.sum(1) > 0).astype(np.float32)},
                                 np.repeat(np.arange(6), 2), max_items_per_user=2)
  cfg = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.1,
         "num_steps": 2, "sampling_rate": 0.5, "n_users": 6}
  plans = [dp.plan("dp_sgd_user", cfg, data.spec, num_params=5)]
  loss = lambda p, ex: (ex["x"] @ p["w"] + p["b"] - ex["y"]) ** 2
  params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
  with pytest.raises(TypeError, match="score must return one number"):
    private_select(plans, {"gamma": 0.5}, loss, params, data, jax.random.key(0), score=bad,
                   metric_data="public")


@pytest.mark.parametrize("z, want", [(1e200, 0.0), (1e-200, math.inf)])
def test_group_privacy_of_an_extreme_gaussian_is_answered(z, want):
  # RDP squared z = 1e200 (OverflowError) and PLD's grid of z = 1e-200 overflowed ("cannot
  # convert float infinity to integer"); a LaplaceDpEvent(1e-6) PLD was killed for memory
  import dp_accounting
  gp = privacy.group_privacy_epsilon(dp_accounting.GaussianDpEvent(z), group_size=3,
                                     delta=1e-5)
  assert gp.epsilon == want
  gp = privacy.group_privacy_epsilon(dp_accounting.LaplaceDpEvent(1e-6), group_size=3,
                                     delta=1e-5)
  assert gp.epsilon == math.inf   # no item delta lifts within delta: the module's inf


def test_a_gaussian_whose_mu_squared_overflows_has_epsilon_inf():
  # mu = 2e154 (z = 1e-154 under replace-one): mu^2 / 2 overflowed the bracket and brentq
  # raised "Failed to converge after 100 iterations"
  import dp_accounting
  from dpsco_jax.privacy.accountant import gaussian_epsilon
  assert gaussian_epsilon(2e154, 1e-5) == math.inf
  assert privacy.epsilon_of(dp_accounting.GaussianDpEvent(1e-154), delta=1e-5,
                            relation="replace_one") == math.inf
  assert gaussian_epsilon(1e154, 1e-5) == pytest.approx(5e307, rel=1e-9)


def test_a_keyed_calibration_takes_jax_numbers():
  # with key=, epsilon / delta / lower went into the memo as they were: a 0-d jax array
  # raised "unhashable type: 'jaxlib._jax.ArrayImpl'"
  import dp_accounting
  want = privacy.calibrate_noise_multiplier(dp_accounting.GaussianDpEvent, epsilon=1.0,
                                            delta=1e-5, lower=0.5, key="hunt gaussian")
  got = privacy.calibrate_noise_multiplier(
      dp_accounting.GaussianDpEvent, epsilon=jnp.asarray(1.0), delta=jnp.asarray(1e-5, float),
      lower=jnp.asarray(0.5), key="hunt gaussian")
  assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("epsilon", [700.0, 1e300])
def test_del_output_pert_refuses_an_epsilon_past_float_range_naming_it(epsilon):
  # delta' = delta / (e^eps + 2) raised OverflowError "math range error" past eps ~ 709 (a
  # sc_output_pert plan at epsilon 1e300); at eps 700 kappa's 1/delta' overflowed
  from dpsco_jax.privacy.discrete_laplace import del_output_pert_params
  with pytest.raises(ValueError, match="epsilon=.*below 1e-300"):
    del_output_pert_params(epsilon, 1e-5)
  assert del_output_pert_params(600.0, 1e-5).delta_prime == 1e-5 / (math.exp(600.0) + 2.0)


def test_a_report_checks_its_extra_delta_and_tv_distance():
  # report(extra_delta=nan) or tv_distance=nan gave delta nan, tv_distance=inf delta inf, and
  # an np.float16 extra_delta made the whole delta a float16 (1e-5 + 1e-6 -> 1.0967e-05)
  import dp_accounting
  ledger = privacy.PrivacyLedger(delta=1e-5).compose(dp_accounting.GaussianDpEvent(1.0),
                                                     label="g")
  report = ledger.report(provenance="accountant", extra_delta=np.float16(1e-6))
  assert type(report.delta) is float and report.delta >= 1e-5 + float(np.float16(1e-6))
  for kw in ({"extra_delta": math.nan}, {"tv_distance": math.nan}, {"tv_distance": math.inf},
             {"extra_delta": -1.0}):
    with pytest.raises(ValueError, match=next(iter(kw))):
      ledger.report(provenance="accountant", **kw)


def test_a_ledger_group_is_a_name():
  # group=0 beside group="x" crashed epsilon() with "'<' not supported between instances of
  # 'str' and 'int'" (groups are sorted), long after the compose that took it
  import dp_accounting
  ledger = privacy.PrivacyLedger(delta=1e-5)
  ledger.compose(dp_accounting.GaussianDpEvent(2.0), label="b", group="x")
  with pytest.raises(TypeError, match="group must be a str"):
    ledger.compose(dp_accounting.GaussianDpEvent(1.0), label="a", group=0)
  assert ledger.epsilon() == privacy.epsilon_of(dp_accounting.GaussianDpEvent(2.0), delta=1e-5)


def test_the_audit_gdp_epsilon_of_a_huge_mu_is_inf():
  # gdp_epsilon(1e300, delta) raised scipy's "The function value at x=inf is NaN; solver
  # cannot continue" (mu * mu overflowed its bracket)
  from dpsco_jax.audit import gdp_epsilon
  assert gdp_epsilon(1e300, 1e-5) == math.inf
  assert gdp_epsilon(1.0, 1e-5) == pytest.approx(4.377178, rel=1e-6)
