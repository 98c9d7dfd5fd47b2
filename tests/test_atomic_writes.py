"""A file written whole or not at all (a temporary file beside it, renamed
over it): a write that fails midway, here on a full file system (a small
tmpfs of the test's own), leaves the file as it was and no temporary file."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hutch._atomic import write_json


@pytest.fixture
def full_disk() -> Iterator[str]:
    """A directory on a 64 KiB tmpfs, nearly full."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root")
    where = tempfile.mkdtemp(prefix="hutch-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where], check=True)
    try:
        with open(os.path.join(where, "record.json"), "w") as fh:
            fh.write('{"kept": true}')
        with open(os.path.join(where, "filler"), "wb", buffering=0) as fh, \
                contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)
        yield where
    finally:
        subprocess.run(["umount", where], check=True)
        os.rmdir(where)


WRITERS: dict[str, Callable[[str, Any], None]] = {
    "durable": write_json,
    "not durable": lambda path, value: write_json(path, value, durable=False),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_write_on_a_full_disk_leaves_the_file_as_it_was_and_no_temporary(
    full_disk: str, writer: str
) -> None:
    path = os.path.join(full_disk, "record.json")
    with pytest.raises(OSError) as caught:
        WRITERS[writer](path, {"big": "x" * (256 << 10)})
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(full_disk)) == ["filler", "record.json"]
    with open(path) as fh:
        assert fh.read() == '{"kept": true}'


def test_a_value_that_is_not_json_leaves_the_file_as_it_was_and_no_temporary(
    tmp_path: Any,
) -> None:
    path = os.path.join(tmp_path, "record.json")
    write_json(path, {"kept": True})
    with pytest.raises(TypeError):
        write_json(path, {"half": "written", "then": object()})
    assert os.listdir(tmp_path) == ["record.json"]
    with open(path) as fh:
        assert fh.read() == '{"kept": true}'
