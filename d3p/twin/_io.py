"""Atomic output: write into a temporary file or directory, rename at the end."""

import contextlib
import os
import shutil
import tempfile

__all__ = ["move_into_place", "atomic_directory", "temporary_file_for", "temporary_directory_for"]


def move_into_place(tmp: str, final: str) -> None:
    """Rename ``tmp`` (a file or directory) to ``final``, replacing an existing ``final``."""
    if os.path.isdir(final) and not os.path.islink(final):
        parent = os.path.dirname(os.path.abspath(final))
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-", dir=parent)
        os.rmdir(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def temporary_directory_for(final: str) -> str:
    """Create and return an empty temporary directory next to ``final``."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"The directory {parent!r} (for {final!r}) does not exist.")
    return tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)


@contextlib.contextmanager
def atomic_directory(final: str, *, overwrite: bool = False):
    """Yield a temporary directory next to ``final``; on success rename it to
    ``final``, on failure remove it."""
    final = os.fspath(final)
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final!r} exists; pass overwrite=True (CLI: --overwrite) to replace it.")
    tmp = temporary_directory_for(final)
    try:
        yield tmp
        move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_file_for(final: str) -> str:
    """Create and return an empty temporary file next to ``final`` (caller renames or removes it)."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"The directory {parent!r} (for {final!r}) does not exist.")
    fd, path = tempfile.mkstemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    os.close(fd)
    return path
