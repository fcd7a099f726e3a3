# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of :meth:`d3p.svi.DPSVI.run`: the state's arrays, the step
reached and the privacy ledger, in one ``.npz`` file (no pickle: arrays and
one JSON text only)."""

import json
import os
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

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


def save_checkpoint(path: Union[str, os.PathLike], state, step: int,
                    ledger: Optional[PrivacyLedger] = None) -> None:
    leaves, treedef = jax.tree.flatten(state)
    arrays = {f"leaf_{i}": np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)}
    meta = {"format": FORMAT, "version": VERSION, "structure": str(treedef), "step": int(step),
            "num_leaves": len(leaves), "ledger": None if ledger is None else ledger.to_dict()}
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def load_checkpoint(path: Union[str, os.PathLike], like=None) -> Checkpoint:
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
