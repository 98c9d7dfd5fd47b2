"""The kubernetes provider against the API stand-in (tests/kube_standin.py).

The whole conformance suite runs on it with
``HUTCH_CONFORMANCE_PROVIDERS=kubernetes``; these are the quick checks of
every run: the pod's life, exec over the channel protocol, files, and the
parts of the API contract the provider leans on.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import docker
import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.kube_standin import ExecFault, KubeStandin
from tests.late_headers import exec_headers_read_late

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture(scope="module")
def standin() -> Iterator[KubeStandin]:
    server = KubeStandin().start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


async def _sandbox(standin: KubeStandin, runtime: str = "agent") -> Any:
    return await hutch.create_sandbox(
        "kubernetes", kubeconfig=standin.kubeconfig, image=TEST_IMAGE, read_before_write=False,
        runtime=runtime)


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_a_sandbox_is_a_pod_that_runs_commands_and_holds_files(
        standin: KubeStandin, runtime: str) -> None:
    async with await _sandbox(standin, runtime) as sb:
        assert sb.capabilities.runtime == runtime
        pods = list(standin.objects["pods"].values())
        assert len(pods) == 1
        labels = pods[0]["metadata"]["labels"]
        assert labels["hutch.dev/sandbox"] == sb.id.lower() and labels["hutch.dev/home"]
        result = await sb.exec(["sh", "-c", "cat; echo oops >&2; exit 3"], stdin="fed")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "fed", "oops\n")
        assert (await sb.exec("pwd")).stdout.strip() == sb.workdir
        await sb.write_text("deep/er/a.txt", "hello\n")
        assert await sb.read_text("deep/er/a.txt") == "hello\n"
        assert (await sb.exec(["cat", "deep/er/a.txt"])).stdout == "hello\n"
        assert (await sb.exec(["id", "-un"], user="nobody")).stdout.strip() == "nobody"
        with pytest.raises(FileNotFoundError):
            await sb.exec(["hutch-no-such-command"])
        process = await sb.start(["sleep", "300"])
        await process.kill()
        assert (await process.wait()).exit_code != 0
    # Closed: the pod and its container are gone.
    assert standin.objects["pods"] == {}


async def test_the_agent_serves_everything_over_one_kept_exec(standin: KubeStandin) -> None:
    async with await _sandbox(standin) as sb:
        # The pod's start: the agent copied in, then its relay.
        relays = [c for c in standin.execs if c[1:2] == ["relay"]]
        assert relays and relays[-1][0] == "/.hutch/bin/hutch-agent"
        served = len(standin.execs)
        for i in range(20):
            assert (await sb.exec(["sh", "-c", f"echo {i}"])).stdout == f"{i}\n"
        await sb.write_text("src/a.py", "needle = 1\n")
        await sb.write_bytes("big.bin", os.urandom(3 << 20))  # past one frame and one window
        assert len(await sb.read_bytes("big.bin")) == 3 << 20
        assert [m.path for m in await sb.grep("needle", ".")] == [f"{sb.workdir}/src/a.py"]
        assert await sb.glob("**/*.py") == [f"{sb.workdir}/src/a.py"]
        process = await sb.start(["sh", "-c", "read line; echo got $line"], keep_stdin=True)
        await process.write_stdin("it\n")
        assert (await process.wait()).stdout == "got it\n"
        # Not one pods/exec more: everything went over the relay.
        assert len(standin.execs) == served


async def test_a_stream_nobody_reads_holds_back_only_itself(standin: KubeStandin) -> None:
    async with await _sandbox(standin) as sb:
        # 64 MiB of output nobody reads: far past the relay's window and
        # the runtime's queue, so its stream stops; the others go on.
        flood = await sb.start(["sh", "-c", "head -c 67108864 /dev/zero"])
        for i in range(5):
            done = await asyncio.wait_for(sb.exec(["echo", str(i)]), 60)
            assert done.stdout == f"{i}\n"
        assert await asyncio.wait_for(sb.read_text("/etc/hostname"), 60)
        await flood.kill()


async def test_the_relay_opens_again_when_its_exec_drops(standin: KubeStandin) -> None:
    from hutch._sandbox import backend_of

    async with await _sandbox(standin) as sb:
        agent = backend_of(sb).agent
        sleeper = await sb.start(["sleep", "301"])
        await sb.write_text("kept.txt", "kept\n")
        relays = sum(c[1:2] == ["relay"] for c in standin.execs)
        assert standin.drop_execs() >= 1
        for _ in range(1000):  # the tunnel sees its exec end (or was opened anew)
            if not agent.connected or sum(c[1:2] == ["relay"] for c in standin.execs) > relays:
                break
            await asyncio.sleep(0.01)
        # The next request opens a new relay; the agent ran on, and so did
        # what it runs (only connections were lost).
        assert (await sb.exec(["cat", "kept.txt"])).stdout == "kept\n"
        assert agent.connected and sum(c[1:2] == ["relay"] for c in standin.execs) > relays
        busy = await sb.exec(["sh", "-c", "pgrep -fc '^sleep 301$' || true"])
        assert busy.stdout.strip() == "1"
        del sleeper
        # A pod deleted outside hutch: the sandbox is lost, and says so.
        (pod,) = standin.objects["pods"].values()
        async with httpx.AsyncClient() as http:  # as kubectl delete does
            gone = await http.delete(f"{standin.url}/api/v1/namespaces/{standin.namespace}"
                                     f"/pods/{pod['metadata']['name']}")
            assert gone.status_code == 200
        with pytest.raises(hutch.SandboxUnavailable, match=r"is (Gone|Failed)"):
            for _ in range(3):
                await sb.exec(["true"])


@pytest.fixture(scope="module")
def v4_standin() -> Iterator[KubeStandin]:
    """An API server before v5.channel.k8s.io (Kubernetes 1.29 and older)."""
    server = KubeStandin(protocols=("v4.channel.k8s.io",)).start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_an_api_server_that_speaks_only_v4(v4_standin: KubeStandin, runtime: str) -> None:
    # v4 cannot close a command's stdin: the agent is copied in by size, its
    # relay never needs to, and the native runtime writes files by size too.
    async with await _sandbox(v4_standin, runtime) as sb:
        assert (await sb.exec(["echo", "v4"])).stdout == "v4\n"
        await sb.write_text("d/f.txt", "on v4\n")
        assert await sb.read_text("d/f.txt") == "on v4\n"
        if runtime == "agent":
            assert (await sb.exec(["cat"], stdin="fed")).stdout == "fed"


async def test_a_relay_closed_ends_its_exec_even_on_v4(v4_standin: KubeStandin) -> None:
    from hutch._sandbox import backend_of

    async with await _sandbox(v4_standin) as sb:
        await backend_of(sb).agent.close()
        for _ in range(1000):  # the server sees the connection close
            if v4_standin.open_execs == 0:
                break
            await asyncio.sleep(0.01)
        assert v4_standin.open_execs == 0
        assert (await sb.exec(["echo", "again"])).stdout == "again\n"  # a new relay


def _install_exec(command: list[str]) -> bool:
    """Whether ``command`` is the exec that copies the agent in (it says ``uname -m`` first)."""
    return command[:2] == ["sh", "-c"] and command[2].lstrip().startswith("uname -m")


def _without_uname(command: list[str]) -> ExecFault:
    """The install's own script in an image that has no ``uname``."""
    return ExecFault(command=[*command[:2], "PATH=/nonexistent\n" + command[2], *command[3:]])


