"""Rényi-DP bounds of the subsampled discrete Gaussian sum against independent references.

References never go through d3p's wrappers: exact Rényi divergences of the
discrete Gaussian and of the released sums of small data sets, summed here
over the integer lattice; dp-accounting's privacy loss distributions of actual
neighbouring pairs of the discrete mechanism (a lower bound on its ε); and
dp-accounting's RDP of the continuous subsampled Gaussian, which every generic
bound also covers.
"""

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, special

from d3p._accounting import _discrete, _rdp
from d3p._accounting._names import Relation
from d3p.accounting import Phase

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting.pld import privacy_loss_distribution as pld  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant  # noqa: E402

CASES = _discrete.CASES
PA, PS, FS = _discrete.POISSON_ADD_REMOVE, _discrete.POISSON_SUBSTITUTE, _discrete.FIXED_SIZE_SUBSTITUTE
SMALL_ORDERS = np.array([2, 3, 4, 6, 10, 20])


# ---------------------------------------------------------------------------
# exact references, summed over the lattice
# ---------------------------------------------------------------------------


def log_dgauss(z, s):
    """log pmf of the discrete Gaussian N_Z(0, s) at the integers ``z``."""
    half = int(math.ceil(40 * math.sqrt(s) + 40))
    grid = np.arange(-half, half + 1, dtype=np.float64)
    return -np.asarray(z, dtype=np.float64) ** 2 / (2 * s) - special.logsumexp(-grid ** 2 / (2 * s))


def renyi(log_p, log_q, alpha):
    """D_α(P ‖ Q) of two log pmfs on the same (ample) support."""
    return float(special.logsumexp(alpha * log_p + (1 - alpha) * log_q)) / (alpha - 1)


def mixture(log_pmfs, weights):
    """log of Σ_i weights[i] · exp(log_pmfs[i])."""
    return special.logsumexp(np.stack(log_pmfs), axis=0, b=np.asarray(weights, dtype=np.float64)[:, None])


def support(s, reach):
    """Integers covering all but a negligible mass of shifts up to ``reach``."""
    half = int(math.ceil(reach + 40 * math.sqrt(s) + 20))
    return np.arange(-half, half + 1)


# ---------------------------------------------------------------------------
# (a) the unsampled discrete Gaussian
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("shift", [(1, 0), (1, 1), (2, 1)])
def test_unsampled_renyi_is_alpha_norm2_over_2s(s, shift):
    """D_α(x + Z ‖ x' + Z) = α‖x - x'‖²/(2s) at integer α, ≤ at other α, in
    both directions, from 1-D and 2-D pmfs summed directly."""
    z = support(s, 2)
    z1, z2 = np.meshgrid(z, z, indexing="ij")
    base = log_dgauss(z1, s) + log_dgauss(z2, s)
    moved = log_dgauss(z1 - shift[0], s) + log_dgauss(z2 - shift[1], s)
    norm2 = shift[0] ** 2 + shift[1] ** 2
    for alpha in [2, 3, 5, 10]:
        for p, q in [(moved, base), (base, moved)]:
            assert renyi(p.ravel(), q.ravel(), alpha) == pytest.approx(alpha * norm2 / (2 * s), rel=1e-9)
    for alpha in [1.5, 2.5, 7.3]:
        d = renyi(moved.ravel(), base.ravel(), alpha)
        assert d <= alpha * norm2 / (2 * s) * (1 + 1e-12)
        if s == 0.5:  # the lattice sum shifted by a non-integer is visibly smaller
            assert d < alpha * norm2 / (2 * s) * (1 - 1e-6)
    one_d = renyi(log_dgauss(z - shift[0], s), log_dgauss(z, s), 3)
    assert one_d == pytest.approx(3 * shift[0] ** 2 / (2 * s), rel=1e-9)


