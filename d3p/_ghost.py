"""Per-record gradient norms without per-record gradients ("ghost norms").

Private helper of the ``"ghost"`` strategy (``d3p._strategies``) of
:func:`d3p.gradients.clipped_grad_sum`. For a parameter ``W`` whose only uses
in the loss of one record are dense products ``z = dot_general(a, W)`` (``a``
any value, possibly depending on other parameters), the record's gradient is
``dL/dW = sum over uses of aᵀ δ`` with ``δ = dL/dz``. Its squared norm is
``Σ_{u,v} (a_u·a_v)(δ_u·δ_v)`` over the rows ``u, v`` of all uses (``‖a‖²‖δ‖²``
for a single row), and the sum over records of the clipped gradients is one
matrix product ``(c ⊙ A)ᵀ Δ`` over the rows of all records. So only the
activations ``a`` and output gradients ``δ`` of every record are needed,
which a batched forward and backward pass produce as fast as the non-private
gradient; the per-record ``W``-sized gradients are never formed.

How it works: the per-record loss is traced once (``jax.make_jaxpr``) for one
record; nested ``jit`` calls are inlined, everything else (``custom_jvp``,
``custom_vjp``, control flow) stays opaque. A liveness pass drops dead code.
A parameter leaf qualifies if every live use of it, through norm-preserving
views (reshape, transpose, copy, dtype-preserving converts), is an operand of
a ``dot_general`` without batch dimensions, all with the same layout. The
jaxpr is then re-evaluated, vmapped over the records, with a zero
perturbation added to the output of every such product and the other operand
recorded; the gradient with respect to the perturbations is ``δ``. All other
parameter leaves get exact per-record gradients in the same pass; their
clipped sum is a product too, ``fᵀ G`` over blocks of records
(``d3p._certified_sum._df_weighted_sums``), under the same budget as the
ghost products (a double-float tree over the records, its levels each
compiled into kernels of their own, took about a seventh of the VAE's step
compile on CPU).

Whatever the analysis concludes, the per-record bound used for clipping is
computed from the very ``a`` and ``δ`` (and residual gradients) that are then
summed, so the sensitivity bound never depends on the analysis being right;
only the equality with the plain per-record gradient does, and the tests check
that. The bound used for a record is that of ``Σ_r |a_r| |δ_r|ᵀ`` (the
entries replaced by their magnitudes; see :func:`gram_bound`), which is at
least the exact norm of ``Σ_r a_r δ_rᵀ`` and also bounds the rounding that
the record's rows can cause in the products that sum all records: so a
record whose rows cancel is clipped as if they did not (never less than its
exact norm requires); for single rows (a dense layer applied to a vector)
it is the exact norm, within a few units of roundoff. The products contract
``k`` rows each (``d3p._certified_sum._ghost_rows_per_product``: small enough
that their rounding fits the margin of the sum), and their results are
added up in double-float (the other strategies sum their per-record
gradients exactly, in fixed point; see :mod:`d3p.gradients`). The
floating-point primitives (scaled norms, rounding bounds, the clip factor:
``d3p._clipping``; the double-float sum: ``d3p._certified_sum``) are the
ones every strategy uses; this module imports them and sits below
``d3p._strategies``.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from d3p import _certified_sum, _clipping

PyTree = Any

# nested calls whose body is inlined (semantics unchanged)
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "remat2"})
# ops that only rearrange the elements of one array (norm preserving, bijective)
_VIEWS = frozenset({"reshape", "transpose", "copy", "copy_p", "squeeze", "expand_dims",
                    "convert_element_type", "broadcast_in_dim"})


class Unsupported(Exception):
    """The loss cannot be analysed; use another strategy."""


class _Lit(NamedTuple):
    val: Any


class _Eqn(NamedTuple):
    prim: Any
    params: dict
    ins: list  # int ids or _Lit
    outs: list  # int ids
    ctx: Any
    effects: Any


class Program:
    """A flat (jit-inlined) version of a closed jaxpr with integer variable ids."""

    def __init__(self, closed):
        self.consts = {}
        self.eqns: List[_Eqn] = []
        self.avals = {}
        self._next = 0
        jaxpr = closed.jaxpr
        self.invars = []
        for v in jaxpr.invars:
            self.invars.append(self._new(v.aval))
        self.outvars = self._inline(jaxpr, closed.consts, self.invars)

    def _new(self, aval):
        i = self._next
        self._next += 1
        self.avals[i] = aval
        return i

    def _inline(self, jaxpr, consts, ins):
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            i = self._new(v.aval)
            self.consts[i] = c
            env[v] = i
        for v, a in zip(jaxpr.invars, ins):
            env[v] = a

        def atom(v):
            if isinstance(v, jex_core.Literal):
                return _Lit(v.val)
            return env[v]

        for eqn in jaxpr.eqns:
            eins = [atom(v) for v in eqn.invars]
            sub = _inline_body(eqn)
            if sub is not None:
                body, body_consts = sub
                outs = self._inline(body, body_consts, eins)
                for v, o in zip(eqn.outvars, outs):
                    if not isinstance(v, jex_core.DropVar):
                        env[v] = o
                continue
            outs = [self._new(v.aval) for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jex_core.DropVar):
                    env[v] = o
            self.eqns.append(_Eqn(eqn.primitive, dict(eqn.params), eins, outs,
                                  getattr(eqn, "ctx", None), eqn.effects))
        return [atom(v) for v in jaxpr.outvars]

    def live_eqns(self, outputs) -> List[int]:
        """Indices of the equations that the given output atoms depend on."""
        live = {a for a in outputs if isinstance(a, int)}
        keep = []
        for k in range(len(self.eqns) - 1, -1, -1):
            e = self.eqns[k]
            if e.effects or any(o in live for o in e.outs):
                keep.append(k)
                live.update(a for a in e.ins if isinstance(a, int))
        return keep[::-1]


def _inline_body(eqn):
    if eqn.primitive.name not in _INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jex_core.ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, jex_core.Jaxpr):
            if body.constvars:
                return None
            return body, []
    return None


def _bind(eqn: _Eqn, invals):
    params = eqn.prim.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        invals = list(subfuns) + list(invals)
    manager = getattr(eqn.ctx, "manager", None)
    if manager is not None:
        with manager:
            out = eqn.prim.bind(*invals, **params)
    else:
        out = eqn.prim.bind(*invals, **params)
    return out if eqn.prim.multiple_results else [out]


def _is_view(eqn: _Eqn, avals) -> bool:
    name = eqn.prim.name
    if name not in _VIEWS or len(eqn.outs) != 1:
        return False
    if not eqn.ins or not isinstance(eqn.ins[0], int):
        return False
    if any(not isinstance(a, _Lit) for a in eqn.ins[1:]):
        return False
    a_in, a_out = avals[eqn.ins[0]], avals[eqn.outs[0]]
    if getattr(a_in, "dtype", None) != getattr(a_out, "dtype", None):
        return False
    if int(np.prod(a_in.shape)) != int(np.prod(a_out.shape)):
        return False
    if name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    return len(eqn.ins) == 1


def _signature(eqn: _Eqn) -> Tuple:
    return (eqn.prim.name, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))


class GhostUse(NamedTuple):
    """One dense product in which a ghost leaf is an operand."""

    eqn: int  # index into Program.eqns
    side: int  # 0: the leaf is lhs, 1: rhs
    rows: int  # rows R of the other operand (per record)
    n_in: int  # contracted size
    n_out: int  # free size of the leaf side
    x_perm: Tuple[int, ...]  # transpose of the other operand to (free..., contracted...)
    d_perm: Optional[Tuple[int, ...]]  # transpose of the output to (rows..., leaf free...)
    w_perm: Tuple[int, ...]  # W dims in canonical (contracted..., free...) order
    w_shape: Tuple[int, ...]


class Plan(NamedTuple):
    program: Program
    live: List[int]
    n_params: int  # leading invars that are parameter leaves
    ghost_leaves: Tuple[int, ...]
    residual_leaves: Tuple[int, ...]
    uses: Tuple[Tuple[GhostUse, ...], ...]  # per ghost leaf
    chains: Tuple[Tuple[int, ...], ...]  # per ghost leaf: eqn indices of the view chain
    ghost_size: int
    residual_size: int
    per_record_floats: int  # floats kept per record (a, δ, residual gradient)
    outer_residual_size: int  # entries of residual leaves with outer-product gradients


def _dot_use(eqn: _Eqn, side: int, avals) -> Optional[GhostUse]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb:
        return None
    lhs, rhs = eqn.ins
    if not all(isinstance(a, int) for a in (lhs, rhs)):
        return None
    ls, rs = tuple(avals[lhs].shape), tuple(avals[rhs].shape)
    lc, rc = tuple(lc), tuple(rc)
    lf = tuple(d for d in range(len(ls)) if d not in lc)
    rf = tuple(d for d in range(len(rs)) if d not in rc)
    if side == 1:  # W = rhs, X = lhs
        xs, xc, xf, ws, wc, wf = ls, lc, lf, rs, rc, rf
        d_perm = None  # output is (X free..., W free...) already
    else:  # W = lhs, X = rhs
        xs, xc, xf, ws, wc, wf = rs, rc, rf, ls, lc, lf
        nwf = len(lf)
        d_perm = tuple(range(nwf, nwf + len(rf))) + tuple(range(nwf))
    rows = int(np.prod([xs[d] for d in xf], dtype=np.int64))
    n_in = int(np.prod([ws[d] for d in wc], dtype=np.int64))
    n_out = int(np.prod([ws[d] for d in wf], dtype=np.int64))
    return GhostUse(-1, side, rows, n_in, n_out, xf + xc, d_perm, wc + wf, ws)


def analyse(closed, n_params: int, param_sizes: Sequence[int]) -> Plan:
    """Find the parameter leaves whose per-record norm can be had from (a, δ)."""
    prog = Program(closed)
    if len(prog.outvars) != 1:
        raise Unsupported("the loss must have a single output")
    live = prog.live_eqns(prog.outvars)
    uses = _leaf_uses(prog, live, n_params)
    outer = _outer_product_leaves(prog, live, n_params)
    ghost, residual, all_uses, chains = [], [], [], []
    per_record = 0
    for leaf in range(n_params):
        gus = _ghost_uses(prog, leaf, uses[leaf])
        if gus is not None:
            rows = sum(g.rows for g in gus)
            ghost.append(leaf)
            all_uses.append(gus)
            chains.append(tuple(uses[leaf][0][2]))
            per_record += sum(g.rows * (g.n_in + g.n_out) for g in gus) + rows * rows
        else:
            residual.append(leaf)
            per_record += int(param_sizes[leaf])
    return Plan(
        prog, live, n_params, tuple(ghost), tuple(residual), tuple(all_uses), tuple(chains),
        int(sum(param_sizes[i] for i in ghost)), int(sum(param_sizes[i] for i in residual)),
        per_record, int(sum(param_sizes[i] for i in residual if i in outer)),
    )


def _leaf_uses(prog: Program, live: List[int], n_params: int) -> dict:
    """Per parameter leaf, its live uses through views: ``(eqn index, side,
    chain of view eqn indices)`` where it is an operand of a ``dot_general``,
    None for any other use (an output of the loss included)."""
    avals = prog.avals
    # view var -> (leaf, chain of eqn indices)
    view = {prog.invars[i]: (i, ()) for i in range(n_params)}
    uses = {i: [] for i in range(n_params)}  # leaf -> list of (eqn idx, side, chain) or None (other use)
    for k in live:
        e = prog.eqns[k]
        touched = [(j, a) for j, a in enumerate(e.ins) if isinstance(a, int) and a in view]
        if not touched:
            continue
        if _is_view(e, avals):
            leaf, chain = view[e.ins[0]]
            view[e.outs[0]] = (leaf, chain + (k,))
            continue
        if e.prim.name == "dot_general":
            for j, a in touched:
                leaf, chain = view[a]
                uses[leaf].append((k, j, chain))
        else:
            for _, a in touched:
                uses[view[a][0]].append(None)
    for a in prog.outvars:
        if isinstance(a, int) and a in view:
            uses[view[a][0]].append(None)
    return uses


def _ghost_uses(prog: Program, leaf: int, us) -> Optional[Tuple[GhostUse, ...]]:
    """The :class:`GhostUse` of every use ``us`` of a parameter leaf (see
    :func:`_leaf_uses`), or None where the leaf takes exact per-record
    gradients: a use other than a product without batch dimensions, a
    non-float leaf, uses of different layouts, or more rows than pay off."""
    avals = prog.avals
    aval = avals[prog.invars[leaf]]
    if not (bool(us) and all(u is not None for u in us) and jnp.issubdtype(aval.dtype, jnp.floating)):
        return None
    gus, sigs = [], set()
    for k, side, chain in us:
        gu = _dot_use(prog.eqns[k], side, avals)
        if gu is None:
            return None
        gus.append(gu._replace(eqn=k))
        sig = tuple(_signature(prog.eqns[c]) for c in chain) + (
            side, repr(prog.eqns[k].params["dimension_numbers"]))
        sigs.add(sig)
    if len(sigs) != 1:
        return None
    rows = sum(g.rows for g in gus)
    # the Gram form costs rows² per record; beyond the leaf's size the
    # per-record gradient is cheaper
    if rows * rows > gus[0].n_in * gus[0].n_out:
        return None
    return tuple(gus)


_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def _outer_product_leaves(prog: Program, live, n_params: int) -> set:
    """Parameter leaves that enter a product with per-record data through an
    operand computed from parameters alone: their per-record gradient is an
    outer product (slow to batch on CPU)."""
    pdeps = {prog.invars[i]: 1 << i for i in range(n_params)}
    rec = {v: True for v in prog.invars[n_params:]}
    outer = 0
    for k in live:
        e = prog.eqns[k]
        ins = [a for a in e.ins if isinstance(a, int)]
        d = 0
        r = False
        for a in ins:
            d |= pdeps.get(a, 0)
            r = r or rec.get(a, False)
        if e.prim.name in _PRODUCTS and len(e.ins) >= 2:
            ops = e.ins[:2]
            for j in (0, 1):
                a, b = ops[j], ops[1 - j]
                if isinstance(a, int) and isinstance(b, int):
                    if pdeps.get(a, 0) and not rec.get(a, False) and rec.get(b, False):
                        outer |= pdeps[a]
        for o in e.outs:
            if d:
                pdeps[o] = d
            if r:
                rec[o] = True
    return {i for i in range(n_params) if outer >> i & 1}


def evaluate(plan: Plan, param_leaves, record_leaves, perturbations=None):
    """Evaluate the flat program for one record.

    :param perturbations: dict eqn index -> array added to that equation's
        output; its operands are recorded.
    :return: ``(loss, recorded)`` with ``recorded`` a dict eqn index ->
        ``(lhs, rhs)`` values.
    """
    prog = plan.program
    env = dict(prog.consts)
    inputs = list(param_leaves) + list(record_leaves)
    if len(inputs) != len(prog.invars):
        raise Unsupported("argument structure changed since tracing")
    env.update(zip(prog.invars, inputs))
    perturbations = perturbations or {}
    recorded = {}

    def read(a):
        return a.val if isinstance(a, _Lit) else env[a]

    for k in plan.live:
        e = prog.eqns[k]
        vals = [read(a) for a in e.ins]
        outs = _bind(e, vals)
        if k in perturbations:
            recorded[k] = (vals[0], vals[1])
            outs = [outs[0] + perturbations[k].astype(outs[0].dtype)]
        for o, v in zip(e.outs, outs):
            env[o] = v
    return read(prog.outvars[0]), recorded


def canonical_rows(use: GhostUse, x, delta):
    """(A, Δ) of one use for one record: rows × n_in and rows × n_out."""
    A = jnp.transpose(x, use.x_perm).reshape(use.rows, use.n_in)
    if use.d_perm is not None:
        delta = jnp.transpose(delta, use.d_perm)
    D = delta.reshape(use.rows, use.n_out)
    return A, D


def to_leaf(plan: Plan, g: int, canonical, leaf_value):
    """Map a canonical (n_in × n_out) gradient of ghost leaf ``g`` to the leaf's layout."""
    use = plan.uses[g][0]
    ws = use.w_shape
    perm = use.w_perm
    G = canonical.reshape(tuple(ws[d] for d in perm))
    G = jnp.transpose(G, np.argsort(perm))
    chain = plan.chains[g]
    if not chain:
        return G.astype(leaf_value.dtype)
    prog = plan.program

    def apply_chain(w):
        for k in chain:
            w = _bind(prog.eqns[k], [w])[0]
        return w

    _, vjp = jax.vjp(apply_chain, leaf_value)
    return vjp(G.astype(apply_chain(leaf_value).dtype))[0]


