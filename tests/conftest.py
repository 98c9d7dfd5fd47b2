"""Shared test configuration: the anyio backend, docker availability, and
the run's hygiene (every daemon a test made is closed; the run fails if it
left containers, mounts, loop devices, processes, cgroups or files behind)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

# Imported now, not first by the warnings machinery inside a finalizer (a
# ResourceWarning with a source imports it to say where the object was
# made): on Python 3.11 an import that runs inside another import on the
# same thread (a garbage collection during it) breaks the outer one's module
# lock with a KeyError (gh-91351, fixed in 3.12).
import tracemalloc  # noqa: F401
from collections.abc import Iterator

import pytest

from tests import artifacts, postgres_fixture, snapshot_leaks
from tests.daemon_fixture import DaemonProcess

TEST_IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")


def _run_root() -> str:
    """This run's own temporary directory: every temporary file of the run
    (its daemons' data directories, the hutch home of in-process sandboxes,
    the tests' own) is made in it, through TMPDIR, so that what the run left
    can be told from what other runs on the same machine and Engine hold.
    xdist's workers share their controller's."""
    inherited = os.environ.get("HUTCH_TEST_RUN_ROOT")
    if inherited and os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(inherited):
        return inherited
    base = os.environ.get("HUTCH_TEST_RUN_PARENT") or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="hutch-test-run-", dir=base)
    os.chmod(root, 0o1777)  # as /tmp: other users reach (and make) their own files in it
    os.environ["HUTCH_TEST_RUN_ROOT"] = root
    return root


# Made at import, before any test module (some make a daemon when imported).
RUN_ROOT = _run_root()
# pytest's own tmp_path stays where it was (its retention keeps a few runs).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
os.environ["TMPDIR"] = RUN_ROOT
tempfile.tempdir = RUN_ROOT
#: This process's own hutch home: what in-process tests make (containers,
#: snapshot layers, images labelled with it) is told apart from other runs'
#: (and other xdist workers') on the same host and Docker Engine, and checked
#: at the session's end.
SESSION_HOME = os.path.join(RUN_ROOT, "home-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.makedirs(SESSION_HOME, exist_ok=True)
os.environ["HUTCH_HOME"] = SESSION_HOME


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(
        ["docker", "image", "inspect", TEST_IMAGE], capture_output=True, check=False
    )
    return probe.returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Docker tests must run, not skip, in CI: .ci/run starts the engine first.
    # Outside CI a developer without docker gets a clear failure reason up front.
    if any(item.get_closest_marker("docker") for item in items) and not docker_available():
        if os.environ.get("HUTCH_SKIP_DOCKER") == "1":
            items[:] = [i for i in items if not i.get_closest_marker("docker")]
            return
        raise pytest.UsageError(
            f"docker tests need a Docker Engine with image {TEST_IMAGE}: run "
            "scripts/ensure-docker.sh (or set HUTCH_SKIP_DOCKER=1 to deselect them)"
        )


@pytest.fixture(params=["agent", "native"])
def docker_runtime(request: pytest.FixtureRequest) -> str:
    """Each docker test that takes this runs on both runtimes: hutch's agent
    inside the container, and docker's own exec and archive API."""
    return str(request.param)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[postgres_fixture.PostgresCluster]:
    """A throwaway PostgreSQL server, one per worker: each test takes a
    database of its own from it (``new_database``)."""
    made = postgres_fixture.PostgresCluster()
    try:
        yield made
    finally:
        made.close()


# -- hygiene -----------------------------------------------------------------------------


def _close_daemons_made_since(before: set[int]) -> None:
    from tests.daemon_fixture import OPEN

    for daemon in [d for d in list(OPEN) if id(d) not in before and not d.for_session]:
        daemon.close()


@pytest.fixture(autouse=True, scope="module")
def _close_module_daemons() -> Iterator[None]:
    """A daemon made in a module (by a test or a fixture of any scope below the
    session: a module's fixture may first be asked for in the middle of a
    test) is closed, with all it holds, when the module ends, whether its
    maker stopped it, killed it or neither."""
    from tests.daemon_fixture import OPEN

    before = {id(d) for d in OPEN}
    yield
    _close_daemons_made_since(before)


def _cgroups() -> set[str]:
    found = set()
    for controller in ("memory", "pids", "cpu", "freezer", "unified", ""):
        parent = os.path.join("/sys/fs/cgroup", controller, "hutch")
        try:
            found.update(os.path.join(parent, name) for name in os.listdir(parent)
                         if os.path.isdir(os.path.join(parent, name)))
        except OSError:
            continue
    return found


def _procs(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as fh:
            return [int(line) for line in fh if line.strip()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _private_mounts(pid: int) -> str:
    """The mount table of a process in a mount namespace not the host's (a
    bubblewrap keeper's or exec's bwrap: its command line names no sandbox
    directory, its mounts do), else nothing."""
    try:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return ""
        with open(f"/proc/{pid}/mountinfo", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _of_run(pid: int, roots: list[str]) -> bool:
    """Whether process ``pid`` belongs to this run (named by its directories)."""
    line = _cmdline(pid)
    if any(r + "/" in line for r in roots):
        return True
    # Anywhere in its mount table: a sandbox's own root and working directory
    # are overlays, whose directories show only in their options
    # (``lowerdir=...,upperdir=...``), not as a mount's source or point.
    mounts = _private_mounts(pid)
    return any(r + "/" in mounts for r in roots)


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (wall clock), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _pids_of_run(roots: list[str]) -> list[int]:
    """The processes (this one aside) of the directories ``roots``."""
    me = os.getpid()
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and int(entry) != me and _of_run(int(entry), roots)]


def _processes_of(homes: list[str]) -> list[str]:
    """This worker's processes left running: those of its daemons' homes
    (told with the test that was running when each started)."""
    return [f"process {pid}: {_cmdline(pid)[:160]}{_made_by(_started_at(pid))}"
            for pid in _pids_of_run(homes)]


_CGROUPS_AT_START: set[str] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _CGROUPS_AT_START.update(_cgroups())


def _leftovers(roots: list[str]) -> list[str]:
    """What this run left: things under its own directories (``roots``), or
    labelled with a hutch home there."""
    from tests.daemon_fixture import loops_under, mounts_under

    left = []
    listed = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=hutch.managed=1",
         "--format", '{{.ID}} {{.Label "hutch.home"}} {{.Names}}'],
        capture_output=True, text=True, timeout=120, check=False,
    )
    for line in listed.stdout.splitlines():
        cid, _, rest = line.partition(" ")
        home = rest.split(" ")[0]
        if any(home == r or home.startswith(r + "/") for r in roots):
            left.append(f"container {cid} ({rest})")
    # The Kubernetes API stand-in's pods (tests/kube_standin.py), by the home it served.
    pods = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=hutch-test.kube-standin",
         "--format", '{{.ID}} {{.Label "hutch-test.kube-standin"}} {{.Names}}'],
        capture_output=True, text=True, timeout=120, check=False,
    )
    for line in pods.stdout.splitlines():
        cid, _, rest = line.partition(" ")
        home = rest.split(" ")[0]
        if any(home == r or home.startswith(r + "/") for r in roots):
            left.append(f"stand-in pod container {cid} ({rest})")
    # Its claims' and snapshots' volumes.
    volumes = subprocess.run(
        ["docker", "volume", "ls", "--filter", "label=hutch-test.kube-standin",
         "--format", '{{.Name}} {{.Label "hutch-test.kube-standin"}}'],
        capture_output=True, text=True, timeout=120, check=False,
    )
    for line in volumes.stdout.splitlines():
        name, _, home = line.partition(" ")
        if any(home == r or home.startswith(r + "/") for r in roots):
            left.append(f"stand-in volume {name} ({home})")
    for root in roots:
        left += [f"mount {point}" for point in mounts_under(root)]
        left += [f"loop device {dev} backed by {back}" for dev, back in loops_under(root)]
    left += [f"process {pid}: {_cmdline(pid)[:200]}" for pid in _pids_of_run(roots)]
    # A cgroup cannot carry a run's name: one made during this run that still
    # holds a process of this run, or that stays empty (its sandbox gone), is left.
    new = _cgroups() - _CGROUPS_AT_START
    if new:
        time.sleep(1)  # a sandbox of another run being made or ended right now
        for cgroup in sorted(new & _cgroups()):
            procs = _procs(cgroup)
            if not procs or any(_of_run(p, roots) for p in procs):
                left.append(f"cgroup {cgroup} (processes {procs})")
    return left