@pytest.mark.parametrize(("fault", "said"), [
    # The API server could not reach the kubelet: its Failure Status, no output.
    (lambda _: ExecFault(status_message="error dialing backend: dial tcp 10.0.0.7:10250: "
                                        "connect: connection refused"),
     r"error dialing backend: dial tcp 10\.0\.0\.7:10250"),
    # The connection closed with no Status (the API server or a proxy went away).
    (lambda _: ExecFault(close_code=1011, close_reason="standin: the proxy went away"),
     r"1011.*the proxy went away"),
    # The connection dropped with no close at all.
    (lambda _: ExecFault(drop=True), r"connection dropped before its status"),
    # An image without uname: the command's own exit status and stderr.
    (_without_uname, r"exit status 127.*uname: not found"),
    # An exec that never says a word: bounded (1 s here).
    (lambda _: ExecFault(command=["sh", "-c", "echo stuck >&2; sleep 600"]),
     r"said no machine in 1 s"),
], ids=["status", "closed", "dropped", "no-uname", "silent"])
async def test_an_agent_install_that_cannot_say_the_machine_says_why(
        standin: KubeStandin, monkeypatch: pytest.MonkeyPatch,
        fault: Callable[[list[str]], ExecFault], said: str) -> None:
    """CI once got "the pod's machine is 'unknown'" where the exec itself had
    failed: the error carries what the exec reported, and nothing hangs."""
    from hutch.providers.kubernetes import agentpod

    monkeypatch.setattr(agentpod, "MACHINE_ANSWER_TIMEOUT", 1.0)
    monkeypatch.setattr(standin, "exec_fault",
                        lambda command: fault(command) if _install_exec(command) else None)
    with pytest.raises(hutch.ProviderError, match=said) as failed:
        await asyncio.wait_for(_sandbox(standin), 120)
    assert "unknown" not in str(failed.value)
    assert standin.objects["pods"] == {}  # the pod made for it is gone


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_exec_output_that_came_with_the_headers_is_served(
        standin: KubeStandin, monkeypatch: pytest.MonkeyPatch, runtime: str) -> None:
    """The stand-in's exec reads docker's hijacked connection: output read
    with the response's headers by a slow thread is the stream's start, not
    lost (CI: the agent install's ``uname -m`` gave nothing under load, and
    the sandbox failed with "the pod's machine is 'unknown'")."""
    monkeypatch.setattr(standin.docker, "api",
                        exec_headers_read_late(monkeypatch, standin.docker.api, 0.5))
    async with await _sandbox(standin, runtime) as sb:  # the agent's install reads late too
        for n in range(2):
            result = await sb.exec(["sh", "-c", f"echo out-{n}; echo err-{n} >&2"])
            assert (result.exit_code, result.stdout, result.stderr) == (
                0, f"out-{n}\n", f"err-{n}\n"), result
        big = await sb.exec(["head", "-c", "300000", "/dev/zero"])  # past the reader's buffer
        assert big.stdout_bytes == bytes(300000), len(big.stdout_bytes)


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_a_command_quiet_longer_than_the_standins_docker_timeout_runs_on(
        standin: KubeStandin, monkeypatch: pytest.MonkeyPatch, runtime: str) -> None:
    """The stand-in's docker client times its requests out (60 s by default,
    1 s here): an exec's stream is no request, and a quiet command (the
    agent's relay is quiet for minutes) is not cut with no Status."""
    async with await _sandbox(standin, runtime) as sb:
        monkeypatch.setattr(standin.docker.api, "timeout", 1)
        result = await sb.exec(["sh", "-c", "sleep 3; echo done"])
        assert (result.exit_code, result.stdout) == (0, "done\n"), result
        assert (await sb.exec(["echo", "after"])).stdout == "after\n"