def gram_bound(A, D):
    """Per record, bounds for clipping the contribution ``AᵀD = Σ_r a_r ⊗ d_r`` of
    one ghost leaf; ``A``: (B, R, n_in), ``D``: (B, R, n_out), the values that
    are then summed, with the clipping factor ``f`` applied to ``A``.

    :return: ``(M, E)``, shape (B,) each: ``M`` is at least the norm of
        ``Σ_r |a_r| |d_r|ᵀ`` (entries replaced by their magnitudes), hence of
        the record's exact contribution ``Σ_r (f a_r) d_rᵀ`` per unit of
        ``f`` and of the weight ``Σ_r |f a_r| |d_r|ᵀ`` of the rounding its
        rows can cause in the products that sum all records (the
        multiplication by ``f`` adds ``(1 + u)``); ``E`` the absolute error
        of entries below the smallest normal number; ``inf`` for records
        with non-finite entries or a bound that overflows.

    **Why these are bounds.** With ``T`` an upper bound of ``Σ_r ‖a_r‖ ‖d_r‖``
    from row norms (``d3p._clipping._norm_bound`` and its primitives), the
    norm of ``Σ_r |a_r| |d_r|ᵀ`` is at most ``T`` (triangle inequality; for
    one row it is ``‖a‖ ‖d‖`` itself). For R > 1, with ``A`` and ``D``
    scaled by powers of two (exact) so that their largest entries lie in
    [1, 4), it is also at most ``sqrt(s + c T² + φ)``, where ``s`` is the
    computed Gram form ``Σ_uv (|a_u|·|a_v|)(|d_u|·|d_v|)`` (no cancellation:
    every term is non-negative), whose rounding error (Gram entries formed
    in any order: ``γ(n_in)‖a_u‖‖a_v‖`` and ``γ(n_out)‖d_u‖‖d_v‖``; the
    products and their blocked sum: ``γ(depth + 1)`` of their magnitudes) is
    at most ``c T²`` because ``Σ_uv ‖a_u‖‖a_v‖‖d_u‖‖d_v‖ = (Σ_u ‖a_u‖‖d_u‖)²``,
    and ``φ`` covers results flushed below the smallest normal number
    ``tiny``. Entries below ``tiny``, which a backend may treat as zero in
    any of these products, move the exact norm by at most
    ``tiny (sqrt(n_in) Σ_r‖d_r‖ + sqrt(n_out) Σ_r‖a_r‖)`` (in ``M``), and
    ``f A`` flushed to zero moves the sum by at most ``tiny sqrt(n_in) Σ_r‖d_r‖``
    whatever ``f`` (in ``E``, with the flushed products ``R sqrt(n_in n_out) tiny``).
    Every computed quantity is increased by the relative error bound of the
    roundings that produced it (``_up``).
    """
    (_, M, E), = _gram_bounds([(A, D)])[0]
    return M, E


