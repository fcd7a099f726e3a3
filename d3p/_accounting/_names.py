# SPDX-License-Identifier: Apache-2.0
"""The neighbouring relations and batch samplers that d3p accounts for.

Each is a ``str`` enum: a member equals, hashes and prints like its canonical
name (``Relation.ADD_REMOVE == "add_remove"``), so it serves as a dict key, in
messages and in JSON, and the type's lookup accepts every documented spelling
case-insensitively (``Relation("add-remove") is Relation.ADD_REMOVE``).
Unknown names raise the message of :func:`d3p._validate.choice`.
"""

import enum

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