def test_the_standin_keeps_the_api_contract(standin: KubeStandin) -> None:
    base = f"{standin.url}/api/v1/namespaces/{standin.namespace}/persistentvolumeclaims"
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "hutch-contract"}, "spec": {}}
    with httpx.Client() as http:
        made = http.post(base, json=claim)
        assert made.status_code == 201
        uid = made.json()["metadata"]["uid"]
        again = http.post(base, json=claim)
        assert (again.status_code, again.json()["reason"]) == (409, "AlreadyExists")
        wrong = http.request("DELETE", base + "/hutch-contract",
                             json={"preconditions": {"uid": "not-" + uid}})
        assert (wrong.status_code, wrong.json()["reason"]) == (409, "Conflict")
        assert http.request("DELETE", base + "/hutch-contract",
                            json={"preconditions": {"uid": uid}}).status_code == 200
        gone = http.get(base + "/hutch-contract")
        assert (gone.status_code, gone.json()["reason"]) == (404, "NotFound")


# -- configuration ---------------------------------------------------------------------

PLACEMENT = {
    "node_selector": {"hutch-test/pool": "sandboxes"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "agents",
                     "effect": "NoSchedule"}],
    "image_pull_secrets": ["hutch-test-regcred"],
}


@pytest.fixture(scope="module")
def tainted_standin() -> Iterator[KubeStandin]:
    """A cluster whose one node is labelled for sandboxes and reserved for agents."""
    server = KubeStandin(node_labels={"hutch-test/pool": "sandboxes"},
                         node_taints=[{"key": "dedicated", "value": "agents",
                                       "effect": "NoSchedule"}]).start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