#: When each test of this process began (wall clock, node id), in order: a
#: leftover is told with the test that was running when it was made.
_TESTS_BEGUN: list[tuple[float, str]] = []


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _TESTS_BEGUN.append((time.time(), nodeid))


def _made_by(when: float | None) -> str:
    if when is None:
        return ""
    running = [nodeid for began, nodeid in _TESTS_BEGUN if began <= when]
    return f" (made during {running[-1]})" if running else " (made before the first test)"


def _snapshot_leftovers() -> list[str]:
    """This process's snapshot storage left behind: images labelled with its
    homes, snapshot layers or branch directories under them. Whatever is found
    is reported with the test that made it, then freed."""
    homes = [SESSION_HOME, *DaemonProcess.data_dirs]
    images = snapshot_leaks.leftover_images(homes)
    layers = snapshot_leaks.leftover_layers(homes)
    when = snapshot_leaks.made_at(images, layers)
    snapshot_leaks.free(images, layers)
    return ([f"snapshot image {tags} ({image_id[7:19]}){_made_by(when.get(image_id))}, now freed"
             for image_id, tags in images]
            + [f"snapshot layer directory {path}{_made_by(when.get(path))}, now freed"
               for path in layers])


#: What each xdist worker found it left (its daemons and homes are its own).
_WORKERS_LEFT: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    output = getattr(node, "workeroutput", None) or {}
    _WORKERS_LEFT.extend(output.get("hutch_leftovers", []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close the daemons still open (made at import or by a session fixture),
    then fail the run if it left anything behind; the controller checks once
    every xdist worker has finished (each sends what its own check found)."""
    from tests.daemon_fixture import OPEN

    for daemon in list(OPEN):
        daemon.close()
    ssh = sys.modules.get("tests.ssh_server")
    if ssh is not None:
        ssh.close_shared()
    left = _snapshot_leftovers()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        # Its own daemons' sandboxes, while it still knows which test ran when:
        # the controller's check below finds them too, but cannot say who made them.
        left += _processes_of([SESSION_HOME, *DaemonProcess.data_dirs])
        workeroutput["hutch_leftovers"] = left
        return
    left += _WORKERS_LEFT
    if session.config.option.collectonly:
        shutil.rmtree(RUN_ROOT, ignore_errors=True)
        return
    roots = [RUN_ROOT]
    factory = getattr(session.config, "_tmp_path_factory", None)  # tmp_path's, this run's
    if factory is not None:
        roots.append(str(factory.getbasetemp()))
    left += _leftovers(roots)
    shutil.rmtree(RUN_ROOT, ignore_errors=True)
    if os.path.exists(RUN_ROOT):
        left.append(f"files under {RUN_ROOT} that cannot be removed")
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["this run left things behind (a test or fixture did not end what it made):",
                 *(f"  {item}" for item in left)]
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: object) -> None:
    """The fault harness's table: kills survived per step and provider; the
    artifacts the run saved (tests/artifacts.py)."""
    from tests.faults import summary

    summary(terminalreporter)
    artifacts.summary(terminalreporter)
