"""The released clipped sum moves by at most C when one record is added or
removed, whatever the order of the records and whatever the others are
(d3p.gradients: the double-float sum and its public margin).

What would fail if a claim were false:

- records chosen greedily against sequential float32 accumulation (the
  construction that moves a plain sequential sum by about 5 C at
  B = 16,384) moved through every strategy by more than C: a sum whose
  rounding depends on the other records beyond the margin;
- records chosen so that the final rounding of the sum goes up with record
  0 and down without it: a margin that does not cover the last rounding;
- the error-free addition (Fast2Sum) checked against exact rationals after
  compilation: a compiler that simplified it away, or a wrong bound.
"""

import fractions
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3p import gradients
from d3p.gradients import clipped_grad_sum

F32 = np.float32


# ---------------------------------------------------------------------------
# the adversarial records
# ---------------------------------------------------------------------------


def greedy_records(B: int, C: float = 1.0, seed: int = 0, candidates: int = 512) -> np.ndarray:
    """``B`` scalars in ``[-C, C]`` that maximise, one at a time, the gap
    between the sequential float32 sums with and without record 0.

    Record 0 is ``0.99 C``; the records after it first raise both sums to
    ``T`` (the largest power of two below ``0.9 B C``), then keep the sum with
    record 0 at or above ``T`` and the one without it below ``T``, where
    the float32 spacing is half as large, each record picked from random
    candidates to make the two roundings differ the most. A plain sequential
    float32 sum of these records moves by about 1.01 C at B = 1024, 1.24 C at
    4096 and 4.95 C at 16,384 when record 0 is removed."""
    rng = np.random.default_rng(seed)
    r0 = F32(0.99 * C)
    a, b = F32(r0), F32(0.0)
    out = [r0]
    T = F32(2.0 ** np.floor(np.log2(0.9 * B * C)))
    while len(out) < B:
        if a < T:
            cands = np.array([min(0.99 * C, float(T - a) + 0.5 * float(r0))], F32)
        else:
            cands = (rng.uniform(-0.99, 0.99, candidates) * C).astype(F32)
        na, nb = (a + cands).astype(F32), (b + cands).astype(F32)
        gain = na.astype(np.float64) - nb.astype(np.float64)
        straddle = (nb < T) & (na >= T)
        if a < T or np.any(straddle):
            j = int(np.argmax(np.where(straddle | (a < T), gain, -np.inf)))
        else:   # back to the boundary
            j = int(np.argmin(np.abs(na.astype(np.float64) - (float(T) + 0.5 * float(gain[0])))))
        out.append(cands[j])
        a, b = na[j], nb[j]
    return np.array(out, F32)


def sequential_gap(records: np.ndarray) -> float:
    """``|fl(Σ D) - fl(Σ D')|`` with plain sequential float32 additions, ``D'``
    without record 0 (the accumulation the construction targets)."""
    with_0 = F32(0.0)
    for x in records:
        with_0 = F32(with_0 + x)
    without = F32(0.0)
    for x in records[1:]:
        without = F32(without + x)
    return abs(float(with_0) - float(without))


def test_greedy_construction_breaks_a_plain_sequential_sum():
    """The construction has the power the tests below rely on."""
    assert sequential_gap(greedy_records(1024)) > 1.0
    assert sequential_gap(greedy_records(4096)) > 1.2


# ---------------------------------------------------------------------------
# the released sum of every strategy on neighbouring data sets
# ---------------------------------------------------------------------------


def dot_loss(params, record):
    """The per-record gradient is the record itself, exactly."""
    return jnp.sum(params["w"] * record)


def dense_loss(params, record):
    """The same gradient through a dense product (a ghost leaf)."""
    return jnp.sum(record[None, :] @ params["W"])


def residual_loss(params, record):
    """The same gradient on a leaf that the ghost strategy differentiates per
    record (a product with ``b``, not a dense product) and sums in products of
    records weighted by their clip factors; its ghost leaf ``W`` gets zeros."""
    return jnp.sum(params["b"] * record) + 0.0 * jnp.sum(record[None, :] @ params["W"])


