"""Bench: the gvisor provider beside bare ``runsc``.

Floors, measured alternately with hutch in the same run, on a bare runsc
container over the same root file system with the same global flags (its
own state directory), running the same agent binary (serving on a socket
inside, which a checkpoint keeps) beside the same process:

- suspend / resume of a sandbox holding a small process (a shell loop) and
  one holding 200 MB (a Python process with a 200 MB buffer) beside bare
  ``runsc checkpoint`` / ``runsc restore --detach`` of a container running
  the same process (goal <= 1.2x). Both suspends end once the stopped
  sandbox's process has ended, its memory freed (runsc answers a little
  before). hutch adds: the agent letting go of its socket and listening
  again, the build record, and its answer.
  A resume right after a suspend (as here) also waits for the stopped
  sandbox to be gone (runsc refuses a container name still in use; a 200 MB
  one takes a while to give its memory back): the floor restores under a
  new name each time and does not.
- fork + 3 branches to first exec (``exec true`` having run in each) beside
  ``runsc checkpoint``, a restore of the origin and of 3 branches, and
  ``runsc exec true`` in each.
- ``exec true`` through the agent beside ``runsc exec CONTAINER true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, median_ms, row, run, scratch_dir
from hutch.providers.agent import agent_binary
from hutch.providers.gvisor import bundle, runsc
from hutch.providers.images.exported import docker_image_rootfs

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
RUNS = int(os.environ.get("HUTCH_BENCH_RUNS", "5"))
EXEC_RUNS = 40
SMALL = "while :; do sleep 1; done"
BIG = ("import random, time\n"
       "buf = bytearray(random.Random(7).randbytes(200 << 20))\n"
       "open('/tmp/big.ready', 'w').write('ok')\n"
       "while True: time.sleep(1)\n")


class Bare:
    """A bare runsc container: the floor. Each restore takes a new name, so
    that no timed step waits for a delete."""

    def __init__(self, root: str, rootfs: str, argv: list[str]) -> None:
        self.root = root
        self.state = os.path.join(root, "state")
        self.bundle = os.path.join(root, "bundle")
        self.images = os.path.join(root, "images")
        self.serial = 0
        self.names: list[str] = []
        self.branches: list[str] = []
        spec = bundle.spec(rootfs=rootfs, agent=str(agent_binary()),
                           run_dir=scratch_dir("hutch-bench-gvisor-run-"), env={},
                           hostname="bare", sandbox_id=f"bare-{os.getpid()}", memory=None,
                           pids=None, cpus=None)
        # The same agent as hutch's sandboxes run (its memory is checkpointed
        # too), serving on a socket inside: one a checkpoint keeps.
        spec["process"]["args"] = [
            "sh", "-c", f"{bundle.AGENT_BINARY_PATH} serve /tmp/bare-agent.sock & exec \"$@\"",
            "sh", *argv,
        ]
        bundle.write(self.bundle, spec)
        self.cgroup = str(spec["linux"]["cgroupsPath"]).strip("/")
        self.name = self._next()
        self._runsc("run", "--detach", "--bundle", self.bundle, "--pid-file",
                    self.pid_file(self.name), self.name)

    def _next(self) -> str:
        self.serial += 1
        name = f"bare-{os.getpid()}-{self.serial}"
        self.names.append(name)
        return name

    def _runsc(self, *args: str) -> None:
        subprocess.run(
            [runsc.runsc_binary(), "--root", self.state, *runsc.GLOBAL_FLAGS, *args],
            check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def pid_file(self, name: str) -> str:
        """The pid of ``name``'s sandbox process (runsc's ``--pid-file``)."""
        return os.path.join(self.root, f"{name}.pid")

    def image(self) -> str:
        return os.path.join(self.images, self.name)

    def checkpoint(self) -> None:
        """Until the stopped sandbox's process has ended (its memory freed)."""
        os.makedirs(self.image())
        sandbox = runsc.sandbox_process(self.pid_file(self.name))
        try:
            self._runsc("checkpoint", "--image-path", self.image(), self.name)
            if sandbox is not None:
                runsc.await_exit(sandbox, 60)
        finally:
            if sandbox is not None:
                os.close(sandbox)

    def restore(self, image: str | None = None) -> str:
        image = image or self.image()
        name = self._next()
        self._runsc("restore", "--detach", "--image-path", image, "--bundle", self.bundle,
                    "--pid-file", self.pid_file(name), name)
        self.name = name
        return name

    def fork3(self) -> None:
        """Checkpoint, the origin restored, 3 branches restored and each
        running ``true``."""
        self.checkpoint()
        image = self.image()
        self.restore(image)
        origin = self.name
        self.branches = []
        for _ in range(3):
            self.branches.append(self.restore(image))
            self.exec_true(self.branches[-1])
        self.name = origin

    def exec_true(self, name: str | None = None) -> None:
        self._runsc("exec", name or self.name, "true")

    def wait_file(self, path: str) -> None:
        for _ in range(3000):
            done = subprocess.run(
                [runsc.runsc_binary(), "--root", self.state, *runsc.GLOBAL_FLAGS, "exec",
                 self.name, "test", "-e", path], stdin=subprocess.DEVNULL, check=False,
                capture_output=True,
            )
            if done.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{path} never appeared in the bare container")

    def delete(self, names: list[str]) -> None:
        for name in names:
            subprocess.run(
                [runsc.runsc_binary(), "--root", self.state, "delete", "--force", name],
                check=False, capture_output=True, stdin=subprocess.DEVNULL,
            )

    def close(self) -> None:
        self.delete(self.names)
        # Made by the first container, which runsc leaves behind when its
        # restores (under the same bundle) joined it.
        made = f"/sys/fs/cgroup/{self.cgroup}"
        for left in [*glob.glob(f"/sys/fs/cgroup/*/{self.cgroup}"), made]:
            with contextlib.suppress(OSError):
                os.rmdir(left)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def floor_timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    await asyncio.to_thread(fn)
    return time.perf_counter() - started


