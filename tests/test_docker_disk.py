"""A docker sandbox's disk figure (hutch.providers.docker.disk), on the real
Docker Engine: what it wrote over its image, in its container's writable
layer and its working directory, kept across a suspend and a resume."""

from __future__ import annotations

import os
import tempfile

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.docker import DockerSandbox
from hutch.providers.docker.disk import engine_size_rw, walk_usage
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

MB = 1_000_000
#: What a 5 MB file may add beyond its bytes (its blocks, a directory's own).
SLACK = 300_000


async def disk(sandbox: hutch.Sandbox) -> int:
    figure = (await sandbox.info())["disk_bytes"]
    assert isinstance(figure, int)
    return figure


async def test_a_docker_sandbox_tells_what_it_wrote_over_its_image() -> None:
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE) as sandbox:
        start = await disk(sandbox)
        assert start < MB  # a fresh container has written next to nothing

        # Its container's writable layer.
        await sandbox.exec("head -c 5000000 /dev/urandom > /tmp/blob")
        in_layer = await disk(sandbox)
        assert 5 * MB <= in_layer - start <= 5 * MB + SLACK

        # Its working directory.
        await sandbox.exec("head -c 5000000 /dev/urandom > blob")
        in_workdir = await disk(sandbox)
        assert 5 * MB <= in_workdir - in_layer <= 5 * MB + SLACK

        await sandbox.exec("rm /tmp/blob")
        assert 5 * MB <= await disk(sandbox) - start <= 5 * MB + SLACK

        # Suspended, it holds what it had; resumed, what the suspend committed
        # still counts (its new container runs from it).
        # (Small files too: a block each, which the committed layers must count as the walk does.)
        await sandbox.exec("head -c 5000000 /dev/urandom > /tmp/blob2 && mkdir /tmp/small && "
                           "for i in $(seq 1 300); do echo x > /tmp/small/$i; done")
        before = await disk(sandbox)
        await sandbox.suspend()
        assert await disk(sandbox) == before
        await sandbox.resume()
        assert abs(await disk(sandbox) - before) <= SLACK


async def test_the_engines_own_figure_agrees_with_the_walk() -> None:
    """The fallback where the upper directory cannot be read (another
    storage driver, a daemon that is not root)."""
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE) as sandbox:
        await sandbox.exec("head -c 5000000 /dev/urandom > /tmp/blob")
        backend = backend_of(sandbox)
        assert isinstance(backend, DockerSandbox) and backend.container_id is not None
        engines = engine_size_rw(backend.container_id)
        assert engines is not None and 5 * MB <= engines <= 5 * MB + SLACK


def test_a_walk_counts_blocks_once_per_inode_and_nothing_where_nothing_is() -> None:
    with tempfile.TemporaryDirectory() as top:
        os.makedirs(os.path.join(top, "a", "b"))
        with open(os.path.join(top, "a", "b", "data"), "wb") as fh:
            fh.write(os.urandom(100_000))
        os.link(os.path.join(top, "a", "b", "data"), os.path.join(top, "again"))
        usage = walk_usage(top)
        assert usage.entries == 4  # a, a/b, a/b/data, again
        assert 100_000 <= usage.used <= 100_000 + 3 * 4096 + 3 * 4096
        assert walk_usage(os.path.join(top, "missing")).used == 0
