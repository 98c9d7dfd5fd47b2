"""The seam between a sandbox and the lifecycle engine.

Every sandbox operation passes through :meth:`LifecycleGate.enter` and
:meth:`LifecycleGate.leave`; that is where activity is tracked, a suspended
sandbox is resumed (or refused), and an expired one fails with its reason.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .._sandbox import Sandbox
    from ..states import SandboxState


class LifecycleGate(Protocol):
    async def enter(self, sandbox: Sandbox, op: str, *, activity: bool) -> None: ...

    def leave(self, sandbox: Sandbox, op: str, *, activity: bool) -> None: ...

    def touch(self, sandbox: Sandbox) -> None: ...

    async def pause(self, sandbox: Sandbox) -> None: ...

    async def suspend(self, sandbox: Sandbox) -> None: ...

    async def resume(self, sandbox: Sandbox) -> None: ...

    async def closed(self, sandbox: Sandbox) -> None: ...

    def held(self, sandbox: Sandbox) -> AbstractAsyncContextManager[SandboxState]: ...