async def suspend_resume(rootfs: str, label: str, *, big: bool) -> None:
    runs = max(2, RUNS // 2) if big else RUNS
    bare = Bare(scratch_dir("hutch-bench-gvisor-"), rootfs,
                ["python3", "-c", BIG] if big else ["sh", "-c", SMALL])
    try:
        async with await hutch.create_sandbox("gvisor", image=IMAGE) as sb:
            if big:
                await sb.write_text("/tmp/big.py", BIG)
                await sb.exec("nohup python3 /tmp/big.py >/dev/null 2>&1 &")
                await sb.exec("while [ ! -e /tmp/big.ready ]; do sleep 0.05; done", timeout=120)
                await asyncio.to_thread(bare.wait_file, "/tmp/big.ready")
            else:
                await sb.exec(f"nohup sh -c '{SMALL}' >/dev/null 2>&1 &")
            ours: dict[str, list[float]] = {"suspend": [], "resume": []}
            floor: dict[str, list[float]] = {"suspend": [], "resume": []}
            for _ in range(runs):
                floor["suspend"].append(await floor_timed(bare.checkpoint))
                floor["resume"].append(await floor_timed(bare.restore))
                ours["suspend"].append(await timed(sb.suspend))
                ours["resume"].append(await timed(sb.resume))
            await sb.exec("true")
            for step in ("suspend", "resume"):
                row(f"{step} ({label})", median_ms(ours[step]), median_ms(floor[step]),
                    "goal <= 1.2x")
    finally:
        await asyncio.to_thread(bare.close)


async def fork_three(rootfs: str) -> None:
    bare = Bare(scratch_dir("hutch-bench-gvisor-"), rootfs, ["sh", "-c", SMALL])
    ours, floor = [], []
    try:
        async with await hutch.create_sandbox("gvisor", image=IMAGE) as sb:
            await sb.exec(f"nohup sh -c '{SMALL}' >/dev/null 2>&1 &")
            for _ in range(RUNS):
                floor.append(await floor_timed(bare.fork3))
                await asyncio.to_thread(bare.delete, bare.branches)
                started = time.perf_counter()
                fork = await sb.fork(count=3)
                for branch in fork.branches:
                    await branch.exec("true")
                ours.append(time.perf_counter() - started)
                await fork.close()
        row("fork + 3 branches to first exec", median_ms(ours), median_ms(floor))
    finally:
        await asyncio.to_thread(bare.close)


async def exec_true(rootfs: str) -> None:
    bare = Bare(scratch_dir("hutch-bench-gvisor-"), rootfs, ["sh", "-c", SMALL])
    ours, floor = [], []
    try:
        async with await hutch.create_sandbox("gvisor", image=IMAGE) as sb:
            for _ in range(3):
                await sb.exec("true")
                bare.exec_true()
            for _ in range(EXEC_RUNS):
                floor.append(await floor_timed(bare.exec_true))
                ours.append(await timed(lambda: sb.exec(["true"])))
        row("exec true (agent vs runsc exec)", median_ms(ours), median_ms(floor))
    finally:
        await asyncio.to_thread(bare.close)


async def main() -> None:
    rootfs = await asyncio.to_thread(docker_image_rootfs, IMAGE)
    print(f"runsc: {runsc.runsc_build().splitlines()[0]}")
    header("gvisor (runsc) beside bare runsc")
    parts = sys.argv[1:] or ["small", "big", "fork", "exec"]
    if "small" in parts:
        await suspend_resume(rootfs, "small process", big=False)
    if "big" in parts:
        await suspend_resume(rootfs, "200 MB process", big=True)
    if "fork" in parts:
        await fork_three(rootfs)
    if "exec" in parts:
        await exec_true(rootfs)


if __name__ == "__main__":
    run(main)
