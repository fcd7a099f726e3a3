"""Table schemas for synthetic data twins: column kinds, levels, bounds, encoding.

A :class:`Schema` says, for every column of a table, what the twin's model may
assume about it: its kind (categorical, boolean, real or count), the
categories of a categorical column, the bounds of a numeric column, whether
it may be missing, and which distribution models it. It is a plain,
JSON-serialisable description; :meth:`Schema.encode` turns a DataFrame into
the float matrix the models see and :meth:`Schema.decode` turns model output
back into a DataFrame with the schema's columns and dtypes (the dtypes are
part of the schema, never read from the data's values).

**Privacy.** Everything in a schema shapes the synthetic data and is released
with the twin (it is stored in the saved model). Levels, bounds and the fact
that a column has missing values are facts about the data: if they are read
from the private data they are *not* covered by the (ε, δ) guarantee of the
fit. A rare category, for instance, reveals that some record has it, and a
minimum or maximum is one record's value. :func:`infer_schema` therefore reads
them from the data only where the caller did not supply them, records which
ones it read (``ColumnSpec.inferred``) and warns with
:class:`SchemaInferenceWarning`. To avoid the leak, supply them from public
knowledge (code books, plausible ranges) or obtain them privately.

Encoding (one float per column and record, ``NaN`` for a missing value):

* ``categorical``: the index of the value in ``levels``;
* ``boolean``: 0 or 1;
* ``real``, and ``count`` modelled as ``normal``/``lognormal``: the value is
  clipped to ``[lower, upper]``, ``u = (x - lower) / (upper - lower)`` in
  [0, 1]; for ``normal`` the code is ``2 u - 1``, for ``lognormal`` it is
  ``log(u + c)`` (``c`` = :data:`LOG_OFFSET`) mapped affinely onto [-1, 1].
  ``upper == lower`` gives 0. Decoding inverts this (clipping to [-1, 1]
  first) and rounds counts to integers;
* ``count`` modelled as ``poisson``: ``round(x) - lower`` after clipping to
  the bounds.

A complete schema maps every record on its own, by public rules that read the
schema and that one record only (:meth:`ColumnSpec.encode`; docs/twin.md,
"Records that do not fit the schema"): a value outside the bounds goes to the
nearest bound, a value the column cannot hold to its declared ``other`` level
or to missing, a missing value in a non-nullable column to the column's
fallback. No record can make encoding fail, warn or print; only the schema
itself (malformed, or columns that do not match the table's) is an error.

The code lives in private modules, one concept each, imported in one
direction only: ``d3p.twin._schema_common`` (kinds, constants, errors,
checks) < ``d3p.twin._schema_encoding`` (values to codes and back) <
``d3p.twin._schema_types`` (:class:`ColumnSpec`, :class:`Schema`) <
``d3p.twin._schema_inference`` (:func:`infer_schema`); this module imports
and re-exports their public names.
"""

# every public name of the schema's modules, imported from here by d3p.twin's
# modules and tests
from d3p.twin._schema_common import (  # noqa: F401
    DEFAULT_MAX_LEVELS,
    DISTRIBUTIONS,
    HURDLE_MIN_SHARE,
    INTEGER_CODE_DISTRIBUTIONS,
    KINDS,
    LOG_OFFSET,
    MAX_DECIMALS,
    NUMERIC_MAX_LEVELS,
    POISSON_MAX_RANGE,
    SchemaInferenceWarning,
    TwinInputError,
    check_frame,
    check_type,
)
from d3p.twin._schema_inference import inference_message, infer_schema  # noqa: F401
from d3p.twin._schema_types import ColumnSpec, Schema

__all__ = [
    "KINDS",
    "DISTRIBUTIONS",
    "LOG_OFFSET",
    "DEFAULT_MAX_LEVELS",
    "ColumnSpec",
    "Schema",
    "infer_schema",
    "SchemaInferenceWarning",
    "TwinInputError",
]
