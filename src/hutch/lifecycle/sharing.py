"""The engine's side of sandboxes other programs hold too (see
:mod:`.shared` for the seam): a transition is taken under the claim, after
following what another program did; activity is written for the others'
idle rules; a sandbox is taken down only with no call of theirs in flight."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from .._errors import SandboxUnavailable
from ..states import FINAL, SandboxState
from .base import EngineBase
from .records import EXPIRY_ERRORS, LifecycleRecord
from .shared import CLAIM_WAIT_SECONDS, MIN_PUBLISH_SECONDS, PUBLISH_SHARE, SharedView

if TYPE_CHECKING:
    from ..core.live import LiveSandbox

log = logging.getLogger("hutch.lifecycle")


class Sharing(EngineBase):
    def _active(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        """Activity now: the idle clock restarts, here and for every program
        that shares the sandbox."""
        record.last_activity_mono = self.clock.monotonic()
        if self.shared is not None:
            self._publish(sandbox, record)

    @asynccontextmanager
    async def _claimed(self, sandbox: LiveSandbox, record: LifecycleRecord) -> AsyncIterator[bool]:
        """With other programs sharing the sandbox: hold the claim while a
        transition is taken and recorded, after bringing a handle another
        program has moved since up to date (its state becomes the recorded
        one, so that this program never resumes over that one's resume).
        Yields whether it was brought up to date. Waits while another
        program holds the claim, and gives up (typed) after a long while."""
        if self.shared is None or record.state in FINAL:
            yield False
            return
        waited_since = self.clock.monotonic()
        delay = 0.02
        while True:
            async with self.shared.claim(record.sandbox_id) as view:
                if view is not None:
                    if not view.current:
                        await self._follow(sandbox, record, view)
                    yield not view.current
                    return
            if self.clock.monotonic() - waited_since > CLAIM_WAIT_SECONDS:
                raise SandboxUnavailable(
                    f"sandbox {record.sandbox_id}: another program holding it has been "
                    f"changing its state for over {CLAIM_WAIT_SECONDS:g} s; try again"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _follow(
        self, sandbox: LiveSandbox, record: LifecycleRecord, view: SharedView
    ) -> None:
        """Another program moved the sandbox: take its record as this
        handle's state (nothing is written: that program wrote it). One it
        ended on a time limit ends here with the same reason, so that its
        typed error is the same whichever program's timer acted."""
        assert self.shared is not None
        state = await self.shared.refresh(sandbox)
        if state is None or state in FINAL:
            expired = state is not None and view.reason in EXPIRY_ERRORS
            record.state = SandboxState.TERMINATED
            record.reason = view.reason if expired else "ended by another program"
        else:
            record.state, record.reason = state, None
        record.meter.switch(record.state, self.clock.monotonic())
        log.info("sandbox %s: another program made it %s; this handle follows",
                 record.sandbox_id, record.state.value)
        if record.state in FINAL:
            self._forget(record)  # its timers stop; its backend is not this program's to free

    def _publish_interval(self, record: LifecycleRecord) -> float | None:
        """How often this record's activity is written: a share of its
        shortest idle window; None without one (no idle rule reads it)."""
        windows = [w for w in (record.options.idle_suspend_after, record.options.idle_timeout)
                   if w is not None]
        if not windows:
            return None
        return max(MIN_PUBLISH_SECONDS, min(windows) * PUBLISH_SHARE)

    def _publish(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        """Have the activity written: at once if none was written for an
        interval, else once the interval is over (the latest by then), and
        again each interval while an operation stays open here."""
        if record.publishing or record.state in FINAL:
            return
        if self._publish_interval(record) is None:
            return
        record.publishing = True
        task = asyncio.get_running_loop().create_task(self._publishing(sandbox, record))
        self._publishers.add(task)
        task.add_done_callback(self._publishers.discard)

    async def _publishing(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        shared = self.shared
        try:
            while shared is not None:
                interval = self._publish_interval(record)
                if interval is None:
                    return
                wait = record.published_at_mono + interval - self.clock.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if sandbox.open_operations and record.state is SandboxState.RUNNING:
                    # An operation open here (a long upload) is invisible to
                    # the other programs' idle rules but through its activity.
                    record.last_activity_mono = self.clock.monotonic()
                seen = record.last_activity_mono
                if seen <= record.published_activity_mono or record.state in FINAL:
                    return
                at_unix = self.clock.time() - (self.clock.monotonic() - seen)
                await shared.publish(record.sandbox_id, at_unix)
                record.published_activity_mono = seen
                record.published_at_mono = self.clock.monotonic()
        except Exception as exc:  # the next activity tries again; a timer here still reads it
            log.warning("sandbox %s: its activity was not shared: %s", record.sandbox_id, exc)
        finally:
            record.publishing = False

    @asynccontextmanager
    async def _calls_held_off(self, record: LifecycleRecord) -> AsyncIterator[None]:
        """Under the claim: wait until no other program sharing the sandbox
        has a call in flight, and hold off their new ones (they wait for the
        claim, then follow) while the block takes the sandbox down: a
        suspend never kills another program's command, nor does one meet
        the container going down. Gives up (typed) after a long while."""
        if self.shared is None or record.state in FINAL:
            yield
            return
        waited_since = self.clock.monotonic()
        delay = 0.005
        while True:
            with self.shared.calls_held_off(record.sandbox_id) as held:
                if held:
                    yield
                    return
            if self.clock.monotonic() - waited_since > CLAIM_WAIT_SECONDS:
                raise SandboxUnavailable(
                    f"sandbox {record.sandbox_id}: another program holding it has had a call "
                    f"running for over {CLAIM_WAIT_SECONDS:g} s; it is not taken down under "
                    "that call: try again once it ends"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