CASES = {
    "vmap": (dot_loss, "vmap", None),
    "scan": (dot_loss, "scan", None),
    "chunked 64": (dot_loss, "chunked", 64),
    "chunked 1000": (dot_loss, "chunked", 1000),
    "ghost": (dense_loss, "ghost", None),
    "ghost chunked 512": (dense_loss, "ghost", 512),
    "ghost residual": (residual_loss, "ghost", None),
    "auto": (dot_loss, "auto", None),
}


def _params(loss, d):
    if loss is dense_loss:
        return {"W": jnp.zeros((d, 1), jnp.float32)}
    if loss is residual_loss:
        return {"W": jnp.zeros((d, 1), jnp.float32), "b": jnp.zeros((d,), jnp.float32)}
    return {"w": jnp.zeros((d,), jnp.float32)}


@functools.partial(jax.jit, static_argnames=("loss", "strategy", "chunk"))
def _released(loss, params, records, mask, C, strategy, chunk):
    return clipped_grad_sum(loss, params, records, mask, C, strategy=strategy, chunk_size=chunk).grad_sum


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def neighbour_gaps(case: str, records: np.ndarray, C: float):
    """``(removed by mask, removed as a row, substituted)``: how far the released
    sum moves, in units of ``C``, when record 0 is masked out, deleted (one
    slot fewer) or replaced by its negation."""
    loss, strategy, chunk = CASES[case]
    params = _params(loss, records.shape[1])
    B = records.shape[0]
    recs = jnp.asarray(records)

    def released(r, m):
        return _flat(_released(loss, params, r, m, C, strategy, chunk))

    full = released(recs, jnp.ones(B, bool))
    masked = released(recs, jnp.arange(B) > 0)
    removed = released(recs[1:], jnp.ones(B - 1, bool))
    substituted = released(recs.at[0].multiply(-1.0), jnp.ones(B, bool))
    return tuple(float(np.linalg.norm(full - x)) / C for x in (masked, removed, substituted))


@functools.lru_cache(maxsize=None)
def _adversarial(B, d, C):
    """``(B, d)`` records: independent greedy constructions per coordinate,
    scaled so that every record has norm below ``C`` (built once per
    arguments, a few seconds each: read-only)."""
    cols = [greedy_records(B, C / np.sqrt(d), seed=k) for k in range(d)]
    records = np.stack(cols, axis=1).astype(F32)
    records.flags.writeable = False
    return records


#: The default step's strategies; the slow step runs every case of CASES.
DEFAULT_CASES = ("vmap", "scan", "chunked 64", "ghost", "ghost residual")


@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_greedy_records_move_the_release_by_at_most_C(case):
    """B = 16,384 slots, one coordinate: masking or deleting record 0 moves the
    released sum by at most C, substituting it by at most 2 C, for every
    strategy (a plain sequential float32 sum moves by about 4.95 C)."""
    C = 1.0
    records = _adversarial(16384, 1, C)
    masked, removed, substituted = neighbour_gaps(case, records, C)
    assert masked <= 1.0 and removed <= 1.0, (masked, removed)
    assert substituted <= 2.0, substituted
    assert masked > 0.97   # record 0 itself still counts almost fully


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [3])
def test_greedy_records_move_the_release_by_at_most_C_several_dims_slow(case, d):
    C = 2.5
    records = _adversarial(16384, d, C)
    masked, removed, substituted = neighbour_gaps(case, records, C)
    assert masked <= 1.0 and removed <= 1.0 and substituted <= 2.0, (masked, removed, substituted)


