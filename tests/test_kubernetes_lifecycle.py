"""The kubernetes provider's lifecycle against the API stand-in
(tests/kube_standin.py): suspend to nothing (the pod deleted, its claim
kept), resume on the same claim, pods lost outside hutch told by the watch,
a daemon's restart adopting its pods and claims and reaping the orphans of
its home, snapshots and forks (CSI VolumeSnapshots where the cluster has
them, archives elsewhere)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.kube_standin import KubeStandin

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

POD_ENDED = ("failed",)


@pytest.fixture(scope="module")
def standin() -> Iterator[KubeStandin]:
    server = KubeStandin(snapshots=True, bookmark_interval=0.5).start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


@pytest.fixture(scope="module")
def daemon(standin: KubeStandin) -> Iterator[DaemonProcess]:
    d = DaemonProcess(provider="kubernetes", extra_args=["--allow", "kubeconfig"]).start()
    try:
        yield d
    finally:
        d.close()


def _home_tag(home: str) -> str:
    return hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:16]


def _wait(predicate: Any, what: str, within: float = 60.0) -> None:
    """Until ``predicate()`` holds (a bound so that a failure ends the test, not a timing)."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.1)


def _claims_of(standin: KubeStandin, sandbox_id: str) -> list[str]:
    return [n for n, c in standin.objects["persistentvolumeclaims"].items()
            if c["metadata"]["labels"].get("hutch.dev/sandbox") == sandbox_id.lower()]


def _pods_of(standin: KubeStandin, sandbox_id: str) -> list[str]:
    return [n for n, p in standin.objects["pods"].items()
            if p["metadata"]["labels"].get("hutch.dev/sandbox") == sandbox_id.lower()]


async def test_suspend_deletes_the_pod_and_twenty_cycles_keep_every_file(
        standin: KubeStandin) -> None:
    async with await hutch.create_sandbox(
            "kubernetes", kubeconfig=standin.kubeconfig, image=TEST_IMAGE,
            read_before_write=False) as sb:
        assert sb.capabilities.suspend
        assert len(_claims_of(standin, sb.id)) == 1
        for cycle in range(20):
            await sb.write_text(f"deep/cycle{cycle}.txt", f"cycle {cycle}\n")
            await sb.suspend()
            assert _pods_of(standin, sb.id) == [], "suspend left the pod"
            assert len(_claims_of(standin, sb.id)) == 1, "suspend dropped the claim"
            await sb.resume()
            assert len(_pods_of(standin, sb.id)) == 1
        listed = (await sb.exec("ls deep | sort -V")).stdout.split()
        assert listed == [f"cycle{c}.txt" for c in range(20)]
        for cycle in range(20):
            assert await sb.read_text(f"deep/cycle{cycle}.txt") == f"cycle {cycle}\n"
    assert _claims_of(standin, sb.id) == [] and _pods_of(standin, sb.id) == []


async def test_a_sandbox_without_a_claim_cannot_suspend(standin: KubeStandin) -> None:
    async with await hutch.create_sandbox(
            "kubernetes", kubeconfig=standin.kubeconfig, image=TEST_IMAGE, persistent=False,
            read_before_write=False) as sb:
        assert not sb.capabilities.suspend
        assert _claims_of(standin, sb.id) == []
        with pytest.raises(hutch.CapabilityUnsupported):
            await sb.suspend()