# ---------------------------------------------------------------------------
# subsampled mixtures and whole mechanisms on small data sets
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("delta_int", [1, 3])
@pytest.mark.parametrize("q", [0.05, 0.3, 0.8])
def test_poisson_add_remove_bound_covers_exact_mixtures(sigma, delta_int, q):
    """Both directions of (1-q)N_Z(0,s) + qN_Z(k,s) vs N_Z(0,s), 1 ≤ k ≤ Δ,
    s = (σΔ)², stay below the bound, which is attained at α = 2."""
    s = (sigma * delta_int) ** 2
    z = support(s, delta_int)
    bound = _discrete.phase(PA, sigma, q, SMALL_ORDERS)
    worst = np.zeros(len(SMALL_ORDERS))
    for k in range(1, delta_int + 1):
        base = log_dgauss(z, s)
        mixed = mixture([base, log_dgauss(z - k, s)], [1 - q, q])
        for i, alpha in enumerate(SMALL_ORDERS):
            worst[i] = max(worst[i], renyi(mixed, base, alpha), renyi(base, mixed, alpha))
    assert np.all(worst <= bound)
    assert worst[0] == pytest.approx(bound[0], rel=1e-8)


def _poisson_release(values, q, s, z):
    """log pmf of the released sum: each record with probability q."""
    logs, weights = [], []
    for mask in itertools.product([0, 1], repeat=len(values)):
        k = sum(mask)
        weights.append(q ** k * (1 - q) ** (len(values) - k))
        logs.append(log_dgauss(z - sum(v for v, m in zip(values, mask) if m), s))
    return mixture(logs, weights)


def _fixed_size_release(values, batch, s, z):
    """log pmf of the released sum: a uniform subset of ``batch`` records."""
    subsets = list(itertools.combinations(range(len(values)), batch))
    return mixture([log_dgauss(z - sum(values[i] for i in b), s) for b in subsets],
                   [1 / len(subsets)] * len(subsets))


def _worst_substitute(releases, values_range, alphas):
    """max over data sets and substitutions of record 0 of D_α, both directions."""
    worst = np.zeros(len(alphas))
    for data, p in releases.items():
        for v in values_range:
            r = releases[(v,) + data[1:]]
            worst = np.maximum(worst, [renyi(p, r, a) for a in alphas])
    return worst


@pytest.mark.parametrize("sigma, q", [(0.5, 0.1), (1.0, 0.5), (2.0, 0.3)])
def test_poisson_substitute_bound_covers_small_data_sets(sigma, q):
    """Every data set of 3 records with values in [-2, 2] and every
    substitution: the exact divergences stay below each of the two bounds."""
    delta_int, s = 2, (sigma * 2) ** 2
    z = support(s, 3 * delta_int)
    values = range(-delta_int, delta_int + 1)
    releases = {d: _poisson_release(d, q, s, z) for d in itertools.product(values, repeat=3)}
    alphas = SMALL_ORDERS[:5]
    worst = _worst_substitute(releases, values, alphas)
    direct = [_discrete._poisson_substitute_direct(sigma, q, int(a)) for a in alphas]
    triangle = [_discrete._poisson_substitute_triangle(sigma, q, int(a)) for a in alphas]
    assert np.all(worst <= direct) and np.all(worst <= triangle)
    assert np.all(worst <= _discrete.phase(PS, sigma, q, alphas))
    # the comparison has power: the exact divergences reach 40% of the bound
    assert np.all(worst >= 0.4 * _discrete.phase(PS, sigma, q, alphas))


@pytest.mark.parametrize("sigma, num, batch", [(0.5, 3, 1), (1.0, 3, 2), (2.0, 4, 2)])
def test_fixed_size_substitute_bound_covers_small_data_sets(sigma, num, batch):
    """Every data set of ``num`` records with values in [-2, 2], batches of
    ``batch`` without replacement: exact divergences stay below the bound, and
    the worst pair is the extreme one (all +Δ, one record -Δ)."""
    delta_int, s, q = 2, (sigma * 2) ** 2, batch / num
    z = support(s, batch * delta_int)
    values = range(-delta_int, delta_int + 1)
    releases = {d: _fixed_size_release(d, batch, s, z) for d in itertools.product(values, repeat=num)}
    alphas = SMALL_ORDERS[:5]
    worst = _worst_substitute(releases, values, alphas)
    assert np.all(worst <= _discrete.phase(FS, sigma, q, alphas))
    plus = releases[(delta_int,) * num]
    flipped = releases[(-delta_int,) + (delta_int,) * (num - 1)]
    extreme = [max(renyi(plus, flipped, a), renyi(flipped, plus, a)) for a in alphas]
    np.testing.assert_allclose(worst, extreme, rtol=1e-9)


