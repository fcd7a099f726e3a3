# SPDX-License-Identifier: Apache-2.0
"""The engines behind :mod:`d3p.accounting` (private).

* ``_names``: the neighbouring relations and batch samplers, with their spellings.
* ``_search``: the one monotone root search, with the side of its answer guaranteed.
* ``_pair``: densities and privacy loss of the composed pairs.
* ``_gaussian``: closed forms of the Gaussian mechanism (q = 1).
* ``_rdp``: the Rényi-DP upper bound.
* ``_window``: tail bounds and the grid window of the Fourier accountant.
* ``_dominating``: the Fourier accountant as an upper bound: a discrete
  pair dominating each step ("connect the dots"), composed by an
  exponentially tilted FFT.
* ``_pld``: the adapter to dp-accounting's PLD accountant.
* ``_engine``: which engine answers a validated question.

Every function here takes validated inputs; :mod:`d3p.accounting` and
:mod:`d3p.dputil` check arguments at the boundary.
"""
