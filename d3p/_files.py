# SPDX-License-Identifier: Apache-2.0
"""Files that hold secrets (a checkpoint's noise key), written safely.

:func:`write_private` writes through a temporary file that is created
exclusively (``O_EXCL``), with an unpredictable name, in the target's own
folder, readable and writable by the owner only (mode 0600), and renamed over
the target at the end: a reader sees the old file or the whole new one, never
a part; a link planted at any predictable name is never followed (the
temporary name is not predictable, and the rename replaces a link at the
target instead of writing through it); on failure the temporary file is
removed and the target is untouched.
"""

import os
import tempfile
from typing import BinaryIO, Callable, Union


def write_private(path: Union[str, os.PathLike], write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a new private temporary file next to ``path`` and
    rename it to ``path`` (see the module docstring)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Expected the folder of path={path!r} to exist, got no folder {folder!r}.")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o600)   # mkstemp's default, made explicit
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
