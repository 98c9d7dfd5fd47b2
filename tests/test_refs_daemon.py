"""Refs through the daemon: sessions in other processes attach with a ref,
which is also a credential for that one sandbox (issue 9)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

import hutch
from hutch._refwire import decode_ref
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        try:
            d.remove_everything()  # workspaces and their snapshots outlive a stop
        finally:
            d.stop()
            shutil.rmtree(d.data_dir, ignore_errors=True)


def bare_env() -> dict[str, str]:
    """An environment that knows no daemon: only the ref may say where it is."""
    return {k: v for k, v in os.environ.items() if k not in ("HUTCH_URL", "HUTCH_TOKEN")}


def worker(ref: str, code: str) -> subprocess.CompletedProcess[str]:
    """Python in another process, attached with ``ref`` as ``sb``."""
    program = f"import hutch, sys\nsb = hutch.attach_sync(sys.argv[1])\n{code}\n"
    return subprocess.run([sys.executable, "-c", program, ref], capture_output=True,
                          text=True, timeout=120, env=bare_env(), stdin=subprocess.DEVNULL)


def attach_cli(ref: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HUTCH, "attach", ref, "--", *cmd], capture_output=True, text=True,
                          timeout=120, env=bare_env(), stdin=subprocess.DEVNULL)


def test_owner_and_attached_in_two_processes(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        owner = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        owner.write_text("from-owner.txt", "o")
        ref = owner.ref()
        assert daemon.token not in ref
        seen = worker(ref, "print(sb.read_text('from-owner.txt'));"
                           "sb.write_text('from-worker.txt', 'w');"
                           "print(sb.start('sleep 60').id); sb.close()")
        assert seen.returncode == 0, seen.stderr
        owner_text, job_id = seen.stdout.split()
        assert owner_text == "o"
        assert owner.read_text("from-worker.txt") == "w"
        assert job_id in [p.id for p in owner.processes()]  # the same live processes
        # The worker's close only detached it.
        assert owner.exec("echo still").stdout == "still\n"
        assert owner.status().state == "running"
        # A session is listed while attached (with its ref), not once it left.
        ref_id = decode_ref(ref).ref_id  # type: ignore[union-attr]
        assert owner.info()["attachments"] == []
        assert [r["ref_id"] for r in owner.info()["refs"]] == [ref_id]
        with hutch.Client(daemon.url, token="") as stranger:
            present = [stranger.attach(ref), stranger.attach(ref)]
            listed = owner.info()["attachments"]
            assert [a["ref_id"] for a in listed] == [ref_id, ref_id]
            assert len({a["session"] for a in listed}) == 2  # two sessions, one ref
            env = dict(bare_env(), HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
            table = subprocess.run([*HUTCH, "ls", "--wide"], env=env, capture_output=True,
                                   text=True, timeout=60).stdout.splitlines()
            column = table[0].split().index("ATTACHED")
            assert [line.split()[column] for line in table if owner.id in line] == ["2"]
            present[0].close()
            assert len(owner.info()["attachments"]) == 1
            present[1].close()
        assert owner.info()["attachments"] == []
        # From the command line too, with no other configuration.
        ran = attach_cli(ref, "cat", "from-worker.txt")
        assert (ran.returncode, ran.stdout) == (0, "w"), ran.stderr
        owner.close()
    gone = attach_cli(ref, "true")
    assert gone.returncode == 4, gone.stderr
    assert "sandbox_unavailable" in gone.stderr and "owner's cleanup ended it" in gone.stderr
    late = worker(ref, "sb.exec('true')")
    assert "owner's cleanup ended it" in late.stderr


def test_in_process_attached_sessions_through_the_sdk(daemon: DaemonProcess) -> None:
    """client.attach: the worker is its own session (read-before-write is its own)."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        owner = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        owner.write_text("shared.txt", "v1")
        owner.read_text("shared.txt")
        with hutch.Client(daemon.url, token="") as stranger:
            ref = owner.ref()
            attached, twin = stranger.attach(ref), stranger.attach(ref)
        with pytest.raises(hutch.ReadBeforeWrite):
            attached.write_text("shared.txt", "v2")  # the owner's read is not its own
        twin.read_text("shared.txt")
        with pytest.raises(hutch.ReadBeforeWrite):
            attached.write_text("shared.txt", "v2")  # nor is another session's, same ref
        twin.close()
        attached.read_text("shared.txt")
        attached.write_text("shared.txt", "v2")
        attached.close()
        with pytest.raises(hutch.SandboxUnavailable, match="detached"):
            attached.exec("true")
        assert owner.read_text("shared.txt") == "v2"
        owner.close()


