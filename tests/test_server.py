"""The HTTP layer: the fast path answers exactly as the FastAPI routes do."""

from __future__ import annotations

import base64
import json
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import httpx
import pytest

from hutch.daemon import Daemon, OperatorPolicy
from hutch.server import ServerSettings, create_app
from tests.daemon_fixture import DaemonProcess

#: The fast path takes application/json; FastAPI also takes any +json type, so
#: this content type reaches the FastAPI route with the same body.
VIA_FASTAPI = "application/vnd.hutch+json"


@pytest.fixture(scope="module")
def http() -> Iterator[tuple[httpx.Client, str]]:
    daemon = DaemonProcess().start()
    workdir = tempfile.mkdtemp()
    headers = {"Authorization": f"Bearer {daemon.token}"}
    try:
        with httpx.Client(base_url=daemon.url, headers=headers, timeout=30) as client:
            made = client.post("/v1/sandboxes", json={"provider": "local", "workdir": workdir})
            assert made.status_code == 201, made.text
            yield client, made.json()["id"]
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(daemon.data_dir, ignore_errors=True)


def both_ways(client: httpx.Client, path: str, body: dict[str, object]) -> list[httpx.Response]:
    return [
        client.post(path, json=body),
        client.post(path, content=httpx.Request("POST", "/", json=body).content,
                    headers={"content-type": VIA_FASTAPI}),
    ]


@pytest.mark.parametrize("body", [
    {"cmd": ["echo", "hi"]},
    {"cmd": "printf '\\377\\376'; echo err >&2; exit 3"},  # not UTF-8: base64 on the wire
    {"cmd": "cat; echo $X", "stdin_b64": base64.b64encode(b"in\n").decode(), "env": {"X": "1"}},
    {"cmd": "sleep 5", "timeout": 0.2},  # an error: exec_timeout
    {"cmd": []},  # an error raised by the sandbox: invalid_argument
    {"cmd": "true", "timeout": -1},  # refused by validation: the fast path falls through
    {"cmd": "true", "bogus": 1},
])
def test_exec_fast_path_and_route_agree(http: tuple[httpx.Client, str], body: dict[str, object]
                                        ) -> None:
    client, sid = http
    fast, routed = both_ways(client, f"/v1/sandboxes/{sid}/exec", body)
    assert (fast.status_code, fast.json()) == (routed.status_code, routed.json())


@pytest.mark.parametrize("body", [
    {"provider": "nope"},  # an error of the daemon's: the same either way
    {"provider": "local", "bogus": 1},
    {"provider": "local", "timeout": "soon"},
    {"from_snapshot": 3},  # a create from a snapshot: FastAPI's route answers
    [1, 2],  # not an object: FastAPI's validation answers
])
def test_create_fast_path_and_route_agree_on_errors(
    http: tuple[httpx.Client, str], body: object
) -> None:
    client, _ = http
    raw = json.dumps(body).encode()  # ASCII: a lone surrogate as its escape
    fast = client.post("/v1/sandboxes", content=raw,
                       headers={"content-type": "application/json"})
    routed = client.post("/v1/sandboxes", content=raw, headers={"content-type": VIA_FASTAPI})
    assert fast.status_code == routed.status_code
    assert fast.status_code != 201
    assert fast.json() == routed.json()


