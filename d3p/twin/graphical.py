"""Discrete graphical models on a junction tree: exact marginals and sampling.

A :class:`GraphicalModel` is a distribution over D discrete columns (column j
has ``sizes[j]`` cells) of the form ``p(x) ∝ exp(Σ_c θ_c(x_c))``, one
log-potential ``θ_c`` per factor clique ``c`` (a set of columns). With the
junction tree of its cliques (:mod:`d3p.twin.junction`), belief propagation
gives every maximal clique's exact marginal (:func:`calibrate`); from those,
:func:`marginal` answers the marginal of any small set of columns, and
:func:`sample` draws records by ancestral sampling down the tree.

Post-processing only: the potentials are what :mod:`d3p.twin.estimation`
fitted to noisy measurements; nothing here sees the data. NumPy, in log space.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from d3p.twin.junction import JunctionTree, build_junction_tree

__all__ = ["GraphicalModel", "Calibrated", "calibrate", "marginal", "sample", "uniform_model"]

Clique = Tuple[int, ...]


class GraphicalModel(NamedTuple):
    """``p(x) ∝ exp(Σ_c potentials[c](x_c))``: ``factors[i]`` is a sorted tuple of
    columns and ``potentials[i]`` an array of shape ``[sizes[v] for v in factors[i]]``."""

    sizes: Tuple[int, ...]
    factors: Tuple[Clique, ...]
    potentials: Tuple[np.ndarray, ...]


class Calibrated(NamedTuple):
    """A model's junction tree and the log-marginals of its maximal cliques."""

    tree: JunctionTree
    beliefs: Tuple[np.ndarray, ...]


def uniform_model(sizes: Sequence[int], factors: Sequence[Sequence[int]]) -> GraphicalModel:
    """The uniform distribution, with zero potentials on ``factors`` (sorted)."""
    sizes = tuple(int(s) for s in sizes)
    factors = tuple(tuple(sorted(f)) for f in factors)
    return GraphicalModel(sizes, factors, tuple(np.zeros([sizes[v] for v in f]) for f in factors))


def logsumexp(x: np.ndarray, axis=None) -> np.ndarray:
    """log Σ exp(x) over ``axis`` (all axes if None); finite inputs."""
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())


def _expand(values: np.ndarray, sub: Sequence[int], full: Sequence[int]) -> np.ndarray:
    """``values`` over the sorted columns ``sub`` reshaped to broadcast over the sorted ``full``."""
    shape = [values.shape[list(sub).index(v)] if v in sub else 1 for v in full]
    return np.reshape(values, shape)


def _sum_to(log_values: np.ndarray, full: Sequence[int], sub: Sequence[int]) -> np.ndarray:
    """Log-sum-exp of ``log_values`` over the columns of ``full`` not in ``sub``."""
    axes = tuple(i for i, v in enumerate(full) if v not in sub)
    return logsumexp(log_values, axis=axes) if axes else log_values


def _clique_potentials(model: GraphicalModel, tree: JunctionTree) -> List[np.ndarray]:
    psi = [np.zeros([tree.sizes[v] for v in c]) for c in tree.cliques]
    for f, theta in zip(model.factors, model.potentials):
        i = tree.host[f]
        psi[i] = psi[i] + _expand(np.asarray(theta, np.float64), f, tree.cliques[i])
    return psi


def calibrate(model: GraphicalModel, tree: JunctionTree = None) -> Calibrated:
    """Belief propagation on the junction tree: the log-marginal of every maximal clique.

    :param GraphicalModel model: the model.
    :param JunctionTree tree: its junction tree, if already built.
    """
    if tree is None:
        tree = build_junction_tree(model.sizes, model.factors)
    psi = _clique_potentials(model, tree)
    cl, sep = tree.cliques, tree.separators
    children = tree.child_lists
    up: Dict[int, np.ndarray] = {}
    total: Dict[int, np.ndarray] = {}
    for i in reversed(tree.order):
        t = psi[i]
        for ch in children[i]:
            t = t + _expand(up[ch], sep[ch], cl[i])
        total[i] = t
        if tree.parent[i] >= 0:
            up[i] = _sum_to(t, cl[i], sep[i])
    beliefs: List[np.ndarray] = [None] * len(cl)
    down: Dict[int, np.ndarray] = {}
    for i in tree.order:
        b = total[i] + (_expand(down[i], sep[i], cl[i]) if tree.parent[i] >= 0 else 0.0)
        for ch in children[i]:
            down[ch] = _sum_to(b - _expand(up[ch], sep[ch], cl[i]), cl[i], sep[ch])
        beliefs[i] = b - logsumexp(b)
    return Calibrated(tree, tuple(beliefs))


def _path(tree: JunctionTree, a: int, b: int) -> List[int]:
    """The cliques on the tree path from ``a`` to ``b`` (both included)."""
    def up_chain(i):
        chain = [i]
        while tree.parent[chain[-1]] >= 0:
            chain.append(tree.parent[chain[-1]])
        return chain

    ca, cb = up_chain(a), up_chain(b)
    common = next((x for x in ca if x in cb), None)
    if common is None:  # different trees of the forest
        return ca + cb
    return ca[:ca.index(common) + 1] + cb[:cb.index(common)][::-1]


def _steiner(tree: JunctionTree, columns: Sequence[int]) -> List[int]:
    """Cliques of a small connected part of the tree (or forest) that covers ``columns``."""
    anchors = []
    for v in columns:
        holders = [i for i, c in enumerate(tree.cliques) if v in c]
        anchors.append(min(holders, key=lambda i: tree.cells(tree.cliques[i])))
    nodes = {anchors[0]}
    for a in anchors[1:]:
        for b in list(nodes):
            nodes.update(_path(tree, a, b))
            break
    return sorted(nodes)


