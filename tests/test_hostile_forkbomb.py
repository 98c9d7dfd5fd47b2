"""A fork bomb in a sandbox, on every isolating provider. On docker and
bubblewrap the pids limit refuses the bomb's forks and the sandbox lives on; on this runsc (Debian's
2022 build, ptrace platform) each process of the sandbox is a host process
too, in the sandbox's host cgroup, and nothing bounds them below its pids
limit (no RLIMIT_NPROC, no pids controller in gVisor's own cgroups): the
host refuses one, gVisor's kernel panics, and the whole sandbox ends. The
outcome is told as it is: the sandbox failed, and its reason says the
process limit ended it; the host keeps nothing of it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.gvisor import cgroups, deaths
from hutch.providers.gvisor.runsc import PANIC_LOG, list_ids
from tests import isolating
from tests.daemon_fixture import DaemonProcess, cleaned_daemon, client  # noqa: F401 - cleaned_daemon is the daemon fixture
from tests.hostprocs import named

RUNSC_MISSING = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed")

BOMB = "f() { f | f & }; f; sleep 20"
PIDS_LIMIT = 64


def host_processes_naming(word: str) -> list[int]:
    """Host processes whose command line names ``word`` (runsc's carry the
    sandbox's id)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if word.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize(
    # Not gvisor (below: the bomb ends it), nor kubernetes (a pod's limits
    # are its cluster's, not hutch's).
    "kind", isolating.params("docker-agent", "docker-native", "bubblewrap-agent",
                             "bubblewrap-native"),
)
async def test_a_fork_bomb_leaves_the_sandbox_usable(kind: str) -> None:
    async with await hutch.create_sandbox(
        **isolating.settings(kind, pids_limit=PIDS_LIMIT), read_before_write=False
    ) as sb:
        # The bomb runs a copy of bash named after it, so that what is left
        # of it (a zombie too keeps its name) is seen from the host.
        tag = "fb" + uuid.uuid4().hex[:8]
        bomb = f'cp "$(command -v bash)" ./{tag} && exec ./{tag} -c {shlex.quote(BOMB)}'
        with pytest.raises(hutch.ExecTimeout):  # its forks refused; its timeout ends it
            await sb.exec(bomb, timeout=8)
        # Its timeout answers once the bomb's killed processes are reaped:
        # none holds the pids limit any more, and the sandbox is usable at once.
        assert named(tag) == []
        answer = await sb.exec("echo alive", timeout=30)
        assert answer.stdout == "alive\n"


@pytest.mark.anyio
@RUNSC_MISSING
async def test_a_fork_bomb_ends_a_gvisor_sandbox_saying_the_process_limit_did() -> None:
    sb = await hutch.create_sandbox("gvisor", pids_limit=PIDS_LIMIT)
    try:
        sandbox_dir = backend_of(sb).describe()["sandbox_dir"]
        assert (await sb.exec("echo up")).stdout == "up\n"
        with pytest.raises(hutch.SandboxUnavailable) as bomb:
            await sb.exec(BOMB, timeout=8)
        said = str(bomb.value)
        assert f"process limit (pids_limit {PIDS_LIMIT})" in said, said
        # Every later call says the same, typed.
        with pytest.raises(hutch.SandboxUnavailable, match="process limit"):
            await sb.exec("true")
    finally:
        await sb.close()
    # The host keeps nothing of it: no runsc process, no container, no directory.
    assert host_processes_naming(sb.id) == []
    assert not [c for c in list_ids() if sb.id in c]
    assert not os.path.exists(sandbox_dir)


@RUNSC_MISSING
def test_the_daemon_fails_a_gvisor_sandbox_its_fork_bomb_ended(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox("gvisor", pids_limit=PIDS_LIMIT)
        with pytest.raises(hutch.SandboxUnavailable):
            sb.exec(BOMB, timeout=8)
        deadline = time.monotonic() + 10
        while (info := c.get_sandbox(sb.id).info())["state"] != "failed":
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        assert "process limit" in str(info["reason"]), info
        with pytest.raises(hutch.SandboxUnavailable):
            sb.exec("true")
        # The daemon and its other sandboxes work on.
        other = c.create_sandbox("gvisor", pids_limit=PIDS_LIMIT)
        assert other.exec("echo ok").stdout == "ok\n"
        c.delete_sandbox(other.id)
        c.delete_sandbox(sb.id)
    assert host_processes_naming(sb.id) == []


def refused_a_fork(container: str) -> None:
    """A process in ``container``'s held pids cgroup (limit 1) whose fork the
    host refuses, as it refuses a gVisor kernel's stub at the limit."""
    trying = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\nsys.stdin.readline()\n"
         "try:\n    pid = os.fork()\nexcept OSError as exc:\n    print(exc.errno)\n"
         "else:\n    pid or os._exit(0)\n    os.waitpid(pid, 0)\n    print(0)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    where = Path(cgroups.PIDS_ROOT + "/hutch-gvisor", container)
    (where / "cgroup.procs").write_text(str(trying.pid))
    said, _ = trying.communicate("go\n", timeout=30)
    assert said.strip() == "11"  # EAGAIN: the limit refused it


@pytest.mark.skipif(not os.path.isdir(cgroups.PIDS_ROOT), reason="no cgroup v1 pids hierarchy")
@pytest.mark.parametrize("refused", [True, False])
def test_a_gvisor_death_is_named_by_the_hosts_refused_forks_whatever_its_panic_says(
    tmp_path: Path, refused: bool,
) -> None:
    # Under a fork bomb the kernel's panic is at times not the refused fork
    # but what it tripped on after it (seen in CI): the host's count tells.
    container = "2+sb-" + uuid.uuid4().hex[:12]
    sandbox_id = deaths.sandbox_of(container)
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "config.json").write_text(
        json.dumps({"linux": {"resources": {"pids": {"limit": 1}}}}))
    (tmp_path / PANIC_LOG).write_text(
        "panic: trying to use inactive address space?\n\ngoroutine 82 [running]:\n")
    cgroups.hold(container, str(tmp_path / "bundle"))
    try:
        if refused:
            refused_a_fork(container)
        said = deaths.death_reason(str(tmp_path), container)
        assert said is not None
        if refused:
            assert said.startswith("its processes reached the process limit (pids_limit 1)"), said
            assert "trying to use inactive address space?" in said
        else:
            assert said == "gVisor's kernel panicked: panic: trying to use inactive address space?"
    finally:
        cgroups.release(sandbox_id)
    assert not os.path.exists(cgroups.PIDS_ROOT + "/hutch-gvisor/" + container)
    assert cgroups.refused_forks(container) is None
