# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of :meth:`d3p.svi.DPSVI.run`: the state's arrays, the step
reached and the privacy ledger, in one ``.npz`` file (no pickle: arrays and
one JSON text only). :func:`save_checkpoint`, :func:`load_checkpoint` and
:class:`Checkpoint` are public as :mod:`d3p.svi`'s."""

import json
import os
import secrets
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from d3p import _files, _validate
from d3p._state import DPSVIRunResult, DPSVIState
from d3p.ledger import PrivacyLedger, release_from_dict, release_to_dict

#: The ``format`` field of a checkpoint's metadata.
FORMAT = "d3p.checkpoint"
#: The versions of the checkpoint format that :func:`load_checkpoint` reads
#: (2 adds the checkpoint's ``id`` and the ``continued`` runs).
VERSIONS = (1, 2)
#: The version :func:`save_checkpoint` writes.
VERSION = 2


class Checkpoint(NamedTuple):
    """A run's state saved by :func:`save_checkpoint` and read back by :func:`load_checkpoint`.

    Pass it as ``init_state`` to :meth:`d3p.svi.DPSVI.run` to continue: the
    run rebuilds the state's structure from the data's shapes, fills in the
    saved arrays, continues the batch keys at ``step`` and records its steps
    in ``ledger`` (unless another ledger is passed).

    A checkpoint is continued once per ``rng_key`` and step: before it reads
    any data, :meth:`~d3p.svi.DPSVI.run` records the continuation in the
    checkpoint (and in its file, if it was read from one that still holds it)
    and refuses one that would repeat the key's steps of an earlier
    continuation, whose batches and noise would be the same (see
    :func:`continue_from`).
    """

    state: Any
    """The :class:`d3p.svi.DPSVIState` (if :func:`load_checkpoint` was given
    ``like``), else None: :meth:`d3p.svi.DPSVI.run` builds it."""
    leaves: Sequence[np.ndarray]
    """The state's arrays, in the order of ``jax.tree.leaves``."""
    structure: str
    """The state's tree structure, as text (checked against the state it is filled into)."""
    step: int
    """The steps taken: the index of the next batch in the run's stream of batch keys."""
    ledger: Optional[PrivacyLedger]
    """The privacy ledger saved with it (None: none was), with the runs
    continued from it already recorded."""
    path: Optional[str] = None
    """The file it was read from (None: not read from a file)."""
    id: Optional[str] = None
    """A random name given when it was saved (None: a version 1 file), so that
    a continuation is recorded in the file only while the file holds this checkpoint."""
    continued: Optional[list] = None
    """The runs continued from it (ledger records, as
    :meth:`d3p.ledger.PrivacyLedger.to_dict` writes them), shared by its
    copies; None: none yet."""

    def into(self, like) -> Any:
        """The saved arrays in the structure of ``like`` (a state of the same
        model, guide and optimizer), checked to match in structure, shapes and dtypes."""
        leaves, treedef = jax.tree.flatten(like)
        if str(treedef) != self.structure:
            raise ValueError(
                "Expected a state of the structure saved in the checkpoint (same model, guide and "
                f"optimizer), got the structure {treedef} where the checkpoint has {self.structure}.")
        for i, (saved, now) in enumerate(zip(self.leaves, leaves)):
            if saved.shape != np.shape(now) or saved.dtype != np.asarray(now).dtype:
                raise ValueError(
                    f"Expected the checkpoint's array {i} to have shape {np.shape(now)} and dtype "
                    f"{np.asarray(now).dtype}, got shape {saved.shape} and dtype {saved.dtype}.")
        return jax.tree.unflatten(treedef, [_like(x, now) for x, now in zip(self.leaves, leaves)])


