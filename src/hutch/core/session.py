"""What every session of a sandbox does before and around its operations:
the gate each operation passes (the ref it came with checked, the lifecycle
engine told, a backend failure said as hutch's), and the live sandbox's
parts a session reaches through it. :class:`hutch.Sandbox` is built on it;
it holds no public member (the sync face is generated from the public ones).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from .._errors import HutchError, ProviderError, SandboxUnavailable
from .._guardrail import ReadBeforeWriteGuard, session_guard
from .commands import forget_finished
from .live import LiveSandbox, closed_message

if TYPE_CHECKING:
    from .._process import Process
    from .._watch import Watcher
    from ..lifecycle.gate import LifecycleGate
    from ..providers.base import SandboxBackend, SandboxRuntime
    from ..store import RefRow


class SandboxSession:
    """One session's hold on a live sandbox (see the module docstring)."""

    _live: LiveSandbox
    #: This session's read-before-write guard.
    _guard: ReadBeforeWriteGuard
    #: An attached session that detached: every call is refused.
    _detached: bool
    #: The ref an attached session came in with (None for the owner).
    _ref: RefRow | None

    @property
    def _backend(self) -> SandboxBackend:
        return self._live.backend

    @property
    def _processes(self) -> dict[str, Process]:
        return self._live.processes

    @property
    def _gate(self) -> LifecycleGate | None:
        return self._live.gate

    @property
    def _open_ops(self) -> int:
        return self._live.open_ops

    @_open_ops.setter
    def _open_ops(self, count: int) -> None:
        self._live.open_ops = count

    @property
    def _runtime(self) -> SandboxRuntime:
        """What executes and moves files here now (see providers.base)."""
        return self._backend.runtime

    @property
    def _session_guard(self) -> ReadBeforeWriteGuard:
        """The read-before-write guard of the session making this call."""
        return session_guard.get() or self._guard

    @asynccontextmanager
    async def _operation(self, name: str, *, activity: bool = True) -> AsyncIterator[None]:
        if self._detached:
            raise SandboxUnavailable(
                f"this session detached from sandbox {self._live.id}; attach again with a ref"
            )
        if self._ref is not None and not self._live.closed:
            # As through a server: a revoked or expired ref is refused at every call.
            self._ref.check_usable(time.time())
        if self._gate is not None:
            # The gate knows why a sandbox is gone (expired, closed) and says so.
            await self._gate.enter(self._live, name, activity=activity)
        unavailable: SandboxUnavailable | None = None
        try:
            if self._live.closed:
                raise SandboxUnavailable(closed_message(self._live.id))
            self._open_ops += 1
            try:
                yield
            except SandboxUnavailable as exc:
                unavailable = exc  # asked about below, once the call is let out
            except HutchError:
                raise
            except (OSError, ValueError, NotImplementedError, TimeoutError):
                raise
            except Exception as exc:  # a backend failure that is not ours
                raise ProviderError(
                    f"{self._live.backend.provider} sandbox {self._live.id}: {exc}"
                ) from exc
            finally:
                self._open_ops -= 1
        finally:
            # Every call the gate let in is let out (it may have marked it in flight).
            if self._gate is not None:
                self._gate.leave(self._live, name, activity=activity)
        if unavailable is not None:
            # The call found the sandbox unavailable: if its runtime is gone
            # for good, the sandbox fails saying so (out of the call: a
            # suspend waiting for calls in flight holds what failing takes).
            failed = None if self._gate is None else await self._gate.lost(
                self._live, str(unavailable))
            if failed is not None:
                raise failed from unavailable
            raise unavailable

    def _process_exited(self, process: Process) -> None:
        if self._gate is not None:
            self._gate.touch(self._live)
        forget_finished(self._processes)

    async def _write(
        self, full: str, write: Callable[[], Awaitable[None]], overwrite: bool
    ) -> None:
        """A write, under the read-before-write guard (unless told to overwrite)."""
        guard = self._session_guard
        async with self._operation("write"):
            await guard.check_write(lambda: self._runtime, full, overwrite)
            await write()
        # What this session wrote, it knows: it may overwrite it again.
        guard.mark_read(full)

    def _watch_closed(self, watcher: Watcher) -> None:
        self._live.watchers.pop(watcher.id, None)

    def _engine(self) -> Any:
        if self._gate is None:
            raise SandboxUnavailable(f"sandbox {self._live.id} has no lifecycle engine")
        return self._gate