def test_a_ref_reaches_its_sandbox_and_nothing_else(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        mine = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        other = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        ref = mine.ref()
        with httpx.Client(base_url=daemon.url,
                          headers={"Authorization": f"Bearer {ref}"}) as h:
            assert h.post(f"/v1/sandboxes/{mine.id}/exec", json={"cmd": "true"}).status_code == 200
            assert h.get(f"/v1/sandboxes/{mine.id}").status_code == 200
            refused = {
                "list": h.get("/v1/sandboxes"),
                "create": h.post("/v1/sandboxes", json={"provider": "virtual"}),
                "other": h.post(f"/v1/sandboxes/{other.id}/exec", json={"cmd": "true"}),
                "other info": h.get(f"/v1/sandboxes/{other.id}"),
                "other delete": h.delete(f"/v1/sandboxes/{other.id}"),
                "dot-dot": h.get(f"/v1/sandboxes/{mine.id}/../{other.id}"),
                "more refs": h.post(f"/v1/sandboxes/{mine.id}/refs", json={}),
                "fork": h.post(f"/v1/sandboxes/{mine.id}/fork", json={}),
                "snapshot": h.post(f"/v1/sandboxes/{mine.id}/snapshots", json={}),
                "snapshots": h.get("/v1/snapshots"),
                "definitions": h.get("/v1/definitions"),
                "events": h.get("/v1/events"),
                "workspaces": h.get("/v1/workspaces"),
                "named pause": h.post("/v1/pause", json={"sandbox": other.id}),
            }
            for what, answer in refused.items():
                assert answer.status_code in (401, 403), (what, answer.status_code)
                assert answer.json()["error"]["code"] in ("unauthorized", "permission_denied")
            # Its DELETE detaches; the sandbox stays.
            assert h.delete(f"/v1/sandboxes/{mine.id}").status_code == 204
        assert mine.exec("echo up").stdout == "up\n"
        assert other.exec("echo up").stdout == "up\n"
        for forged in (ref[:-2] + ("AA" if not ref.endswith("AA") else "BB"), "hutch-ref:x",
                       "hutch-ref:" + "A" * 5000):
            answer = httpx.get(f"{daemon.url}/v1/sandboxes/{mine.id}",
                               headers={"Authorization": f"Bearer {forged}"})
            assert answer.status_code == 401, forged[:40]
        mine.close()
        other.close()


def test_expired_and_revoked_refs_answer_401(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        short = sb.ref(expires_in=1)
        revoked = sb.ref()
        assert attach_cli(revoked, "true").returncode == 0
        sb.revoke_ref(revoked)
        sb.revoke_ref(revoked)  # idempotent
        denied = attach_cli(revoked, "true")
        assert denied.returncode == 5 and "revoked" in denied.stderr
        time.sleep(1.5)
        expired = attach_cli(short, "true")
        assert expired.returncode == 5 and "expired" in expired.stderr
        for bad in (0, -1, float("inf"), 10 ** 9):
            with pytest.raises(hutch.InvalidArgument):
                sb.ref(expires_in=bad)
        kinds = [e["message"] for e in c.events(sb.id) if e["kind"] == "ref"]
        assert any("handed out" in m for m in kinds)
        assert any("used" in m for m in kinds)
        assert any(f"{revoked.split(':')[0]}" and "revoked" in m for m in kinds)
        assert sb.info()["attachments"] == []  # the one left expired, the other was revoked
        sb.close()


def test_cli_ref_hands_out_a_ref(daemon: DaemonProcess) -> None:
    env = dict(bare_env(), HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        made = subprocess.run([*HUTCH, "ref", sb.id, "--expires-in", "600"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        ref = made.stdout.strip()
        fed = subprocess.run([*HUTCH, "attach", "-i", ref, "--", "sh", "-c", "cat > in.txt"],
                             env=bare_env(), input="piped", capture_output=True, text=True,
                             timeout=60)
        assert fed.returncode == 0, fed.stderr
        assert sb.read_text("in.txt") == "piped"
        revoked = subprocess.run([*HUTCH, "ref", sb.id, "--revoke", ref], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert revoked.returncode == 0, revoked.stderr
        assert attach_cli(ref, "true").returncode == 5
        sb.close()


def test_a_busy_worker_keeps_the_sandbox_from_idle_suspend(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        owner = c.create_sandbox("virtual", idle_suspend_after=1, read_before_write=False)
        attached = c.attach(owner.ref())
        slept = None
        for i in range(12):  # three idle windows of work, from the worker alone
            attached.write_text("tick", str(i))
            status = owner.status()
            assert status.state == "running", f"suspended under a busy worker ({i})"
            # A write would resume it: that its time asleep never grows says it stayed up.
            slept = status.meter["suspended_s"] if slept is None else slept
            assert status.meter["suspended_s"] == slept, f"suspended under a busy worker ({i})"
            time.sleep(0.25)
        deadline = time.monotonic() + 15
        while owner.status().state != "suspended":  # once the worker stops, it sleeps
            assert time.monotonic() < deadline, "never suspended once idle"
            time.sleep(0.2)
        attached.close()
        owner.close()


@pytest.mark.docker
def test_refs_to_a_workspace_survive_a_daemon_crash(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        ws = c.create_workspace("shared", image=TEST_IMAGE)
        sb = c.get_sandbox(ws["live_sandbox_id"])
        sb.write_text("/root/kept.txt", "kept")
        ref = sb.ref()
    daemon.restart()  # SIGKILL, then start on the same data directory and port
    ran = attach_cli(ref, "cat", "/root/kept.txt")
    assert (ran.returncode, ran.stdout) == (0, "kept"), ran.stderr
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.delete_workspace("shared")


def test_ref_expiry_is_checked_on_the_wire(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        headers = {"Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"}
        for body in (b'{"expires_in": -1}', b'{"expires_in": 0}', b'{"expires_in": NaN}',
                     b'{"expires_in": Infinity}', b'{"expires_in": 1e300}',
                     b'{"expires_in": 5, "sandbox": "x"}'):
            answer = httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/refs", content=body,
                                headers=headers)
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["code"] == "invalid_argument"
        made = httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/refs", headers=headers,
                          json={"expires_in": 60})
        assert made.status_code == 201
        answer = made.json()
        assert set(answer) == {"ref", "ref_id", "sandbox_id", "expires_at_unix"}
        assert answer["sandbox_id"] == sb.id
        assert abs(answer["expires_at_unix"] - time.time() - 60) < 30
        missing = httpx.post(f"{daemon.url}/v1/sandboxes/sb-nothing/refs", headers=headers,
                             json={})
        assert missing.status_code == 404
        sb.close()


def _ref_follows_the_workspace(daemon: DaemonProcess, create: dict[str, object],
                               kept: str) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        ws = c.create_workspace("followed", **create)
        first = ws["live_sandbox_id"]
        c.get_sandbox(first).write_text(kept, "kept")
        ref = c.get_sandbox(first).ref()
        held = hutch.attach_sync(ref)  # attached before the workspace moves on
        try:
            assert held.read_text(kept) == "kept"
            c.suspend_workspace("followed")
            gone = attach_cli(ref, "true")
            assert gone.returncode == 4 and "is suspended" in gone.stderr, gone.stderr
            with pytest.raises(hutch.SandboxUnavailable, match="resume"):
                held.exec("true")
            resumed = c.resume_workspace("followed")
            assert resumed["live_sandbox_id"] != first  # a new sandbox under the same name
            ran = attach_cli(ref, "cat", kept)
            assert (ran.returncode, ran.stdout) == (0, "kept"), ran.stderr
            # The session attached before goes on in the workspace's new sandbox.
            held.write_text("after.txt", "a")
            assert c.get_sandbox(resumed["live_sandbox_id"]).read_text("after.txt") == "a"
            assert [a["ref_id"] for a in
                    c.get_sandbox(resumed["live_sandbox_id"]).info()["attachments"]] != []
            # A ref reaches its workspace's sandboxes only.
            other = c.create_sandbox("virtual")
            with httpx.Client(base_url=daemon.url,
                              headers={"Authorization": f"Bearer {ref}"}) as h:
                assert h.get(f"/v1/sandboxes/{other.id}").status_code == 403
            other.close()
        finally:
            held.close()
        daemon.restart()  # SIGKILL, then start on the same data directory and port
        ran = attach_cli(ref, "cat", kept)
        assert (ran.returncode, ran.stdout) == (0, "kept"), ran.stderr
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.delete_workspace("followed")
    gone = attach_cli(ref, "true")
    said = " ".join(gone.stderr.split())  # as printed, wrapped to the terminal
    assert gone.returncode == 4 and "owner's cleanup ended it" in said, said


def test_a_ref_follows_its_workspace_through_suspend_resume_and_a_crash(
    daemon: DaemonProcess,
) -> None:
    _ref_follows_the_workspace(daemon, {"provider": "local"}, "kept.txt")


@pytest.mark.docker
def test_a_ref_follows_its_docker_workspace(daemon: DaemonProcess) -> None:
    _ref_follows_the_workspace(daemon, {"image": TEST_IMAGE}, "/root/kept.txt")