def _gram_bounds(leaf_rows, others=()):
    """:func:`gram_bound` of every ``(A, D)`` of ``leaf_rows``, and
    :func:`d3p._clipping._norm_bound` of the rows of each of ``others``:
    ``(bounds, other_bounds)``, ``bounds`` a list of ``(leaves, M, E)``. Two
    or more leaves of one row per record (``R = 1``, dense layers) and one
    accumulation dtype are one entry, ``M`` and ``E`` of shape
    ``(len(leaves), B)`` (row ``i``: leaf ``leaves[i]``), computed on the
    leaves stacked: the same roundings, value by value, as leaf by leaf, in
    a fraction of the operations. Any other leaf is an entry of its own,
    ``M`` and ``E`` of shape ``(B,)``. The row norms of the triangle bounds
    and the others' norms are one batch of norm bounds
    (:func:`d3p._clipping._norm_bounds`)."""
    g = _clipping
    forms, rows = [], list(others)
    for j, (A, D) in enumerate(leaf_rows):
        acc = g._acc_dtype(A.dtype, D.dtype)
        rnd = g._rounding(acc, A.dtype, D.dtype)
        _, R, n_in = A.shape
        n_out = D.shape[2]
        A, D = jnp.abs(A.astype(acc)), jnp.abs(D.astype(acc))
        # the Gram form's error bound (relative to T²) grows with the sizes; where
        # it could not beat the triangle bound, T alone is the bound
        use_triangle = R == 1 or (n_in + n_out + 2 * R + 2) * rnd.u > 1e-2
        forms.append(_LeafForm(j, use_triangle, len(rows), A, D, rnd, (R, n_in, n_out)))
        if use_triangle:
            rows += [A, D]
    norms = g._norm_bounds(rows)
    groups = {}
    for f in forms:   # the one-row leaves by accumulation dtype, the others alone
        groups.setdefault((f.A.dtype, f.rnd) if f.sizes[0] == 1 else f.leaf, []).append(f)
    bounds = []
    for members in groups.values():
        leaves = [f.leaf for f in members]
        if len(members) == 1:
            f = members[0]
            parts = (_triangle_bound(norms[f.at], norms[f.at + 1], f.rnd) if f.use_triangle
                     else _gram_form_bound(f.A, f.D, f.rnd))
            bounds.append((leaves, *_with_tiny_entries(*parts, *f.sizes, f.rnd)))
            continue
        na = jnp.stack([norms[f.at] for f in members])
        nd = jnp.stack([norms[f.at + 1] for f in members])
        sizes = [np.array([[f.sizes[k]] for f in members], np.float64) for k in range(3)]
        rnd = members[0].rnd
        bounds.append((leaves, *_with_tiny_entries(*_triangle_bound(na, nd, rnd), *sizes, rnd)))
    return bounds, norms[:len(others)]


