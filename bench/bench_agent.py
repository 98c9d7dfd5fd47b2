"""Bench: hutch's agent (a docker sandbox's keeper and runtime) beside the raw
Docker floors, in one run.

Floors: exec = the docker SDK's exec_create + exec_start + exec_inspect of
``true``; a 1 MB write + read = put_archive + get_archive; grep = ``grep -r``
run inside the container over the same 10 000-file tree (started through the
agent, so docker's own ~50 ms exec start is not in the floor); the busy count
= the Engine's ``top`` (what the native runtime asks). Each pair is measured
alternately, in blocks (:func:`blocks`), so a machine whose speed drifts moves
both alike, while the Engine's own after-work from a raw call (runc, the shim,
dockerd) lands on the floor's block, not on hutch's next call.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from collections.abc import Awaitable, Callable

import docker
from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, paired, row, run, turn
from hutch._sandbox import backend_of

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
EXEC_RUNS = 200
FILE_RUNS = 100
BUSY_RUNS = 20
#: 50 busy loops (each its own runnable process), started in the background.
BUSY_LOOPS = ("echo 'while :; do :; done' > /tmp/busy.sh; "
              "for i in $(seq 50); do sh /tmp/busy.sh >/dev/null 2>&1 & done")
GREP_RUNS = 15
MB = os.urandom(1024 * 1024)
TREE_FILES = 10_000


BLOCK = 20


async def blocks(
    ours: Callable[[], Awaitable[object]], floor: Callable[[], object], runs: int
) -> tuple[float, float]:
    """Median ms of ``ours`` and ``floor``, in alternating blocks of BLOCK calls,
    each block's first call left out (the other side's after-work)."""
    ours_samples: list[float] = []
    floor_samples: list[float] = []
    for _ in range(max(1, runs // BLOCK)):
        turn()  # at a block's start: its first call is left out anyway
        for i in range(BLOCK + 1):
            t = time.perf_counter()
            floor()
            if i:
                floor_samples.append(time.perf_counter() - t)
        for i in range(BLOCK + 1):
            t = time.perf_counter()
            await ours()
            if i:
                ours_samples.append(time.perf_counter() - t)
    return median_ms(ours_samples), median_ms(floor_samples)


def raw_exec(api: docker.APIClient, container: str) -> None:
    created = api.exec_create(container, ["true"])
    api.exec_start(created["Id"])
    api.exec_inspect(created["Id"])


def raw_write_read(api: docker.APIClient, container: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("workspace/raw.bin")
        info.size = len(MB)
        tar.addfile(info, io.BytesIO(MB))
    api.put_archive(container, "/", buffer.getvalue())
    stream, _ = api.get_archive(container, "/workspace/raw.bin")
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        member = tar.next()
        assert member is not None
        extracted = tar.extractfile(member)
        assert extracted is not None and len(extracted.read()) == len(MB)


async def write_read(sb: hutch.Sandbox) -> None:
    await sb.write_bytes("hutch.bin", MB)
    assert len(await sb.read_bytes("hutch.bin")) == len(MB)


async def in_process(api: docker.APIClient) -> None:
    header(f"agent runtime, in process (floor: the docker SDK directly), image {IMAGE}")
    async with await hutch.create_sandbox(
        "docker", image=IMAGE, runtime="agent", read_before_write=False
    ) as sb:
        container = backend_of(sb).container_id
        assert container is not None
        ours, floor = await blocks(
            lambda: sb.exec(["true"]), lambda: raw_exec(api, container), EXEC_RUNS
        )
        row("exec true", ours, floor, "goal: <= 2 ms")
        ours, floor = await blocks(
            lambda: write_read(sb), lambda: raw_write_read(api, container), FILE_RUNS
        )
        row("1 MB write + read", ours, floor, "goal: <= 20 ms")

        # 10 000 files in 100 directories, one line in 1 file in 100 matching.
        script = (
            "for d in $(seq 0 99); do mkdir -p tree/d$d; for f in $(seq 0 99); do "
            "if [ $f = 7 ]; then echo 'a needle here' > tree/d$d/f$f.txt; "
            "else echo 'hay hay hay' > tree/d$d/f$f.txt; fi; done; done"
        )
        await sb.exec(script, timeout=300)
        expected = 100

        async def ours_grep() -> None:
            assert len(await sb.grep("needle", "tree")) == expected

        grep_floor: list[float] = []

        async def floor_grep() -> None:
            # grep's own time inside the container, not the exec that starts it.
            result = await sb.exec(
                ["sh", "-c", "s=$(date +%s%N); grep -r needle tree >/dev/null; "
                 "e=$(date +%s%N); echo $((e - s))"]
            )
            grep_floor.append(int(result.stdout) / 1e9)

        ours_samples = []
        for _ in range(GREP_RUNS):
            turn()
            await floor_grep()
            t = time.perf_counter()
            await ours_grep()
            ours_samples.append(time.perf_counter() - t)
        row(f"grep over {TREE_FILES} files", median_ms(ours_samples), median_ms(grep_floor),
            "goal: <= 1.5x")

        ours, floor = await paired(
            backend_of(sb).runtime.count_busy_processes,
            lambda: api.top(container, ps_args="-e -o pid,stat"),
            EXEC_RUNS,
        )
        row("busy count (floor: the Engine's top)", ours, floor, "goal: <= 1 ms")


async def under_load(api: docker.APIClient) -> None:
    header("agent runtime while the sandbox runs 50 busy loops, 1 CPU (floor: the docker SDK)")
    async with await hutch.create_sandbox(
        "docker", image=IMAGE, runtime="agent", cpus=1.0, read_before_write=False
    ) as sb:
        container = backend_of(sb).container_id
        assert container is not None
        ours, floor = await blocks(
            lambda: sb.exec(["true"]), lambda: raw_exec(api, container), BUSY_RUNS
        )
        row("exec true, idle", ours, floor, "")
        # The agent's own work (a grep it runs over 1000 files), the floor its
        # time idle: beside the loops in one cpu cgroup it had 1/51 of the CPU.
        await sb.exec("for d in $(seq 0 9); do mkdir -p tree/d$d; for f in $(seq 0 99); do "
                      "echo 'hay a needle' > tree/d$d/f$f.txt; done; done", timeout=300)

        async def grep_times(runs: int = 5) -> float:
            samples = []
            for _ in range(runs):
                turn()
                t = time.perf_counter()
                assert len(await sb.grep("needle", "tree")) == 1000
                samples.append(time.perf_counter() - t)
            return median_ms(samples)

        idle_grep = await grep_times()
        await sb.exec(["sh", "-c", BUSY_LOOPS])
        try:
            ours, floor = await blocks(
                lambda: sb.exec(["true"]), lambda: raw_exec(api, container), BUSY_RUNS
            )
            # ``true`` itself runs in the workload, among the loops.
            row("exec true beside 50 busy loops", ours, floor, "")
            ours, floor = await blocks(
                lambda: sb.read_text("/etc/os-release"),
                lambda: b"".join(api.get_archive(container, "/etc/os-release")[0]), BUSY_RUNS
            )
            row("file read beside 50 busy loops", ours, floor, "")
            row("grep 1000 files beside 50 busy loops (floor: idle)", await grep_times(),
                idle_grep, "goal: <= 3x")
        finally:
            await sb.exec(["pkill", "-9", "-f", "busy.sh"])


def through_daemon(api: docker.APIClient) -> None:
    header("agent runtime through the daemon and the sync SDK (floor: the docker SDK)")
    daemon = DaemonProcess().start()
    try:
        with hutch.Client(daemon.url, token=daemon.token) as client:
            remote = client.create_sandbox("docker", image=IMAGE, runtime="agent")
            try:
                container = docker.APIClient(version="auto").containers(
                    filters={"label": f"hutch.sandbox_id={remote.id}"}
                )[0]["Id"]
                async def ours() -> None:
                    remote.exec(["true"])

                mine, floor = asyncio.run(
                    blocks(ours, lambda: raw_exec(api, container), EXEC_RUNS)
                )
                row("exec true (SDK + daemon + agent)", mine, floor, "goal: <= 4 ms")
            finally:
                remote.close()
    finally:
        daemon.close()


async def main() -> None:
    api = docker.APIClient(version="auto")
    if sys.argv[1:] == ["under-load"]:
        await under_load(api)
        return
    await in_process(api)
    await under_load(api)
    await asyncio.to_thread(through_daemon, api)


if __name__ == "__main__":
    run(main)