def _like(saved: np.ndarray, now):
    """``saved`` as a JAX array typed as ``now``, weak type included (a
    weakly typed scalar such as an optimizer's step counter comes back weakly
    typed, so that the compiled steps are reused)."""
    out = jax.numpy.asarray(saved)
    if saved.shape == () and getattr(now, "weak_type", False):
        weak = jax.numpy.asarray(saved.item())   # a Python scalar gives a weakly typed array
        if weak.dtype == out.dtype:
            return weak
    return out


def _write(path: Union[str, os.PathLike], state, step: int, ledger: Optional[PrivacyLedger] = None) -> None:
    """Write the checkpoint file of :func:`save_checkpoint` (checked arguments)."""
    leaves, treedef = jax.tree.flatten(state)
    arrays = [np.asarray(jax.device_get(x)) for x in leaves]
    meta = {"format": FORMAT, "version": VERSION, "structure": str(treedef), "step": int(step),
            "num_leaves": len(leaves), "ledger": None if ledger is None else ledger.to_dict(),
            "id": secrets.token_hex(16), "continued": []}
    _write_file(path, meta, arrays)


def _write_file(path, meta: dict, arrays: Sequence[np.ndarray]) -> None:
    """The file of ``meta`` and ``arrays``: private (the parameters, the state),
    through an exclusively created temporary file, renamed (d3p._files)."""
    leaves = {f"leaf_{i}": x for i, x in enumerate(arrays)}
    _files.write_private(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **leaves))


def _read_file(path) -> tuple:
    """``(meta, leaves)`` of the checkpoint file at ``path``, checked."""
    with np.load(path, allow_pickle=False) as data:
        try:
            meta = json.loads(str(data["meta"]))
        except KeyError:
            raise ValueError(f"Expected a d3p checkpoint at path={os.fspath(path)!r}: it has no metadata.") from None
        if meta.get("format") != FORMAT or meta.get("version") not in VERSIONS:
            raise ValueError(
                f"Expected a d3p checkpoint of version {' or '.join(map(str, VERSIONS))} at "
                f"path={os.fspath(path)!r}, got format={meta.get('format')!r}, version={meta.get('version')!r}.")
        leaves = [data[f"leaf_{i}"] for i in range(meta["num_leaves"])]
    return meta, leaves


def _read(path: Union[str, os.PathLike], like=None) -> Checkpoint:
    """Read the checkpoint file of :func:`load_checkpoint`."""
    meta, leaves = _read_file(path)
    ledger = None if meta["ledger"] is None else PrivacyLedger.from_dict(meta["ledger"])
    continued = list(meta.get("continued", []))
    if ledger is not None:   # what was released from this checkpoint since it was saved
        for release in _releases(continued):
            ledger._add_recorded(release)
    checkpoint = Checkpoint(None, leaves, meta["structure"], int(meta["step"]), ledger,
                            os.path.abspath(os.fspath(path)), meta.get("id"), continued)
    if like is not None:
        checkpoint = checkpoint._replace(state=checkpoint.into(like))
    return checkpoint


def _releases(continued: Sequence[dict]) -> list:
    """The ledger records of the runs ``continued`` from a checkpoint."""
    return [release_from_dict(item, f"continued[{i}]") for i, item in enumerate(continued)]


