"""Settings and providers that reach the host are the operator's; limits
apply by default.

Through a real daemon: each host-reaching setting a client asks for is
refused with ``permission_denied`` naming it and how the operator allows it;
the operator's ``--allow`` and hutch.toml ``[server]`` let it through; so are
providers that run on the host itself (``local``, ``ssh``: ``--allow-provider``,
``providers = [...]``), and a request that names no provider gets the
operator's default, never ``local`` unless the operator chose it. In
process, where the caller is the operator, everything stays allowed. A docker
sandbox made with no limits gets the server's (tests/test_containment.py
has an 8 GiB allocation killed at it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.hazards import workload_limits


def start(*args: str) -> DaemonProcess:
    """A daemon as its operator starts it: no default provider named (the
    daemon's own choice: docker here), nothing on the host allowed but by ``args``."""
    return DaemonProcess(token=f"tok-{uuid.uuid4().hex}", provider=None, extra_args=args).start()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = start()
    yield d
    d.close()


def post(d: DaemonProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{d.url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {d.token}"})


def made(d: DaemonProcess) -> set[str]:
    listed = httpx.get(f"{d.url}/v1/sandboxes?all=true",
                       headers={"Authorization": f"Bearer {d.token}"}).json()
    return {s["id"] for s in listed["sandboxes"]}


HOST_REACHING = [
    ("mounts", {"mounts": ["/etc:/host-etc"]}),
    ("mounts", {"providers": {"docker": {"mounts": ["/:/host:ro"]}}}),
    ("host_workdir", {"host_workdir": "/etc"}),
    ("network_mode", {"network_mode": "host"}),
    ("network_mode", {"network_mode": "container:some-other-sandbox"}),
    ("cap_drop", {"cap_drop": []}),
    ("cap_drop", {"cap_drop": ["MKNOD"]}),
    # Outliving hutch's cleanup, and hutch's own marks, are the operator's too.
    ("preserve", {"preserve": True}),
    ("labels", {"labels": {"hutch.preserve": "1"}}),
    ("labels", {"labels": {"team": "a", "HUTCH.home": "/elsewhere"}}),
]
#: Other providers' settings that reach the host, each refused alike.
OTHER_PROVIDERS = [
    # The daemon user's ssh keys are the operator's to aim.
    ("destination", {"provider": "ssh", "destination": "h", "working_directory": "/tmp"}),
    ("config_file", {"provider": "ssh", "destination": "h", "working_directory": "/tmp",
                     "config_file": "/tmp/evil-ssh-config-with-a-ProxyCommand"}),
    ("known_hosts", {"provider": "ssh", "destination": "h", "working_directory": "/tmp",
                     "known_hosts": "/etc/passwd"}),
    ("rootfs", {"provider": "bubblewrap", "rootfs": "/"}),
]


@pytest.mark.parametrize(("setting", "body"), HOST_REACHING)
def test_a_host_reaching_setting_is_refused(
    daemon: DaemonProcess, setting: str, body: dict[str, Any]
) -> None:
    before = made(daemon)
    answer = post(daemon, "/v1/sandboxes", {"provider": "docker", "image": TEST_IMAGE, **body})
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "permission_denied"
    assert repr(setting) in error["message"]
    assert f"--allow {setting}" in error["message"] and "[server]" in error["message"]
    assert made(daemon) == before  # nothing was made


@pytest.fixture(scope="module")
def daemon_allowing_ssh() -> Iterator[DaemonProcess]:
    d = start("--allow-provider", "ssh")
    yield d
    d.close()


@pytest.fixture(scope="module")
def daemon_allowing_destination() -> Iterator[DaemonProcess]:
    d = start("--allow-provider", "ssh", "--allow", "destination")
    yield d
    d.close()


@pytest.mark.parametrize(("setting", "body"), OTHER_PROVIDERS)
def test_other_providers_host_settings_are_refused(
    daemon: DaemonProcess, request: pytest.FixtureRequest, setting: str, body: dict[str, Any]
) -> None:
    if body.get("provider") == "ssh":
        # Past the provider (allowed here) and the destination (allowed for
        # the others), each ssh setting is judged.
        daemon = request.getfixturevalue(
            "daemon_allowing_ssh" if setting == "destination" else "daemon_allowing_destination"
        )
    answer = post(daemon, "/v1/sandboxes", body)
    assert answer.status_code == 403, answer.text
    assert repr(setting) in answer.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"host_workdir": "/etc"}, {"mounts": ["/root:/r"]}])
def test_a_workspace_cannot_bring_host_settings(
    daemon: DaemonProcess, body: dict[str, Any]
) -> None:
    answer = post(daemon, "/v1/workspaces",
                  {"name": f"w{uuid.uuid4().hex[:8]}", "provider": "docker", "image": TEST_IMAGE,
                   **body})
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["code"] == "permission_denied"


# -- providers that run on the host itself ------------------------------------------------------


HOST_PROVIDERS = [
    ("local", {"provider": "local", "workdir": "/etc"}),
    ("local", {"provider": "local"}),
    ("ssh", {"provider": "ssh", "destination": "h", "working_directory": "/tmp"}),
]


