"""A sandbox found held (paused) when a daemon adopts it (its restart) is
said paused, behaves as one this daemon paused, and resumes; one recorded
paused but resumed behind hutch's back is said running (SPEC §2: the status
says what the sandbox really is).

Every provider that can pause: docker (both runtimes), bubblewrap, gvisor.
The pause and unpause behind the daemon's back are the provider's own
(reconnected in this process, the daemon down), as another program's are.

gvisor alone kept whether it was paused in memory (runsc's pause freezes no
cgroup the host can read): a handle found again learns it from runsc, and a
command's kill or its reader's silence asks runsc, for another program on
the host may have paused it (docker's own case is in test_docker_freeze).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import uuid
from typing import Any

import anyio
import pytest

import hutch
from hutch._errors import KillIncomplete
from hutch._sandbox import backend_of
from hutch.providers.agent.wire import EXEC_SILENCE_TIMEOUT
from hutch.providers.base import RuntimeState
from hutch.providers.registry import get_provider
from tests import isolating
from tests.daemon_fixture import DaemonProcess, cleaned_daemon, client  # noqa: F401 - cleaned_daemon is the daemon fixture

KINDS = isolating.params("docker-agent", "docker-native", "bubblewrap-agent", "gvisor")


def _settings(kind: str) -> dict[str, Any]:
    """A sandbox of ``kind`` a restarted daemon adopts (a bubblewrap one
    outlives the daemon: not ephemeral)."""
    found = isolating.settings(kind)
    if found["provider"] == "bubblewrap":
        found["ephemeral"] = False
    return found


def _recorded(daemon: DaemonProcess, sandbox_id: str) -> tuple[str, str, dict[str, Any]]:
    """(provider, state, description) of the sandbox as the daemon's store has it."""
    db = os.path.join(daemon.data_dir, "hutch.db")
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        provider, state, description = con.execute(
            "SELECT provider, state, description FROM sandboxes WHERE id = ?",
            (sandbox_id,)).fetchone()
    return provider, state, json.loads(description)