class _LeafForm(NamedTuple):
    """One ghost leaf in :func:`_gram_bounds`: its index, whether ``T`` alone
    bounds it, where its rows' norms are in the batch of norm bounds, ``|A|``
    and ``|D|`` in the accumulation dtype, the rounding constants, and
    ``(R, n_in, n_out)``."""

    leaf: int
    use_triangle: bool
    at: int
    A: jax.Array
    D: jax.Array
    rnd: Any
    sizes: Tuple[int, int, int]


def _triangle_bound(na, nd, rnd):
    """``(M, Σ_r ‖a_r‖, Σ_r ‖d_r‖)`` of :func:`gram_bound` from ``T`` alone, in
    real units, from the row norms ``na``, ``nd`` (..., B, R) of ``|A|`` and
    ``|D|`` (overflow-safe bounds): ``T = Σ_r ‖a_r‖‖d_r‖``."""
    g = _clipping
    R = na.shape[-1]
    M = g._up(jnp.sum(na * nd, axis=-1), R, rnd)
    sum_a = g._up(jnp.sum(na, axis=-1), R - 1, rnd)
    sum_d = g._up(jnp.sum(nd, axis=-1), R - 1, rnd)
    return M, sum_a, sum_d


def _gram_form_bound(A, D, rnd):
    """``(M, Σ_r ‖a_r‖, Σ_r ‖d_r‖)`` of :func:`gram_bound` from the Gram form,
    computed in units scaled by powers of two (exact) so that the largest
    entries of a record's ``A`` and ``D`` lie in [1, 4)."""
    g = _clipping
    R = A.shape[1]
    An, sa, _ = g._unit_scaled(A, 2)
    Dn, sd, _ = g._unit_scaled(D, 2)
    na = g._scaled_norm_bound(An, 1, rnd)  # (B, R)
    nd = g._scaled_norm_bound(Dn, 1, rnd)
    T = g._up(jnp.sum(na * nd, axis=1), R, rnd)
    M = g._times_pow2(jnp.minimum(_gram_norm_bound(An, Dn, T, rnd), T), -(sa + sd))
    sum_a = g._times_pow2(g._up(jnp.sum(na, axis=1), R, rnd), -sa)
    sum_d = g._times_pow2(g._up(jnp.sum(nd, axis=1), R, rnd), -sd)
    return M, sum_a, sum_d


