"""The conformance suite's sandboxes: one fixture per kind, one param per provider.

A provider joins the suite by adding one entry to ``MAKERS``: an async
context manager that yields a running sandbox with the guardrail off. Each
runs the packaged suite (``hutch.testing``) once; tests that reach the
sandbox's files from the host side use ``host_harness``.

The suite's cases share a sandbox per provider (``Shelf``): making one costs
more than most cases (a container, a pod, a daemon's round trips), so after a
case that passed, ``ready_for_another_case`` empties its working directory and
says whether it is as a fresh one; if not, or if the case failed, the next
case gets a new sandbox.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

import hutch
from hutch.testing import ready_for_another_case
from tests.conftest import TEST_IMAGE
from tests.ssh_server import ALIAS, shared_server


@dataclass
class Harness:
    """A sandbox under test, and what the test may know about its host side."""

    sandbox: Any
    provider: str
    #: Host directory that is the sandbox's working directory, where one exists.
    host_workdir: str | None = None


@asynccontextmanager
async def _local() -> AsyncIterator[Harness]:
    workdir = tempfile.mkdtemp(prefix="hutch-conf-")
    try:
        async with await hutch.create_sandbox(
            "local", workdir=workdir, read_before_write=False
        ) as sb:
            yield Harness(sb, "local", workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@asynccontextmanager
async def _virtual() -> AsyncIterator[Harness]:
    async with await hutch.create_sandbox("virtual", read_before_write=False) as sb:
        yield Harness(sb, "virtual")


@asynccontextmanager
async def _docker(runtime: str) -> AsyncIterator[Harness]:
    host_workdir = tempfile.mkdtemp(prefix="hutch-conf-docker-")
    try:
        async with await hutch.create_sandbox(
            "docker", image=TEST_IMAGE, host_workdir=host_workdir, read_before_write=False,
            runtime=runtime,
        ) as sb:
            assert sb.capabilities.runtime == runtime
            yield Harness(sb, "docker", host_workdir)
    finally:
        shutil.rmtree(host_workdir, ignore_errors=True)


def _docker_agent() -> AbstractAsyncContextManager[Harness]:
    return _docker("agent")


def _docker_native() -> AbstractAsyncContextManager[Harness]:
    return _docker("native")


Maker = Callable[[], AbstractAsyncContextManager[Harness]]


def _bubblewrap(runtime: str) -> Maker:
    @asynccontextmanager
    async def make() -> AsyncIterator[Harness]:
        # The root file system is the test image, exported from Docker once.
        async with await hutch.create_sandbox(
            "bubblewrap", image=TEST_IMAGE, runtime=runtime, ephemeral=True,
            read_before_write=False,
        ) as sb:
            # Its working directory, as a directory of the overlay's upper layer
            # (reached through the keeper's private mount namespace).
            from hutch._sandbox import backend_of

            yield Harness(sb, "bubblewrap", backend_of(sb).parts.layers.upper + sb.workdir)

    return make


@asynccontextmanager
async def _gvisor() -> AsyncIterator[Harness]:
    async with await hutch.create_sandbox(
        "gvisor", image=TEST_IMAGE, read_before_write=False
    ) as sb:
        yield Harness(sb, "gvisor")


@asynccontextmanager
async def _ssh() -> AsyncIterator[Harness]:
    # The host is this machine, through a real sshd on loopback: the working
    # directory is a host directory the test can also reach directly.
    server = shared_server()
    workdir = tempfile.mkdtemp(prefix="hutch-conf-ssh-")
    try:
        async with await hutch.create_sandbox(
            "ssh", destination=ALIAS, working_directory=workdir,
            config_file=server.config_file, read_before_write=False,
        ) as sb:
            yield Harness(sb, "ssh", workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_e2b_standin: Any = None


@asynccontextmanager
async def _e2b() -> AsyncIterator[Harness]:
    # E2B's service is a second hutch serve (docker) speaking the E2B wire:
    # one hutch drives another through the unmodified e2b SDK.
    global _e2b_standin
    if _e2b_standin is None:
        from tests.daemon_fixture import DaemonProcess

        _e2b_standin = DaemonProcess(provider="docker", for_session=True).start()
    from hutch._e2bkey import e2b_key

    d = _e2b_standin
    async with await hutch.create_sandbox(
        "e2b", template=TEST_IMAGE, api_url=d.url, sandbox_url=d.url,
        api_key=e2b_key(d.token), domain=f"e2b.local:{d.port}", read_before_write=False,
    ) as sb:
        yield Harness(sb, "e2b")


def kube_standin() -> Any:
    """The session's Kubernetes API stand-in (tests/kube_standin.py: pods as
    local docker containers), with a CSI snapshotter: snapshots are
    VolumeSnapshots (tests/test_kubernetes_lifecycle.py covers archives)."""
    from tests.kube_standin import shared

    return shared()


@asynccontextmanager
async def _kubernetes() -> AsyncIterator[Harness]:
    async with await hutch.create_sandbox(
        "kubernetes", kubeconfig=kube_standin().kubeconfig, image=TEST_IMAGE,
        read_before_write=False,
    ) as sb:
        yield Harness(sb, "kubernetes")


#: provider -> (maker, its files are in a host directory the test can reach,
#: pytest marks). Every provider runs every case of the suite; what a case
#: needs beyond files is asked of the sandbox's capabilities, never named here.
MAKERS: dict[str, tuple[Maker, bool, list[pytest.MarkDecorator]]] = {
    "local": (_local, True, []),
    "virtual": (_virtual, False, []),
    "docker": (_docker_agent, True, [pytest.mark.docker]),
    "docker-native": (_docker_native, True, [pytest.mark.docker]),
    "bubblewrap": (_bubblewrap("agent"), True, [pytest.mark.docker]),
    "bubblewrap-native": (_bubblewrap("native"), True, [pytest.mark.docker]),
    "ssh": (_ssh, True, []),
    "gvisor": (_gvisor, False, [pytest.mark.docker]),
    "e2b": (_e2b, False, [pytest.mark.docker]),
    # Against tests/kube_standin.py: a pod (a docker container) and a claim
    # (a docker volume) per case, about 2 s of a worker's time each.
    "kubernetes": (_kubernetes, False, [pytest.mark.docker]),
}


# Remote makers (through hutch.Client / AsyncClient against a live daemon) are
# added by tests/conformance/remote.py when the daemon is available.
try:
    from tests.conformance.remote import REMOTE_MAKERS

    MAKERS.update(REMOTE_MAKERS)
except ImportError:
    pass

_selected = os.environ.get("HUTCH_CONFORMANCE_PROVIDERS")
if _selected:
    MAKERS = {k: v for k, v in MAKERS.items() if k in _selected.split(",")}


def _params(*, host_files: bool) -> list[Any]:
    return [
        pytest.param(name, marks=marks, id=name)
        for name, (_, has_host_files, marks) in MAKERS.items()
        if has_host_files or not host_files
    ]


class Shelf:
    """The sandboxes kept between cases, one per provider, on the event loop
    they were made on (the module's: see ``shelf``)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[AsyncExitStack, Harness]] = {}

    async def take(self, provider: str) -> tuple[AsyncExitStack, Harness]:
        kept = self._kept.pop(provider, None)
        if kept is not None:
            return kept
        stack = AsyncExitStack()
        return stack, await stack.enter_async_context(MAKERS[provider][0]())

    async def give_back(
        self, provider: str, stack: AsyncExitStack, harness: Harness, case_passed: bool
    ) -> None:
        if case_passed and await ready_for_another_case(harness.sandbox):
            self._kept[provider] = (stack, harness)
        else:
            await stack.aclose()

    async def close(self) -> None:
        while self._kept:
            await self._kept.popitem()[1][0].aclose()


@pytest.fixture(scope="module")
async def shelf() -> AsyncIterator[Shelf]:
    # Module-scoped, so the event loop the kept sandboxes run on lasts as long.
    kept = Shelf()
    try:
        yield kept
    finally:
        await kept.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CASE_PASSED] = report.passed
    return report


_CASE_PASSED = pytest.StashKey[bool]()


@pytest.fixture(params=_params(host_files=False))
async def harness(request: pytest.FixtureRequest, shelf: Shelf) -> AsyncIterator[Harness]:
    stack, h = await shelf.take(request.param)
    try:
        yield h
    except BaseException:
        await stack.aclose()
        raise
    await shelf.give_back(
        request.param, stack, h, request.node.stash.get(_CASE_PASSED, False)
    )


@pytest.fixture(params=_params(host_files=True))
async def host_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """A provider whose working directory is a host directory the test can reach."""
    async with MAKERS[request.param][0]() as h:
        assert h.host_workdir is not None
        yield h


@pytest.fixture
def sandbox(harness: Harness) -> Any:
    return harness.sandbox
