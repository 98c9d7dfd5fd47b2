"""Conformance from the host's side: what the suite cannot do through the
sandbox alone (make a file immutable beneath it)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conformance.conftest import Harness

pytestmark = pytest.mark.anyio


async def test_permission_denied_on_write(host_harness: Harness) -> None:
    # Root ignores mode bits, but not the immutable attribute.
    harness = host_harness
    assert harness.host_workdir is not None
    sandbox = harness.sandbox
    await sandbox.write_text("locked.txt", "original")
    host_file = os.path.join(harness.host_workdir, "locked.txt")
    subprocess.run(["chattr", "+i", host_file], check=True)
    try:
        with pytest.raises(PermissionError) as info:
            await sandbox.write_text("locked.txt", "changed")
        assert info.value.code == "permission_denied"
    finally:
        subprocess.run(["chattr", "-i", host_file], check=True)
    assert await sandbox.read_text("locked.txt") == "original"