def _gram_norm_bound(An, Dn, T, rnd):
    """Upper bound of the exact norm of ``AnᵀDn`` per record (scaled units): the
    computed Gram form ``s = Σ_uv (a_u·a_v)(d_u·d_v)`` plus its rounding error
    (at most ``c T²``, see :func:`gram_bound`) and results flushed below the
    smallest normal number."""
    g = _clipping
    _, R, n_in = An.shape
    n_out = Dn.shape[2]
    acc = An.dtype
    hi = lax.Precision.HIGHEST
    ga = jnp.einsum("bri,bsi->brs", An, An, precision=hi)
    gd = jnp.einsum("bro,bso->brs", Dn, Dn, precision=hi)
    s, depth = g._blocked_sum(ga * gd, 2)
    gi, go = g._gamma(n_in, rnd), g._gamma(n_out, rnd)
    c = (gi + go + gi * go + g._gamma(depth + 1, rnd) * (1 + gi) * (1 + go)) * (1 + 1e-3)
    phi = R * R * (64.0 * n_in * n_out + 4.0) * rnd.tiny
    sq = g._up(jnp.maximum(s, 0.0) + np.asarray(c, acc) * jnp.square(T) + np.asarray(phi, acc), 4, rnd)
    # entries of An, Dn flushed to zero: at most 20 R sqrt(n_in n_out) tiny in the norm
    return g._up(jnp.sqrt(sq) + np.asarray(20.0 * R * float(np.sqrt(n_in * n_out)) * rnd.tiny, acc), 3, rnd)


