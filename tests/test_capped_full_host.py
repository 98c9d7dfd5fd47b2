"""A capped directory (an ext4 image, loop-mounted: providers/_diskcap.py)
keeps what was written to it when the host's disk fills.

The root cause of a failure seen once in CI
(test_truth.py::test_a_full_store_refuses_transitions_and_nothing_is_half_done:
``work.txt`` read back as 30 NUL bytes after the data directory had been
full). Every docker sandbox the daemon makes is capped (a 4 GiB default),
so its working directory's upper layer is in such an image, in the data
directory. The image is sparse: a block the ext4 inside takes is given
host space only when the loop device writes it back. A file written just
before the host's disk fills is acknowledged and sits dirty in the page
cache; its write-back then fails (the kernel logs "critical space
allocation error, dev loopN ... potential data loss!"), the page is left
clean, and once memory pressure (a busy CI machine) evicts it, the file
reads as the hole it is on disk: zeros of the right length. The ext4
journal aborts with it, and the store stays read-only (``emergency_ro``).
Here the eviction is forced (write-back with ``syncfs``, then
``POSIX_FADV_DONTNEED``) so that it happens on every run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import tempfile

import pytest

from hutch.providers import _diskcap

_libc = ctypes.CDLL(None, use_errno=True)


def _fill(directory: str) -> str:
    path = os.path.join(directory, "filler")
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as fh:
        for size in (len(chunk), 4096, 1):  # what a big write cannot take, small ones do
            with contextlib.suppress(OSError):
                while fh.write(chunk[:size]):
                    pass
    return path


def _write_back_and_evict(root: str, path: str) -> None:
    """What a flusher thread and memory pressure do, in order, now."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)  # its result is the write-back's, not this test's
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# Not strict: a write-back that happens to run between the write and the
# fill (a loaded machine's flusher) saves the file, and the test passes.
@pytest.mark.xfail(strict=False, raises=AssertionError,
                   reason="capped stores are sparse images: a full host disk loses what "
                   "they had not yet written back (see the module's docstring)")
def test_a_capped_directory_keeps_its_files_when_the_host_disk_fills() -> None:
    host = tempfile.mkdtemp(prefix="hutch-capped-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", host],
                   check=True)
    store = os.path.join(host, "store")
    try:
        _diskcap.mount_capped(store, 4 * 1024**3)  # the daemon's default cap
        path = os.path.join(store, "work.txt")
        with open(path, "w") as fh:
            fh.write("written before the disk filled")
        filler = _fill(host)
        _write_back_and_evict(store, path)
        os.remove(filler)
        with open(path, "rb") as fh:
            assert fh.read() == b"written before the disk filled"
    finally:
        with contextlib.suppress(OSError):
            _diskcap.unmount_capped(store)
        subprocess.run(["umount", "-l", host], check=False)
        os.rmdir(host)
