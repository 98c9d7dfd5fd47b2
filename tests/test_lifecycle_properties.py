"""Property test: random operations and clock steps never reach an illegal
state or lose a file (virtual provider, virtual clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hutch
from hutch.lifecycle.clock import VirtualClock
from hutch.lifecycle.engine import LifecycleEngine
from hutch.states import ALLOWED, FINAL, HELD, SandboxState

T = TypeVar("T")
#: The state each transition the machine tries asks for.
ACTION_TARGETS = {
    "pause": SandboxState.PAUSED, "suspend": SandboxState.SUSPENDED, "resume": SandboxState.RUNNING,
}
NAMES = st.sampled_from(["a.txt", "dir/b.bin", "dir/sub/c", "odd name ü.txt"])


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = LifecycleEngine(clock=VirtualClock(), timeout_ceiling=1000)
        self.sandbox: Any = self.run(
            hutch.create_sandbox(
                "virtual", engine=self.engine, read_before_write=False,
                idle_suspend_after=30, idle_timeout=400, max_lifetime=3000,
            )
        )
        self.files: dict[str, bytes] = {}
        self.streams = 0
        self.suspended_at_streams = False
        self.transitions: list[tuple[SandboxState, SandboxState]] = [
            (SandboxState.CREATING, SandboxState.RUNNING)
        ]
        self.engine.on_transition = lambda _id, old, new, _r: self.transitions.append((old, new))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.engine.close())
        self.loop.close()

    @property
    def alive(self) -> bool:
        return self.sandbox.state not in FINAL

    @precondition(lambda self: self.alive)
    @rule(name=NAMES, data=st.binary(max_size=64))
    def write(self, name: str, data: bytes) -> None:
        try:
            self.run(self.sandbox.write_bytes(name, data))
        except hutch.SandboxUnavailable:
            assert self.sandbox.state == SandboxState.PAUSED
            return
        self.files[name] = data

    @precondition(lambda self: self.alive)
    @rule(name=NAMES)
    def read(self, name: str) -> None:
        try:
            data = self.run(self.sandbox.read_bytes(name))
        except FileNotFoundError:
            assert name not in self.files
        except hutch.SandboxUnavailable:
            assert self.sandbox.state == SandboxState.PAUSED
        else:
            assert data == self.files[name]

    @precondition(lambda self: self.alive)
    @rule(action=st.sampled_from(["pause", "suspend", "resume"]))
    def transition(self, action: str) -> None:
        before = self.sandbox.state
        target = ACTION_TARGETS[action]
        try:
            self.run(getattr(self.sandbox, action)())
        except hutch.InvalidState:
            assert self.sandbox.state == before, "a refused transition changed the state"
            # The engine refuses only what hutch.states forbids.
            assert target not in ALLOWED[before], f"{before} -> {target} refused"
        else:
            if self.sandbox.state != before:
                assert self.sandbox.state == target
                assert target in ALLOWED[before], f"{before} -> {target} allowed"

    @precondition(lambda self: self.alive)
    @rule(seconds=st.integers(min_value=-5, max_value=1200))
    def set_timeout(self, seconds: int) -> None:
        try:
            deadline = self.run(self.sandbox.set_timeout(seconds))
        except hutch.TimeoutTooLarge:
            assert seconds > 1000
        else:
            assert deadline == self.engine.clock.time() + seconds

    @precondition(lambda self: self.alive)
    @rule()
    def open_stream(self) -> None:
        # An exec stream held open: work, so idleness must not suspend or reap.
        self.sandbox._open_ops += 1
        self.streams += 1

    @precondition(lambda self: self.streams > 0)
    @rule()
    def close_stream(self) -> None:
        self.sandbox._open_ops -= 1
        self.streams -= 1

    @invariant()
    def idleness_never_strikes_while_a_stream_is_open(self) -> None:
        if self.streams:
            reason = self.sandbox.status().reason
            if self.sandbox.state is SandboxState.SUSPENDED and self.suspended_at_streams:
                assert reason != "idle", "idle-suspended while a stream was open"
            if self.sandbox.state in FINAL:
                assert reason != "idle_timeout", "idle-reaped while a stream was open"

    @precondition(lambda self: self.alive)
    @rule(name=NAMES, data=st.binary(max_size=16), seconds=st.sampled_from([0, 31, 500]))
    def write_while_timers_fire(self, name: str, data: bytes, seconds: int) -> None:
        # An operation and the timers on one loop at once: whatever the
        # interleaving, a write either lands (and is kept) or is refused whole.
        async def both() -> tuple[BaseException | None, BaseException | None]:
            wrote, advanced = await asyncio.gather(
                self.sandbox.write_bytes(name, data), self.engine.advance(seconds),
                return_exceptions=True,
            )
            return wrote, advanced

        wrote, advanced = self.run(both())
        assert advanced is None, f"the timers failed: {advanced!r}"
        if wrote is None:
            self.files[name] = data
        else:
            assert isinstance(wrote, hutch.SandboxUnavailable | hutch.SandboxExpired), wrote

    @rule(seconds=st.sampled_from([0, 1, 10, 29, 31, 100, 500]))
    def advance(self, seconds: int) -> None:
        was = self.sandbox.state
        self.run(self.engine.advance(seconds))
        if was is not SandboxState.SUSPENDED and self.sandbox.state is SandboxState.SUSPENDED:
            self.suspended_at_streams = self.streams > 0

    @invariant()
    def every_transition_is_legal_and_chained(self) -> None:
        for (old, new), (_, previous_new) in zip(
            self.transitions[1:], self.transitions, strict=False
        ):
            assert old == previous_new, "a transition started from a state it was not in"
            assert new in ALLOWED[old], f"illegal transition {old} -> {new}"
        assert self.sandbox.state == self.transitions[-1][1]
        if self.sandbox.state in FINAL:
            assert self.sandbox.status().reason in {
                "idle_timeout", "max_lifetime_exceeded", "timeout_expired"
            }

    @invariant()
    def no_file_is_lost(self) -> None:
        if self.sandbox.state in (SandboxState.RUNNING, SandboxState.SUSPENDED):
            for name, data in self.files.items():
                assert self.run(self.sandbox.read_bytes(name)) == data


LifecycleMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycleProperties = LifecycleMachine.TestCase


def test_the_states_module_is_the_one_table() -> None:
    # The lifecycle defines no states of its own, nor names hutch.states' again.
    from hutch.lifecycle import state
    assert not {"ALLOWED", "FINAL", "HELD", "check_transition"} & set(vars(state))
    assert hutch.SandboxState is SandboxState
    # Nothing leaves a final state; every held one resumes or ends.
    assert all(not ALLOWED[s] for s in FINAL)
    assert all(SandboxState.RUNNING in ALLOWED[s] and ALLOWED[s] >= FINAL for s in HELD)
