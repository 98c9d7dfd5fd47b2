"""Bench: the local and virtual providers beside the raw floor.

Floor for local: the same work done directly (subprocess.run, open/read/write).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, paired, row, time_async, time_sync

RUNS = 200
MB = os.urandom(1024 * 1024)


async def main() -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-bench-", dir="/dev/shm")
    header("local provider (floor: subprocess / direct file I/O)")
    def floor_exec() -> None:
        subprocess.run(["true"], check=True)

    async with await hutch.create_sandbox("local", workdir=workdir, read_before_write=False) as sb:
        ours, floor = await paired(lambda: sb.exec(["true"]), floor_exec, RUNS)
        row("exec round trip (true)", ours, floor, "goal: +2 ms at most")

        async def create_first_exec() -> None:
            async with await hutch.create_sandbox(
                "local", workdir=workdir, read_before_write=False
            ) as fresh:
                await fresh.exec(["true"])

        ours, floor = await paired(create_first_exec, floor_exec, 50)
        row("create to first exec", ours, floor)

        path = os.path.join(workdir, "floor.bin")

        def floor_write() -> None:
            with open(path, "wb") as fh:
                fh.write(MB)

        def floor_read() -> None:
            with open(path, "rb") as fh:
                fh.read()

        row("write 1 MB", await time_async(lambda: sb.write_bytes("one.bin", MB), RUNS),
            time_sync(floor_write, RUNS))
        row("read 1 MB", await time_async(lambda: sb.read_bytes("one.bin"), RUNS),
            time_sync(floor_read, RUNS))

    header("virtual provider (floor: a bytes copy into a dict)")
    store: dict[str, bytes] = {}
    async with await hutch.create_sandbox("virtual", read_before_write=False) as vb:
        row("write 1 MB", await time_async(lambda: vb.write_bytes("one.bin", MB), RUNS),
            time_sync(lambda: store.__setitem__("one.bin", bytes(MB)), RUNS))
        row("read 1 MB", await time_async(lambda: vb.read_bytes("one.bin"), RUNS),
            time_sync(lambda: store["one.bin"], RUNS))


if __name__ == "__main__":
    asyncio.run(main())
