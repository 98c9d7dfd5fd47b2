"""Lifecycle engine internals: the scheduler, work-aware idleness with a fake
process count, transitions racing operations, failures, and process exit.

Everything runs on the virtual provider; the clock is virtual except where
the scheduler's own sleeping task is the thing under test.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import hutch
from hutch._sandbox import live_of
from hutch._types import Capabilities
from hutch.lifecycle.clock import RealClock, VirtualClock
from hutch.lifecycle.engine import LifecycleEngine
from hutch.lifecycle.scheduler import Scheduler
from hutch.providers.virtual import VirtualSandbox
from hutch.states import ALLOWED, FINAL, SandboxState, check_transition

pytestmark = pytest.mark.anyio


class BusyVirtual(VirtualSandbox):
    """A virtual sandbox that reports ``busy`` processes besides its keeper."""

    capabilities = Capabilities(processes=True, pause=True, suspend=True)

    def __init__(self, sandbox_id: str, workdir: str = "/workspace") -> None:
        super().__init__(sandbox_id, workdir)
        self.busy = 0
        self.counted = 0
        self.gate: asyncio.Event | None = None
        self.fail_pause = False

    async def count_busy_processes(self) -> int:
        self.counted += 1
        return self.busy

    async def suspend(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        await super().suspend()

    async def pause(self) -> None:
        if self.fail_pause:
            raise RuntimeError("the freezer is stuck")
        await super().pause()


@pytest.fixture
async def engine() -> AsyncIterator[LifecycleEngine]:
    eng = LifecycleEngine(clock=VirtualClock())
    yield eng
    await eng.close()


async def busy_sandbox(engine: LifecycleEngine, **options: Any) -> tuple[Any, BusyVirtual]:
    backend = BusyVirtual(f"sb-busy-{id(options)}")
    sandbox = hutch.Sandbox(backend, read_before_write=False)
    await engine.attach(live_of(sandbox), hutch.SandboxOptions(**options))
    return sandbox, backend


# -- the state machine ---------------------------------------------------------------
def test_every_illegal_transition_is_a_typed_error() -> None:
    for old in SandboxState:
        for new in SandboxState:
            if new in ALLOWED[old]:
                check_transition("sb", old, new)
            else:
                with pytest.raises(hutch.InvalidState) as info:
                    check_transition("sb", old, new)
                assert info.value.code == "invalid_state"
    assert all(not ALLOWED[s] for s in FINAL)


async def test_expired_sandbox_answers_every_call_with_its_reason(
    engine: LifecycleEngine,
) -> None:
    sb = await hutch.create_sandbox("virtual", engine=engine, max_lifetime=10)
    await engine.advance(11)
    for call in (sb.pause, sb.suspend, sb.resume, lambda: sb.set_timeout(5),
                 lambda: sb.read_text("x"), lambda: sb.glob("*")):
        with pytest.raises(hutch.MaxLifetimeExceeded, match="make a new sandbox"):
            await call()
    assert sb.status().reason == "max_lifetime_exceeded"
    assert sb.closed, "reaping released the backend"


async def test_failed_backend_step_is_the_failed_state(engine: LifecycleEngine) -> None:
    sb, backend = await busy_sandbox(engine)
    backend.fail_pause = True
    with pytest.raises(RuntimeError, match="freezer"):
        await sb.pause()
    assert sb.state == SandboxState.FAILED
    assert "freezer" in (sb.status().reason or "")
    with pytest.raises(hutch.SandboxUnavailable, match="failed"):
        await sb.read_text("x")


# -- idleness ---------------------------------------------------------------------------
async def test_busy_processes_keep_a_sandbox_awake(engine: LifecycleEngine) -> None:
    sb, backend = await busy_sandbox(engine, idle_suspend_after=2, idle_timeout=5)
    backend.busy = 1  # `nohup sleep 600 &`: no calls, but work going on
    await engine.advance(600)
    assert sb.state == SandboxState.RUNNING
    backend.busy = 0
    await engine.advance(3.5)
    assert sb.state == SandboxState.SUSPENDED
    await engine.advance(6)
    assert sb.state == SandboxState.TERMINATED
    assert sb.status().reason == "idle_timeout"


async def test_busy_recheck_is_cheap_for_long_windows(engine: LifecycleEngine) -> None:
    sb, backend = await busy_sandbox(engine, idle_timeout=600)
    backend.busy = 1
    await engine.advance(3600)
    assert sb.state == SandboxState.RUNNING
    # Looked at every 30 s (5 % of the window), not every second.
    assert backend.counted <= 3600 / 30 + 2
    backend.busy = 0
    await engine.advance(600 + 31)
    assert sb.state == SandboxState.TERMINATED


async def test_open_operation_is_activity(engine: LifecycleEngine) -> None:
    sb, _ = await busy_sandbox(engine, idle_suspend_after=5)
    sb._open_ops += 1  # an exec stream held open for a long time
    await engine.advance(100)
    assert sb.state == SandboxState.RUNNING
    assert sb.status().idle_seconds == 0
    sb._open_ops -= 1
    await engine.advance(7)
    assert sb.state == SandboxState.SUSPENDED


async def test_idle_suspend_rearms_after_auto_resume(engine: LifecycleEngine) -> None:
    sb: Any = await hutch.create_sandbox(
        "virtual", engine=engine, read_before_write=False, idle_suspend_after=10
    )
    await sb.write_text("f", "kept")
    for _ in range(5):
        await engine.advance(11)
        assert sb.state == SandboxState.SUSPENDED
        assert await sb.read_text("f") == "kept"
        assert sb.state == SandboxState.RUNNING
    assert sb.meter["suspended_s"] == pytest.approx(5 * 1)


async def test_paused_sandbox_still_meets_its_hard_bounds(engine: LifecycleEngine) -> None:
    sb = await hutch.create_sandbox("virtual", engine=engine, max_lifetime=50, idle_timeout=5)
    await sb.pause()
    await engine.advance(49)
    assert sb.state == SandboxState.PAUSED  # idle clock stopped
    await engine.advance(2)
    assert sb.status().reason == "max_lifetime_exceeded"


async def test_suspended_sandbox_is_reaped_by_idle_timeout(engine: LifecycleEngine) -> None:
    sb = await hutch.create_sandbox(
        "virtual", engine=engine, idle_suspend_after=5, idle_timeout=20
    )
    await engine.advance(6)
    assert sb.state == SandboxState.SUSPENDED
    await engine.advance(15)
    assert sb.status().reason == "idle_timeout"


async def test_local_provider_ignores_idle_suspend_and_says_so() -> None:
    from hutch.providers.local import LocalSandbox

    assert not LocalSandbox.capabilities.pause
    assert not LocalSandbox.capabilities.suspend
    eng = LifecycleEngine(clock=VirtualClock())
    sb = await hutch.create_sandbox("local", engine=eng, idle_suspend_after=5)
    await eng.advance(100)
    assert sb.state == SandboxState.RUNNING
    with pytest.raises(hutch.CapabilityUnsupported, match="suspend"):
        await sb.suspend()
    with pytest.raises(hutch.CapabilityUnsupported, match="pause"):
        await sb.pause()
    await sb.close()
    await eng.close()


# -- transitions and operations ------------------------------------------------------------
async def test_operation_during_suspend_waits_then_resumes(engine: LifecycleEngine) -> None:
    sb, backend = await busy_sandbox(engine)
    await sb.write_text("f", "kept")
    backend.gate = asyncio.Event()
    suspending = asyncio.ensure_future(sb.suspend())
    await asyncio.sleep(0)
    reading = asyncio.ensure_future(sb.read_text("f"))
    await asyncio.sleep(0.01)
    assert not reading.done(), "an operation slipped into a sandbox going down"
    backend.gate.set()
    await suspending
    assert await reading == "kept"
    assert sb.state == SandboxState.RUNNING


async def test_transition_hook_sees_pause_resume_and_close(engine: LifecycleEngine) -> None:
    calls: list[str] = []

    def hook(sid: str, old: SandboxState, new: SandboxState, reason: str | None) -> None:
        calls.append(new.value)

    engine.on_transition = hook
    sb = await hutch.create_sandbox("virtual", engine=engine)
    await sb.pause()
    await sb.resume()
    await sb.close()
    assert calls == ["running", "paused", "running", "terminated"]


async def test_an_adopted_sandbox_is_said_in_its_recorded_state_while_it_is_written_again(
    engine: LifecycleEngine,
) -> None:
    """A daemon adopting a running sandbox (after a restart, or taking over
    a dead daemon's) finds it on record as running, and writes it again
    (that write checks the daemon still owns it). Meanwhile calls already
    reach the sandbox: its status says what the store says, running, never
    the 'creating' it never was for its callers."""
    writing, go_on = asyncio.Event(), asyncio.Event()

    async def hook(sid: str, old: SandboxState, new: SandboxState, reason: str | None) -> None:
        writing.set()
        await go_on.wait()

    engine.on_transition = hook
    sandbox = hutch.Sandbox(VirtualSandbox("sb-adopted", "/workspace"), read_before_write=False)
    adopting = asyncio.ensure_future(engine.attach(
        live_of(sandbox), hutch.SandboxOptions(), state=SandboxState.RUNNING,
        created_unix=time.time() - 60, meter={"running_s": 60.0}, recorded=True))
    await writing.wait()
    assert sandbox.status().state is SandboxState.RUNNING, "said creating while adopted"
    go_on.set()
    await adopting
    assert sandbox.status().state is SandboxState.RUNNING
    # A new sandbox's first state is on record as creating until its write is done.
    writing.clear()
    go_on.clear()
    fresh = hutch.Sandbox(VirtualSandbox("sb-fresh", "/workspace"), read_before_write=False)
    creating = asyncio.ensure_future(engine.attach(live_of(fresh), hutch.SandboxOptions()))
    await writing.wait()
    assert fresh.status().state is SandboxState.CREATING
    go_on.set()
    await creating
    assert fresh.status().state is SandboxState.RUNNING
    await sandbox.close()
    await fresh.close()


async def test_status_says_the_recorded_state_while_a_transition_is_written(
    engine: LifecycleEngine,
) -> None:
    """While a transition's record is being written, the status says the
    state the store still has: the write may be refused (a full disk), and
    the transition undone; nobody may have been told it happened."""
    writing, refuse = asyncio.Event(), asyncio.Event()
    go_on = asyncio.Event()

    async def hook(sid: str, old: SandboxState, new: SandboxState, reason: str | None) -> None:
        if new is SandboxState.PAUSED:
            writing.set()
            await go_on.wait()
            if refuse.is_set():
                raise hutch.StoreUnavailable("hutch.db: database or disk is full")

    engine.on_transition = hook
    sb = await hutch.create_sandbox("virtual", engine=engine)
    for refused in (True, False):
        writing.clear()
        go_on.clear()
        if refused:
            refuse.set()
        else:
            refuse.clear()
        pausing = asyncio.ensure_future(sb.pause())
        await writing.wait()
        assert sb.status().state is SandboxState.RUNNING, "told before it was recorded"
        go_on.set()
        if refused:
            with pytest.raises(hutch.StoreUnavailable):
                await pausing
            assert sb.status().state is SandboxState.RUNNING
        else:
            await pausing
            assert sb.status().state is SandboxState.PAUSED
    await sb.close()


async def test_state_for_the_daemon(engine: LifecycleEngine) -> None:
    sb = await hutch.create_sandbox("virtual", engine=engine, read_before_write=False)
    await engine.advance(3)
    await sb.write_text("x", "y")
    await engine.advance(4)
    deadline = await engine.set_timeout(live_of(sb), 100)
    view = engine.state(live_of(sb))
    assert view.state is SandboxState.RUNNING
    assert view.deadline_unix == deadline == engine.clock.time() + 100
    assert view.created_at_unix == engine.clock.time() - 7
    assert view.last_active_unix == engine.clock.time() - 4
    assert view.idle_seconds == 4
    assert view.as_dict()["meter"] == {"running_s": 7, "paused_s": 0, "suspended_s": 0}
    assert sb.status() == view
    info = await sb.info()
    assert {k: info[k] for k in view.as_dict()} == view.as_dict()
    assert (info["provider"], info["open_operations"]) == ("virtual", 0)


# -- the scheduler ---------------------------------------------------------------------------
async def test_scheduler_keeps_one_live_entry_per_key() -> None:
    fired: list[str] = []

    async def callback(key: str) -> None:
        fired.append(key)

    clock = VirtualClock()
    scheduler = Scheduler(clock, callback, drive=False)
    for i in range(1000):
        scheduler.schedule("a", 10 + i)  # rescheduled 1000 times
    scheduler.schedule("b", 5)
    scheduler.cancel("b")
    assert len(scheduler) == 1
    assert scheduler.next_due() == 1009
    clock.step(2000)
    await asyncio.gather(*scheduler.run_due())
    assert fired == ["a"]
    assert len(scheduler) == 0


async def test_scheduler_task_wakes_early_and_closes() -> None:
    fired: list[tuple[str, float]] = []

    async def callback(key: str) -> None:
        fired.append((key, time.monotonic()))

    scheduler = Scheduler(RealClock(), callback)
    start = time.monotonic()
    scheduler.schedule("late", start + 60)
    await asyncio.sleep(0.01)  # the task now sleeps for a minute
    scheduler.schedule("soon", start + 0.1)
    await asyncio.sleep(0.4)
    assert [k for k, _ in fired] == ["soon"]
    assert fired[0][1] - start < 0.35
    await scheduler.close()
    assert scheduler._task is not None and scheduler._task.done()


async def test_many_idle_sandboxes_cost_nothing_while_nothing_is_due() -> None:
    calls = 0

    async def callback(key: str) -> None:
        nonlocal calls
        calls += 1

    clock = VirtualClock()
    scheduler = Scheduler(clock, callback, drive=False)
    for i in range(100_000):
        scheduler.schedule(f"sb-{i}", 3600 + i % 100)
    clock.step(3599)
    started = time.process_time()
    for _ in range(1000):  # a thousand wake-ups with nothing due
        assert not scheduler.run_due()
    assert time.process_time() - started < 0.5
    assert calls == 0


def test_timers_never_keep_the_process_alive() -> None:
    script = textwrap.dedent(
        """
        import asyncio, hutch
        async def main():
            sb = await hutch.create_sandbox(
                "virtual", idle_timeout=3600, idle_suspend_after=600, max_lifetime=7200
            )
            await sb.set_timeout(3000)
        asyncio.run(main())
        print("done")
        """
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.strip() == "done"
    assert time.monotonic() - started < 15


async def test_default_engine_ceiling_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def in_fresh_loop() -> float:
        sb = await hutch.create_sandbox("virtual")
        try:
            with pytest.raises(hutch.TimeoutTooLarge, match="ceiling of 600 s"):
                await sb.set_timeout(601)
            return await sb.set_timeout(600)
        finally:
            await sb.close()

    monkeypatch.setenv("HUTCH_TIMEOUT_CEILING", "600")
    # A new loop gets a new default engine, which reads the variable.
    deadline = await asyncio.to_thread(asyncio.run, in_fresh_loop())
    assert deadline == pytest.approx(time.time() + 600, abs=5)


def test_expiry_error_for_a_sandbox_known_only_from_a_store() -> None:
    from hutch.lifecycle.records import expiry_error

    err = expiry_error("sb-1", SandboxState.TERMINATED, "idle_timeout")
    assert isinstance(err, hutch.IdleTimeoutExpired) and "make a new sandbox" in str(err)
    assert isinstance(expiry_error("sb-1", SandboxState.TERMINATED, "closed"),
                      hutch.SandboxUnavailable)


async def test_a_transition_the_hook_cannot_record_does_not_happen(
    engine: LifecycleEngine,
) -> None:
    """The hook is the daemon's store: what it cannot keep is not acknowledged,
    and memory, store and backend stay as they were (never half done)."""
    store_full = True
    recorded: list[tuple[SandboxState, SandboxState, str | None]] = []

    async def store(_: str, old: SandboxState, new: SandboxState, reason: str | None) -> None:
        if store_full:
            raise hutch.StoreUnavailable("disk full")
        recorded.append((old, new, reason))

    deadlines: list[float] = []

    async def store_deadline(_: str, deadline: float) -> None:
        if store_full:
            raise hutch.StoreUnavailable("disk full")
        deadlines.append(deadline)

    sb = await hutch.create_sandbox("virtual", engine=engine, idle_timeout=5)
    engine.on_transition, engine.on_deadline = store, store_deadline
    for number, refused in enumerate((sb.pause, sb.suspend, sb.close,
                                      lambda: sb.set_timeout(1))):
        await sb.write_text(f"{number}.txt", "before")
        with pytest.raises(hutch.StoreUnavailable):
            await refused()
        assert sb.state == SandboxState.RUNNING and not sb.closed
        # The backend step was undone: the sandbox is live and its files are there.
        assert await sb.read_text(f"{number}.txt") == "before"
    assert sb.status().deadline_unix is None, "an unrecorded deadline took effect"

    # A reaping the store cannot record is not done either; it is tried again.
    await engine.advance(6)
    assert sb.state == SandboxState.RUNNING and not sb.closed
    store_full = False
    await engine.advance(engine.retry_after + 1)
    assert sb.state == SandboxState.TERMINATED and sb.closed
    assert recorded[-1] == (SandboxState.RUNNING, SandboxState.TERMINATED, "idle_timeout")
    assert engine.tracked() == 0 and len(engine.scheduler) == 0


async def test_set_timeout_refuses_what_is_not_a_duration(engine: LifecycleEngine) -> None:
    import math

    sb = await hutch.create_sandbox("virtual", engine=engine)
    for bad in (True, math.nan, -math.inf, "60"):
        with pytest.raises(hutch.InvalidArgument):
            await sb.set_timeout(bad)  # type: ignore[arg-type]
    with pytest.raises(hutch.TimeoutTooLarge):
        await sb.set_timeout(math.inf)
    assert sb.status().deadline_unix is None, "a refused timeout set a deadline"


async def test_preview_url_of_an_expired_sandbox_names_its_reason() -> None:
    eng = LifecycleEngine(clock=VirtualClock())
    sb = await hutch.create_sandbox("local", engine=eng, max_lifetime=10)
    assert (await sb.preview_url(8080)).endswith(":8080")
    await eng.advance(11)
    with pytest.raises(hutch.MaxLifetimeExceeded):
        await sb.preview_url(8080)
    await eng.close()


async def test_scheduler_heap_stays_bounded_when_deadlines_move_earlier() -> None:
    async def callback(key: str) -> None:
        return None

    scheduler = Scheduler(VirtualClock(), callback, drive=False)
    for i in range(100):
        scheduler.schedule(f"other-{i}", 1e9)
    for i in range(100_000):
        # A shorter set_timeout each time: every old entry sinks below the top.
        scheduler.schedule("moving", 1e6 - i)
    assert len(scheduler) == 101
    assert len(scheduler._heap) <= max(2 * 101, 1024) + 1
    assert scheduler.next_due() == 1e6 - 99_999


async def test_adopting_after_a_restart_keeps_every_bound(engine: LifecycleEngine) -> None:
    wall = engine.clock.time()
    options = hutch.SandboxOptions(idle_timeout=100, max_lifetime=1000)
    meter = {"running_s": 40.0, "paused_s": 5.0, "suspended_s": 0.0}

    async def adopt(**persisted: Any) -> Any:
        sandbox = hutch.Sandbox(BusyVirtual(f"sb-adopted-{len(persisted)}"))
        await engine.attach(live_of(sandbox), options, created_unix=wall - 50, **persisted)
        return sandbox

    sb = await adopt(deadline_unix=wall + 30, last_active_unix=wall - 20, meter=meter)
    status = sb.status()
    assert status.deadline_unix == wall + 30
    assert status.idle_seconds == 20 and status.last_active_unix == wall - 20
    assert status.meter == meter
    await engine.advance(31)
    assert sb.status().reason == "timeout_expired"

    now = engine.clock.time()
    idle = await adopt(last_active_unix=now - 90)
    await engine.advance(9)
    assert idle.state == SandboxState.RUNNING
    await engine.advance(2)
    assert idle.status().reason == "idle_timeout", "the idle clock started again on adoption"

    late = await adopt(deadline_unix=engine.clock.time() - 1)  # passed while the daemon was down
    await engine.advance(0)
    assert late.status().reason == "timeout_expired"


# -- a sandbox shared with other programs ---------------------------------------------


class _SlowLook:
    """Shared activity whose look at the store (``moved``) waits until let go:
    a store read taking its time off the loop, as the real one may."""

    def __init__(self) -> None:
        self.looking = asyncio.Event()
        self.let_go = asyncio.Event()
        self.marks = 0

    async def moved(self, sandbox_id: str) -> bool:
        self.looking.set()
        await self.let_go.wait()
        return False

    def begin_call(self, sandbox_id: str) -> Any:
        from hutch._inflight import CallMark

        self.marks += 1
        return CallMark.FIRST

    def end_call(self, sandbox_id: str) -> None:
        self.marks -= 1

    async def limits(self, sandbox_id: str) -> None:
        return None

    def limits_now(self, sandbox_id: str) -> None:
        return None

    async def publish(self, sandbox_id: str, last_active_unix: float) -> None:
        return None


async def test_a_call_cancelled_while_it_looks_at_the_store_leaves_no_mark() -> None:
    """The look whether another program moved a shared sandbox reads the
    store off the loop, and may take its time: a call cancelled meanwhile
    never started, and leaves no mark that would hold back another
    program's suspend (which waits for this program's marked calls)."""
    shared = _SlowLook()
    eng = LifecycleEngine(clock=VirtualClock(), shared=shared)  # type: ignore[arg-type]
    try:
        sandbox, _ = await busy_sandbox(eng)
        call = asyncio.ensure_future(eng.enter(live_of(sandbox), "exec", activity=True))
        await shared.looking.wait()
        assert shared.marks == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert shared.marks == 0
        shared.let_go.set()
        await eng.enter(live_of(sandbox), "exec", activity=True)  # a call that looks whole
        assert shared.marks == 1  # its mark ends with the call (end_call, not enter's)
    finally:
        await eng.close()
