# SPDX-License-Identifier: Apache-2.0
"""What the accountants know of a batch sampler: its name, its neighbouring
relation, and what truncating a Poisson batch adds to δ.

This is the bottom of the sampling/accounting layering: :mod:`d3p.minibatch`
(the samplers) and :mod:`d3p.accounting` (the accountants) both import it, and
it imports neither; :mod:`d3p.dputil` (calibration) and the privacy ledger sit
above :mod:`d3p.accounting`.

``Relation`` and ``Sampler`` are ``str`` enums: a member equals, hashes and
prints like its canonical name (``Relation.ADD_REMOVE == "add_remove"``), so
it serves as a dict key, in messages and in JSON, and the type's lookup
accepts every documented spelling case-insensitively
(``Relation("add-remove") is Relation.ADD_REMOVE``). Unknown names raise the
message of :func:`d3p._validate.choice`.
"""

import enum
import math

from d3p import _validate


class _Name(str, enum.Enum):
    """A canonical name with its other spellings (``member.spellings``)."""

    def __new__(cls, value: str, *spellings: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.spellings = spellings
        return member

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def _argument(cls) -> str:
        """The argument name used in error messages."""
        raise NotImplementedError

    @classmethod
    def _missing_(cls, value):
        """The member of any spelling of a name; the shared message otherwise."""
        table = {spelling: member for member in cls for spelling in (member.value, *member.spellings)}
        return _validate.choice(cls._argument(), value, table)


class Relation(_Name):
    """A neighbouring relation: ``"add_remove"`` or ``"substitute"``.

    ``Relation(name)`` accepts, case-insensitively, ``"add_remove"``,
    ``"add-remove"``, ``"add/remove"``, ``"remove"`` and ``"substitute"``,
    ``"substitution"``, ``"replace"``, ``"replace_one"``.
    """

    #: Neighbouring data sets differ by the presence of one record.
    ADD_REMOVE = ("add_remove", "add-remove", "add/remove", "remove")
    #: Neighbouring data sets have the same size and differ in one record's value.
    SUBSTITUTE = ("substitute", "substitution", "replace", "replace_one")

    @classmethod
    def _argument(cls) -> str:
        """The argument name used in error messages."""
        return "relation"


class Sampler(_Name):
    """A batch sampler: ``"poisson"`` or ``"fixed_size"``.

    ``Sampler(name)`` accepts, case-insensitively, ``"poisson"``,
    ``"poisson_batchify_data"`` and ``"fixed_size"``, ``"fixed-size"``,
    ``"fixed"``, ``"feistel"``, ``"without_replacement"``,
    ``"subsample_batchify_data"``.
    """

    #: Each record independently with probability q, padded to a fixed shape with a mask.
    POISSON = ("poisson", "poisson_batchify_data")
    #: B = qN records drawn without replacement (a keyed Feistel permutation).
    FIXED_SIZE = ("fixed_size", "fixed-size", "fixed", "feistel", "without_replacement",
                  "subsample_batchify_data")

    @classmethod
    def _argument(cls) -> str:
        """The argument name used in error messages."""
        return "sampler"


def overflow_probability(num_records: int, q: float, max_batch_size: int) -> float:
    """``P(K > max_batch_size)`` for ``K ~ Binomial(num_records, q)`` (0 if
    ``max_batch_size >= num_records``); validated inputs."""
    from scipy.stats import binom

    if max_batch_size >= num_records:
        return 0.0
    return float(binom.sf(max_batch_size, num_records, q))


def overflow_delta(num_records: int, q: float, max_batch_size: int, num_steps: int, epsilon: float) -> float:
    """What truncating overflowing Poisson batches adds to δ over ``num_steps``
    steps of an (ε, δ) guarantee: ``(1 + e^ε) T P(K > max_batch_size)`` with
    the overflow probability of the larger neighbour (``N + 1`` records),
    at most 1; validated inputs (see
    :func:`d3p.minibatch.poisson_overflow_delta`)."""
    p = overflow_probability(num_records + 1, q, max_batch_size)
    if p == 0.0:
        return 0.0
    return float(min(1.0, (1.0 + math.exp(min(epsilon, 700.0))) * int(num_steps) * p))
