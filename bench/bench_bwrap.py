"""Bench: the bubblewrap provider beside a bare ``bwrap ... true``.

Floors: every time is set beside a bare bubblewrap run on the same root file
system (``bwrap --bind ROOT / --proc /proc --dev /dev --unshare-all true``),
which is what any sandbox of this kind costs at least; pause + resume beside
two raw writes to a freezer cgroup; memory of idle sandboxes beside bare bwrap
processes that hold the same namespaces, in a cgroup of their own.

A command's kill from the host (the native runtime's: its tree, a shell and
8 sleeps) with 2000 unrelated processes on the host, beside the same kill
with none: a kill looks among its sandbox's processes (its cgroup's), so
the host's others cost it nothing.

``HUTCH_BENCH_IDLE`` sets how many idle sandboxes to hold at once (500).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, kill_beside_others, median_ms, paired, row, run, turn
from hutch._sandbox import backend_of
from hutch.providers.bubblewrap.cgroups import JOIN_AND_EXEC, SandboxCgroup
from hutch.providers.bubblewrap.rootfs import resolve_rootfs

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
IDLE = int(os.environ.get("HUTCH_BENCH_IDLE", "500"))
CREATE_RUNS = 20
EXEC_RUNS = 40
FORK_RUNS = 15
PAUSE_RUNS = 50
FORK_FILES = 10_000


def bare_bwrap(root: str) -> None:
    subprocess.run(
        ["bwrap", "--bind", root, "/", "--proc", "/proc", "--dev", "/dev", "--unshare-all",
         "--die-with-parent", "true"],
        check=True,
    )


def bare_keeper(
    root: str, cgroup: SandboxCgroup, read_end: int, write_end: int
) -> subprocess.Popen[bytes]:
    """A bare bwrap holding the same namespaces, blocked reading a pipe."""
    return subprocess.Popen(
        ["sh", "-c", JOIN_AND_EXEC, "bench-floor",
         "bwrap", "--bind", root, "/", "--proc", "/proc", "--dev", "/dev",
         "--unshare-all", "--die-with-parent", "sh", "-c", "read _"],
        stdin=read_end, pass_fds=(write_end,),
        env={"PATH": os.environ.get("PATH", ""), "HUTCH_CGROUP_PROCS": cgroup.procs_files()},
    )


async def bench_create(root: str) -> None:
    samples: list[float] = []
    floors: list[float] = []
    for _ in range(CREATE_RUNS):
        turn()
        t = time.perf_counter()
        bare_bwrap(root)
        floors.append(time.perf_counter() - t)
        t = time.perf_counter()
        sb = await hutch.create_sandbox("bubblewrap", rootfs=root, read_before_write=False)
        await sb.exec(["true"])
        samples.append(time.perf_counter() - t)
        await sb.close()
    row("create-to-first-exec", median_ms(samples), median_ms(floors), "goal: <= 25 ms")


async def bench_exec_and_pause(root: str) -> None:
    async with await hutch.create_sandbox(
        "bubblewrap", rootfs=root, read_before_write=False
    ) as sb:
        ours, floor = await paired(
            lambda: sb.exec(["true"]), lambda: bare_bwrap(root), EXEC_RUNS
        )
        row("exec round trip (true), live sandbox", ours, floor)

        # The floor: the same two writes to a freezer cgroup of our own.
        raw = SandboxCgroup(f"bench-{uuid.uuid4().hex[:8]}")
        raw.create(memory=None, pids=None, cpus=None)

        async def pause_resume() -> None:
            await sb.pause()
            await sb.resume()

        def raw_freeze_thaw() -> None:
            raw.freeze()
            raw.thaw()

        try:
            ours, floor = await paired(pause_resume, raw_freeze_thaw, PAUSE_RUNS)
        finally:
            raw.remove()
        row("pause + resume (freezer)", ours, floor, "goal: <= 2 ms")


async def bench_fork(root: str) -> None:
    """``Sandbox.fork`` once, then ``Fork.attach()`` + the first exec: what a
    new branch costs (the capture itself is paid once, by the fork)."""
    async with await hutch.create_sandbox(
        "bubblewrap", rootfs=root, read_before_write=False
    ) as origin:
        await origin.exec(
            f"mkdir -p tree && cd tree && for d in $(seq 0 99); do mkdir $d; "
            f"for f in $(seq 0 {FORK_FILES // 100 - 1}); do echo $d/$f > $d/$f; done; done",
            timeout=600,
        )
        count = (await origin.exec("find tree -type f | wc -l")).stdout.strip()
        fork = await origin.fork("bench")
        samples: list[float] = []
        floors: list[float] = []
        try:
            for _ in range(FORK_RUNS):
                turn()
                t = time.perf_counter()
                bare_bwrap(root)
                floors.append(time.perf_counter() - t)
                t = time.perf_counter()
                branch = await fork.attach()
                await branch.exec(["true"])
                samples.append(time.perf_counter() - t)
                await branch.close()
        finally:
            await hutch.remove_snapshot(fork.snapshot)
    row(f"fork-to-first-exec ({count} files)", median_ms(samples), median_ms(floors),
        "goal: <= 30 ms")


async def bench_kill(root: str) -> None:
    async with await hutch.create_sandbox(
        "bubblewrap", rootfs=root, runtime="native", read_before_write=False
    ) as sb:
        await kill_beside_others(sb)


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


async def bench_idle(root: str) -> None:
    # The floor: bare bwrap processes holding the same namespaces, blocked
    # reading a pipe, in one cgroup of their own.
    floor_cgroup = SandboxCgroup(f"bench-floor-{uuid.uuid4().hex[:8]}")
    floor_cgroup.create(memory=None, pids=None, cpus=None)
    read_end, write_end = os.pipe()
    floor_procs = []
    try:
        for _ in range(IDLE):
            floor_procs.append(bare_keeper(root, floor_cgroup, read_end, write_end))
        await asyncio.sleep(1)
        floor_per = (floor_cgroup.memory_usage() or 0) / IDLE
    finally:
        for proc in floor_procs:
            proc.kill()
        for proc in floor_procs:
            proc.wait()
        os.close(read_end)
        os.close(write_end)
        floor_cgroup.kill_all()
        floor_cgroup.remove()

    before = _mem_available()
    sandboxes = []
    t = time.perf_counter()
    try:
        for _ in range(IDLE):
            sandboxes.append(await hutch.create_sandbox(
                "bubblewrap", rootfs=root, read_before_write=False
            ))
        made_s = time.perf_counter() - t
        await asyncio.sleep(1)
        charged = 0
        for sb in sandboxes:
            charged += (await backend_of(sb).memory_bytes()) or 0
        charged /= IDLE
        host_per = (before - _mem_available()) / IDLE
        # Still answering with them all alive: an exec in the last one.
        start = time.perf_counter()
        result = await sandboxes[-1].exec(["echo", "ok"])
        answer_ms = (time.perf_counter() - start) * 1000
        assert result.stdout == "ok\n"
    finally:
        for sb in sandboxes:
            await sb.close()
    mib = 1024 * 1024
    print(f"{IDLE} idle sandboxes made in {made_s:.1f} s; exec with all alive {answer_ms:.1f} ms")
    print(f"{'memory per idle sandbox (its cgroup)':<44} {charged / mib:>8.2f}MiB "
          f"{floor_per / mib:>8.2f}MiB {charged / floor_per if floor_per else 0:>6.2f}x"
          f"  goal: <= 2 MiB")
    print(f"{'memory per idle sandbox (host MemAvailable)':<44} {host_per / mib:>8.2f}MiB"
          "  (other work on the host moves this one)")


async def main() -> None:
    root = resolve_rootfs(None, IMAGE)
    header(f"bubblewrap provider (floor: bare bwrap ... true), image {IMAGE}")
    await bench_create(root)
    await bench_exec_and_pause(root)
    await bench_fork(root)
    await bench_kill(root)
    await bench_idle(root)


if __name__ == "__main__":
    run(main)