def _with_tiny_entries(M, sum_a, sum_d, R, n_in, n_out, rnd):
    """``(M, E)`` of :func:`gram_bound`: ``M`` increased by what entries below the
    smallest normal number (in real units) can change, ``E`` what ``f A``
    flushed to zero can; both ``inf`` unless finite. ``R``, ``n_in`` and
    ``n_out``: one leaf's sizes, or arrays ``(L, 1)`` of the sizes of the
    ``L`` leaves stacked in ``M``, ``sum_a`` and ``sum_d`` (``(L, B)``)."""
    g = _clipping
    acc = M.dtype
    t_in = np.asarray(2.0 * np.sqrt(n_in) * rnd.tiny, acc)
    t_out = np.asarray(2.0 * np.sqrt(n_out) * rnd.tiny, acc)
    two_tiny = np.asarray(2.0 * rnd.tiny, acc)
    M = g._up(M + (sum_d * t_in + two_tiny) + (sum_a * t_out + two_tiny), 4, rnd)
    E = g._up(sum_d * t_in + np.asarray((2.0 * R * np.sqrt(n_in * n_out) + 2.0) * rnd.tiny, acc), 2, rnd)
    finite = jnp.isfinite(M) & jnp.isfinite(E)
    inf = jnp.asarray(jnp.inf, acc)
    return jnp.where(finite, M, inf), jnp.where(finite, E, inf)


def trace_plan(loss_fn: Callable, params: PyTree, records: PyTree) -> Tuple[Plan, Any, Any]:
    """Trace ``loss_fn(params, one record)`` and analyse it.

    :return: ``(plan, params_treedef, records_treedef)``.
    """
    p_leaves, p_def = jax.tree.flatten(params)
    r_leaves, r_def = jax.tree.flatten(records)
    one = [jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in r_leaves]
    p_structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in p_leaves]

    def flat_loss(p, r):
        return loss_fn(jax.tree.unflatten(p_def, p), jax.tree.unflatten(r_def, r))

    try:
        closed = jax.make_jaxpr(flat_loss)(p_structs, one)
    except Exception as err:  # noqa: BLE001 - any tracing problem means: no ghost path
        raise Unsupported(f"could not trace the per-record loss: {err}") from err
    out = closed.out_avals
    if len(out) != 1 or tuple(out[0].shape) != ():
        raise Unsupported("the per-record loss must return a scalar")
    sizes = [int(np.prod(np.shape(x), dtype=np.int64)) for x in p_leaves]
    return analyse(closed, len(p_leaves), sizes), p_def, r_def