def _behind_the_daemons_back(daemon: DaemonProcess, sandbox_id: str, how: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``how`` (pause, unpause) done to the sandbox by its provider here, on
    the daemon's data directory, the daemon down."""
    with monkeypatch.context() as patched:
        patched.setenv("HUTCH_HOME", daemon.data_dir)
        anyio.run(_by_the_provider, daemon, sandbox_id, how)


async def _by_the_provider(daemon: DaemonProcess, sandbox_id: str, how: str) -> None:
    provider, _, description = _recorded(daemon, sandbox_id)
    backend = await get_provider(provider).reconnect(sandbox_id, description)
    await getattr(backend, how)()


@pytest.mark.docker
@pytest.mark.parametrize("kind", KINDS)
def test_a_sandbox_adopted_paused_is_said_paused_and_resumes(
    daemon: DaemonProcess, kind: str
) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox(**_settings(kind), read_before_write=False)
        try:
            sb.write_text("kept.txt", "kept\n")
            sb.pause()
            daemon.restart()
            assert sb.status().state is hutch.SandboxState.PAUSED
            assert _recorded(daemon, sb.id)[1] == "paused"
            with pytest.raises(hutch.SandboxUnavailable, match="paused"):
                sb.exec("echo no")
            sb.resume()
            assert sb.status().state is hutch.SandboxState.RUNNING
            assert sb.read_text("kept.txt") == "kept\n"
            assert sb.exec("echo thawed").stdout == "thawed\n"
        finally:
            c.delete_sandbox(sb.id)


@pytest.mark.docker
@pytest.mark.parametrize("kind", KINDS)
def test_a_sandbox_paused_behind_the_daemons_back_is_adopted_paused(
    daemon: DaemonProcess, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded running, found paused (a pause the daemon never saw): the
    daemon says and records paused, and the sandbox resumes as one it paused."""
    with client(daemon) as c:
        sb = c.create_sandbox(**_settings(kind), read_before_write=False)
        try:
            sb.write_text("kept.txt", "kept\n")
            daemon.kill()
            _behind_the_daemons_back(daemon, sb.id, "pause", monkeypatch)
            daemon.start()
            assert sb.status().state is hutch.SandboxState.PAUSED
            assert _recorded(daemon, sb.id)[1] == "paused"
            with pytest.raises(hutch.SandboxUnavailable, match="paused"):
                sb.exec("echo no")
            sb.resume()
            assert sb.status().state is hutch.SandboxState.RUNNING
            assert sb.exec("cat kept.txt").stdout == "kept\n"
        finally:
            c.delete_sandbox(sb.id)


@pytest.mark.docker
@pytest.mark.parametrize("kind", KINDS)
def test_a_sandbox_resumed_behind_the_daemons_back_is_adopted_running(
    daemon: DaemonProcess, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded paused, found running (resumed while the daemon was down):
    the daemon says and records running, and calls reach it."""
    with client(daemon) as c:
        sb = c.create_sandbox(**_settings(kind), read_before_write=False)
        try:
            sb.write_text("kept.txt", "kept\n")
            sb.pause()
            daemon.kill()
            _behind_the_daemons_back(daemon, sb.id, "unpause", monkeypatch)
            daemon.start()
            assert sb.status().state is hutch.SandboxState.RUNNING
            assert _recorded(daemon, sb.id)[1] == "running"
            assert sb.exec("cat kept.txt").stdout == "kept\n"
            sb.pause()  # and it pauses as any running one
            assert sb.status().state is hutch.SandboxState.PAUSED
            sb.resume()
        finally:
            c.delete_sandbox(sb.id)


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("kind", isolating.params("gvisor"))
async def test_a_gvisor_sandbox_found_paused_is_known_held(kind: str) -> None:
    """The provider found again (a restart, a takeover) learns the pause from
    runsc, as it knows one it made: a kill of a command there goes the held
    way (left for the thaw, said at once), never a wait on the frozen agent.
    Found running again, it is known running."""
    settings = isolating.settings(kind)
    settings.pop("provider")
    async with await hutch.create_sandbox("gvisor", **settings,
                                          read_before_write=False) as sb:
        await sb.pause()
        try:
            found = await get_provider("gvisor").reconnect(sb.id, backend_of(sb).describe())
            assert await found.observed_state() is RuntimeState.PAUSED
            assert found.runtime.frozen()
        finally:
            await sb.resume()
        assert await found.observed_state() is RuntimeState.RUNNING
        assert not found.runtime.frozen()


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("kind", isolating.params("gvisor"))
async def test_a_kill_in_a_gvisor_sandbox_another_program_paused_goes_the_held_way(
    kind: str,
) -> None:
    """Paused by another program on the host (a handle of it found again, as
    a program sharing the store has): a kill of this program's command there
    is KillIncomplete at once, its kill left for the thaw, as in a sandbox
    paused here; the command's tree ends once it resumes."""
    settings = isolating.settings(kind)
    settings.pop("provider")
    async with await hutch.create_sandbox("gvisor", **settings,
                                          read_before_write=False) as sb:
        tag = "ah" + uuid.uuid4().hex[:8]
        process = await sb.start(f'cp "$(command -v sleep)" ./{tag} && exec ./{tag} 1000')
        await _until(sb, tag, 1)
        other = await get_provider("gvisor").reconnect(sb.id, backend_of(sb).describe())
        await other.pause()
        try:
            with pytest.raises(KillIncomplete, match="paused"):
                await process.kill()
        finally:
            await other.unpause()
        await _until(sb, tag, 0)
        assert await _alive(sb, tag) == 0


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("kind", isolating.params("gvisor"))
async def test_a_gvisor_command_lives_through_another_programs_long_pause(kind: str) -> None:
    """Paused by another program on the host for longer than a running
    command's agent may be silent: the command is held, not lost (its
    reader asks runsc, not only what this program did); it runs on at the
    resume, and its kill then ends it."""
    settings = isolating.settings(kind)
    settings.pop("provider")
    async with await hutch.create_sandbox("gvisor", **settings,
                                          read_before_write=False) as sb:
        tag = "ah" + uuid.uuid4().hex[:8]
        process = await sb.start(f'cp "$(command -v sleep)" ./{tag} && ./{tag} 1000; echo ended')
        await _until(sb, tag, 1)
        other = await get_provider("gvisor").reconnect(sb.id, backend_of(sb).describe())
        await other.pause()
        try:
            await anyio.sleep(EXEC_SILENCE_TIMEOUT + 2)
        finally:
            await other.unpause()
        assert await _alive(sb, tag) == 1
        assert process.running
        await process.kill()
        assert await _alive(sb, tag) == 0


async def _alive(sb: hutch.Sandbox, name: str) -> int:
    """How many processes named ``name`` the sandbox's own /proc shows alive."""
    result = await sb.exec(
        f"n=0; for s in /proc/[0-9]*/stat; do read -r line < $s 2>/dev/null || continue; "
        f'case "$line" in *"({name}) Z"*) ;; *"({name}) "*) n=$((n+1));; esac; done; echo $n')
    return int(result.stdout.strip())


async def _until(sb: hutch.Sandbox, name: str, count: int) -> None:
    """Until ``count`` processes named ``name`` are alive in the sandbox (a minute at most)."""
    with anyio.move_on_after(60):
        while True:
            if await _alive(sb, name) == count:
                break
            await anyio.sleep(0.1)
