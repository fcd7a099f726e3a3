"""Fit a graphical model to noisy marginal measurements (post-processing).

Each :class:`Measurement` is a noisy linear view of one marginal table: the
counts of a clique of columns, optionally coarsened along some columns
(neighbouring cells merged), plus Gaussian noise of a known standard
deviation. :func:`estimate` finds the graphical model
(:mod:`d3p.twin.graphical`) whose marginals explain them best in weighted
least squares,

    minimise over θ   Σ_i ‖Q_i μ_{c_i}(θ) − y_i / N‖² / (2 (s_i / N)²),

with ``μ_c(θ)`` the model's marginal of clique ``c`` (probabilities), ``Q_i``
the coarsening, ``y_i`` the noisy counts, ``s_i`` their noise std and ``N``
the (public) number of records: the estimator of Private-PGM (McKenna,
Sheldon & Miklau 2019, "Graphical-model based estimation and inference for
differential privacy"), by entropic mirror descent on the marginal polytope
(``θ ← θ − α ∇_μ L``) with a backtracking step size. The result is the
maximum-entropy-like distribution whose factors are the measured cliques;
it is consistent and non-negative where the measurements are not.

Post-processing of the measurements: nothing here sees the data.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from d3p.twin.graphical import GraphicalModel, calibrate, logsumexp
from d3p.twin.junction import build_junction_tree

__all__ = ["Measurement", "estimate", "project", "project_transpose"]

Clique = Tuple[int, ...]


class Measurement(NamedTuple):
    """A noisy marginal: ``values = Q(counts of clique) + N(0, std²)``.

    ``clique`` is a sorted tuple of columns; ``coarsening`` holds, per
    column of the clique, a matrix ``(k, size)`` merging its cells (or None
    for the cells as they are); ``values`` has the shape of the coarsened
    table.
    """

    clique: Clique
    values: np.ndarray
    std: float
    coarsening: Tuple[Optional[np.ndarray], ...]


def project(table: np.ndarray, coarsening: Sequence[Optional[np.ndarray]]) -> np.ndarray:
    """``Q table``: every axis ``a`` multiplied by ``coarsening[a]`` (None: unchanged)."""
    out = table
    for axis, m in enumerate(coarsening):
        if m is not None:
            out = np.moveaxis(np.tensordot(m, out, axes=([1], [axis])), 0, axis)
    return out


def project_transpose(table: np.ndarray, coarsening: Sequence[Optional[np.ndarray]]) -> np.ndarray:
    """``Qᵀ table`` (the adjoint of :func:`project`)."""
    out = table
    for axis, m in enumerate(coarsening):
        if m is not None:
            out = np.moveaxis(np.tensordot(m.T, out, axes=([1], [axis])), 0, axis)
    return out


def _loss_and_grad(measurements: Sequence[Measurement], mus: dict, num_records: int):
    """The weighted squared error and its gradient w.r.t. each clique marginal."""
    loss, grads = 0.0, {}
    for m in measurements:
        scale = (m.std / num_records) ** 2
        diff = project(mus[m.clique], m.coarsening) - m.values / num_records
        loss += 0.5 * float(np.sum(diff * diff)) / scale
        g = project_transpose(diff, m.coarsening) / scale
        grads[m.clique] = grads.get(m.clique, 0.0) + g
    return loss, grads


def _marginals(model: GraphicalModel, tree, cliques) -> dict:
    """The model's marginals of ``cliques`` (each inside one maximal clique of ``tree``)."""
    cal = calibrate(model, tree)
    out = {}
    for c in cliques:
        h = tree.host[c]
        axes = tuple(i for i, v in enumerate(tree.cliques[h]) if v not in c)
        out[c] = np.exp(logsumexp(cal.beliefs[h], axes)) if axes else np.exp(cal.beliefs[h])
    return out


def estimate(sizes: Sequence[int], measurements: Sequence[Measurement], num_records: int, *,
             init: Optional[GraphicalModel] = None, num_iterations: int = 500,
             tolerance: float = 1e-8) -> GraphicalModel:
    """The graphical model whose marginals best explain ``measurements`` (see the module docstring).

    :param sizes: the number of cells of every column.
    :param measurements: the noisy measurements.
    :param int num_records: N (public), the total the counts add up to.
    :param GraphicalModel init: a starting point (its potentials on cliques
        that are still measured are kept; warm start).
    :param int num_iterations: the most mirror-descent steps.
    :param float tolerance: stop when a step lowers the loss by less than this
        relative amount.
    :return: :class:`GraphicalModel` with one factor per measured clique and
        per column.
    """
    sizes = tuple(int(s) for s in sizes)
    cliques = sorted({m.clique for m in measurements} | {(v,) for v in range(len(sizes))})
    start = {} if init is None else dict(zip(init.factors, init.potentials))
    theta = {c: np.array(start.get(c, np.zeros([sizes[v] for v in c])), np.float64) for c in cliques}
    tree = build_junction_tree(sizes, cliques)
    model = GraphicalModel(sizes, tuple(cliques), tuple(theta[c] for c in cliques))
    mus = _marginals(model, tree, {m.clique for m in measurements})
    loss, grads = _loss_and_grad(measurements, mus, num_records)
    alpha = min((m.std / num_records) ** 2 * m.values.size for m in measurements) if measurements else 1.0
    for step in range(num_iterations):
        while True:
            trial = {c: theta[c] - alpha * grads.get(c, 0.0) for c in cliques}
            trial_model = GraphicalModel(sizes, tuple(cliques), tuple(trial[c] for c in cliques))
            trial_mus = _marginals(trial_model, tree, mus.keys())
            trial_loss, trial_grads = _loss_and_grad(measurements, trial_mus, num_records)
            decrease = sum(float(np.sum(grads[c] * (mus[c] - trial_mus[c]))) for c in grads)
            if loss - trial_loss >= 0.5 * decrease or alpha < 1e-300:
                break
            alpha *= 0.5
        converged = step >= 20 and loss - trial_loss <= tolerance * max(loss, 1e-300)
        theta, model, mus, loss, grads = trial, trial_model, trial_mus, trial_loss, trial_grads
        alpha *= 2.0
        if converged:
            break
    return model


def total_error(model: GraphicalModel, measurements: List[Measurement], num_records: int) -> float:
    """The estimator's loss at ``model`` (for diagnostics)."""
    mus = _marginals(model, None, {m.clique for m in measurements})
    return _loss_and_grad(measurements, mus, num_records)[0]