def test_three_point_pairs_on_the_2d_lattice():
    """(1-q)μ_0 + qμ_u vs (1-q)μ_0 + qμ_w for all u, w ∈ Z² with ‖u‖², ‖w‖² ≤ 5
    (the reduced form of one Poisson step): below the substitute bound, and
    with w = 0 or u = 0 (add/remove) below the add/remove bound."""
    sigma, q, norm2 = 0.5, 0.2, 5
    s = sigma ** 2 * norm2
    z = support(s, 3)
    z1, z2 = np.meshgrid(z, z, indexing="ij")
    points = [(a, b) for a in range(-2, 3) for b in range(-2, 3) if a * a + b * b <= norm2]
    pmf = {v: (log_dgauss(z1 - v[0], s) + log_dgauss(z2 - v[1], s)).ravel() for v in points}
    mixed = {v: mixture([pmf[(0, 0)], pmf[v]], [1 - q, q]) for v in points}
    alphas = SMALL_ORDERS[:4]
    sub = _discrete.phase(PS, sigma, q, alphas)
    add_remove = _discrete.phase(PA, sigma, q, alphas)
    for u, w in itertools.product(points, points):
        d = np.array([renyi(mixed[u], mixed[w], a) for a in alphas])
        assert np.all(d <= sub), (u, w)
        if u == (0, 0) or w == (0, 0):
            assert np.all(d <= add_remove), (u, w)


# ---------------------------------------------------------------------------
# dp-accounting: ε of actual neighbouring pairs of the discrete mechanism
# ---------------------------------------------------------------------------


def _pld_discrete_pair(case, sigma, q, delta_int):
    """dp-accounting's PLD (optimistic rounding) of a neighbouring pair of the
    1-D discrete mechanism with integer sensitivity ``delta_int``, s = (σΔ)²."""
    scale = sigma * delta_int
    if case == PA:  # D' = D + one record of value Δ, all others 0
        return pld.from_discrete_gaussian_mechanism(
            scale, sensitivity=delta_int, sampling_prob=q, pessimistic_estimate=False)
    if case == FS:  # all records +Δ, record 0 of D' at -Δ: shift 2Δ w.p. q
        return pld.from_discrete_gaussian_mechanism(
            scale, sensitivity=2 * delta_int, sampling_prob=q, pessimistic_estimate=False)
    # Poisson, substitute: other records 0, record 0 is +Δ in D and -Δ in D';
    # outcomes beyond 12 noise scales (mass < 1e-30) are left out, which can
    # only lower this reference
    s = scale ** 2
    half = int(math.ceil(delta_int + 12 * scale + 3))
    z = np.arange(-half, half + 1)
    base = log_dgauss(z, s)
    upper = mixture([base, log_dgauss(z - delta_int, s)], [1 - q, q])
    lower = mixture([base, log_dgauss(z + delta_int, s)], [1 - q, q])
    return pld.from_two_probability_mass_functions(
        dict(zip(z.tolist(), lower.tolist())), dict(zip(z.tolist(), upper.tolist())),
        pessimistic_estimate=False)


FLOOR = [(1.0, 0.01, 1000, 1e-5, 1), (0.8, 0.1, 100, 1e-6, 1), (2.0, 0.05, 300, 1e-5, 3)]
FLOOR_SLOW = [(s, q, t, (1e-5, 1e-8)[i % 2], 1 + (i // 2) % 2) for i, (s, q, t) in enumerate(
    itertools.product([0.8, 1.0, 2.0, 4.0], [0.001, 0.01, 0.1], [10, 1000, 5000]))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "sigma, q, steps, delta, delta_int", FLOOR + [pytest.param(*f, marks=pytest.mark.slow) for f in FLOOR_SLOW])
def test_epsilon_at_least_dp_accounting_pld_of_a_neighbouring_pair(case, sigma, q, steps, delta, delta_int):
    """Our ε is at least the ε of one actual neighbouring pair composed T
    times (a lower bound on the mechanism's ε), and δ likewise."""
    pair = _pld_discrete_pair(case, sigma, q, delta_int).self_compose(steps)
    eps_ref = pair.get_epsilon_for_delta(delta)
    eps = _discrete.epsilon(case, [Phase(sigma, q, steps)], delta)
    assert eps >= eps_ref
    assert _discrete.delta(case, [Phase(sigma, q, steps)], eps_ref) >= delta * (1 - 1e-6)


# ---------------------------------------------------------------------------
# the generic bounds cover the continuous Gaussian as well
# ---------------------------------------------------------------------------


def _continuous_poisson_rdp(sigma, q, orders):
    """dp-accounting's exact RDP of the Poisson subsampled Gaussian (add/remove)."""
    acc = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in orders])
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    return acc.rdp


