"""The seam between a sandbox and the lifecycle engine.

Every sandbox operation passes through :meth:`LifecycleGate.enter` and
:meth:`LifecycleGate.leave`; that is where activity is tracked, a suspended
sandbox is resumed (or refused), and an expired one fails with its reason;
and :meth:`LifecycleGate.lost` is asked when an operation found the sandbox
unavailable, where no watch may have told yet that its runtime is gone.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .._errors import HutchError
    from ..core.live import LiveSandbox
    from ..states import SandboxState


class LifecycleGate(Protocol):
    async def enter(self, sandbox: LiveSandbox, op: str, *, activity: bool) -> None: ...

    def leave(self, sandbox: LiveSandbox, op: str, *, activity: bool) -> None: ...

    def touch(self, sandbox: LiveSandbox) -> None: ...

    async def lost(self, sandbox: LiveSandbox, found: str) -> HutchError | None: ...

    async def pause(self, sandbox: LiveSandbox) -> None: ...

    async def suspend(self, sandbox: LiveSandbox) -> None: ...

    async def resume(self, sandbox: LiveSandbox) -> None: ...

    async def closed(self, sandbox: LiveSandbox) -> None: ...

    async def note(self, sandbox: LiveSandbox, kind: str, message: str) -> None: ...

    def held(self, sandbox: LiveSandbox) -> AbstractAsyncContextManager[SandboxState]: ...
