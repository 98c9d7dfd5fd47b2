"""The seam through which programs that hold one sandbox share its idle rule
and its time limits.

Several programs may hold the same live sandbox, each with a lifecycle
engine of its own (a thread's sandbox found again by ``ensure`` in another
process, no daemon between them). Idleness is then the sandbox's, not one
program's: every engine writes its activity where all of them read it (the
durable store), and an engine whose timer fires reads the others' before it
acts, under a claim only one program holds at a time, so that no program
suspends or reaps a sandbox another is using, and two timers never both act.

Its time limits are the sandbox's too: its creation time (max_lifetime
counts from there, whichever program found it later) and its set_timeout
deadline (whichever program set it last) are recorded there, every
program's timer goes by them, and one that fires reads them again under the
claim before it acts (another program may have moved the deadline).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .._inflight import CallMark
    from ..core.live import LiveSandbox
    from ..states import SandboxState

#: An engine writes its activity at most once per this share of the
#: shortest idle window (and always within it of the activity). Another
#: program then misses at most two of these: its idle rule acts only once a
#: whole window has passed since the latest activity it reads, so activity
#: written late never lets it act on a sandbox in use.
PUBLISH_SHARE = 0.25
#: Nor more often than this (a window of a fraction of a second).
MIN_PUBLISH_SECONDS = 0.05
#: How long a transition waits for another program's to finish before it
#: gives up (typed), rather than hang.
CLAIM_WAIT_SECONDS = 120.0
#: How soon a timer that found the claim held (another program acting on
#: the sandbox now) looks again.
CLAIM_RETRY_SECONDS = 0.2
#: How often a timer looks whether another program changed a shared
#: sandbox's time limits (a set_timeout there, its program gone since): a
#: deadline moved earlier is kept at most this late. Cheap: a counter read,
#: and the record only when another program wrote.
LIMITS_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class SharedLimits:
    """A shared sandbox's time limits as recorded (Unix times; None: not recorded)."""

    #: When the sandbox was made: max_lifetime counts from here.
    created_unix: float | None
    #: Its set_timeout deadline, whichever program set it last.
    deadline_unix: float | None


@dataclass(frozen=True)
class SharedView:
    """What the programs sharing a sandbox have recorded of it, read under a claim."""

    #: The record is still what this program last wrote or found: no other
    #: program has moved the sandbox since (suspended, resumed or ended it).
    current: bool
    #: The latest activity any program recorded (Unix time), if any did.
    last_active_unix: float | None
    #: Its time limits as recorded.
    limits: SharedLimits = SharedLimits(None, None)
    #: Why its recorded state is what it is (an ended one: its expiry).
    reason: str | None = None


class SharedActivity(Protocol):
    """Where a sandbox's activity and idle transitions are shared (a store)."""

    async def moved(self, sandbox_id: str) -> bool:
        """Whether another program may have moved the sandbox since this one
        last knew it (then the caller looks under the claim). Cheap: asked
        on every operation, it reads the store (off the caller's event loop)
        only when another program has written since."""

    async def publish(self, sandbox_id: str, last_active_unix: float) -> None:
        """Record activity seen by this program; the record keeps the latest
        of every program's (an older time never moves it back)."""

    async def limits(self, sandbox_id: str) -> SharedLimits | None:
        """The sandbox's time limits as recorded, if another program may
        have changed them since this one last looked; None if none did (or
        it is this program's alone). Cheap: asked at every timer poll, it
        reads the store (off the caller's event loop) only when another
        program has written since."""

    def limits_now(self, sandbox_id: str) -> SharedLimits | None:
        """:meth:`limits`, for a synchronous status: the truth at once (a
        deadline another program has just set), read on the caller's thread
        when another program has written since the last look. The engine's
        asynchronous paths look first (each operation, each timer poll), so
        that a status read after them finds nothing new to read."""

    async def record_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        """Record a set_timeout deadline made here (called under the claim,
        before it takes effect): every program's timer goes by it."""

    def claim(self, sandbox_id: str) -> AbstractAsyncContextManager[SharedView | None]:
        """Hold the right to act on the sandbox's idleness while the block
        runs (the transition is recorded inside it). Yields None while
        another program holds it (it is acting now: look again later)."""

    def begin_call(self, sandbox_id: str) -> CallMark:
        """Mark a call of this program starting on the sandbox, for the other
        programs' suspends to wait for (never blocks); REFUSED while one is
        taking it down (the call then waits for that under the claim)."""

    def end_call(self, sandbox_id: str) -> None:
        """A call :meth:`begin_call` marked (not refused) has ended."""

    def calls_held_off(self, sandbox_id: str) -> AbstractContextManager[bool]:
        """Hold off the other programs' calls while the block runs (called
        under the claim, around a step that takes the sandbox down), if none
        is in flight; yields whether it did (never blocks)."""

    async def refresh(self, sandbox: LiveSandbox) -> SandboxState | None:
        """Bring this program's handle of ``sandbox`` up to what another
        program recorded since (called under the claim): its backend found
        again as recorded, and the state the record names; None if it is no
        longer this program's to use (ended, or taken over by a daemon)."""