def _continuous_midpoint_rdp(sigma, q, alpha):
    """D_α((1-q)N(0,σ²)+qN(1,σ²) ‖ (1-q)N(0,σ²)+qN(-1,σ²)) by quadrature."""
    def log_mix(x, sign):
        return np.logaddexp(math.log1p(-q) - x * x / (2 * sigma ** 2),
                            math.log(q) - (x - sign) ** 2 / (2 * sigma ** 2)) - 0.5 * math.log(2 * math.pi * sigma ** 2)

    def f(x):
        return alpha * log_mix(x, 1.0) + (1 - alpha) * log_mix(x, -1.0)

    grid = np.linspace(-40 * sigma - 2 * alpha, 40 * sigma + 2 * alpha, 20001)
    top = float(np.max(f(grid)))
    val, _ = integrate.quad(lambda x: math.exp(f(x) - top), grid[0], grid[-1], points=[0.0], limit=400,
                            epsabs=0, epsrel=1e-10)
    return (top + math.log(val)) / (alpha - 1)


@pytest.mark.parametrize("sigma", [0.6, 1.0, 3.0])
@pytest.mark.parametrize("q", [0.001, 0.02, 0.3])
def test_generic_bounds_at_least_continuous_gaussian_rdp(sigma, q):
    """Zhu & Wang's and Wang, Balle & Kasiviswanathan's bounds hold for the
    continuous Gaussian too, so they must not fall below its exact RDP:
    Poisson add/remove at σ; fixed size at the add/remove pair with σ/2 (an
    actual pair of that sampler); Poisson substitute above both the
    add/remove pair (a substitution by a zero record) and the midpoint pair."""
    orders = _discrete.ORDERS[PA][_discrete.ORDERS[PA] <= 300]
    assert np.all(_discrete.phase(PA, sigma, q, orders) >= _continuous_poisson_rdp(sigma, q, orders))
    assert np.all(_discrete.phase(FS, sigma, q, orders) >= _continuous_poisson_rdp(sigma / 2, q, orders))
    sub_orders = _discrete.ORDERS[PS][_discrete.ORDERS[PS] <= 300]
    ours = _discrete.phase(PS, sigma, q, sub_orders)
    assert np.all(ours >= _continuous_poisson_rdp(sigma, q, sub_orders))
    for i, alpha in enumerate(sub_orders[:6]):
        assert ours[i] >= _continuous_midpoint_rdp(sigma, q, int(alpha)) * (1 - 1e-8)


# ---------------------------------------------------------------------------
# shape of the bounds, edge cases, interface
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_monotone_in_sigma_q_and_steps(case):
    eps = np.array([[[_discrete.epsilon(case, [Phase(s, q, t)], 1e-5) for t in (10, 100, 1000)]
                     for q in (0.001, 0.01, 0.1, 1.0)] for s in (0.7, 1.0, 2.0, 5.0)])
    assert np.all(np.diff(eps, axis=0) < 0)   # more noise, smaller ε
    assert np.all(np.diff(eps, axis=1) > 0)   # more sampling, larger ε
    assert np.all(np.diff(eps, axis=2) > 0)   # more steps, larger ε
    orders = _discrete.ORDERS[case]
    for s, q in itertools.product((0.7, 2.0), (0.01, 0.2)):
        assert np.all(np.diff(_discrete.phase(case, s, q, orders)) >= 0)  # nondecreasing in α
        assert np.all(_discrete.phase(case, s, q, orders) <= _discrete.phase(case, s, min(1.0, 2 * q), orders))


@pytest.mark.parametrize("case, c", [(PA, 1.0), (PS, 2.0), (FS, 2.0)])
def test_q_one_is_the_unsampled_discrete_gaussian(case, c):
    """q = 1: ε(α) = αc²/(2σ²), c = 1 (add/remove) or 2 (substitute); every
    q < 1 stays below it."""
    orders = _discrete.ORDERS[case]
    np.testing.assert_allclose(_discrete.phase(case, 1.3, 1.0, orders), orders * c ** 2 / (2 * 1.3 ** 2), rtol=2e-9)
    assert np.all(_discrete.phase(case, 1.3, 0.999, orders) <= _discrete.phase(case, 1.3, 1.0, orders))