def test_idle_suspend_through_the_daemon_and_the_next_exec_resumes(
        standin: KubeStandin, daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox("kubernetes", kubeconfig=standin.kubeconfig,
                                   image=TEST_IMAGE, idle_suspend_after=1,
                                   read_before_write=False)
        try:
            sb.write_text("kept.txt", "kept across the suspend\n")
            _wait(lambda: sb.status().state == "suspended", "the idle sandbox suspended")
            assert _pods_of(standin, sb.id) == []
            assert len(_claims_of(standin, sb.id)) == 1
            assert sb.exec(["cat", "kept.txt"]).stdout == "kept across the suspend\n"
            assert len(_pods_of(standin, sb.id)) == 1
        finally:
            sb.close()
    assert _claims_of(standin, sb.id) == [] and _pods_of(standin, sb.id) == []


@pytest.mark.parametrize("how", ["evicted", "deleted", "deleted after a 410",
                                 "suspended, its claim deleted"])
def test_a_pod_lost_outside_hutch_fails_its_sandbox_with_the_reason(
        standin: KubeStandin, daemon: DaemonProcess, how: str) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox("kubernetes", kubeconfig=standin.kubeconfig,
                                   image=TEST_IMAGE, read_before_write=False)
        try:
            sb.write_text("work.txt", "work\n")
            pod = _pods_of(standin, sb.id)[0]
            if how == "deleted after a 410":
                # etcd compacted and the watch ended: the watcher's next watch
                # from its version is told 410 Gone, and it lists again.
                standin.compact()
                standin.end_watches()
            if how == "evicted":
                standin.evict(pod, "The node was low on resource: memory.")
            elif how.startswith("suspended"):
                sb.suspend()
                standin.delete_outside("persistentvolumeclaims", _claims_of(standin, sb.id)[0])
            else:
                standin.delete_outside("pods", pod)
            _wait(lambda: sb.status().state == "failed", f"the sandbox whose pod was {how} failed")
            reason = sb.status().reason or ""
            if how == "evicted":
                assert "evicted" in reason and "low on resource: memory" in reason, reason
            elif how.startswith("suspended"):
                assert f"claim {pod}" in reason and "deleted outside hutch" in reason, reason
                return
            else:
                assert f"pod {pod} was deleted outside hutch" in reason, reason
            # Its files stay on the claim until it is deleted.
            assert len(_claims_of(standin, sb.id)) == 1
        finally:
            sb.close()
    _wait(lambda: not _claims_of(standin, sb.id), "the failed sandbox's claim freed on delete")


def test_a_restarted_daemon_adopts_its_pods_and_claims_and_reaps_orphans(
        standin: KubeStandin) -> None:
    d = DaemonProcess(provider="kubernetes", extra_args=["--allow", "kubeconfig"]).start()
    base = f"{standin.url}/api/v1/namespaces/{standin.namespace}"
    try:
        with hutch.Client(d.url, token=d.token) as client:
            running = client.create_sandbox("kubernetes", kubeconfig=standin.kubeconfig,
                                            image=TEST_IMAGE, read_before_write=False)
            resting = client.create_sandbox("kubernetes", kubeconfig=standin.kubeconfig,
                                            image=TEST_IMAGE, read_before_write=False)
            running.write_text("a.txt", "running\n")
            running.write_text("serve.py", LISTING_SERVER)
            running.preview_url(8000)  # its Service, which a record names
            resting.write_text("b.txt", "resting\n")
            resting.suspend()
        # Orphans of this home (no record names them), and another home's claim
        # and Service.
        with httpx.Client() as http:
            for home, name in ((d.data_dir, "hutch-sb-orphan"), ("/elsewhere", "hutch-sb-other")):
                labels = {"hutch.dev/home": _home_tag(home), "hutch.dev/sandbox": name[6:]}
                for kind in ("persistentvolumeclaims", "services"):
                    assert http.post(f"{base}/{kind}", json={
                        "metadata": {"name": name, "labels": labels},
                        "spec": {}}).status_code == 201
        d.kill()
        d.start()
        with hutch.Client(d.url, token=d.token) as client:
            again = client.get_sandbox(running.id)
            assert again.status().state == "running"
            assert again.exec(["cat", "a.txt"]).stdout == "running\n"
            rested = client.get_sandbox(resting.id)
            assert rested.status().state == "suspended"
            assert rested.exec(["cat", "b.txt"]).stdout == "resting\n"
            for kind in ("persistentvolumeclaims", "services"):
                assert "hutch-sb-orphan" not in standin.objects[kind]
                assert "hutch-sb-other" in standin.objects[kind]
            assert f"hutch-{running.id.lower()}-8000" in standin.objects["services"]
            # The restarted daemon forwards the adopted pod's port.
            again.start(["python3", "serve.py"])
            url = again.preview_url(8000)
            with httpx.Client(trust_env=False) as http:
                _wait(lambda: _answers(http, url), "the adopted sandbox's preview URL answered")
            # The restarted daemon watches its pods again.
            standin.delete_outside("pods", _pods_of(standin, running.id)[0])
            _wait(lambda: again.status().state == "failed", "the adopted sandbox failed")
    finally:
        standin.delete_outside("persistentvolumeclaims", "hutch-sb-other")
        standin.delete_outside("services", "hutch-sb-other")
        d.close()


def _answers(http: httpx.Client, url: str) -> bool:
    try:
        answer = http.get(url + "/", timeout=10)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and "<li>serve.py</li>" in answer.text


@pytest.fixture(scope="module")
def plain_standin() -> Iterator[KubeStandin]:
    """A cluster without a CSI snapshotter (no snapshot.storage.k8s.io)."""
    server = KubeStandin(snapshots=False).start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


@pytest.mark.parametrize("csi", [True, False], ids=["volume-snapshot", "archive"])
async def test_snapshots_and_forks_of_a_running_and_a_suspended_sandbox(
        standin: KubeStandin, plain_standin: KubeStandin, csi: bool) -> None:
    from hutch.providers.kubernetes import KubernetesSandbox

    cluster = standin if csi else plain_standin
    async with await hutch.create_sandbox(
            "kubernetes", kubeconfig=cluster.kubeconfig, image=TEST_IMAGE,
            read_before_write=False) as sb:
        assert sb.capabilities.snapshot and sb.capabilities.fork
        await sb.write_text("deep/a.txt", "origin\n")
        await sb.exec(["sh", "-c", "chmod 640 deep/a.txt && ln -s deep/a.txt link"])
        snapshot = await sb.snapshot("first")
        try:
            held = cluster.objects["volumesnapshots"]
            assert (len(held) == 1) is csi, "a VolumeSnapshot only where the cluster has them"
            assert snapshot.id in await KubernetesSandbox.held_snapshots()
            await sb.write_text("deep/a.txt", "changed later\n")
            branch = await hutch.create_sandbox_from_snapshot(snapshot)
            try:
                assert await branch.read_text("deep/a.txt") == "origin\n"
                said = (await branch.exec(["stat", "-c", "%a", "deep/a.txt"])).stdout.strip()
                assert said == "640"
                assert (await branch.exec(["readlink", "link"])).stdout.strip() == "deep/a.txt"
                await branch.write_text("deep/a.txt", "branch\n")
            finally:
                await branch.close()
            assert await sb.read_text("deep/a.txt") == "changed later\n"
        finally:
            await hutch.remove_snapshot(snapshot)
        await hutch.remove_snapshot(snapshot)  # idempotent
        assert snapshot.id not in await KubernetesSandbox.held_snapshots()
        assert cluster.objects["volumesnapshots"] == {}
        # A suspended sandbox is forked as it rests: no pod is left running.
        await sb.suspend()
        fork = await sb.fork("resting")
        try:
            assert _pods_of(cluster, sb.id) == []
            assert sb.state == hutch.SandboxState.SUSPENDED
            branch = await fork.attach()
            assert await branch.read_text("deep/a.txt") == "changed later\n"
        finally:
            await fork.close()
        assert _pods_of(cluster, branch.id) == [] and _claims_of(cluster, branch.id) == []


#: A directory listing on port 8000, a thread per connection (the test
#: image's Python is python3-minimal: no http.server).
LISTING_SERVER = """\
import os, socket, threading
def serve(c):
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        piece = c.recv(65536)
        if not piece:
            c.close()
            return
        data += piece
    names = "".join(f"<li>{n}</li>\\n" for n in sorted(os.listdir(".")))
    body = ("<h1>Directory listing for /</h1>\\n" + names).encode()
    c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(body), body))
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8000))
s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


async def _listing(sb: hutch.Sandbox) -> str:
    """The preview URL of port 8000 once the server in ``sb`` answers on it."""
    await sb.start(["python3", "serve.py"])
    url = await sb.preview_url(8000)
    async with httpx.AsyncClient(trust_env=False) as client:
        for _ in range(100):
            try:
                answer = await client.get(url + "/", timeout=10)
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code == 200:
                assert "Directory listing for /" in answer.text
                assert "<li>serve.py</li>" in answer.text
                return url
            await anyio.sleep(0.1)
    raise AssertionError("the preview URL never answered")


async def _raw_get(url: str, path: str) -> tuple[Any, Any]:
    """A connection to ``url`` with a request begun, not finished."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.0\r\n".encode())
    await writer.drain()
    return reader, writer


