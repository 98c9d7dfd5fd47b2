"""Faults at every step (issue 20): the daemon killed (SIGKILL) in the middle
of each step of suspend, resume, pause, snapshot, fork, a workspace's
suspend and resume, an image build and a definition's ensure, on each
provider the step applies to, and what the restarted daemon makes of it:
every sandbox answers its real state (the runtime's own, not the record's)
within 5 s, a call on it succeeds (after a resume where it says so) or fails
with a typed error that says what to do, and no file of its working
directory is lost.

The points are named in the source (``hutch._faults.fault_point``) and found
there (tests/faults.py), so a step added with its point is killed too. The
run prints, per step and provider, how many kills it survived.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import hutch
from hutch import HutchError, SandboxUnavailable
from tests import faults
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, end_everything
from tests.faults import FaultCase

#: How long a restarted daemon may take to answer for a sandbox.
ANSWER_SECONDS = 5.0


def _param(case: FaultCase) -> Any:
    marks = [pytest.mark.docker] if case.provider in ("docker", "host", "kubernetes") else []
    if case.provider == "gvisor":
        marks.append(pytest.mark.skipif(shutil.which("runsc") is None and
                                        not os.environ.get("HUTCH_RUNSC"),
                                        reason="runsc is not installed"))
    return pytest.param(case, marks=marks, id=case.id)


def settings(provider: str, point: str, scratch: str) -> dict[str, Any]:
    """The sandbox settings a case's sandboxes are made with."""
    if provider == "docker":
        found: dict[str, Any] = {"image": TEST_IMAGE, "runtime": "native"}
        if point == "snapshot.docker.frozen":
            # Only a working directory the daemon does not layer is committed
            # frozen by the container's own commit (the layered one is moved).
            found["host_workdir"] = os.path.join(scratch, "workdir")
        return found
    if provider in ("bubblewrap", "gvisor"):
        return {"image": TEST_IMAGE}
    if provider == "kubernetes":
        from tests.kube_standin import shared

        return {"image": TEST_IMAGE, "kubeconfig": shared().kubeconfig}
    return {}


class Armed:
    """One daemon for a worker's kills, one after another: armed for a step
    through a file (``HUTCH_FAULT=file:...``), so that it starts once a kill
    (the restart after it), not twice."""

    def __init__(self, directory: str) -> None:
        self.file = os.path.join(directory, "fault")
        Path(self.file).write_text("")
        self.daemon = DaemonProcess(
            extra_args=["--allow", "host_workdir", "--allow-provider", "local",
                        "--allow", "kubeconfig"],
            extra_env={"HUTCH_FAULT": f"file:{self.file}"},
        )

    def arm(self, point: str | None) -> None:
        Path(self.file).write_text(point or "")

    def running(self) -> DaemonProcess:
        """The daemon up, disarmed and holding nothing (a case cut short by a
        failed check may have left it down or holding something)."""
        self.arm(None)
        if self.daemon.proc is None or self.daemon.proc.poll() is not None:
            self.daemon.proc = None
            self.daemon.start()
        with hutch.Client(self.daemon.url, token=self.daemon.token) as c:
            end_everything(c, force=True)
        return self.daemon

    def kill_at(self, point: str, call: Callable[[], object]) -> None:
        """Run a step armed at ``point``: the daemon must die there (SIGKILL)."""
        daemon = self.daemon
        assert daemon.proc is not None
        self.arm(point)
        try:
            call()
        except (httpx.TransportError, HutchError):
            pass  # the daemon died under the call (the client says so, as it can)
        finally:
            self.arm(None)
        try:
            code = daemon.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"fault point {point} was never reached by its step: the "
                                 "harness drives the step in a way that misses it") from None
        assert code == -signal.SIGKILL, (
            f"the daemon ended with {code}, not at {point}:\n{daemon.log()}")
        daemon.proc = None


@pytest.fixture(scope="module")
def armed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Armed]:
    harness = Armed(str(tmp_path_factory.mktemp("faults")))
    yield harness
    harness.arm(None)
    harness.daemon.close()


