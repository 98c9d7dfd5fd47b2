"""Every value is checked before anything is made: through a real daemon,
a bad value (a size, a provider that is not a name, text no system call
takes, a mount point over the kernel's file systems, a command past the
kernel's limits) answers 400 ``invalid_argument`` naming the field, makes
nothing, and shows no path of the daemon's own data directory. Then
hypothesis sends hostile create and exec bodies: never a 500."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hutch
from hutch._values import MAX_COMMAND_BYTES
from tests.daemon_fixture import DaemonProcess, containers_of

#: 100 kB pieces that together pass the command size limit.
_PIECES_PAST_THE_LIMIT = MAX_COMMAND_BYTES // 100_000 + 1

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=180,
                      headers={"Authorization": f"Bearer {daemon.token}"}) as c:
        yield c


def post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    """``body`` as JSON, written by hand where Python's encoder would refuse
    (a lone surrogate travels as its ``\\ud800`` escape)."""
    raw = json.dumps(body, ensure_ascii=True)
    return client.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def refused(answer: httpx.Response, field: str, daemon: DaemonProcess) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument", error
    assert field in error["message"], error
    assert daemon.data_dir not in error["message"], error


HUGE = "9" * 100_000
BAD_SIZES: list[Any] = ["abc", -5, 0, "0", "-1g", HUGE, "x" * 100_000, True, 1.5, "1", "100k",
                        "2048t", [], {}]
BAD_CREATES: list[tuple[dict[str, Any], str]] = [
    *[({"provider": p, key: v}, key) for p in ("docker", "bubblewrap")
      for key in ("memory", "disk") for v in BAD_SIZES],
    *[({"provider": p, key: v}, key) for p in ("docker", "bubblewrap")
      for key in ("cpus", "pids_limit") for v in (True, -1, 0, "abc", float("inf"))],
    ({"provider": "bubblewrap", "image": "\ud800"}, "image"),
    ({"provider": "bubblewrap", "image": "a\0b"}, "image"),
    ({"provider": "docker", "image": "\udfff"}, "image"),
    *[({"provider": p, "image": name}, "image") for p in ("docker", "bubblewrap")
      for name in ("x" * 100_000, "../../etc", "a/../b", "-rm", "a b", ":")],
    ({"provider": "bubblewrap", "image": "UPPER"}, "image"),
    ({"provider": "docker", "env": {"A": "\udc00"}}, "env"),
    ({"provider": "docker", "env": {"\ud800": "a"}}, "env"),
    ({"provider": "bubblewrap", "env": {"A": "a\0"}}, "env"),
    ({"provider": "docker", "labels": {"x": "\ud800"}}, "labels"),
    ({"provider": "docker", "runtime": "fast"}, "runtime"),
    ({"provider": "bubblewrap", "network": "some"}, "network"),
    *[({"provider": v}, "provider") for v in (0, {}, [], 1.5, True)],
    ({"provider": "docker", "providers": 5}, "providers"),
    ({"provider": "docker", "options": "x"}, "options"),
    ({"provider": "docker", "idle_timeout": "soon"}, "idle_timeout"),
    *[({"provider": "docker", "mount_point": p}, "mount_point")
      for p in ("/proc", "/proc/x", "/sys", "/sys/fs", "/dev", "/dev/shm", "/", "//", "/etc",
                "/usr", "relative", "/a:ro", "/.hutch", "/proc/../proc", "/w\ud800")],
    *[({"provider": "bubblewrap", "workdir": p}, "workdir")
      for p in ("/proc", "/sys/kernel", "/dev", "/", "/bin", "x")],
]


def _id(case: tuple[dict[str, Any], str]) -> str:
    return json.dumps(case[0], ensure_ascii=True)[:60]


@pytest.mark.parametrize("body,field", BAD_CREATES, ids=[_id(c) for c in BAD_CREATES])
def test_a_bad_setting_is_refused_naming_it(
    daemon: DaemonProcess, client: httpx.Client, body: dict[str, Any], field: str
) -> None:
    refused(post(client, "/v1/sandboxes", body), field, daemon)
    # Nothing was made: no sandbox, no container.
    assert client.get("/v1/sandboxes").json()["sandboxes"] == []
    assert containers_of(daemon.data_dir) == []


def test_a_workspace_name_is_a_string(daemon: DaemonProcess, client: httpx.Client) -> None:
    for raw in (b'{"name": Infinity, "provider": "virtual"}', b'{"name": 5, "provider": "virtual"}',
                b'{"name": "ok\\n", "provider": "virtual"}',
                b'{"name": "ok", "provider": "virtual", "snapshot_tag": 7}'):
        answer = client.post("/v1/workspaces", content=raw,
                             headers={"content-type": "application/json"})
        assert answer.status_code in (400, 404), answer.text
        assert answer.json()["error"]["code"] in ("invalid_argument", "not_found"), answer.text
    assert client.get("/v1/workspaces").json()["workspaces"] == []
    refused(post(client, "/v1/workspaces", {"name": "\ud800", "provider": "virtual"}),
            "name", daemon)


def test_definitions_and_threads_take_text_only(
    daemon: DaemonProcess, client: httpx.Client
) -> None:
    refused(client.put("/v1/definitions/d1", content=json.dumps(
        {"provider": "virtual", "tenant": "\ud800"}).encode(),
        headers={"content-type": "application/json"}), "tenant", daemon)
    refused(client.put("/v1/definitions/d1", content=json.dumps(
        {"provider": "virtual", "workspace": {"setup": ["echo \udc80"]}}).encode(),
        headers={"content-type": "application/json"}), "setup", daemon)
    assert client.get("/v1/definitions").json()["definitions"] == []


@pytest.fixture(scope="module")
def sandbox(client: httpx.Client) -> Iterator[str]:
    made = client.post("/v1/sandboxes", json={"provider": "docker", "runtime": "agent"})
    assert made.status_code == 201, made.text
    sid = str(made.json()["id"])
    yield sid
    client.delete(f"/v1/sandboxes/{sid}")


BAD_EXECS: list[tuple[dict[str, Any], str]] = [
    ({"cmd": "cat", "stdin": "\ud800"}, "stdin"),
    ({"cmd": "echo \ud800"}, "cmd"),
    ({"cmd": ["echo", "\udc00"]}, "cmd"),
    ({"cmd": ["echo", "a\0b"]}, "cmd"),
    ({"cmd": "env", "env": {"A": "\udc00"}}, "env"),
    ({"cmd": "env", "env": {"A": "a\0"}}, "env"),
    ({"cmd": "env", "env": {"A=B": "a"}}, "env"),
    ({"cmd": "pwd", "cwd": "\udc00"}, "cwd"),
    ({"cmd": "id", "user": "\ud800"}, "user"),
    ({"cmd": "true " + "x" * 2_000_000}, "cmd"),
    ({"cmd": ["true", "x" * 200_000]}, "cmd"),
    # Past the limit in many pieces, each small: the limit is on the whole.
    ({"cmd": ["true", *(["x" * 100_000] * _PIECES_PAST_THE_LIMIT)]}, "cmd"),
    ({"cmd": "env", "env": {f"V{i}": "x" * 100_000 for i in range(_PIECES_PAST_THE_LIMIT)}},
     "cmd and env"),
]


@pytest.mark.parametrize("body,field", BAD_EXECS, ids=[_id(c) for c in BAD_EXECS])
@pytest.mark.parametrize("route", ["exec", "exec/stream", "processes"])
def test_a_bad_command_is_refused_naming_it(
    daemon: DaemonProcess, client: httpx.Client, sandbox: str, route: str,
    body: dict[str, Any], field: str,
) -> None:
    refused(post(client, f"/v1/sandboxes/{sandbox}/{route}", body), field, daemon)
    assert client.get(f"/v1/sandboxes/{sandbox}/processes").json()["processes"] == []


def test_the_sdk_in_process_checks_the_same(tmp_path: Any) -> None:
    """The rules are the models' and the sandbox's, not the HTTP layer's."""
    with pytest.raises(hutch.InvalidArgument, match="memory"):
        hutch.create_sandbox_sync("docker", memory="abc")
    with pytest.raises(hutch.InvalidArgument, match="mount_point"):
        hutch.create_sandbox_sync("docker", mount_point="/proc")
    with pytest.raises(hutch.InvalidArgument, match="image"):
        hutch.create_sandbox_sync("bubblewrap", image="\ud800")
    with pytest.raises(hutch.InvalidArgument, match="provider"):
        hutch.create_sandbox_sync(0)  # type: ignore[arg-type]
    sb = hutch.create_sandbox_sync("local", workdir=str(tmp_path))
    try:
        for call in (lambda: sb.exec("cat", stdin="\ud800"), lambda: sb.exec(["echo", "\udc00"]),
                     lambda: sb.exec("true " + "x" * 200_000),
                     lambda: sb.exec("env", env={"A": "\0"}),
                     # stdin of a type it cannot be, to a background command as to exec
                     lambda: sb.start("cat", stdin=True),  # type: ignore[arg-type]
                     lambda: sb.start("cat", stdin=5)):  # type: ignore[arg-type]
            with pytest.raises(hutch.InvalidArgument):
                call()
        assert sb.exec("pwd").stdout.strip() == str(tmp_path)
    finally:
        sb.close()


