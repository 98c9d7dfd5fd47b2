"""Filling a file system to its last byte, for the tests of what a full disk does."""

from __future__ import annotations

import contextlib
import os


def fill(directory: str, byte: bytes = b"\0") -> str:
    """Fill the file system ``directory`` is on with ``byte``; return the filler's path."""
    path = os.path.join(directory, "filler")
    chunk = byte * (1 << 20)
    with open(path, "wb", buffering=0) as fh:
        for size in (len(chunk), 4096, 1):  # what a big write cannot take, small ones do
            with contextlib.suppress(OSError):
                while fh.write(chunk[:size]):
                    pass
    return path