def _answer(daemon: DaemonProcess, path: str) -> Any:
    """A GET the restarted daemon must answer within ANSWER_SECONDS."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    started = time.monotonic()
    try:
        got = httpx.get(daemon.url + path, headers=headers, timeout=ANSWER_SECONDS)
    except httpx.TimeoutException:
        raise AssertionError(f"GET {path} not answered within {ANSWER_SECONDS} s") from None
    assert time.monotonic() - started <= ANSWER_SECONDS, f"GET {path} took too long"
    assert got.status_code == 200, got.text
    return got.json()


def _read_back(sb: Any, name: str) -> str:
    """Read a file of a sandbox found after the restart: at once, or after a
    resume where the error says to resume; any other failure must be typed
    and say what to do, and fails the check (its work would be out of reach)."""
    try:
        return str(sb.read_text(name))
    except SandboxUnavailable as exc:
        assert "resume" in str(exc), f"a refusal that does not say what to do: {exc}"
    sb.resume()
    return str(sb.read_text(name))


def check_after_restart(daemon: DaemonProcess, case: FaultCase, token: str,
                        files: dict[str, str]) -> None:
    """What the restarted daemon must make of everything the kill left."""
    rows = _answer(daemon, "/v1/sandboxes?all=true")["sandboxes"]
    with hutch.Client(daemon.url, token=daemon.token) as c:
        for row in rows:
            info = _answer(daemon, f"/v1/sandboxes/{row['id']}")
            state = info["state"]
            if state == "terminated" and info.get("reason") == "closed":
                # Ended on purpose (deleted, or a branch of a fork undone):
                # what it ran is gone, not kept for good by a record that
                # says it ended.
                real = faults.real_state(case.provider, row["id"], daemon.data_dir)
                assert real in (None, "gone"), (
                    f"sandbox {row['id']} is recorded ended, yet its runtime is {real} "
                    f"after the kill at {case.point}")
                continue
            assert state in ("running", "paused", "suspended"), (
                f"sandbox {row['id']} is {state} ({info.get('reason')}) after the kill at "
                f"{case.point}: nothing outside hutch died, so nothing may be lost")
            real = faults.real_state(case.provider, row["id"], daemon.data_dir)
            if real is not None:
                assert state == real, (f"sandbox {row['id']} says {state}; its runtime is "
                                       f"{real} (after the kill at {case.point})")
            sb = c.get_sandbox(row["id"])
            for name, content in files.items():
                assert _read_back(sb, name) == content, (row["id"], name)
        for ws in c.list_workspaces():
            assert ws["status"] in ("running", "suspended", "stale"), ws
            if ws["status"] != "running" or not ws.get("live_sandbox_id"):
                ws = c.resume_workspace(ws["name"])
            sb = c.get_sandbox(ws["live_sandbox_id"])
            for name, content in files.items():
                assert _read_back(sb, name) == content, (ws["name"], name)
        for snap in c.snapshots():  # each listed one is whole: a sandbox starts from it
            assert snap.provider == case.provider, snap
        del token


# -- the steps, as a client drives them --------------------------------------------------


def drive(case: FaultCase, harness: Armed, scratch: str, token: str) -> dict[str, str]:
    """Set up what the step works on, then run the step (the daemon dies in
    it); the files every sandbox left must hold."""
    step, provider, point = case.step, case.provider, case.point
    daemon = harness.daemon
    made = settings(provider, point, scratch)
    files = {"keep.txt": token}
    with hutch.Client(daemon.url, token=daemon.token) as c:
        if step in ("pause", "suspend", "resume", "snapshot", "fork"):
            sb = c.create_sandbox(provider, **made)
            sb.write_text("keep.txt", token)
            if step == "resume":
                (sb.pause if point == "resume.unpaused" else sb.suspend)()
            act: Callable[[], object] = {
                "pause": sb.pause, "suspend": sb.suspend, "resume": sb.resume,
                "snapshot": lambda: sb.snapshot("faulted"),
                "fork": lambda: sb.fork("faulted", count=1),
            }[step]
        elif step in ("workspace-suspend", "workspace-resume"):
            ws = c.create_workspace("faulted", provider=provider, **made)
            c.get_sandbox(ws["live_sandbox_id"]).write_text("keep.txt", token)
            if step == "workspace-resume":
                c.suspend_workspace("faulted", diff=True)
                act = lambda: c.resume_workspace("faulted")  # noqa: E731
            else:
                act = lambda: c.suspend_workspace("faulted", diff=True)  # noqa: E731
        elif step == "delete":
            sb = c.create_sandbox(provider, **made)
            sb.write_text("keep.txt", token)
            files = {}  # deleted on purpose: nothing of it is to be kept
            act = lambda: c.delete_sandbox(sb.id)  # noqa: E731
        elif step == "definition-ensure":
            c.put_definition({
                "id": "faulted", "provider": {"type": provider, **made},
                "workspace": {"setup": [f"printf %s {token} > keep.txt"]},
                "lifecycle": {"keep_alive": "30m"},
            })
            act = lambda: c.ensure("faulted", token)  # noqa: E731
        else:
            raise AssertionError(f"no drive for step {step}")
        harness.kill_at(point, act)
    return files


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(c) for c in faults.plan() if c.provider != "host"])
def test_a_daemon_killed_at_a_step_loses_nothing(
    case: FaultCase, armed: Armed, request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    survived = False
    try:
        daemon = armed.running()
        token = secrets.token_hex(8)
        files = drive(case, armed, str(tmp_path), token)
        daemon.start()
        check_after_restart(daemon, case, token, files)
        with hutch.Client(daemon.url, token=daemon.token) as c:
            if case.step == "definition-ensure":
                again = c.ensure("faulted", token)
                assert _read_back(again.sandbox, "keep.txt") == token
                live = [s["id"] for s in c.list_sandboxes()]
                assert live == [again.sandbox.id], (
                    f"an ensure cut at {case.point} left {live}; the thread has one sandbox")
            end_everything(c, force=True)
        survived = True
    finally:
        faults.record(request, case, survived)


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.parametrize("case", [_param(c) for c in faults.plan() if c.provider == "host"])
def test_a_build_killed_at_a_step_leaves_nothing_half_made(
    case: FaultCase, request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    """An image build's program killed part-way: the image is not listed
    half-made, what the build left is removed by the next build, and the
    next build makes it whole."""
    home = tmp_path / "home"
    name = f"hutch-fault-{secrets.token_hex(4)}"
    dockerfile = tmp_path / "Dockerfile"
    # One small file: the build's own steps are what is killed, not a base's unpacking.
    (tmp_path / "built.txt").write_text("built\n")
    dockerfile.write_text("FROM scratch\nCOPY built.txt /built.txt\n")
    env = {**os.environ, "HUTCH_HOME": str(home)}
    build = [sys.executable, "-c",
             "import sys; from hutch import images; "
             "images.build(sys.argv[1], dockerfile=sys.argv[2])",
             name, str(dockerfile)]
    survived = False
    try:
        killed = subprocess.run(build, env={**env, "HUTCH_FAULT": case.point},
                                capture_output=True, timeout=300, check=False)
        assert killed.returncode == -signal.SIGKILL, (
            f"fault point {case.point} not reached: {killed.stderr.decode()[-2000:]}")
        listing = subprocess.run(
            [sys.executable, "-c", "from hutch import images; "
             "print([i.name for i in images.list_images()])"],
            env=env, capture_output=True, text=True, timeout=60, check=True)
        assert name not in listing.stdout or case.point == "image-build.described", listing.stdout
        subprocess.run(build, env=env, capture_output=True, timeout=300, check=True)
        images_dir = home / "images"
        assert not [p.name for p in images_dir.iterdir() if p.name.startswith(".build-")], (
            "a build killed part-way left its work behind")
        rootfs = next(images_dir.glob("*/rootfs"))
        assert (rootfs / "built.txt").read_text() == "built\n"
        survived = True
    finally:
        faults.record(request, case, survived)
        subprocess.run([sys.executable, "-c",
                        "import sys; from hutch import images; "
                        "images.remove(sys.argv[1], force=True)",
                        name], env=env, capture_output=True, timeout=120, check=False)


def test_every_fault_point_is_killed_this_run() -> None:
    """Each point the source names is in this run's plan, on a provider its
    step applies to (the plan is read from the source, so a new step's point
    is covered once it is named)."""
    planned = {c.point for c in faults.plan()}
    assert planned == set(faults.fault_points())
    # Every step the harness drives has points: none went unnamed.
    assert {p.split(".")[0] for p in planned} == set(faults.STEPS)


# -- the restart reads the runtime's own state (issue 20, item 2) -------------------------


def _freeze_outside(provider: str, sandbox_id: str) -> None:
    """Freeze a sandbox as a suspend cut short by SIGKILL leaves it (its
    runtime frozen, its record saying running), from outside hutch."""
    if provider == "docker":
        import docker

        docker.APIClient().pause(f"hutch-{sandbox_id}")
    else:
        from hutch.providers.bubblewrap.cgroups import SandboxCgroup

        SandboxCgroup(sandbox_id).freeze()


@pytest.mark.parametrize("provider", [pytest.param("docker", marks=pytest.mark.docker),
                                      "bubblewrap"])
def test_a_sandbox_left_frozen_answers_its_real_state_after_a_restart(
    provider: str, armed: Armed,
) -> None:
    """The daemon killed while a sandbox was frozen for a step (a suspend's
    commit) left it frozen with its record saying running: after the restart
    it says what it is, and a resume gets it going, where before exec
    answered "is paused" and resume "is running" for ever."""
    daemon = armed.running()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox(provider, **settings(provider, "", ""))
        sb.write_text("keep.txt", "kept")
    daemon.kill()
    _freeze_outside(provider, sb.id)
    daemon.start()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        found = c.get_sandbox(sb.id)
        real = faults.real_state(provider, sb.id, daemon.data_dir)
        assert found.info()["state"] == real == "paused"
        with pytest.raises(SandboxUnavailable, match="resume it"):
            found.exec("true")
        found.resume()
        assert found.read_text("keep.txt") == "kept"
        assert found.exec("echo on").stdout == "on\n"
        assert faults.real_state(provider, sb.id, daemon.data_dir) == "running"
        found.close()


# -- a fork whose caller goes (issue 20, item 5) ------------------------------------------


@pytest.mark.docker
def test_a_fork_whose_caller_is_cut_off_leaves_nothing_behind(armed: Armed) -> None:
    """A fork's caller gone part-way (cut off after 2 s) never learns of its
    snapshot or branches: the fork is undone, all of it (no snapshot with no
    branches, no branch running for no one), and the origin is untouched."""
    daemon = armed.running()
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, runtime="native")
        sb.write_text("keep.txt", "kept")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{daemon.url}/v1/sandboxes/{sb.id}/fork", headers=headers,
                       json={"label": "cut", "count": 8}, timeout=2)

        def settled() -> bool:
            return (c.snapshots() == []
                    and [s["id"] for s in c.list_sandboxes()] == [sb.id])

        deadline = time.monotonic() + 120
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert c.snapshots() == [], "the cut fork's snapshot stayed, no one knowing of it"
        assert [s["id"] for s in c.list_sandboxes()] == [sb.id]
        assert sb.read_text("keep.txt") == "kept"
        # The origin's lineage is as before: its next snapshot has no parent.
        assert sb.snapshot("next").parent_id is None
        sb.close()
        end_everything(c, force=True)




# -- a runtime gone while the daemon was down keeps its files --------------------------


@pytest.mark.docker
def test_a_container_gone_while_the_daemon_was_down_keeps_its_files_until_deleted(
    armed: Armed,
) -> None:
    """Found gone at start (the container removed, as a host reboot or a
    cleanup would), the sandbox fails, and its working directory stays on
    the host until the sandbox is deleted, as for a death seen while the
    daemon runs: the restart never deletes work."""
    import docker

    from hutch.store.sqlite import SQLiteStore

    daemon = armed.running()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, runtime="native")
        sb.write_text("keep.txt", "kept")
    daemon.kill()
    docker.APIClient().remove_container(f"hutch-{sb.id}", force=True)
    daemon.start()
    store = SQLiteStore(os.path.join(daemon.data_dir, "hutch.db"))
    try:
        row = store.get_sandbox(sb.id)
        assert row is not None
        workdir = Path(str(row.description["host_workdir"]))
    finally:
        store.close()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        info = c.get_sandbox(sb.id).info()
        assert (info["state"], info["reason"]) == (
            "failed", "lost: its runtime died while the daemon was down")
        assert (workdir / "keep.txt").read_text() == "kept"
        c.delete_sandbox(sb.id)
        assert not (workdir / "keep.txt").exists()