async def test_preview_url_forwards_through_portforward_and_a_service(
        standin: KubeStandin) -> None:
    async with await hutch.create_sandbox(
            "kubernetes", kubeconfig=standin.kubeconfig, image=TEST_IMAGE) as sb:
        assert sb.capabilities.preview_url
        await sb.write_text("serve.py", LISTING_SERVER)
        url = await _listing(sb)
        assert url.startswith("http://127.0.0.1:")
        assert await sb.preview_url(8000) == url  # one listener per port
        services = [s for s in standin.objects["services"].values()
                    if s["metadata"]["labels"].get("hutch.dev/sandbox") == sb.id.lower()]
        assert [s["spec"]["ports"][0]["port"] for s in services] == [8000]
        assert services[0]["spec"]["selector"]["hutch.dev/sandbox"] == sb.id.lower()
        assert services[0]["spec"]["type"] == "ClusterIP"

        # Two connections at once, each its own port-forward: the second
        # is answered while the first is still open, its request unfinished.
        first_reader, first = await _raw_get(url, "/")
        second_reader, second = await _raw_get(url, "/")
        second.write(b"\r\n")
        assert b"<li>serve.py</li>" in await second_reader.read()
        first.write(b"\r\n")
        assert b"<li>serve.py</li>" in await first_reader.read()
        for writer in (first, second):
            writer.close()

        # A port nothing listens on: the API's error ends the connection.
        closed_port = await sb.preview_url(8001)
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await client.get(closed_port + "/", timeout=60)

        # Suspend closes the listener; the next preview_url opens another.
        await sb.suspend()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(trust_env=False) as client:
                await client.get(url + "/", timeout=10)
        await sb.resume()
        url = await _listing(sb)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(url + "/", timeout=10)
    assert [s for s in standin.objects["services"].values()
            if s["metadata"]["labels"].get("hutch.dev/sandbox") == sb.id.lower()] == []