def final_rounding_records(r0_max: float, B: int = 16384) -> np.ndarray:
    """Records whose exact sum ``S(D) = 2^13 + 2^-11 + 2^-24`` rounds up to
    ``2^13 + 2^-10`` while ``S(D) - r0`` (below ``2^13``, where the spacing is
    half as large) rounds down by almost a quarter spacing of ``2^13``:
    removing record ``r0 <= r0_max`` moves the correctly rounded sums by
    ``r0 + 2^-11 + 2^-12 - 2^-23``. Every record is exact in float32."""
    u = 2.0**-24
    gamma = 1.0 - r0_max                        # multiple of 2^-24
    theta = ((2.0**-12 - 2 * u) - gamma) % 2.0**-11
    r0 = r0_max - theta
    halves = B - 2
    assert halves * 0.5 == 2**13 - 1
    rest = (1.0 - r0) + 2.0**-11 + u             # makes S(D) = 2^13 + 2^-11 + 2^-24
    records = np.array([r0] + [0.5] * halves + [rest], np.float64)
    assert np.all(records.astype(F32).astype(np.float64) == records)
    exact = sum(fractions.Fraction(float(x)) for x in records)
    assert exact == fractions.Fraction(2**13) + fractions.Fraction(2.0**-11) + fractions.Fraction(u)
    return records.astype(F32)[:, None]


@pytest.mark.parametrize("case", ["vmap", "scan", "ghost", "ghost residual"])
def test_final_rounding_is_inside_the_margin(case):
    """Record 0 as large as an unclipped record can be, the others chosen so
    that the last rounding of the sum moves up with record 0 and down
    without it (about 1.8e-4 C of extra gap at C = 1): the release still
    moves by at most C. Without the margin this exceeds C."""
    C = 1.0
    loss, strategy, chunk = CASES[case]
    params = _params(loss, 1)
    B = 16384
    # the clipped value of a huge record: the largest contribution a record can make
    probe = jnp.zeros((B, 1), jnp.float32).at[0, 0].set(1e6)
    top = float(np.max(_flat(_released(loss, params, probe, jnp.arange(B) == 0, C, strategy, chunk))))
    records = final_rounding_records(float(F32(top - 2.0**-20)), B)
    masked, removed, _ = neighbour_gaps(case, records, C)
    assert masked <= 1.0 and removed <= 1.0, (masked, removed)
    assert masked > float(records[0, 0]) / C   # the last rounding did widen the gap


# ---------------------------------------------------------------------------
# the double-float sum itself
# ---------------------------------------------------------------------------


def _exact(x) -> fractions.Fraction:
    return fractions.Fraction(float(x))


