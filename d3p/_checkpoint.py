# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of :meth:`d3p.svi.DPSVI.run`: the state's arrays, the step
reached and the privacy ledger, in one ``.npz`` file (no pickle: arrays and
one JSON text only). :func:`save_checkpoint`, :func:`load_checkpoint` and
:class:`Checkpoint` are public as :mod:`d3p.svi`'s."""

import json
import os
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from d3p import _files, _validate
from d3p._state import DPSVIRunResult, DPSVIState
from d3p.ledger import PrivacyLedger

#: The ``format`` field of a checkpoint's metadata.
FORMAT = "d3p.checkpoint"
#: The version of the checkpoint format that :func:`load_checkpoint` reads.
VERSION = 1


class Checkpoint(NamedTuple):
    """A run's state saved by :func:`save_checkpoint` and read back by :func:`load_checkpoint`.

    Pass it as ``init_state`` to :meth:`d3p.svi.DPSVI.run` to continue: the
    run rebuilds the state's structure from the data's shapes, fills in the
    saved arrays, continues the batch keys at ``step`` and records its steps
    in ``ledger`` (unless another ledger is passed).
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
    """The privacy ledger saved with it (None: none was)."""

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
    arrays = {f"leaf_{i}": np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)}
    meta = {"format": FORMAT, "version": VERSION, "structure": str(treedef), "step": int(step),
            "num_leaves": len(leaves), "ledger": None if ledger is None else ledger.to_dict()}
    # secret (the noise key): a private, exclusively created temporary file, renamed (d3p._files)
    _files.write_private(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **arrays))


def _read(path: Union[str, os.PathLike], like=None) -> Checkpoint:
    """Read the checkpoint file of :func:`load_checkpoint`."""
    with np.load(path, allow_pickle=False) as data:
        try:
            meta = json.loads(str(data["meta"]))
        except KeyError:
            raise ValueError(f"Expected a d3p checkpoint at path={os.fspath(path)!r}: it has no metadata.") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(
                f"Expected a d3p checkpoint of version {VERSION} at path={os.fspath(path)!r}, got "
                f"format={meta.get('format')!r}, version={meta.get('version')!r}.")
        leaves = [data[f"leaf_{i}"] for i in range(meta["num_leaves"])]
    ledger = None if meta["ledger"] is None else PrivacyLedger.from_dict(meta["ledger"])
    checkpoint = Checkpoint(None, leaves, meta["structure"], int(meta["step"]), ledger)
    if like is not None:
        checkpoint = checkpoint._replace(state=checkpoint.into(like))
    return checkpoint


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

    The file holds the optimizer state (the parameters), the PRNG key of the
    next step's noise and the step index: secret, as the noise must be; keep
    it where the data is kept. Continue with
    ``svi.run(rng_key, more_steps, *data, init_state=load_checkpoint(path), ...)``
    and the same ``rng_key`` (see :meth:`DPSVI.run`).
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
    :return: :class:`Checkpoint` ``(state, leaves, structure, step, ledger)``.
    """
    return _read(path, like)
