"""A capped directory (an ext4 image, loop-mounted: providers/_diskcap.py)
keeps what was written to it when the host's disk fills, and says "disk
full" (ENOSPC) instead of losing a write.

The root cause of a failure seen once in CI
(test_truth.py::test_a_full_store_refuses_transitions_and_nothing_is_half_done:
``work.txt`` read back as 30 NUL bytes after the data directory had been
full). Every docker sandbox the daemon makes is capped (a 4 GiB default).
A sparse image takes host space only when the loop device writes a block
back: a file written just before the host's disk filled was acknowledged,
its write-back failed ("potential data loss!" in the kernel's log), the
page was left clean, and once evicted the file read as the hole it was on
disk. Here the write-back and the eviction are forced (``syncfs``, then
``drop_caches``) so that they happen on every run. The host is a small
tmpfs: it fills in a moment.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from hutch.providers import _diskcap
from tests.diskfill import fill

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")

_libc = ctypes.CDLL(None, use_errno=True)
CAP = 4 * 1024**3  # the daemon's default cap
PATTERN = bytes(range(1, 256)) * 4111  # no NUL in it: a lost page reads as NULs


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """All of ``data`` at ``offset``, or OSError (what a short write leaves
    out is refused by the next write)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _syncfs(directory: str) -> int:
    """Write back what is dirty in ``directory``'s file system: its errno, 0 if none."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return 0 if _libc.syncfs(fd) == 0 else ctypes.get_errno()
    finally:
        os.close(fd)


def _write_back_and_evict(directory: str) -> None:
    """What a flusher thread and memory pressure do, in order, now."""
    _syncfs(directory)  # its result is the write-back's: the assertions read the files
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3")


@contextlib.contextmanager
def _small_host(size: str) -> Iterator[str]:
    host = tempfile.mkdtemp(prefix="hutch-capped-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", host],
                   check=True)
    store = os.path.join(host, "store")
    try:
        yield store
    finally:
        with contextlib.suppress(OSError):
            _diskcap.unmount_capped(store)
        subprocess.run(["umount", "-l", host], check=False)
        os.rmdir(host)


def test_a_capped_directory_keeps_its_files_when_the_host_disk_fills() -> None:
    with _small_host("400m") as store:
        _diskcap.mount_capped(store, CAP)
        path = os.path.join(store, "work.txt")
        with open(path, "w") as fh:
            fh.write("written before the disk filled")
        filler = fill(os.path.dirname(store), b"\1")
        _write_back_and_evict(store)
        os.remove(filler)
        with open(path, "rb") as fh:
            assert fh.read() == b"written before the disk filled"
        # Its file system did not go read-only: it takes writes again.
        with open(os.path.join(store, "after.txt"), "w") as fh:
            fh.write("after")
        assert _syncfs(store) == 0


def test_a_full_host_disk_is_disk_full_in_a_capped_directory_and_loses_nothing() -> None:
    """Writing on while the host is full ends in ENOSPC (on a write or on the
    fsync), and every byte acknowledged (written and fsynced) reads back."""
    with _small_host("400m") as store:
        _diskcap.mount_capped(store, CAP)
        filler = fill(os.path.dirname(store), b"\1")
        path = os.path.join(store, "big")
        kept = 0  # bytes written and fsynced
        refused = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            # At most twice the host's size: the cap is far above it.
            for _ in range(2 * 400 * (1 << 20) // len(PATTERN)):
                try:
                    _write_all(fd, PATTERN, kept)
                    os.fsync(fd)
                except OSError as exc:
                    refused = exc.errno
                    break
                kept += len(PATTERN)
        finally:
            os.close(fd)
        assert refused == errno.ENOSPC
        _write_back_and_evict(store)
        os.remove(filler)
        with open(path, "rb") as fh:
            for offset in range(0, kept, len(PATTERN)):
                assert fh.read(len(PATTERN)) == PATTERN, f"lost at {offset} of {kept}"


def test_a_capped_directory_takes_host_disk_as_it_fills_up_to_its_cap() -> None:
    """It is not reserved in full up front; it grows as it is written, to
    its cap and not past it."""
    cap = 512 << 20
    with _small_host("1g") as store:
        _diskcap.mount_capped(store, cap)
        image = _diskcap.image_for(store)
        assert os.stat(image).st_blocks * 512 < cap // 2
        path = os.path.join(store, "big")
        written = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    _write_all(fd, PATTERN, written)
                    os.fsync(fd)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    # Full for now: it takes more once it has grown, up to its cap.
                    if not _diskcap.wait_for_room(store, timeout=10):
                        break
                    continue
                written += len(PATTERN)
        finally:
            os.close(fd)
        assert cap * 0.85 < written < cap
        assert os.stat(image).st_blocks * 512 <= cap
        _write_back_and_evict(store)
        with open(path, "rb") as fh:
            for offset in range(0, written, len(PATTERN)):
                assert fh.read(len(PATTERN)) == PATTERN, f"lost at {offset} of {written}"


def test_a_store_another_program_mounted_grows_here_too() -> None:
    """A daemon started again makes room in the stores the one before it
    mounted (its running sandboxes' working directories)."""
    cap = 512 << 20
    with _small_host("1g") as store:
        subprocess.run(
            [sys.executable, "-c", "import sys; from hutch.providers import _diskcap; "
             "_diskcap.mount_capped(sys.argv[1], int(sys.argv[2]))", store, str(cap)],
            check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        _diskcap.keep_growing()
        path = os.path.join(store, "big")
        written = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while written < cap // 2:
                try:
                    _write_all(fd, PATTERN, written)
                    os.fsync(fd)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    assert _diskcap.wait_for_room(store, timeout=10), written
                    continue
                written += len(PATTERN)
        finally:
            os.close(fd)


def _fill_store(fd: int, start: int, size: int, store: str) -> int:
    """Write PATTERN from ``start`` until ``size`` bytes are (fsynced), or
    the store is full for good; how far it got."""
    at = start
    while at < start + size:
        try:
            _write_all(fd, PATTERN, at)
            os.fsync(fd)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            if not _diskcap.wait_for_room(store, timeout=10):
                break
            continue
        at += len(PATTERN)
    return at


def test_space_freed_in_a_capped_directory_goes_back_to_the_host_and_nothing_is_lost() -> None:
    """Files deleted in a store give their host blocks back (the balloon
    takes their room again, the image's blocks under it punched); a full
    host afterwards is still disk full in the store, and what was
    acknowledged reads back."""
    cap = 1 << 30
    with _small_host("1g") as store:
        _diskcap.mount_capped(store, cap)
        image = _diskcap.image_for(store)
        before = os.stat(image).st_blocks * 512
        kept = os.path.join(store, "kept")
        with open(kept, "wb") as fh:
            fh.write(PATTERN)
        fd = os.open(os.path.join(store, "big"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert _fill_store(fd, 0, 640 << 20, store) >= 640 << 20
        finally:
            os.close(fd)
        assert os.stat(image).st_blocks * 512 >= before + (512 << 20)
        os.remove(os.path.join(store, "big"))
        deadline = time.monotonic() + 60
        while os.stat(image).st_blocks * 512 > before + (64 << 20) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.stat(image).st_blocks * 512 <= before + (64 << 20)
        # The host fills: the store is as full as the host, and loses nothing.
        filler = fill(os.path.dirname(store), b"\1")
        path = os.path.join(store, "after")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            written = _fill_store(fd, 0, 2 * cap, store)
        finally:
            os.close(fd)
        assert written < 400 << 20
        _write_back_and_evict(store)
        os.remove(filler)
        for name, size in (("kept", len(PATTERN)), ("after", written)):
            with open(os.path.join(store, name), "rb") as fh:
                for offset in range(0, size, len(PATTERN)):
                    assert fh.read(len(PATTERN)) == PATTERN, f"{name}: lost at {offset}"