# -- fuzzed: never a 500 ---------------------------------------------------------------------

_hostile_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udc00b", "\0", "", "/proc", "/dev/x", "..", "Infinity",
                     "1g", "0", "-1", "9" * 40, "abc"]),
)
_hostile_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              _hostile_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(_hostile_text, inner, max_size=3)),
    max_leaves=6,
)
_SETTINGS = ["memory", "disk", "cpus", "pids_limit", "image", "mount_point", "workdir", "env",
             "network", "runtime", "labels", "idle_timeout", "max_lifetime", "output_limit",
             "providers", "options", "from_snapshot", "hostname"]


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(provider=st.one_of(st.sampled_from(["docker", "bubblewrap", "virtual"]), _hostile_value),
       fields=st.dictionaries(st.sampled_from(_SETTINGS), _hostile_value, min_size=1,
                              max_size=3))
def test_fuzzed_create_bodies_never_answer_500(
    daemon: DaemonProcess, client: httpx.Client, provider: Any, fields: dict[str, Any]
) -> None:
    body = {"provider": provider, **fields}
    answer = post(client, "/v1/sandboxes", body)
    if answer.status_code == 201:
        client.delete(f"/v1/sandboxes/{answer.json()['id']}")
        return
    assert answer.status_code < 500, (body, answer.text)
    assert daemon.data_dir not in answer.text, (body, answer.text)


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(words=st.lists(_hostile_text, min_size=0, max_size=3),
       as_list=st.booleans(),
       extra=st.dictionaries(st.sampled_from(["cwd", "env", "stdin", "user", "timeout",
                                              "output_limit", "stdin_b64"]),
                             _hostile_value, max_size=3))