def test_create_with_a_lone_surrogate_is_refused_naming_its_field(
    http: tuple[httpx.Client, str]
) -> None:
    # TextBodiesRoute's check (application/json bodies only): the fast path leaves it that.
    client, _ = http
    raw = json.dumps({"provider": "local", "workdir": "/tmp", "env": {"X": "\ud800"}}).encode()
    answer = client.post("/v1/sandboxes", content=raw,
                         headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith("env.X is not valid text")


def test_create_fast_path_and_route_make_alike(http: tuple[httpx.Client, str]) -> None:
    client, _ = http
    workdir = tempfile.mkdtemp()
    try:
        made = both_ways(client, "/v1/sandboxes", {"provider": "local", "workdir": workdir,
                                                    "env": {"X": "1"}})
        assert [m.status_code for m in made] == [201, 201], [m.text for m in made]
        fast, routed = (m.json() for m in made)
        assert fast["id"] != routed["id"]
        varying = {"id", "created_at_unix", "deadline_unix", "last_active_unix", "meter",
                   "memory_bytes", "disk_bytes", "description", "status", "idle_seconds"}
        assert {k: v for k, v in fast.items() if k not in varying} == {
            k: v for k, v in routed.items() if k not in varying}
        assert set(fast) == set(routed)
        for info in (fast, routed):
            ran = client.post(f"/v1/sandboxes/{info['id']}/exec", json={"cmd": "echo $X"})
            assert ran.json()["stdout"] == "1\n"
            assert client.delete(f"/v1/sandboxes/{info['id']}").status_code == 204
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_missing_sandbox_reads_alike(http: tuple[httpx.Client, str]) -> None:
    client, _ = http
    fast, routed = both_ways(client, "/v1/sandboxes/sb-none/exec", {"cmd": "true"})
    assert fast.status_code == routed.status_code == 404
    assert fast.json() == routed.json()
    assert client.get("/v1/sandboxes/sb-none").json()["error"]["code"] == "not_found"


def test_files_fast_path_and_route_agree(http: tuple[httpx.Client, str]) -> None:
    client, sid = http
    files = f"/v1/sandboxes/{sid}/files"
    name = "a dir/ünï 'quoted' \"name\".bin"
    data = bytes(range(256)) * 10
    assert client.put(files, params={"path": name}, content=data).status_code == 204
    assert client.get(files, params={"path": name}).content == data
    # "+10" is an int to FastAPI but not to the fast path: FastAPI answers it.
    fast = client.get(files, params={"path": name, "limit": "10"})
    routed = client.get(files, params={"path": name, "limit": "+10"})
    assert fast.status_code == routed.status_code == 413
    assert fast.json() == routed.json()
    for bad in ({}, {"path": name, "limit": "0"}, {"path": name, "limit": "x"}):
        answer = client.get(files, params=bad)
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "invalid_argument"
    assert client.put(files, content=b"x").json()["error"]["code"] == "invalid_argument"
    missing = client.get(files, params={"path": "nope"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "file_not_found")


def test_status_is_the_same_through_both(http: tuple[httpx.Client, str]) -> None:
    client, sid = http
    one = client.get(f"/v1/sandboxes/{sid}").json()
    listed = [s for s in client.get("/v1/sandboxes").json()["sandboxes"] if s["id"] == sid]
    assert set(one) == set(listed[0])
    assert one["state"] == "running" and one["workspace"] is None




@pytest.mark.anyio
async def test_the_fast_path_takes_the_route_fastapi_would(tmp_path: pathlib.Path) -> None:
    # One route table: a route FastAPI tries before a hot one, matching the
    # same request, is the one that answers; the hot ones still answer theirs.
    daemon = Daemon(str(tmp_path / "data"), policy=OperatorPolicy(providers=["local"]))
    await daemon.start()
    try:
        app = create_app(ServerSettings(data_dir=str(tmp_path / "data"), token="t"), core=daemon)

        async def shadow(sandbox_id: str) -> dict[str, str]:
            return {"shadowed": sandbox_id}

        app.router.add_api_route("/v1/sandboxes/{sandbox_id}", shadow, methods=["GET"])
        app.router.routes.insert(0, app.router.routes.pop())  # tried first
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://hutch",
                                         headers={"Authorization": "Bearer t"}) as client:
                made = await client.post("/v1/sandboxes", json={
                    "provider": "local", "workdir": str(tmp_path / "work")})
                sandbox_id = made.json()["id"]
                status = await client.get(f"/v1/sandboxes/{sandbox_id}")
                assert status.json() == {"shadowed": sandbox_id}
                ran = await client.post(f"/v1/sandboxes/{sandbox_id}/exec",
                                        json={"cmd": ["echo", "hot"]})
                assert ran.json()["stdout"] == "hot\n"
                await client.delete(f"/v1/sandboxes/{sandbox_id}")
    finally:
        await daemon.stop()


def test_live_answers_are_as_their_wire_models_say(http: tuple[httpx.Client, str]) -> None:
    """What the daemon's builders make (a live sandbox's info, its files, its
    processes, the daemon's lists) parses as the routes' models, no key more."""
    from pydantic import BaseModel

    from hutch import wire

    client, sandbox_id = http
    base = f"/v1/sandboxes/{sandbox_id}"
    client.put(f"{base}/files", params={"path": "w.txt", "overwrite": "true"}, content=b"x")
    started = client.post(f"{base}/processes", json={"cmd": "true"})
    answers: list[tuple[type[BaseModel], httpx.Response]] = [
        (wire.SandboxInfo, client.get(base)),
        (wire.SandboxList, client.get("/v1/sandboxes", params={"all": "true"})),
        (wire.ExecAnswer, client.post(f"{base}/exec", json={"cmd": "printf hi"})),
        (wire.FileStat, client.get(f"{base}/stat", params={"path": "w.txt"})),
        (wire.FileList, client.get(f"{base}/list")),
        (wire.GlobAnswer, client.post(f"{base}/glob", json={"pattern": "*.txt"})),
        (wire.GrepAnswer, client.post(f"{base}/grep", json={"pattern": "x"})),
        (wire.ProcessInfo, started),
        (wire.ProcessList, client.get(f"{base}/processes")),
        (wire.Deadline, client.post(f"{base}/set_timeout", json={"timeout_seconds": 600})),
        (wire.SnapshotList, client.get("/v1/snapshots")),
        (wire.WorkspaceList, client.get("/v1/workspaces")),
        (wire.DefinitionList, client.get("/v1/definitions")),
        (wire.EventList, client.get("/v1/events")),
    ]
    for model, answer in answers:
        assert answer.status_code in (200, 201), answer.text
        body = answer.json()
        assert model.model_validate(body).model_dump(include=set(body)) == body, model