async def test_the_pod_carries_where_it_runs_and_what_it_pulls_with(
        tainted_standin: KubeStandin) -> None:
    async with await hutch.create_sandbox(
            "kubernetes", kubeconfig=tainted_standin.kubeconfig, image=TEST_IMAGE,
            memory="256m", cpus=0.5, **PLACEMENT) as sb:
        assert sb.capabilities.resource_limits
        assert (await sb.exec(["echo", "placed"])).stdout == "placed\n"
        (pod,) = tainted_standin.objects["pods"].values()
        spec = pod["spec"]
        assert spec["containers"][0]["resources"] == {
            "limits": {"memory": str(256 << 20), "cpu": "500m"}}
        # Held where the container runs (the stand-in's kubelet: docker's cgroup).
        host = docker.from_env().api.inspect_container(
            f"kube-standin-{pod['metadata']['uid']}")["HostConfig"]
        assert (host["Memory"], host["NanoCpus"]) == (256 << 20, 500_000_000)
        assert spec["nodeSelector"] == {"hutch-test/pool": "sandboxes"}
        assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal",
                                        "value": "agents", "effect": "NoSchedule"}]
        assert spec["imagePullSecrets"] == [{"name": "hutch-test-regcred"}]
    # Without the toleration the node does not take the pod: it stays
    # Pending, and the sandbox is refused with the scheduler's reason, its pod gone.
    with pytest.raises(hutch.SandboxUnavailable, match="untolerated taint"):
        await hutch.create_sandbox(
            "kubernetes", kubeconfig=tainted_standin.kubeconfig, image=TEST_IMAGE,
            node_selector=PLACEMENT["node_selector"], ready_timeout=2)
    assert tainted_standin.objects["pods"] == {}