def continue_from(checkpoint: Checkpoint, release) -> Checkpoint:
    """Record in ``checkpoint`` that a run continues from it with ``release``
    (a :class:`d3p.ledger.GaussianSteps` with its batch key's fingerprint),
    before the run reads any data; refuse one that repeats steps of an
    earlier continuation with the same key.

    A run's batches and noise come from its ``rng_key`` and the step index
    alone, so two runs from one checkpoint with the same key and steps would
    add the same noise: on neighbouring data sets (one refreshed between the
    two runs) their difference would be free of noise. The record is kept in
    the checkpoint object (shared by its copies) and, if the checkpoint was
    read from a file that still holds it, in that file, so that loading it
    again sees it. Returns the checkpoint with the record."""
    continued = checkpoint.continued if checkpoint.continued is not None else []
    meta = leaves = None
    if checkpoint.path is not None and checkpoint.id is not None and os.path.exists(checkpoint.path):
        meta, leaves = _read_file(checkpoint.path)
        if meta.get("id") != checkpoint.id:
            meta = None   # the file now holds another checkpoint: this one lives on in memory only
        else:
            for record in meta.get("continued", []):
                if record not in continued:
                    continued.append(record)
    for earlier in _releases(continued):
        if earlier.key is not None and earlier.key == release.key \
                and release.first_step < earlier.first_step + earlier.num_steps \
                and earlier.first_step < release.first_step + release.num_steps:
            raise ValueError(
                f"Expected a new rng_key or later steps to continue this checkpoint: it was already continued "
                f"with this rng_key at steps {earlier.first_step} to {earlier.first_step + earlier.num_steps - 1}, "
                f"and steps {release.first_step} to {release.first_step + release.num_steps - 1} would draw "
                "the same batches and the same noise again (on data that changed in between, their difference "
                "would be free of noise). A new rng_key draws independent batches and noise; nothing was run.")
    record = release_to_dict(release)
    continued.append(record)
    if meta is not None:
        meta["continued"] = continued
        _write_file(checkpoint.path, meta, leaves)
    return checkpoint._replace(continued=continued)


def save_checkpoint(path, result_or_state, step: Optional[int] = None,
                    ledger: Optional[PrivacyLedger] = None) -> None:
    """Save a run's state, the step it reached and its privacy ledger to ``path``
    (one ``.npz`` file of arrays and JSON text; nothing is pickled).

    :param path: the file to write: replaced atomically through a private
        temporary file in its folder, mode 0600, never through a link
        (:mod:`d3p._files`).
    :param result_or_state: a :class:`DPSVIRunResult` (its state, and its
        ``start_step + num_steps`` as ``step``) or a :class:`DPSVIState`.
    :param int step: the steps taken (the next batch's index); required with
        a state, checked against a result's.
    :param PrivacyLedger ledger: the ledger to save with it (optional).

    The file holds the optimizer state (the parameters, released only as the
    run releases them), the step index, the ledger and a record of the runs
    continued from it; keep it where the data is kept. It holds no key that a
    run's noise comes from: :meth:`DPSVI.run` draws step ``i``'s noise from
    its ``rng_key`` and ``i``. Continue with
    ``svi.run(rng_key, more_steps, *data, init_state=load_checkpoint(path), ...)``
    and the same ``rng_key`` (see :meth:`DPSVI.run`); the run records itself
    in the file before it reads data, and a second continuation of the file
    with the same key and steps is refused (see :class:`Checkpoint`).
    """
    if isinstance(result_or_state, DPSVIRunResult):
        done = int((result_or_state.start_step or 0) + result_or_state.num_steps)
        if step is not None and int(step) != done:
            raise ValueError(f"Expected step={done} for this result (start_step + num_steps), got step={step!r}.")
        state, step = result_or_state.state, done
    elif isinstance(result_or_state, DPSVIState):
        if step is None:
            raise ValueError("Expected step (the number of steps taken) with a DPSVIState.")
        state = result_or_state
    else:
        raise TypeError(
            f"Expected result_or_state to be a DPSVIRunResult or DPSVIState, got {type(result_or_state).__name__}.")
    step = _validate.integer("step", step, minimum=0)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"Expected ledger to be a d3p.ledger.PrivacyLedger, got {type(ledger).__name__}.")
    _write(path, state, step, ledger)


def load_checkpoint(path, like: Optional[DPSVIState] = None) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    :param path: the file.
    :param DPSVIState like: optionally a state of the same model, guide and
        optimizer, into whose structure the saved arrays are put
        (``checkpoint.state``); without it, :meth:`DPSVI.run` does that when
        given the checkpoint as ``init_state``.
    :return: :class:`Checkpoint` ``(state, leaves, structure, step, ledger,
        path, id, continued)``; the runs already continued from the file are
        recorded in its ``ledger``.
    """
    return _read(path, like)