def _adversarial_pairs(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    tiny = float(np.finfo(F32).tiny)
    parts = [
        np.sign(rng.normal(size=(n, 2))) * 10.0 ** rng.uniform(-37, 37, (n, 2)),   # mixed magnitudes
        np.stack([v := rng.normal(size=n) * 1e30, -v * (1 + rng.normal(size=n) * 1e-7)], axis=1),   # cancellation
        rng.uniform(-4, 4, (n, 2)) * tiny,   # near the smallest normal number
        np.stack([rng.normal(size=n), rng.normal(size=n) * 2.0**-30], axis=1),   # far apart
    ]
    x = np.concatenate(parts).astype(F32)
    return x[:, 0], x[:, 1]


def test_fast_two_sum_is_exact_after_compilation():
    """``s + e == a + b`` exactly (as rationals) for every pair, up to less
    than 3 tiny where the backend flushes values below the smallest normal
    number, with ``|e| <= u |s|`` (``s`` is the rounded sum)."""
    a, b = _adversarial_pairs()
    s, e = jax.jit(gradients._fast_two_sum)(jnp.asarray(a), jnp.asarray(b))
    s, e = np.asarray(s), np.asarray(e)
    tiny = fractions.Fraction(float(np.finfo(F32).tiny))
    u = fractions.Fraction(1, 2**24)
    worst = max(abs(_exact(x) + _exact(y) - _exact(p) - _exact(q)) for x, y, p, q in zip(a, b, s, e))
    assert worst < 3 * tiny
    assert all(abs(_exact(q)) <= u * abs(_exact(p)) + tiny for p, q in zip(s, e))
    # a plain rounded sum is off by far more on these pairs: the check has power
    assert max(abs(_exact(x) + _exact(y) - _exact(p)) for x, y, p in zip(a, b, s)) > 1e20 * tiny
    exact_pairs = sum(_exact(x) + _exact(y) == _exact(p) + _exact(q) for x, y, p, q in zip(a, b, s, e))
    assert exact_pairs >= 0.75 * len(a)   # exact wherever nothing is near the smallest normal number


def test_df_tree_error_is_within_its_bound():
    """The double-float sum of adversarial columns (huge cancellations, mixed
    magnitudes, values near the smallest normal number) is within
    ``u |S| + 4 u² d M + 8 n tiny`` of the exact sum ``S``, per entry, both
    as one tree and accumulated chunk by chunk under ``scan``."""
    rng = np.random.default_rng(1)
    n, cols = 3001, 6
    x = np.empty((n, cols), np.float64)
    x[:, 0] = np.sign(rng.normal(size=n)) * 10.0 ** rng.uniform(-20, 20, n)
    x[:, 1] = rng.normal(size=n) * 1e25
    x[-1, 1] = -np.sum(x[:-1, 1].astype(F32).astype(np.float64))   # cancels to rounding level
    x[:, 2] = rng.uniform(-3, 3, n) * float(np.finfo(F32).tiny)
    x[:, 3] = np.where(np.arange(n) % 2, 1e8, 1.0)   # ones swamped by large terms
    x[:, 4] = np.where(np.arange(n) % 2, 1e8, -1e8)
    x[:, 4][0] = 1.0
    x[:, 5] = rng.normal(size=n)
    x = x.astype(F32)
    u, tiny = 2.0**-24, float(np.finfo(F32).tiny)
    exact = [sum(map(_exact, x[:, j])) for j in range(cols)]
    magnitude = np.sum(np.abs(x.astype(np.float64)), axis=0)

    def check(hi, depth, additions):
        for j in range(cols):
            err = abs(_exact(hi[j]) - exact[j])
            bound = u * abs(float(exact[j])) + 4 * u * u * depth * magnitude[j] + 8 * additions * tiny
            assert float(err) <= bound * (1 + 1e-9), (j, float(err), bound)

    hi, _ = jax.jit(gradients._df_tree)(jnp.asarray(x))
    check(np.asarray(hi), int(np.ceil(np.log2(n))), n)
    # a plain sequential float32 sum of the cancelling column is far worse: the bound has power
    plain = float(np.cumsum(x[:, 1], dtype=F32)[-1])
    depth = int(np.ceil(np.log2(n)))
    assert abs(plain - float(exact[1])) > 100 * (u * abs(float(exact[1])) + 4 * u * u * depth * magnitude[1])

    chunk = 64
    pairs = gradients._in_chunks(
        lambda recs, m: (gradients._df_tree_pytree({"x": recs}), m, m),
        {"x": jnp.zeros(cols, jnp.float32)}, jnp.asarray(x), jnp.ones(n, bool), chunk)
    check(np.asarray(pairs[0][0]["x"]), int(np.ceil(np.log2(chunk))) + -(-n // chunk), n + n // chunk)


def test_weighted_products_are_within_the_ghost_budget():
    """The ghost strategy's sum of its other leaves' gradients, weighted by the
    clip factors (``_df_weighted_sums``): products of ``k`` records, whose
    rounding is at most ``γ(k)`` times the magnitudes (the budget of a ghost
    product of ``k`` rows), added up in double floats. Per entry of the
    adversarial columns, within ``u |S| + γ(k) M + 4 u² d M + tiny terms``
    of the exact weighted sum ``S`` (``M``: the sum of ``|w_i x_i|``); and
    every product contracts exactly ``k`` records, also where leaves are
    joined (a product over the whole batch would be outside the budget)."""
    from d3p import _certified_sum

    rng = np.random.default_rng(2)
    n, k = 3001, 8
    x = np.empty((n, 4), np.float64)
    x[:, 0] = np.sign(rng.normal(size=n)) * 10.0 ** rng.uniform(-20, 20, n)
    x[:, 1] = rng.normal(size=n) * 1e25
    x[:, 2] = np.where(np.arange(n) % 2, 1e8, 1.0)
    x[:, 3] = rng.normal(size=n)
    x = x.astype(F32)
    w = rng.uniform(0, 1, n).astype(F32)
    w[::7] = 0.0
    x[-1, 1] = -np.sum((w[:-1] * x[:-1, 1]).astype(np.float64)) / w[-1]   # cancels to rounding level
    u, tiny = 2.0**-24, float(np.finfo(F32).tiny)
    gamma = k * u / (1 - k * u)
    depth = int(np.ceil(np.log2(-(-n // k))))
    leaves = [jnp.asarray(x[:, :2]), jnp.asarray(x[:, 2:].reshape(n, 2, 1))]
    hi, _ = jax.jit(lambda ls, w: _certified_sum._df_weighted_sums(ls, w, k))(leaves, jnp.asarray(w))
    got = np.concatenate([np.asarray(h).ravel() for h in hi])
    for j in range(4):
        terms = [_exact(a) * _exact(b) for a, b in zip(w, x[:, j])]
        exact = sum(terms)
        magnitude = float(sum(abs(t) for t in terms))
        bound = u * abs(float(exact)) + (gamma + 4 * u * u * depth * (1 + gamma)) * magnitude + 10 * n * tiny
        err = float(abs(_exact(got[j]) - exact))
        assert err <= bound * (1 + 1e-6), (j, err, bound)
        if j == 3:   # a sum that lost one record's term (a block cut wrong) is outside it: the check has power
            assert float(max(abs(t) for t in terms)) > 100 * bound

    # the products: k records each, for joined small leaves and a large leaf on its own
    big = jnp.zeros((40, _certified_sum._DF_JOIN_MAX + 1), F32)
    jaxpr = jax.make_jaxpr(lambda ls, w: _certified_sum._df_weighted_sums(ls, w, k))(
        [jnp.zeros((40, 3), F32), jnp.zeros((40, 2, 2), F32), big], jnp.ones(40, F32))
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    for e in dots:
        (contract, _), _ = e.params["dimension_numbers"]
        assert [e.invars[0].aval.shape[d] for d in contract] == [k]


# ---------------------------------------------------------------------------
# the public margin
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cases", [
    ("vmap", "ghost"),
    pytest.param(("scan", "chunked 64", "ghost residual"), marks=pytest.mark.slow, id="more strategies"),
])
def test_every_record_is_clipped_to_the_same_threshold_whatever_the_batch(cases):
    """A huge record is clipped to ``C (1 - η)`` (within a few units of
    roundoff) for every batch size, strategy and number of shards, so that
    adding or removing a record leaves the others' contributions unchanged.
    (Each batch size compiles a program: the default step checks exact
    per-record gradients and ghost norms, the slow step the other strategies.)"""
    C, eta = 1.0, gradients._sum_margin(jnp.float32)
    assert eta == 2.0**-7
    for case in cases:
        loss, strategy, chunk = CASES[case]
        got = set()
        for B in [1, 2, 3, 100, 4097]:
            records = jnp.zeros((B, 2), jnp.float32).at[0].set(1e6)
            g = _flat(_released(loss, _params(loss, 2), records, jnp.arange(B) == 0, C, strategy, chunk))
            got.add(float(np.linalg.norm(g)))
        assert max(got) <= C * (1 - eta) and min(got) >= C * (1 - eta) * (1 - 1e-5), (case, got)
        assert max(got) - min(got) <= 1e-7 * C, (case, got)


@pytest.mark.parametrize("strategy", ["vmap", "scan", "ghost"])
def test_batches_beyond_the_certified_size_are_refused(strategy):
    """Above ``η / (2 ε_B)`` slots the float32 sum cannot be certified: a
    ``ValueError`` names the batch size."""
    loss = dense_loss if strategy == "ghost" else dot_loss
    params = _params(loss, 1)
    records = jax.ShapeDtypeStruct((70000, 1), jnp.float32)
    with pytest.raises(ValueError, match=r"got batch size B=70000"):
        jax.eval_shape(lambda r: clipped_grad_sum(loss, params, r, None, 1.0, strategy=strategy), records)
    if strategy != "ghost":   # C = inf (no privacy): nothing to certify
        jax.eval_shape(lambda r: clipped_grad_sum(loss, params, r, None, float("inf"), strategy=strategy),
                       records)


def test_ghost_falls_back_to_exact_gradients_where_its_products_cannot_be_certified():
    """Under "auto", a batch too large for ghost products with even one row
    each takes exact per-record gradients instead; asking for "ghost" names
    the batch size."""
    params = _params(dense_loss, 4)
    records = jax.ShapeDtypeStruct((40000, 4), jnp.float32)
    choice = gradients.choose_strategy(dense_loss, params, records)
    assert choice.strategy != "ghost" and "certified ghost products" in choice.reason
    small = gradients.choose_strategy(dense_loss, params, jax.ShapeDtypeStruct((1000, 4), jnp.float32))
    assert small.strategy == "ghost"
    with pytest.raises(ValueError, match=r"batch size B=40000"):
        gradients.choose_strategy(dense_loss, params, records, strategy="ghost")


def test_sum_error_bound_grows_with_slots_chunks_and_shards():
    """``ε_B`` counts the additions a term passes through and the extra rounding
    of per-device partial sums."""
    params = {"w": jnp.zeros(3, jnp.float32)}
    one = gradients._sum_budget(1000, 1000, 1, params)
    scan = gradients._sum_budget(1000, 1, 1, params)
    shards = gradients._sum_budget(125, 125, 8, params)
    assert scan.rel > one.rel and shards.rel > one.rel
    assert one.slots == shards.slots == 1000
    assert one.margin == scan.margin == shards.margin   # one threshold for all
    assert one.tiny == gradients._sum_budget(5, 5, 1, params).tiny   # independent of B


# ---------------------------------------------------------------------------
# the fixed-point sum of per-record gradients
# ---------------------------------------------------------------------------


def _grid_reference(records: np.ndarray, C: float, dtype=F32) -> np.ndarray:
    """The release of records already below the threshold (clip factor 1),
    computed independently: each entry rounded to the grid of spacing
    ``2^(e - 28)`` (``2^e`` the power of two above ``C (1 - η)``, read with
    ``math.frexp``) in exact rationals, summed as Python integers, and the
    exact sum rounded once to float32 (round to nearest, ties to even)."""
    import math

    margin, k = (2.0**-7, 28) if dtype == F32 else (2.0**-30, 62)
    threshold = float(gradients._SumBudget(1, 0.0, 0.0, margin, dtype).threshold(C, dtype))
    _, e = math.frexp(threshold)               # 2^(e-1) <= threshold < 2^e
    spacing = fractions.Fraction(2) ** (e - k)
    out = []
    for j in range(records.shape[1]):
        total = 0
        for x in records[:, j]:
            total += round(fractions.Fraction(float(x)) / spacing)   # ties to even, as the grid
        exact = total * spacing
        # float(Fraction) is correctly rounded to float64; for float32, round the exact value directly
        out.append(float(exact) if dtype != F32 else float(np.float32(float(exact))))
    return np.array(out, np.float64)


@pytest.mark.parametrize("case", ["vmap", "scan", "chunked 64"])
def test_fixed_point_sum_is_exact_and_independent_of_order_and_batch(case):
    """Records with the clip factor 1 (norm below the threshold): the release is
    the exact sum of their grid values, rounded once, bit for bit as computed
    in Python integers; in any order of the records and with padded slots
    added, the same bits. A double-float or plain float sum of these
    records (mixed magnitudes, cancellation) differs in the last bits in
    some order: the check has power."""
    loss, strategy, chunk = CASES[case]
    rng = np.random.default_rng(3)
    B, d, C = 300, 4, 1.0
    records = rng.normal(size=(B, d)) * 10.0 ** rng.uniform(-6, 0, (B, 1))
    records[::7] *= -1e-3
    records = (records / (np.linalg.norm(records, axis=1, keepdims=True) + 1e-30)
               * rng.uniform(0.0, 0.9, (B, 1))).astype(F32)
    params = _params(loss, d)
    expected = _grid_reference(records, C)
    got = _flat(_released(loss, params, jnp.asarray(records), jnp.ones(B, bool), C, strategy, chunk))
    np.testing.assert_array_equal(got, expected)
    perm = rng.permutation(B)
    padded = np.concatenate([records[perm], rng.normal(size=(37, d)).astype(F32)])
    mask = np.arange(B + 37) < B
    again = _flat(_released(loss, params, jnp.asarray(padded), jnp.asarray(mask), C, strategy, chunk))
    np.testing.assert_array_equal(again, expected)
    # power: a plain float32 sum in these two orders gives different bits
    plain = [np.sum(r, axis=0, dtype=F32) for r in (records, records[perm])]
    seq = [np.cumsum(r, axis=0, dtype=F32)[-1] for r in (records, records[perm])]
    assert np.any(plain[0] != plain[1]) or np.any(seq[0] != seq[1])


def test_from_grid_rounds_the_exact_integer_sum_once():
    """``_from_grid`` of adversarial integer pairs (sums of high and low words
    near the largest values the slot limit allows, of both signs, and
    carries from the low word) is the exact ``2^m Σh + Σl`` rounded to the
    nearest float32, after compilation: nothing is lost in the split or the
    conversion."""
    fp = gradients._fixed_point({"w": jnp.zeros(3, jnp.float32)})
    assert fp is not None and fp.int_dtype == jnp.int32 and fp.k == 28
    rng = np.random.default_rng(5)
    n = 20000
    top = fp.slots * 2 ** (fp.k - fp.m)
    high = np.concatenate([rng.integers(-top, top, n), [top, -top, 0, 1, -1, top - 1]]).astype(np.int32)
    low = np.concatenate([rng.integers(0, fp.slots * (2**fp.m - 1), n),
                          [fp.slots * (2**fp.m - 1), 0, 2**fp.m - 1, 2**fp.m, 0, 12345]]).astype(np.int32)
    got = np.asarray(jax.jit(lambda h, lo: gradients._from_grid(fp, h, lo, jnp.int32(0), jnp.float32))(
        jnp.asarray(high), jnp.asarray(low)))
    exact = high.astype(object) * 2**fp.m + low.astype(object)
    expected = np.array([np.float32(float(fractions.Fraction(int(z)))) for z in exact])
    # float(Fraction(int)) rounds to nearest float64 (exact here: |z| < 2^53), then to float32
    assert all(abs(int(z)) < 2**53 for z in exact)
    np.testing.assert_array_equal(got, expected)
    # a direct float32 conversion of the high word alone loses bits: the check has power
    assert np.any(high.astype(F32).astype(np.float64) * 2**fp.m + low != expected)


def test_grid_is_public_and_fits_the_margin():
    """The grid depends on the dtype and the number of parameters only; its
    share of the threshold is negligible, and its integer sums cannot
    overflow at the largest certified batch."""
    for P in [1, 60, 688884]:
        fp = gradients._fixed_point({"w": jnp.zeros(P, jnp.float32)})
        assert fp.k == 28 and fp.fraction <= np.sqrt(P) * 2.0**-27 * (1 + 1e-5) <= 2.0**-11
        assert fp.slots * 2**fp.m < 2**31 and fp.slots * (2 ** (fp.k - fp.m) + 1) < 2**31
        limit = int(gradients._sum_margin(jnp.float32) / (2 * gradients._sum_budget(1, 1, 1, {"w": jnp.zeros(P, jnp.float32)},
                                                                                        exact=True).rel))
        assert fp.slots >= limit   # every batch the margin allows


@pytest.mark.skipif(not jax.config.jax_enable_x64, reason="float64 parameters need jax_enable_x64 (the x64 step)")
def test_fixed_point_sum_of_float64_parameters_is_exact_in_int64():
    """float64 parameters: 64-bit integers on a grid of ``2^(e - 62)``, the
    release the exact sum rounded once to float64, as computed in Python."""
    fp = gradients._fixed_point({"w": jnp.zeros(3, jnp.float64)})
    assert fp.int_dtype == jnp.int64 and fp.k == 62
    rng = np.random.default_rng(4)
    B, d = 200, 3
    records = rng.normal(size=(B, d)) * 10.0 ** rng.uniform(-12, 0, (B, 1))
    records = records / np.linalg.norm(records, axis=1, keepdims=True) * rng.uniform(0, 0.9, (B, 1))
    params = {"w": jnp.zeros(d, jnp.float64)}
    got = _flat(_released(dot_loss, params, jnp.asarray(records), jnp.ones(B, bool), 1.0, "vmap", None))
    np.testing.assert_array_equal(got, _grid_reference(records, 1.0, np.float64))