def test_settings_are_validated() -> None:
    from hutch.providers.kubernetes.config import KubernetesConfig

    for bad in ({"namespace": "Not_A_Namespace"}, {"image_pull_secrets": ["UPPER"]},
                {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
                {"tolerations": [{"operator": "Equal"}]},
                {"in_cluster": True, "kubeconfig": "/x"}):
        with pytest.raises(ValueError):
            KubernetesConfig.model_validate(bad)


def _daemon_with(*args: str, server_toml: str = "",
                 extra_env: dict[str, str] | None = None) -> DaemonProcess:
    config = os.path.join(tempfile.mkdtemp(prefix="hutch-conf-"), "hutch.toml")
    with open(config, "w") as fh:
        fh.write(server_toml)
    return DaemonProcess(token=f"tok-{uuid.uuid4().hex}", provider=None,
                         extra_args=["--config", config, *args], extra_env=extra_env).start()


def _refused(d: DaemonProcess, body: dict[str, Any], setting: str) -> None:
    answer = httpx.post(f"{d.url}/v1/sandboxes", json={"provider": "kubernetes", **body},
                        headers={"Authorization": f"Bearer {d.token}"}, timeout=60)
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "permission_denied"
    assert repr(setting) in error["message"] and f"--allow {setting}" in error["message"]


def test_through_the_daemon_the_cluster_and_placement_are_the_operators(
        tainted_standin: KubeStandin) -> None:
    kubeconfig = tainted_standin.kubeconfig
    # An operator who named no cluster: neither the daemon user's default
    # kubeconfig (here $KUBECONFIG, the stand-in's), nor a file of the
    # client's choosing, nor the daemon's service account is a client's to use.
    d = _daemon_with(extra_env={"KUBECONFIG": kubeconfig})
    try:
        _refused(d, {"image": TEST_IMAGE}, "kubeconfig")
        _refused(d, {"image": TEST_IMAGE, "kubeconfig": kubeconfig}, "kubeconfig")
        _refused(d, {"image": TEST_IMAGE, "in_cluster": True}, "in_cluster")
    finally:
        d.close()
    # The operator names the cluster: clients use it, but where pods go, what
    # they pull with, and another cluster or namespace stay the operator's.
    operators = (f'[providers.kubernetes]\nkubeconfig = "{kubeconfig}"\n'
                 f'image = "{TEST_IMAGE}"\ntolerations = [{{key = "dedicated", '
                 'operator = "Equal", value = "agents", effect = "NoSchedule"}]\n')
    d = _daemon_with(server_toml=operators)
    try:
        for setting, value in [("node_selector", PLACEMENT["node_selector"]),
                               ("tolerations", [{"operator": "Exists"}]),
                               ("image_pull_secrets", PLACEMENT["image_pull_secrets"]),
                               ("namespace", "elsewhere"), ("context", "other"),
                               ("storage_class", "fast-ssd"),
                               ("kubeconfig", "/etc/hutch-test-other-kubeconfig")]:
            _refused(d, {setting: value}, setting)
        with hutch.Client(d.url, token=d.token) as client:
            # The operator's own settings, left as they are or asked for alike.
            sb = client.create_sandbox("kubernetes", tolerations=PLACEMENT["tolerations"])
            try:
                assert sb.exec("echo ok").stdout == "ok\n"
            finally:
                sb.close()
    finally:
        d.close()
    d = _daemon_with("--allow", "node_selector", "--allow", "tolerations",
                     "--allow", "image_pull_secrets", server_toml=operators)
    try:
        with hutch.Client(d.url, token=d.token) as client:
            sb = client.create_sandbox("kubernetes", **PLACEMENT)
            try:
                assert sb.exec("echo placed").stdout == "placed\n"
                (pod,) = tainted_standin.objects["pods"].values()
                assert pod["spec"]["nodeSelector"] == PLACEMENT["node_selector"]
                assert pod["spec"]["imagePullSecrets"] == [{"name": "hutch-test-regcred"}]
                assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
                # A request that set no limits gets the daemon's.
                assert pod["spec"]["containers"][0]["resources"]["limits"] == {
                    "memory": str(2 << 30), "cpu": "1000m"}
            finally:
                sb.close()
    finally:
        d.close()


def test_the_agent_is_built_for_the_machine_the_pod_runs_on() -> None:
    """A cluster's nodes need not be the daemon's machine (arm64 nodes, an
    amd64 daemon): the pod says its ``uname -m`` and gets the agent for it,
    cross-built by Go (its standard library only) and cached beside the host's."""
    from hutch.providers.agent import AgentUnavailable, agent_binary
    from hutch.providers.agent.build import host_arch

    arm = agent_binary(arch="arm64").read_bytes()
    assert arm[:4] == b"\x7fELF" and int.from_bytes(arm[18:20], "little") == 183  # EM_AARCH64
    assert agent_binary(arch=host_arch()) == agent_binary()
    with pytest.raises(AgentUnavailable, match="vax"):
        agent_binary(arch="vax")
