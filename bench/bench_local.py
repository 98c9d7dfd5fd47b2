"""Bench: the local and virtual providers beside the raw floor.

Floor for local: the same work done directly (subprocess.run, open/read/write).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, paired, row, run, scratch_dir, time_async, time_sync

RUNS = 200
MB = os.urandom(1024 * 1024)


async def main() -> None:
    workdir = scratch_dir("hutch-bench-", "/dev/shm")
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

        # grep: hutch matches in a worker process it can kill (a backtracking
        # pattern never holds the daemon); the floor is the same rule in process.
        tree = os.path.join(workdir, "tree")
        lines = "".join(f"line {i} of some text\n" for i in range(200))
        for d in range(10):
            os.makedirs(os.path.join(tree, f"d{d}"))
            for f in range(20):
                with open(os.path.join(tree, f"d{d}", f"f{f}.txt"), "w") as fh:
                    fh.write(lines + ("needle\n" if f == 7 else ""))
        needle = re.compile("needle")

        def floor_grep_file(path: str) -> list[int]:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8", "replace")
            return [n for n, line in enumerate(text.splitlines(), 1) if needle.search(line)]

        def floor_grep(root: str) -> list[tuple[str, int]]:
            return [
                (name, n)
                for dirpath, _, files in os.walk(root)
                for name in files
                for n in floor_grep_file(os.path.join(dirpath, name))
            ]

        ours, floor = await paired(lambda: sb.grep("needle", "tree/d0/f7.txt"),
                                   lambda: floor_grep_file(os.path.join(tree, "d0", "f7.txt")),
                                   RUNS)
        row("grep one file", ours, floor)
        ours, floor = await paired(lambda: sb.grep("needle", "tree"),
                                   lambda: floor_grep(tree), 50)
        row("grep 200 files x 200 lines", ours, floor)

    header("virtual provider (floor: a bytes copy into a dict)")
    store: dict[str, bytes] = {}
    async with await hutch.create_sandbox("virtual", read_before_write=False) as vb:
        row("write 1 MB", await time_async(lambda: vb.write_bytes("one.bin", MB), RUNS),
            time_sync(lambda: store.__setitem__("one.bin", bytes(MB)), RUNS))
        row("read 1 MB", await time_async(lambda: vb.read_bytes("one.bin"), RUNS),
            time_sync(lambda: store["one.bin"], RUNS))


if __name__ == "__main__":
    run(main)
