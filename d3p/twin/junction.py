"""Junction trees: the structure that makes inference in a graphical model exact.

A graphical model over discrete columns with factors on sets of columns
(*cliques*) is triangulated by greedy variable elimination (each step
eliminates the column whose neighbourhood has the fewest cells), and its
maximal elimination cliques are joined into a tree by a maximum spanning
tree on the sizes of their intersections (Kruskal), which has the running
intersection property for a chordal graph (Koller & Friedman 2009,
Probabilistic Graphical Models, ch. 10). Every factor clique lies in one
maximal clique, its *host*.

Pure Python on public structure (column sizes and the measured cliques):
nothing here sees data.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Sequence, Tuple

__all__ = ["JunctionTree", "build_junction_tree", "maximal_cliques", "tree_size"]

Clique = Tuple[int, ...]


class JunctionTree(NamedTuple):
    """A junction tree (a forest if the columns fall into unconnected groups).

    ``cliques[i]`` are the sorted columns of maximal clique i; ``parent[i]``
    its parent (-1 for a root); ``order`` lists the cliques with every parent
    before its children; ``separators[i]`` the columns clique i shares with
    its parent; ``host[c]`` the maximal clique that holds factor clique c.
    """

    sizes: Tuple[int, ...]
    cliques: Tuple[Clique, ...]
    parent: Tuple[int, ...]
    order: Tuple[int, ...]
    separators: Tuple[Clique, ...]
    host: Dict[Clique, int]

    def children(self, i: int) -> List[int]:
        """The children of clique ``i``."""
        return [c for c in range(len(self.cliques)) if self.parent[c] == i]

    @property
    def child_lists(self) -> List[List[int]]:
        """The children of every clique."""
        out: List[List[int]] = [[] for _ in self.cliques]
        for c, p in enumerate(self.parent):
            if p >= 0:
                out[p].append(c)
        return out

    def cells(self, clique: Sequence[int]) -> int:
        """The number of cells of a set of columns."""
        return math.prod(self.sizes[v] for v in clique)


def _eliminate(sizes: Sequence[int], factors: Sequence[Clique]) -> List[Clique]:
    """Maximal cliques of a greedy elimination (fewest cells in the neighbourhood first).

    A clique ``{v} ∪ N(v)`` formed when ``v`` is eliminated can only lie inside a
    clique formed earlier that holds ``v``; it is kept if it does not.
    """
    neighbours = {v: set() for v in range(len(sizes))}
    for f in factors:
        for a in f:
            neighbours[a].update(b for b in f if b != a)

    def weight(u):
        return math.prod(sizes[w] for w in neighbours[u]) * sizes[u]

    weights = {v: weight(v) for v in neighbours}
    cliques: List[set] = []
    holding: Dict[int, List[int]] = {v: [] for v in neighbours}  # earlier cliques that hold a column
    while weights:
        v = min(weights, key=lambda u: (weights[u], u))
        clique = neighbours[v] | {v}
        if not any(clique <= cliques[i] for i in holding[v]):
            for u in clique:
                holding[u].append(len(cliques))
            cliques.append(clique)
        for a in neighbours[v]:
            neighbours[a].update(neighbours[v] - {a})
            neighbours[a].discard(v)
        del weights[v], neighbours[v]
        for a in clique - {v}:
            weights[a] = weight(a)
    return [tuple(sorted(c)) for c in cliques]


def _spanning_tree(cliques: Sequence[Clique]) -> List[Tuple[int, int]]:
    """Edges of a maximum spanning forest on the intersection sizes (Kruskal)."""
    pairs = [(len(set(a) & set(b)), i, j) for i, a in enumerate(cliques) for j, b in enumerate(cliques) if i < j]
    pairs.sort(key=lambda t: (-t[0], t[1], t[2]))
    group = list(range(len(cliques)))

    def find(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    edges = []
    for weight, i, j in pairs:
        if weight == 0:
            break
        ri, rj = find(i), find(j)
        if ri != rj:
            group[ri] = rj
            edges.append((i, j))
    return edges


def build_junction_tree(sizes: Sequence[int], factors: Sequence[Sequence[int]]) -> JunctionTree:
    """The junction tree of a model over columns of ``sizes`` cells with factors on ``factors``.

    :param sizes: the number of cells of each column (every column is in the tree).
    :param factors: the factor cliques (sets of column indices).
    :return: :class:`JunctionTree`.
    """
    sizes = tuple(int(s) for s in sizes)
    factors = [tuple(sorted(set(int(v) for v in f))) for f in factors]
    cliques = _eliminate(sizes, factors)
    adjacent = {i: [] for i in range(len(cliques))}
    for i, j in _spanning_tree(cliques):
        adjacent[i].append(j)
        adjacent[j].append(i)
    parent = [-2] * len(cliques)
    order: List[int] = []
    for root in range(len(cliques)):
        if parent[root] != -2:
            continue
        parent[root] = -1
        queue = [root]
        while queue:
            i = queue.pop(0)
            order.append(i)
            for j in sorted(adjacent[i]):
                if parent[j] == -2:
                    parent[j] = i
                    queue.append(j)
    separators = tuple(tuple(sorted(set(cliques[i]) & set(cliques[parent[i]]))) if parent[i] >= 0 else ()
                       for i in range(len(cliques)))
    host = {}
    for f in factors + [(v,) for v in range(len(sizes))]:
        host[f] = min((i for i, c in enumerate(cliques) if set(f) <= set(c)),
                      key=lambda i: (math.prod(sizes[v] for v in cliques[i]), i))
    return JunctionTree(sizes, tuple(cliques), tuple(parent), tuple(order), separators, host)


def maximal_cliques(sizes: Sequence[int], factors: Sequence[Sequence[int]]) -> List[Clique]:
    """The maximal cliques of the junction tree of ``factors`` (sorted tuples)."""
    return _eliminate(tuple(sizes), [tuple(sorted(f)) for f in factors])


def tree_size(sizes: Sequence[int], factors: Sequence[Sequence[int]]) -> int:
    """The total number of cells of the maximal cliques of the junction tree of ``factors``."""
    return sum(math.prod(sizes[v] for v in c) for c in maximal_cliques(sizes, factors))
