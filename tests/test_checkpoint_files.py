"""Checkpoint files hold the next step's noise key: they are written safely.

A link planted where a predictable temporary name would be, or at the target
itself, receives nothing; the file is readable by its owner only; a failed
write leaves the old file and no temporary file behind.
"""

import os
import stat

import jax.numpy as jnp
import numpy as np
import pytest

from d3p import _files
from d3p.svi import DPSVIState, load_checkpoint, save_checkpoint


def _state():
    return DPSVIState(((0, {"w": jnp.arange(3.0)}),), None, jnp.arange(2, dtype=jnp.uint32), None)


def test_planted_links_receive_nothing(tmp_path):
    target = tmp_path / "run.npz"
    secret_sink = tmp_path / "elsewhere"
    secret_sink.write_bytes(b"")
    for name in ("run.npz.tmp", ".run.npz.tmp"):   # the names an earlier version or a guess would use
        os.symlink(secret_sink, tmp_path / name)
    os.symlink(secret_sink, target)   # and the target itself
    save_checkpoint(target, _state(), step=3)
    assert secret_sink.read_bytes() == b""          # nothing written through any link
    assert not target.is_symlink() and target.is_file()
    assert load_checkpoint(target).step == 3


def test_the_file_is_private(tmp_path):
    target = tmp_path / "run.npz"
    old = os.umask(0)   # even with a permissive umask
    try:
        save_checkpoint(target, _state(), step=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"old")

    def broken(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _files.write_private(target, broken)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder of path"):
        save_checkpoint(tmp_path / "no" / "run.npz", _state(), step=1)


def test_round_trip(tmp_path):
    target = tmp_path / "run.npz"
    save_checkpoint(target, _state(), step=5)
    again = load_checkpoint(target)
    assert again.step == 5
    np.testing.assert_array_equal(np.asarray(again.leaves[1]), np.arange(3.0))