def put(d: DaemonProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.put(f"{d.url}{path}", json=body, timeout=120,
                     headers={"Authorization": f"Bearer {d.token}"})


def get(d: DaemonProcess, path: str) -> Any:
    answer = httpx.get(f"{d.url}{path}", headers={"Authorization": f"Bearer {d.token}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def assert_provider_refused(answer: httpx.Response, name: str) -> None:
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "permission_denied"
    assert repr(name) in error["message"]
    assert f"--allow-provider {name}" in error["message"] and "[server]" in error["message"]


@pytest.mark.parametrize(("name", "body"), HOST_PROVIDERS)
def test_a_provider_on_the_host_is_refused_by_default(
    daemon: DaemonProcess, name: str, body: dict[str, Any]
) -> None:
    before = made(daemon)
    assert_provider_refused(post(daemon, "/v1/sandboxes", body), name)
    assert_provider_refused(
        post(daemon, "/v1/workspaces", {"name": f"w{uuid.uuid4().hex[:8]}", **body}), name
    )
    settings = {k: v for k, v in body.items() if k != "provider"}
    definition = f"d{uuid.uuid4().hex[:8]}"
    assert_provider_refused(
        put(daemon, f"/v1/definitions/{definition}", {"provider": {"type": name, **settings}}),
        name,
    )
    assert made(daemon) == before  # nothing was made
    assert get(daemon, "/v1/workspaces")["workspaces"] == []
    assert definition not in [d["id"] for d in get(daemon, "/v1/definitions")["definitions"]]


def test_the_operator_allows_a_provider_on_the_host_by_flag_and_by_config_file() -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-allowed-local-")
    config = os.path.join(tempfile.mkdtemp(prefix="hutch-conf-"), "hutch.toml")
    with open(config, "w") as fh:
        fh.write('[server]\nproviders = ["local"]\n')
    try:
        for d in (start("--allow-provider", "local"), start("--config", config)):
            try:
                with hutch.Client(d.url, token=d.token) as c:
                    sb = c.create_sandbox("local", workdir=workdir)
                    try:
                        assert sb.exec("id -u").stdout.strip() == str(os.getuid())
                    finally:
                        sb.close()
                    # Allowed by name, not made the default.
                    assert put(d, "/v1/definitions/plain", {}).json()["provider"]["type"] != (
                        "local")
            finally:
                d.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_relative_host_path_is_refused_through_the_daemon() -> None:
    # A path on the daemon's host, relative, would resolve against the
    # daemon's own working directory, which no client knows: refused as
    # such, before anything is made, even where the setting is allowed.
    d = start("--allow-provider", "local", "--allow", "rootfs")
    try:
        for body, setting in (
            ({"provider": "local", "workdir": "sub"}, "workdir"),
            ({"provider": "local", "workdir": "~/sub"}, "workdir"),
            ({"provider": "local", "providers": {"local": {"workdir": "./sub"}}}, "workdir"),
            ({"provider": "bubblewrap", "rootfs": "rootfs"}, "rootfs"),
        ):
            before = made(d)
            answer = post(d, "/v1/sandboxes", body)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["code"] == "invalid_argument"
            assert setting in error["message"] and "absolute" in error["message"]
            assert made(d) == before
    finally:
        d.close()


def test_an_unknown_provider_allowance_is_refused_at_start() -> None:
    d = DaemonProcess(provider=None, extra_args=["--allow-provider", "no-such-provider"])
    with pytest.raises(RuntimeError, match="no such provider"):
        d.start()


@pytest.mark.docker
def test_a_request_that_names_no_provider_gets_the_daemons_default(
    daemon: DaemonProcess,
) -> None:
    # The operator named none: the daemon's own choice is docker where its
    # Engine answers (never local, the in-process default).
    answer = post(daemon, "/v1/sandboxes", {})
    assert answer.status_code == 201, answer.text
    try:
        assert answer.json()["provider"] == "docker"
    finally:
        httpx.delete(f"{daemon.url}/v1/sandboxes/{answer.json()['id']}", timeout=120,
                     headers={"Authorization": f"Bearer {daemon.token}"})
    assert put(daemon, "/v1/definitions/no-provider", {}).json()["provider"]["type"] == "docker"


@pytest.mark.docker
def test_a_daemon_configured_for_docker_makes_docker_sandboxes_of_requests_naming_none(
    tmp_path: Any,
) -> None:
    config = tmp_path / "hutch.toml"
    # local allowed by name, docker the default: a request naming none gets docker.
    config.write_text(
        '[sandbox]\nprovider = "docker"\n[server]\nproviders = ["local"]\n'
        '[definitions.operators]\nworkspace = { setup = ["true"] }\n'
    )
    d = start("--config", str(config))
    try:
        answer = post(d, "/v1/sandboxes", {"idle_timeout": 600})
        assert answer.status_code == 201, answer.text
        assert answer.json()["provider"] == "docker"
        ws = post(d, "/v1/workspaces", {"name": "plain"})
        assert ws.status_code == 201, ws.text
        assert ws.json()["provider"] == "docker"
        assert put(d, "/v1/definitions/theirs", {}).json()["provider"]["type"] == "docker"
        listed = {x["id"]: x for x in get(d, "/v1/definitions")["definitions"]}
        # The operator's own definition that names no provider: the default too.
        assert listed["operators"]["provider"]["type"] == "docker"
    finally:
        d.close()


def test_an_unknown_allowance_is_refused_at_start() -> None:
    d = DaemonProcess(extra_args=["--allow", "image"])
    with pytest.raises(RuntimeError, match="not a setting that reaches the host"):
        d.start()


def test_a_limit_over_the_ceiling_is_refused(daemon: DaemonProcess) -> None:
    answer = post(daemon, "/v1/sandboxes",
                  {"provider": "docker", "image": TEST_IMAGE, "memory": "64g"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument"
    assert "ceiling of 16g" in error["message"] and "[server.ceilings]" in error["message"]


# -- with a Docker Engine --------------------------------------------------------------------


def host_config(sandbox_id: str) -> dict[str, Any]:
    """The container's HostConfig, with ``Memory`` and ``PidsLimit`` those
    that hold what runs in it (the agent's workload cgroup: the caller's)."""
    info: dict[str, Any] = docker.APIClient().inspect_container(f"hutch-{sandbox_id}")
    config = dict(info["HostConfig"])
    config["Memory"], config["PidsLimit"] = workload_limits(info["Id"])
    return config


@pytest.mark.docker
def test_the_operator_allows_a_setting_by_flag_and_by_config_file() -> None:
    shared = tempfile.mkdtemp(prefix="hutch-allowed-")
    with open(os.path.join(shared, "from-host.txt"), "w") as fh:
        fh.write("shared on purpose")
    config = os.path.join(tempfile.mkdtemp(prefix="hutch-conf-"), "hutch.toml")
    with open(config, "w") as fh:
        fh.write('[server]\nallow = ["host_workdir"]\n')
    d = start("--allow", "mounts", "--config", config)
    try:
        with hutch.Client(d.url, token=d.token) as c:
            sb = c.create_sandbox("docker", image=TEST_IMAGE, mounts=[f"{shared}:/shared:ro"])
            try:
                assert sb.exec("cat /shared/from-host.txt").stdout == "shared on purpose"
            finally:
                sb.close()
            sb = c.create_sandbox("docker", image=TEST_IMAGE, host_workdir=shared)
            try:
                assert sb.read_text("from-host.txt") == "shared on purpose"
            finally:
                sb.close()
            with pytest.raises(PermissionError, match="cap_drop"):
                c.create_sandbox("docker", image=TEST_IMAGE, cap_drop=[])
    finally:
        d.stop()
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.docker
@pytest.mark.anyio
async def test_in_process_the_caller_is_the_operator() -> None:
    shared = tempfile.mkdtemp(prefix="hutch-inproc-")
    try:
        async with await hutch.create_sandbox(
            "docker", image=TEST_IMAGE, mounts=[f"{shared}:/shared"], cap_drop=[]
        ) as sb:
            await sb.exec("echo hi > /shared/x")
        with open(os.path.join(shared, "x")) as fh:
            assert fh.read() == "hi\n"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.docker
def test_server_limits_apply_when_a_request_sets_none(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        plain = c.create_sandbox("docker", image=TEST_IMAGE)
        chosen = c.create_sandbox("docker", image=TEST_IMAGE, memory="512m", cpus=0.5,
                                  pids_limit=64)
        try:
            assert plain.capabilities.resource_limits and plain.capabilities.disk_limit
            # The working directory is a file system of its own, capped at 4 GiB.
            size = plain.exec("df -B1 --output=size /workspace | tail -1").stdout.strip()
            assert 3.5 * 1024**3 < int(size) <= 4 * 1024**3, size
            defaults = host_config(plain.id)
            assert defaults["Memory"] == 2 * 1024**3
            assert defaults["NanoCpus"] == 1_000_000_000
            assert defaults["PidsLimit"] == 1024
            own = host_config(chosen.id)
            assert (own["Memory"], own["NanoCpus"], own["PidsLimit"]) == (
                512 * 1024**2, 500_000_000, 64)
        finally:
            plain.close()
            chosen.close()


@pytest.mark.docker
def test_operator_limits_from_the_config_file() -> None:
    config = os.path.join(tempfile.mkdtemp(prefix="hutch-conf-"), "hutch.toml")
    with open(config, "w") as fh:
        fh.write('[server.limits]\nmemory = "256m"\npids = 100\n'
                 '[server.ceilings]\nmemory = "1g"\n')
    d = start("--config", config)
    try:
        with hutch.Client(d.url, token=d.token) as c:
            sb = c.create_sandbox("docker", image=TEST_IMAGE)
            try:
                hc = host_config(sb.id)
                assert (hc["Memory"], hc["PidsLimit"]) == (256 * 1024**2, 100)
            finally:
                sb.close()
            with pytest.raises(ValueError, match="ceiling of 1g"):
                c.create_sandbox("docker", image=TEST_IMAGE, memory="2g")
    finally:
        d.stop()


# The 8 GiB allocation killed at the default limit, and told: tests/test_containment.py.
