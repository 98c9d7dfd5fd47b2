"""Bench: the docker provider beside the docker SDK called directly.

Floors: exec = exec_create + exec_start + exec_inspect; create-to-first-exec =
create_container + start + one exec; files = put_archive / get_archive; a
command's kill (the native runtime's: its tree, a shell and 8 sleeps) with
2000 unrelated processes on the host = the same kill with none: a kill looks
among the container's processes (its cgroup's), so the host's others cost it
nothing.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile

sys.path.insert(0, os.path.dirname(__file__))

import docker

import hutch
from _common import header, kill_beside_others, paired, row, run, time_async, time_sync
from hutch._sandbox import backend_of

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
EXEC_RUNS = 60
CREATE_RUNS = 10
MB = os.urandom(1024 * 1024)


def raw_exec(api: docker.APIClient, container: str) -> None:
    created = api.exec_create(container, ["true"])
    api.exec_start(created["Id"])
    api.exec_inspect(created["Id"])


def raw_create_first_exec(api: docker.APIClient) -> None:
    container = api.create_container(
        IMAGE, ["sleep", "infinity"], detach=True, host_config=api.create_host_config()
    )
    api.start(container["Id"])
    raw_exec(api, container["Id"])
    api.remove_container(container["Id"], force=True)


def tar_of(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def bench_kill() -> None:
    async with await hutch.create_sandbox(
        "docker", image=IMAGE, runtime="native", read_before_write=False
    ) as sb:
        await kill_beside_others(sb)


async def main() -> None:
    api = docker.APIClient(version="auto")
    header(f"docker provider (floor: the docker SDK directly), image {IMAGE}")
    async with await hutch.create_sandbox("docker", image=IMAGE, read_before_write=False) as sb:
        container = backend_of(sb).container_id
        ours, floor = await paired(
            lambda: sb.exec(["true"]), lambda: raw_exec(api, container), EXEC_RUNS
        )
        row("exec round trip (true)", ours, floor, "goal: <= 1.15x")

        def raw_write() -> None:
            api.put_archive(container, "/tmp", tar_of("raw.bin", MB))

        def raw_read() -> None:
            stream, _ = api.get_archive(container, "/tmp/raw.bin")
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.next()
                assert member is not None
                extracted = tar.extractfile(member)
                assert extracted is not None
                extracted.read()

        row("write 1 MB", await time_async(lambda: sb.write_bytes("/tmp/one.bin", MB), 30),
            time_sync(raw_write, 30))
        row("read 1 MB", await time_async(lambda: sb.read_bytes("/tmp/one.bin"), 30),
            time_sync(raw_read, 30))
    await bench_kill()

    async def create_first_exec() -> None:
        async with await hutch.create_sandbox("docker", image=IMAGE) as fresh:
            await fresh.exec(["true"])

    # Teardown is inside both figures, as in the raw loop.
    ours, floor = await paired(
        create_first_exec, lambda: raw_create_first_exec(api), CREATE_RUNS, warmup=1
    )
    row("create + first exec + remove", ours, floor, "goal: <= 1.1x")

    # What least privilege adds to a create, each beside the same raw floor:
    # the network policy (the default above, "all") installed in the
    # container's namespace, and the working directory's disk cap (an ext4
    # image loop-mounted), which a daemon applies by default.
    async def create_without_policy() -> None:
        async with await hutch.create_sandbox("docker", image=IMAGE, network="none") as fresh:
            await fresh.exec(["true"])

    async def create_with_disk_cap() -> None:
        async with await hutch.create_sandbox("docker", image=IMAGE, disk="4g") as fresh:
            await fresh.exec(["true"])

    ours, floor = await paired(
        create_without_policy, lambda: raw_create_first_exec(api), CREATE_RUNS, warmup=1
    )
    row("  same, network none (no policy to install)", ours, floor)
    ours, floor = await paired(
        create_with_disk_cap, lambda: raw_create_first_exec(api), CREATE_RUNS, warmup=1
    )
    row("  same, policy + 4g disk cap (daemon default)", ours, floor)


if __name__ == "__main__":
    run(main)