def ghost_chunk(plan: Plan, p_def, param_leaves, record_leaves, mask, clipping_threshold, reserve: float,
                block_rows: int):
    """Clipped sum (double-float pairs), losses and norm bounds for one chunk of records.

    Each record's clipping factor comes from :func:`d3p._clipping._clip_factor`
    applied to one bound over all leaves (:func:`_ghost_bounds`: :func:`gram_bound`
    for ghost leaves, norm bounds of the exact per-record gradients of the
    others), so that what is added for the record has exact norm at most
    ``clipping_threshold`` less ``reserve`` (the sum's fixed allowance, see
    ``d3p._certified_sum._SumBudget``), and the rounding weight of its rows in the
    products is bounded by the same norm. Records with mask False or a
    non-finite bound contribute exactly zero (``where``, so their ``nan``
    never reaches the sum). Every product that feeds a bound or the sum runs
    at ``Precision.HIGHEST``; the sum's products contract ``block_rows`` rows
    each.
    """
    dtypes = [jnp.result_type(x) for x in param_leaves]
    losses, leaf_rows, res_grads = _ghost_pass(plan, param_leaves, record_leaves, mask.shape[0])
    norms, abs_err = _ghost_bounds(plan, leaf_rows, res_grads, param_leaves, mask.shape[0])
    factor, keep = _clipping._clip_decision(norms, clipping_threshold, abs_err + reserve, dtypes, mask)
    hi, lo = _ghost_sums(plan, leaf_rows, res_grads, param_leaves, factor, keep, block_rows)
    return (jax.tree.unflatten(p_def, hi), jax.tree.unflatten(p_def, lo)), *_clipping._real_only(mask, losses, norms)


def _ghost_pass(plan: Plan, param_leaves, record_leaves, B: int):
    """The batched forward and backward pass over ``B`` records:
    ``(losses, rows, residual gradients)`` with, per ghost leaf, ``rows`` the
    pair ``(A, D)`` of shapes (B, R, n_in) and (B, R, n_out) over all its uses,
    and the exact per-record gradients of the residual leaves."""
    residual = plan.residual_leaves
    const_leaves = list(param_leaves)
    # one perturbation per product (a product of two ghost leaves serves both)
    dots = sorted({u.eqn for us in plan.uses for u in us})
    out_aval = {k: plan.program.avals[plan.program.eqns[k].outs[0]] for k in dots}

    def one_record(perts, res_vals, rec):
        leaves = list(const_leaves)
        for i, v in zip(residual, res_vals):
            leaves[i] = v
        loss, recorded = evaluate(plan, leaves, rec, dict(zip(dots, perts)))
        return loss, [recorded[k] for k in dots]

    perts = [jnp.zeros((B,) + tuple(out_aval[k].shape), out_aval[k].dtype) for k in dots]
    res_vals = [param_leaves[i] for i in residual]
    grad_fn = jax.value_and_grad(one_record, argnums=(0, 1), has_aux=True)
    (losses, xs), (deltas, res_grads) = jax.vmap(grad_fn, in_axes=(0, None, 0))(
        perts, res_vals, record_leaves
    )
    index = {k: j for j, k in enumerate(dots)}
    return losses, [_leaf_rows(us, xs, deltas, index) for us in plan.uses], res_grads


def _leaf_rows(uses: Sequence[GhostUse], xs, deltas, index):
    """``(A, D)`` of one ghost leaf: the canonical rows of all its uses, per record."""
    As, Ds = [], []
    for u in uses:
        j = index[u.eqn]
        other = xs[j][1 - u.side]  # the operand that is not the leaf
        A, D = jax.vmap(lambda x, d, u=u: canonical_rows(u, x, d))(other, deltas[j])
        As.append(A)
        Ds.append(D)
    A = jnp.concatenate(As, axis=1) if len(As) > 1 else As[0]
    D = jnp.concatenate(Ds, axis=1) if len(Ds) > 1 else Ds[0]
    return A, D