@pytest.mark.parametrize("case", CASES)
def test_nothing_released_and_non_private_phases(case):
    assert _discrete.epsilon(case, [], 1e-5) == 0.0
    assert _discrete.epsilon(case, [Phase(1.0, 0.1, 0)], 1e-5) == 0.0
    assert _discrete.epsilon(case, [Phase(math.inf, 0.1, 50)], 1e-5) == 0.0
    assert _discrete.delta(case, [Phase(1.0, 0.1, 0)], 0.5) == 0.0
    assert _discrete.epsilon(case, [Phase(0.0, 0.1, 5)], 1e-5) == math.inf
    assert _discrete.delta(case, [Phase(0.0, 0.1, 5)], 10.0) == 1.0


@pytest.mark.parametrize("case", CASES)
def test_extreme_noise_multipliers_stay_in_range(case):
    """1/σ² beyond the float range is infinite RDP; σ so large that 1/σ²
    underflows gives (nearly) nothing; no overflow errors either way."""
    assert _discrete.epsilon(case, [Phase(1e-300, 0.01, 10)], 1e-5) == math.inf
    tiny = [_discrete.epsilon(case, [Phase(s, 0.01, 10)], 1e-5) for s in (1e150, 1e300, 1.7e308)]
    assert all(0 <= e < 1e-3 for e in tiny)
    assert math.isfinite(_discrete.epsilon(case, [Phase(1e-100, 0.01, 10)], 1e-5))


@pytest.mark.parametrize("case", CASES)
def test_phases_compose_by_adding_rdp(case):
    one = _discrete.epsilon(case, [Phase(1.1, 0.02, 600)], 1e-5)
    split = _discrete.epsilon(case, [Phase(1.1, 0.02, 200), Phase(1.1, 0.02, 400)], 1e-5)
    assert split == pytest.approx(one, rel=1e-12)
    mixed = _discrete.epsilon(case, [Phase(1.1, 0.02, 300), Phase(2.0, 0.02, 300)], 1e-5)
    assert _discrete.epsilon(case, [Phase(2.0, 0.02, 600)], 1e-5) < mixed < one


@pytest.mark.parametrize("case", CASES)
def test_delta_and_epsilon_are_one_conversion(case):
    """δ at our ε(δ) is δ (the same RDP curve and conversion as _rdp)."""
    phases = [Phase(1.0, 0.01, 500)]
    for target in (1e-3, 1e-5, 1e-9):
        eps = _discrete.epsilon(case, phases, target)
        assert _discrete.delta(case, phases, eps) == pytest.approx(target, rel=1e-6)
        rdp = 500 * _discrete.phase(case, 1.0, 0.01, _discrete.ORDERS[case])
        assert eps == _rdp.epsilon_from_rdp(_discrete.ORDERS[case], rdp, target)


def test_q_one_add_remove_matches_the_continuous_closed_form_rdp():
    """At q = 1 the discrete and continuous Gaussians have the same RDP, so
    the shared conversion gives _rdp's ε (up to the 1e-9 rounding)."""
    phases = [Phase(1.5, 1.0, 40)]
    continuous = _rdp.epsilon(Relation.ADD_REMOVE, phases, 1e-6)
    assert _discrete.epsilon(PA, phases, 1e-6) == pytest.approx(continuous, rel=1e-8)


@pytest.mark.parametrize("case", [("poisson", "remove"), ("Poisson", "replace"), ("feistel", "substitution")])
def test_case_accepts_every_spelling(case):
    assert _discrete.epsilon(case, [Phase(1.0, 0.01, 10)], 1e-5) > 0


@pytest.mark.parametrize("case", [("fixed_size", "add_remove"), ("poisson",), "poisson", ("bogus", "substitute"), None])
def test_unknown_case_is_rejected(case):
    with pytest.raises(ValueError, match=r"Expected case to be one of .*got case="):
        _discrete.epsilon(case, [Phase(1.0, 0.01, 10)], 1e-5)
