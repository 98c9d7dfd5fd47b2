"""Lifecycle logic on the virtual provider with a virtual clock: no real sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import hutch
from hutch.lifecycle.clock import VirtualClock
from hutch.lifecycle.engine import LifecycleEngine
from hutch.states import SandboxState
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine() -> AsyncIterator[LifecycleEngine]:
    eng = LifecycleEngine(clock=VirtualClock())
    yield eng
    await eng.close()


async def make(engine: LifecycleEngine, **options: Any) -> Any:
    return await hutch.create_sandbox(
        "virtual", engine=engine, read_before_write=False, **options
    )


async def test_starts_running_with_a_meter(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    assert sb.state == SandboxState.RUNNING
    await engine.advance(10)
    status = sb.status()
    assert status.meter["running_s"] == 10
    assert status.deadline_unix is None  # no limit is implicit
    await sb.pause()
    await engine.advance(5)
    await sb.resume()
    await sb.suspend()
    await engine.advance(7)
    assert sb.status().meter == {"running_s": 10, "paused_s": 5, "suspended_s": 7}


async def test_illegal_transitions_are_typed_errors(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    with pytest.raises(hutch.InvalidState, match="running; it cannot become running"):
        await sb.resume()
    await sb.pause()
    with pytest.raises(hutch.InvalidState):
        await sb.pause()
    with pytest.raises(hutch.InvalidState, match="paused; it cannot become suspended"):
        await sb.suspend()
    await sb.resume()
    await sb.suspend()
    with pytest.raises(hutch.InvalidState):
        await sb.pause()
    await sb.resume()
    assert sb.state == SandboxState.RUNNING


async def test_paused_sandbox_refuses_operations(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    await sb.write_text("a.txt", "a")
    await sb.pause()
    with pytest.raises(hutch.SandboxUnavailable, match="paused"):
        await sb.read_text("a.txt")
    await sb.resume()
    assert await sb.read_text("a.txt") == "a"


async def test_idle_suspend_then_transparent_resume(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_suspend_after=60)
    await sb.write_text("keep.txt", "kept")
    await engine.advance(59)
    assert sb.state == SandboxState.RUNNING
    await engine.advance(2)
    assert sb.state == SandboxState.SUSPENDED
    assert sb.status().reason == "idle"
    assert await sb.read_text("keep.txt") == "kept"  # resumes on the next call
    assert sb.state == SandboxState.RUNNING


async def test_activity_postpones_idle_suspend(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_suspend_after=60)
    for _ in range(5):
        await engine.advance(50)
        await sb.write_text("tick.txt", "x")
    assert sb.state == SandboxState.RUNNING


async def test_status_and_listing_are_not_activity(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_suspend_after=60)
    for _ in range(10):
        await engine.advance(7)
        sb.status()
    assert sb.state == SandboxState.SUSPENDED


async def test_strict_mode_refuses_a_suspended_sandbox(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_suspend_after=10, auto_resume=False)
    await engine.advance(11)
    assert sb.state == SandboxState.SUSPENDED
    with pytest.raises(hutch.SandboxUnavailable, match="auto_resume is off"):
        await sb.read_text("x")
    await sb.resume()
    await sb.write_text("x", "ok")


async def test_paused_sandbox_idle_clock_is_stopped(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_suspend_after=10, idle_timeout=20)
    await sb.pause()
    await engine.advance(1000)
    assert sb.state == SandboxState.PAUSED
    await sb.resume()
    await engine.advance(11)
    assert sb.state == SandboxState.SUSPENDED


async def test_idle_timeout_terminates_with_reason(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_timeout=30)
    await engine.advance(31)
    assert sb.state == SandboxState.TERMINATED
    with pytest.raises(hutch.IdleTimeoutExpired, match="make a new sandbox") as info:
        await sb.read_text("x")
    assert info.value.code == "idle_timeout"
    with pytest.raises(hutch.SandboxExpired):
        await sb.write_text("x", "y")


async def test_max_lifetime_ignores_activity(engine: LifecycleEngine) -> None:
    sb = await make(engine, max_lifetime=100)
    assert sb.status().deadline_unix == pytest.approx(engine.clock.time() + 100)
    for _ in range(9):
        await engine.advance(10)
        await sb.write_text("busy", "x")
    await engine.advance(11)
    with pytest.raises(hutch.MaxLifetimeExceeded) as info:
        await sb.read_text("busy")
    assert info.value.code == "max_lifetime_exceeded"


async def test_set_timeout_returns_the_deadline(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    deadline = await sb.set_timeout(120)
    assert deadline == engine.clock.time() + 120
    assert sb.status().deadline_unix == deadline


async def test_set_timeout_ceiling(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    with pytest.raises(hutch.TimeoutTooLarge, match="86400") as info:
        await sb.set_timeout(86401)
    assert info.value.code == "timeout_too_large"
    assert await sb.set_timeout(86400) == engine.clock.time() + 86400
    small = LifecycleEngine(clock=VirtualClock(), timeout_ceiling=60)
    other = await make(small)
    with pytest.raises(hutch.TimeoutTooLarge, match="60"):
        await other.set_timeout(61)


async def test_live_deadline_has_authority_over_idle_clock(engine: LifecycleEngine) -> None:
    sb = await make(engine, idle_timeout=10)
    await sb.set_timeout(100)
    await engine.advance(90)
    assert sb.state == SandboxState.RUNNING  # idle 90 s, but the deadline rules
    await engine.advance(11)
    with pytest.raises(hutch.TimeoutExpired, match="set_timeout earlier"):
        await sb.read_text("x")


async def test_deadline_suspends_when_on_timeout_says_so(engine: LifecycleEngine) -> None:
    # E2B's autoPause: the deadline suspends the sandbox instead of ending it.
    sb = await make(engine, on_timeout="suspend")
    await sb.write_text("kept.txt", "still here")
    await sb.set_timeout(30)
    await engine.advance(31)
    assert sb.state == SandboxState.SUSPENDED
    assert sb.status().reason == "timeout" and sb.status().deadline_unix is None
    assert await sb.read_text("kept.txt") == "still here"  # resumed by the operation
    assert sb.state == SandboxState.RUNNING
    await engine.advance(3600)
    assert sb.state == SandboxState.RUNNING  # the deadline was spent


async def test_past_deadline_reaps(engine: LifecycleEngine) -> None:
    sb = await make(engine)
    await sb.set_timeout(-1)
    await engine.advance(0)
    assert sb.state == SandboxState.TERMINATED
    assert sb.status().reason == "timeout_expired"


async def test_close_clears_timers(engine: LifecycleEngine) -> None:
    sbs = [await make(engine, idle_timeout=5, max_lifetime=50) for _ in range(3)]
    assert len(engine.scheduler) == 3
    for sb in sbs:
        await sb.close()
    assert len(engine.scheduler) == 0
    with pytest.raises(hutch.SandboxUnavailable, match="closed"):
        await sbs[0].read_text("x")


async def test_transition_hook_sees_every_transition(engine: LifecycleEngine) -> None:
    seen: list[tuple[str, str, str, str | None]] = []

    async def hook(sid: str, old: SandboxState, new: SandboxState, reason: str | None) -> None:
        seen.append((sid, old.value, new.value, reason))

    engine.on_transition = hook
    sb = await make(engine, idle_suspend_after=5, idle_timeout=50)
    await engine.advance(6)
    await sb.read_text("x") if await sb.exists("x") else None
    await engine.advance(51)
    assert [(o, n, r) for _, o, n, r in seen] == [
        ("creating", "running", None),
        ("running", "suspended", "idle"),
        ("suspended", "running", None),
        ("running", "suspended", "idle"),
        ("suspended", "terminated", "idle_timeout"),
    ]


async def test_a_backend_that_cannot_count_its_processes_is_kept_and_told_plainly(
    engine: LifecycleEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """An idle check whose backend answers with a typed error (its container
    removed outside hutch, its agent gone) keeps the sandbox (unreachable is
    not idle) and logs one line: an expected refusal is no crash to trace."""
    from hutch._sandbox import backend_of

    sb = await hutch.create_sandbox("bubblewrap", engine=engine, image=TEST_IMAGE,
                                    idle_suspend_after=60)
    assert sb.capabilities.processes

    async def refuse() -> int:
        raise hutch.SandboxUnavailable(f"{sb.id}: its container was removed outside hutch")

    monkeypatch.setattr(backend_of(sb).runtime, "count_busy_processes", refuse)
    with caplog.at_level("WARNING", logger="hutch.lifecycle"):
        await engine.advance(61)
    assert sb.state == SandboxState.RUNNING
    told = [r for r in caplog.records if "count its processes" in r.getMessage()]
    assert told and "removed outside hutch" in told[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records), "a typed refusal logged a traceback"
    await sb.close()
