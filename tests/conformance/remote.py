"""Conformance through the SDK: the same suite, against a live daemon.

One daemon serves the whole test session. ``remote-async`` drives it with
``hutch.AsyncClient``; ``remote-sync`` with ``hutch.Client``, each call run in
a worker thread so the async tests can await it.
"""

from __future__ import annotations

import atexit
import inspect
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import pytest

import hutch
import hutch._sync_generated as _sync_faces
from hutch._watch import Watcher
from tests.conformance.conftest import Harness
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.ssh_server import ALIAS, shared_server

_daemon: DaemonProcess | None = None


def daemon() -> DaemonProcess:
    global _daemon
    if _daemon is None:
        # The operator lets clients use ssh, and name a destination and config
        # file (the ssh harness's test server).
        _daemon = DaemonProcess(
            extra_args=["--allow-provider", "ssh", "--allow", "destination",
                        "--allow", "config_file", "--allow", "kubeconfig"],
            for_session=True,
        ).start()
        atexit.register(_daemon.stop)
    return _daemon


class _Deferred:
    """A sync call, awaitable (run in a thread) or async-iterable (ditto per item)."""

    def __init__(self, fn: Any, args: Any, kwargs: Any) -> None:
        self._call = lambda: fn(*args, **kwargs)

    def __await__(self) -> Any:
        async def run() -> Any:
            return adapt(await anyio.to_thread.run_sync(self._call))
        return run().__await__()

    async def __aiter__(self) -> AsyncIterator[Any]:
        iterator = await anyio.to_thread.run_sync(lambda: iter(self._call()))
        done = object()
        while (item := await anyio.to_thread.run_sync(next, iterator, done)) is not done:
            yield item