def test_fuzzed_exec_bodies_never_answer_500(
    daemon: DaemonProcess, client: httpx.Client, sandbox: str, words: list[str],
    as_list: bool, extra: dict[str, Any],
) -> None:
    # Only echo ever runs: the words are its arguments, quoted.
    cmd: Any = ["echo", *words] if as_list else "echo " + " ".join(
        shlex.quote(w) for w in words)
    answer = post(client, f"/v1/sandboxes/{sandbox}/exec", {"cmd": cmd, **extra})
    assert answer.status_code < 500, (cmd, extra, answer.text)
    assert daemon.data_dir not in answer.text, (cmd, extra, answer.text)



def test_no_error_shows_a_path_in_the_data_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Whatever a provider's message says (an Engine's mount error, a layer
    that would not mount), the daemon's answer says its data directory by
    name, keeping what follows (the file a caller named); a path that only
    starts alike is not touched."""
    from hutch._errors import ProviderError
    from hutch.server.errors import error_json

    home = str(tmp_path / "home")
    monkeypatch.setenv("HUTCH_HOME", home)
    said = error_json(ProviderError(
        f'error mounting "{home}/layers/mounts/sb-1/merged" to rootfs at "/proc"; '
        f"store {home}/hutch.db, {home}, a file {home}/sandboxes/sb-1/workspace/x "
        f"and {home}x/y"
    ))["error"]["message"]
    assert said == (
        'error mounting "<hutch data directory>/layers/mounts/sb-1/merged" to rootfs at '
        '"/proc"; store <hutch data directory>/hutch.db, <hutch data directory>, a file '
        f"<hutch data directory>/sandboxes/sb-1/workspace/x and {home}x/y"
    )
