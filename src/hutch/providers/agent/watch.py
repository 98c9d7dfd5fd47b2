"""A directory the agent watches (by inotify, ``go/watch.go``), its events
read off a connection of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..._errors import ProviderError, SandboxUnavailable
from ..._types import FileEvent
from ..watching import BackendWatch
from .replies import file_event, typed_error
from .wire import EXEC_SILENCE_TIMEOUT, AgentFailure, Channel


class AgentWatch(BackendWatch):
    """A directory the agent watches, its events read off their connection."""

    def __init__(
        self, channel: Channel, sandbox_id: str,
        held: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._channel = channel
        self._sandbox_id = sandbox_id
        #: Whether the sandbox is held frozen: its agent's silence is then no failure.
        self._held = held

    async def batch(self) -> list[FileEvent] | None:
        while True:
            try:
                header, _ = await self._channel.recv(EXEC_SILENCE_TIMEOUT, held=self._held)
            except AgentFailure as exc:
                self._channel.close()
                raise SandboxUnavailable(
                    f"the watch in sandbox {self._sandbox_id} ended: its agent went away "
                    f"({exc}); watch again once the sandbox runs"
                ) from None
            kind = header["t"]
            if kind == "hb":
                continue
            if kind == "end":
                self._channel.close()
                return None
            if kind == "err":
                self._channel.close()
                raise typed_error(header)
            events = header.get("events")
            if kind != "ev" or not isinstance(events, list):
                self._channel.close()
                raise ProviderError(f"the agent sent {kind!r} in a watch")
            return [file_event(e) for e in events]

    async def close(self) -> None:
        self._channel.close()