def _root_of(tree: JunctionTree, i: int) -> int:
    while tree.parent[i] >= 0:
        i = tree.parent[i]
    return i


def _log_query(cal: Calibrated, query: Clique) -> np.ndarray:
    """log p(query) for columns spread over several cliques: messages over the
    part of the tree that covers them, carrying the query columns (columns in
    different trees of a forest are independent)."""
    tree = cal.tree
    groups: Dict[int, List[int]] = {}
    for v in query:
        holder = next(i for i, c in enumerate(tree.cliques) if v in c)
        groups.setdefault(_root_of(tree, holder), []).append(v)
    cols, val = (), np.zeros(())
    for part in groups.values():
        cols, val = _multiply(cols, val, tuple(part), _log_query_connected(cal, tuple(part)))
    return val


def _log_query_connected(cal: Calibrated, query: Clique) -> np.ndarray:
    """:func:`_log_query` for columns in one tree."""
    tree = cal.tree
    nodes = _steiner(tree, query)
    inside = set(nodes)
    root = nodes[0]
    adjacent = {i: [j for j in nodes if j != i and (tree.parent[j] == i or tree.parent[i] == j)] for i in nodes}

    def message(i, came_from):
        cols, val = tree.cliques[i], cal.beliefs[i]
        if came_from is not None:  # the conditional of clique i given the separator
            s = tuple(sorted(set(cols) & set(tree.cliques[came_from])))
            val = val - _expand(_sum_to(val, cols, s), s, cols)
        for j in adjacent[i]:
            if j == came_from or j not in inside:
                continue
            mcols, mval = message(j, i)
            cols, val = _multiply(cols, val, mcols, mval)
        keep = set(query)
        if came_from is not None:
            keep |= set(tree.cliques[came_from])
        out = tuple(v for v in cols if v in keep)
        return out, _sum_to(val, cols, out)

    cols, val = message(root, None)
    return _sum_to(val, cols, query)


def _multiply(a_cols, a_val, b_cols, b_val):
    cols = tuple(sorted(set(a_cols) | set(b_cols)))
    return cols, _expand(a_val, a_cols, cols) + _expand(b_val, b_cols, cols)


def marginal(cal: Calibrated, columns: Sequence[int]) -> np.ndarray:
    """The marginal distribution (probabilities) of a set of columns, axes in sorted order.

    :param Calibrated cal: from :func:`calibrate`.
    :param columns: the columns.
    """
    query = tuple(sorted(set(int(v) for v in columns)))
    tree = cal.tree
    holders = [i for i, c in enumerate(tree.cliques) if set(query) <= set(c)]
    if holders:
        i = min(holders, key=lambda k: tree.cells(tree.cliques[k]))
        log_p = _sum_to(cal.beliefs[i], tree.cliques[i], query)
    else:
        log_p = _log_query(cal, query)
    p = np.exp(log_p - np.max(log_p))
    return p / p.sum()


def _draw(rng: np.random.Generator, probs: np.ndarray, size: int) -> np.ndarray:
    """``size`` indices with the proportions of ``probs`` up to rounding, in random order.

    Each index gets ``floor(size p)`` copies and the remaining ones go to
    distinct indices drawn with probability proportional to the fractional
    parts: every index is drawn ``size p`` times in expectation, as by i.i.d.
    sampling, but the table of a sample is within one of ``size p`` in every
    cell (the synthetic data of Private-PGM are drawn the same way), which
    removes most of the sampling noise of small synthetic tables.
    """
    p = np.clip(np.asarray(probs, np.float64), 0.0, None)
    p = p / p.sum()
    counts = size * p
    whole = np.floor(counts).astype(np.int64)
    frac = counts - whole
    extra = size - int(whole.sum())
    if extra > 0:
        replace = np.count_nonzero(frac) < extra  # only through rounding
        chosen = rng.choice(p.size, size=extra, replace=replace, p=frac / frac.sum())
        np.add.at(whole, chosen, 1)
    out = np.repeat(np.arange(p.size), whole)
    rng.shuffle(out)
    return out


def sample(cal: Calibrated, num_records: int, rng: np.random.Generator) -> np.ndarray:
    """Records ``int (num_records, D)`` drawn from the model by ancestral sampling on its junction tree.

    :param Calibrated cal: from :func:`calibrate`.
    :param int num_records: how many.
    :param numpy.random.Generator rng: the generator.
    """
    tree = cal.tree
    out = np.zeros((num_records, len(tree.sizes)), np.int64)
    for i in tree.order:
        cols, sep = tree.cliques[i], tree.separators[i]
        new = [v for v in cols if v not in sep]
        b = np.exp(cal.beliefs[i])
        # axes: separator columns first, then the new ones
        b = np.transpose(b, [cols.index(v) for v in sep] + [cols.index(v) for v in new])
        b = b.reshape(int(np.prod([tree.sizes[v] for v in sep], dtype=np.int64)), -1)
        new_shape = [tree.sizes[v] for v in new]
        if sep:
            key = np.ravel_multi_index(tuple(out[:, v] for v in sep), [tree.sizes[v] for v in sep])
        else:
            key = np.zeros(num_records, np.int64)
        flat = np.empty(num_records, np.int64)
        for k in np.unique(key):
            rows = np.flatnonzero(key == k)
            flat[rows] = _draw(rng, b[k], rows.size)
        if new:
            values = np.unravel_index(flat, new_shape)
            for v, x in zip(new, values):
                out[:, v] = x
    return out
