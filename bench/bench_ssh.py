"""Bench: the ssh provider against a real sshd on loopback, beside its floors.

Both sides of each exec row pay the host's login shell (sshd runs the
command through it; root's ~/.bashrc here costs hundreds of milliseconds), so
read the ratio and the +abs column: they are what hutch adds.

Floors for exec: asyncssh's own ``conn.run("true")`` on a kept connection (the
same transport with nothing of hutch's around it) and a fresh ``ssh host true``
(what a tool that connects per command pays). Floors for 1 MB write + read:
asyncssh's SFTP on the kept connection, and ``scp`` up then down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncssh
from tests.ssh_server import ALIAS, SshServer

import hutch
from _common import header, median_ms, paired, row, run, scratch_dir, turn

RUNS = 200
MB = os.urandom(1024 * 1024)


async def paired_async(
    ours: Callable[[], Awaitable[object]],
    floor: Callable[[], Awaitable[object]],
    runs: int,
    warmup: int = 5,
) -> tuple[float, float]:
    """``paired`` for an async floor: alternate, so drift moves both alike."""
    for _ in range(warmup):
        await ours()
        await floor()
    ours_samples, floor_samples = [], []
    for _ in range(runs):
        turn()
        t = time.perf_counter()
        await floor()
        floor_samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        await ours()
        ours_samples.append(time.perf_counter() - t)
    return median_ms(ours_samples), median_ms(floor_samples)


async def main() -> None:
    server = SshServer().start()
    workdir = scratch_dir("hutch-bench-ssh-")
    ssh = ["ssh", "-F", server.config_file, "-o", "BatchMode=yes"]
    try:
        async with await hutch.create_sandbox(
            "ssh", destination=ALIAS, working_directory=workdir,
            config_file=server.config_file, read_before_write=False,
        ) as sb, asyncssh.connect(ALIAS, config=[server.config_file]) as conn:
            header("ssh provider: exec (floors: asyncssh conn.run, fresh ssh)")
            ours, floor = await paired_async(
                lambda: sb.exec(["true"]), lambda: conn.run("true", check=True), RUNS
            )
            row("exec true, kept connection vs conn.run", ours, floor)

            def fresh_ssh() -> None:
                subprocess.run([*ssh, ALIAS, "true"], check=True)

            ours, floor = await paired(lambda: sb.exec(["true"]), fresh_ssh, 50)
            row("exec true, kept connection vs fresh ssh", ours, floor)

            header("ssh provider: 1 MB write + read (floors: asyncssh SFTP, scp)")

            async def hutch_round_trip() -> None:
                await sb.write_bytes("one.bin", MB)
                assert len(await sb.read_bytes("one.bin")) == len(MB)

            sftp = await conn.start_sftp_client()
            floor_path = os.path.join(workdir, "floor.bin")

            async def sftp_round_trip() -> None:
                async with sftp.open(floor_path, "wb") as fh:
                    await fh.write(MB)
                async with sftp.open(floor_path, "rb") as fh:
                    assert len(await fh.read()) == len(MB)

            ours, floor = await paired_async(hutch_round_trip, sftp_round_trip, 50)
            row("1 MB write+read vs asyncssh SFTP", ours, floor)

            local = os.path.join(workdir, "local.bin")
            back = os.path.join(workdir, "back.bin")
            with open(local, "wb") as fh:
                fh.write(MB)
            scp = ["scp", "-q", "-F", server.config_file, "-o", "BatchMode=yes"]

            def scp_round_trip() -> None:
                subprocess.run([*scp, local, f"{ALIAS}:{workdir}/scp.bin"], check=True)
                subprocess.run([*scp, f"{ALIAS}:{workdir}/scp.bin", back], check=True)

            ours, floor = await paired(hutch_round_trip, scp_round_trip, 20)
            row("1 MB write+read vs scp up + down", ours, floor)
    finally:
        server.cleanup()
        subprocess.run(["rm", "-rf", workdir], check=False)


if __name__ == "__main__":
    run(main)