class AsyncAdapter:
    """The sync SDK object, seen through an async face for the shared tests."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __aiter__(self) -> AsyncIterator[Any]:
        return _Deferred(lambda: self._target, (), {}).__aiter__()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        # A check made on the spot (path, require) is the same plain function
        # on both faces: it is called as it is, not awaited.
        async_twin = getattr(_ASYNC_TWIN[type(self._target)], name, None)
        if callable(attr) and getattr(type(self._target), name, None) is not async_twin \
                and _talks(async_twin):
            return lambda *a, **k: _Deferred(attr, a, k)
        return attr


def _talks(async_twin: Any) -> bool:
    """Whether the async face awaits, iterates or enters this member (a
    check made on the spot, ``path`` or ``status``, is a plain call on both)."""
    if async_twin is None:
        return True
    if inspect.iscoroutinefunction(async_twin) or inspect.isasyncgenfunction(async_twin) \
            or inspect.isasyncgenfunction(getattr(async_twin, "__wrapped__", None)):
        return True
    returns = str(inspect.signature(async_twin).return_annotation)
    return returns.startswith(("AsyncIterator", "AbstractAsyncContextManager"))


_ASYNC_TWIN: dict[type, type] = {
    hutch.client.RemoteSandbox: hutch.client.AsyncRemoteSandbox,
    hutch.client.RemoteProcess: hutch.client.AsyncRemoteProcess,
    hutch.client.RemoteFork: hutch.client.AsyncRemoteFork,
    hutch.client.RemoteWatcher: hutch.client.AsyncRemoteWatcher,
    # The in-process sync faces (hutch._sync_generated) over their async classes.
    hutch.SyncSandbox: hutch.Sandbox,
    hutch.SyncProcess: hutch.Process,
    hutch.SyncFork: hutch.Fork,
    _sync_faces.SyncWatcher: Watcher,
}


def adapt(value: Any) -> Any:
    if isinstance(value, tuple(_ASYNC_TWIN)):
        return AsyncAdapter(value)
    if isinstance(value, list):
        return [adapt(v) for v in value]
    return value


@asynccontextmanager
async def _remote_async() -> AsyncIterator[Harness]:
    d = daemon()
    workdir = tempfile.mkdtemp(prefix="hutch-conf-remote-")
    try:
        async with hutch.AsyncClient(d.url, token=d.token) as client:
            sb = await client.create_sandbox("local", workdir=workdir, read_before_write=False)
            try:
                yield Harness(sb, "remote-async", workdir)
            finally:
                await sb.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@asynccontextmanager
async def _remote_sync() -> AsyncIterator[Harness]:
    d = daemon()
    workdir = tempfile.mkdtemp(prefix="hutch-conf-remote-")
    client = hutch.Client(d.url, token=d.token)
    try:
        sb = await anyio.to_thread.run_sync(
            lambda: client.create_sandbox("local", workdir=workdir, read_before_write=False)
        )
        try:
            yield Harness(AsyncAdapter(sb), "remote-sync", workdir)
        finally:
            await anyio.to_thread.run_sync(sb.close)
    finally:
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)


@asynccontextmanager
async def _remote_bubblewrap() -> AsyncIterator[Harness]:
    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        sb = await client.create_sandbox("bubblewrap", image=TEST_IMAGE, read_before_write=False)
        try:
            # Its working directory, in the hot upper layer under the daemon's
            # data dir, in its keeper's mount namespace.
            upper = f"{d.data_dir}/bubblewrap/sandboxes/{sb.id}/hot/upper"
            yield Harness(
                sb, "remote-bubblewrap", f"/proc/{_keeper_pid(sb.id)}/root{upper}{sb.workdir}"
            )
        finally:
            await sb.close()


@asynccontextmanager
async def _remote_docker_agent() -> AsyncIterator[Harness]:
    # Docker with hutch's agent as its runtime, through the daemon.
    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        sb = await client.create_sandbox(
            "docker", image=TEST_IMAGE, runtime="agent", read_before_write=False
        )
        try:
            assert sb.capabilities.runtime == "agent"
            # Its working directory: a fresh one under the daemon's data
            # directory, layered (its overlay, as the host sees it).
            yield Harness(sb, "remote-docker", f"{d.data_dir}/layers/mounts/{sb.id}/merged")
        finally:
            await sb.close()


@asynccontextmanager
async def _remote_gvisor() -> AsyncIterator[Harness]:
    # gVisor through the daemon: its agent on a socket under the daemon's
    # data directory, its files in the sandbox's own memory (no host side).
    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        sb = await client.create_sandbox("gvisor", image=TEST_IMAGE, read_before_write=False)
        try:
            yield Harness(sb, "remote-gvisor")
        finally:
            await sb.close()


@asynccontextmanager
async def _remote_ssh() -> AsyncIterator[Harness]:
    # The ssh provider through the daemon: the daemon holds the kept connection.
    d = daemon()
    server = shared_server()
    workdir = tempfile.mkdtemp(prefix="hutch-conf-remote-ssh-")
    try:
        async with hutch.AsyncClient(d.url, token=d.token) as client:
            sb = await client.create_sandbox(
                "ssh", destination=ALIAS, working_directory=workdir,
                config_file=server.config_file, read_before_write=False,
            )
            try:
                yield Harness(sb, "remote-ssh", workdir)
            finally:
                await sb.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@asynccontextmanager
async def _remote_kubernetes() -> AsyncIterator[Harness]:
    # The kubernetes provider through the daemon, against the API stand-in
    # the in-process harness uses (tests/kube_standin.py).
    from tests.conformance.conftest import kube_standin

    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        sb = await client.create_sandbox(
            "kubernetes", kubeconfig=kube_standin().kubeconfig, image=TEST_IMAGE,
            read_before_write=False)
        try:
            yield Harness(sb, "remote-kubernetes")
        finally:
            await sb.close()


def _keeper_pid(sandbox_id: str) -> int:
    """The outer bwrap of a bubblewrap sandbox: the one process in its cgroup
    whose parent is not in it."""
    from hutch.providers.bubblewrap.cgroups import SandboxCgroup

    pids = set(SandboxCgroup(sandbox_id).pids())
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        if parent not in pids:
            return pid
    raise LookupError(f"no keeper for {sandbox_id}")


@asynccontextmanager
async def _local_sync() -> AsyncIterator[Harness]:
    """The in-process sync face (``hutch.create_sandbox_sync``), each call
    made from a worker thread, as remote-sync's are."""
    workdir = tempfile.mkdtemp(prefix="hutch-conf-sync-")
    try:
        sb = await anyio.to_thread.run_sync(
            lambda: hutch.create_sandbox_sync("local", workdir=workdir, read_before_write=False)
        )
        try:
            yield Harness(AsyncAdapter(sb), "local-sync", workdir)
        finally:
            await anyio.to_thread.run_sync(sb.close)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


REMOTE_MAKERS: dict[str, tuple[Any, bool, list[pytest.MarkDecorator]]] = {
    "local-sync": (_local_sync, True, []),
    "remote-async": (_remote_async, True, []),
    "remote-sync": (_remote_sync, True, []),
    "remote-bubblewrap": (_remote_bubblewrap, True, [pytest.mark.docker]),
    "remote-docker": (_remote_docker_agent, True, [pytest.mark.docker]),
    "remote-ssh": (_remote_ssh, True, []),
    "remote-gvisor": (_remote_gvisor, False, [pytest.mark.docker]),
    "remote-kubernetes": (_remote_kubernetes, False, [pytest.mark.docker]),
}