def _ghost_bounds(plan: Plan, leaf_rows, res_grads, param_leaves, B: int):
    """``(norms, abs_err)`` per record for :func:`d3p._clipping._clip_decision`:
    one bound over all leaves (the norm of :func:`gram_bound` per ghost leaf
    and of the norm bound of each residual leaf's exact gradient, which
    bounds the record's whole gradient as :func:`d3p._clipping._record_bound`
    does), and the absolute error that does not scale with the clip factor."""
    g = _clipping
    dtypes = [jnp.result_type(x) for x in param_leaves]
    acc = g._acc_dtype(*dtypes)
    rnd = g._rounding(acc, *dtypes)
    # per ghost leaf (M, E); per residual leaf the norm of its rows (as
    # _record_bound's), all shape (B,), from one batch of norm bounds
    ghost, residual = _gram_bounds(leaf_rows, [g._rows(grad) for grad in res_grads])
    columns, abs_errs = _leaf_columns(ghost, len(leaf_rows), acc)
    if residual:
        columns.append(jnp.stack([r.astype(acc) for r in residual], axis=1))
    # one norm over all parts (the residual leaves' norms among them: a bound
    # of the record's whole gradient, as the norm of _record_bound with them)
    norms = g._norm_bound(jnp.concatenate(columns, axis=1)) if columns else jnp.zeros((B,), acc)
    res_size = sum(g._rows(grad).shape[1] for grad in res_grads)
    res_dtypes = [jnp.result_type(param_leaves[i]) for i in plan.residual_leaves]
    abs_err = jnp.asarray(g._flush_slack(res_size, res_dtypes), acc) + sum(abs_errs)
    return norms, g._up(abs_err, len(abs_errs), rnd)


def _leaf_columns(bounds, num_leaves: int, acc):
    """``(columns, abs_errs)`` of :func:`_gram_bounds`' ``bounds``: the bounds
    ``M`` as columns ``(B, ·)`` in the order of the leaves (a list of at most
    one array), and the errors ``E`` as a list in that order, all in ``acc``."""
    if len(bounds) == 1 and bounds[0][1].ndim == 2:   # every leaf in one stack, in order
        _, M, E = bounds[0]
        return [M.astype(acc).T], [E[i].astype(acc) for i in range(num_leaves)]
    per_leaf = [None] * num_leaves
    for leaves, M, E in bounds:
        for i, leaf in enumerate(leaves):
            per_leaf[leaf] = (M[i], E[i]) if M.ndim == 2 else (M, E)
    if not per_leaf:
        return [], []
    return [jnp.stack([M.astype(acc) for M, _ in per_leaf], axis=1)], [E.astype(acc) for _, E in per_leaf]


def _ghost_sums(plan: Plan, leaf_rows, res_grads, param_leaves, factor, keep, block_rows: int):
    """The clipped sum per parameter leaf as double-float pairs ``(hi, lo)`` (lists
    over the leaves): for ghost leaves, products ``(f A)ᵀ D`` of ``block_rows``
    rows each, added up by :func:`d3p._certified_sum._df_tree`; for the others the
    double-float sum of the clipped exact gradients. Every product at
    ``Precision.HIGHEST``; records with ``keep`` False add exactly 0."""
    g = _clipping
    hi, lo = list(param_leaves), list(param_leaves)
    for j, leaf in enumerate(plan.ghost_leaves):
        A, D = leaf_rows[j]
        cA, D0 = g._keep_records(A, keep, factor), g._keep_records(D, keep)
        # the accumulation dtype of the parameter (a conversion of wider
        # activations is one of the roundings the clip factor allows for)
        dtype = g._acc_dtype(jnp.result_type(param_leaves[leaf]))
        h, l_ = _certified_sum._df_tree(_block_products(cA.astype(dtype), D0.astype(dtype), block_rows))
        hi[leaf] = to_leaf(plan, j, h, jnp.asarray(param_leaves[leaf], dtype))
        lo[leaf] = to_leaf(plan, j, l_, jnp.asarray(param_leaves[leaf], dtype))
    # the others: their exact gradients weighted by the clip factors, in
    # products of block_rows records (small leaves joined: _df_weighted_sums)
    kept = [g._keep_records(grad, keep) for grad in res_grads]
    weights = jnp.where(keep, factor, jnp.zeros_like(factor))
    res_hi, res_lo = _certified_sum._df_weighted_sums(kept, weights, block_rows)
    for leaf, h, l_ in zip(plan.residual_leaves, res_hi, res_lo):
        hi[leaf], lo[leaf] = h, l_
    return hi, lo


def _block_products(A, D, k: int):
    """``(n_blocks, n_in, n_out)``: the products ``Σ_r a_r d_rᵀ`` over consecutive
    blocks of ``k`` of the rows of all records (zero rows pad the last block)."""
    n_in, n_out = A.shape[2], D.shape[2]
    A, D = A.reshape(-1, n_in), D.reshape(-1, n_out)
    rows = A.shape[0]
    k = max(1, min(int(k), rows))
    nb = -(-rows // k)
    if nb * k > rows:
        A = jnp.concatenate([A, jnp.zeros((nb * k - rows, n_in), A.dtype)])
        D = jnp.concatenate([D, jnp.zeros((nb * k - rows, n_out), D.dtype)])
    return jnp.einsum("nki,nko->nio", A.reshape(nb, k, n_in), D.reshape(nb, k, n_out),
                      precision=lax.Precision.HIGHEST)
