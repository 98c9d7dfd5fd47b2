"""One command the agent runs (:class:`AgentProcess`): its output, stdin,
window size and exit read off its own connection, and its kill."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, NoReturn

from ..._errors import HutchError, KillIncomplete, ProviderError, StdinClosed
from ..._types import OutputChunk
from .._hostproc import EXEC_MARKER
from .._proctree import REAP_SECONDS, ProcessTree
from ..base import FutureExitProcess, PtyProcess
from .replies import number, ok
from .wire import (
    ANSWER_TIMEOUT,
    EXEC_SILENCE_TIMEOUT,
    MAX_PAYLOAD,
    AgentFailure,
    Channel,
    Header,
)

if TYPE_CHECKING:
    from .runtime import AgentRuntime

#: Output chunks a process holds before its reader waits for the consumer.
_QUEUE_CHUNKS = 64
#: How long a command whose kill was answered (or not) has to be seen ended.
ENDED_AFTER_KILL_SECONDS = 5.0


class AgentUnconfirmed(ProviderError):
    """A request the agent failed while it is alive (it answers a ping, or
    its keeper runs): nothing was restarted, so whatever the request was to
    do may or may not have been done."""


class AgentProcess(FutureExitProcess, PtyProcess):
    """One command the agent runs: a reader task turns its frames into chunks.
    On a PTY, what is typed goes as it comes (``write``), and the window size
    can change (``resize``)."""

    def __init__(
        self, runtime: AgentRuntime, channel: Channel, marker: str, pid: int,
        stdin: bytes | None, *, reusable: bool = False, keep_stdin: bool = False,
    ) -> None:
        self._runtime = runtime
        self._channel = channel
        self._marker = marker
        self._pid = pid
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._space = asyncio.Event()
        self._exit: asyncio.Future[int] = loop.create_future()
        self._exit_code: int | None = None
        self._oom_killed = False
        self._killing = False
        self._eof = False
        #: A plain command's connection serves again once it exits (see _pump).
        self._reusable = reusable
        self._tasks = [loop.create_task(self._pump())]
        #: What feeds the bytes given at the start (writes wait for it).
        self._fed: asyncio.Task[None] | None = None
        if stdin is not None:
            self._fed = loop.create_task(self._feed(stdin, close=not keep_stdin))
            self._tasks.append(self._fed)

    async def _feed(self, data: bytes, *, close: bool) -> None:
        with contextlib.suppress(AgentFailure):
            await self._send_input(data)
            if close:
                await self._channel.send({"t": "eof"})

    async def _send_input(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), MAX_PAYLOAD):
            await self._channel.send({"t": "in"}, view[start:start + MAX_PAYLOAD])

    async def _fed_first(self) -> None:
        if self._fed is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._fed)

    async def write_stdin(self, data: bytes) -> None:
        await self._fed_first()
        if self._exit.done():
            raise StdinClosed("the command has ended")
        try:
            await self._send_input(data)
        except AgentFailure:
            raise StdinClosed("the command has ended (its connection closed)") from None

    async def close_stdin(self) -> None:
        await self._fed_first()
        with contextlib.suppress(AgentFailure):
            await self._channel.send({"t": "eof"})

    async def _put(self, item: OutputChunk | BaseException | None) -> None:
        while self._queue.qsize() >= _QUEUE_CHUNKS and not self._killing and item is not None:
            self._space.clear()
            await self._space.wait()
        if self._killing and isinstance(item, OutputChunk) and self._queue.qsize() >= _QUEUE_CHUNKS:
            return  # being killed, nobody reading: its last output is dropped
        self._queue.put_nowait(item)

    async def _pump(self) -> None:
        exited = False
        try:
            while True:
                # A paused sandbox's agent is silent as long as the pause lasts.
                header, payload = await self._channel.recv(
                    EXEC_SILENCE_TIMEOUT, held=self._runtime.held)
                kind = header["t"]
                if kind == "out":
                    chunk = OutputChunk("stderr" if header.get("s") == 2 else "stdout", payload)
                    await self._put(chunk)
                elif kind == "exit":
                    code = int(number(header, "code"))
                    self._exit_code = code
                    self._oom_killed = header.get("oom") is True
                    if self._oom_killed and self._runtime.on_oom is not None:
                        self._runtime.on_oom()
                    if not self._exit.done():
                        self._exit.set_result(code)
                    exited = True
                    break
                elif kind != "hb":
                    raise AgentFailure(f"the agent sent {kind!r} while running a command")
        except AgentFailure as exc:
            if self._killing and self._exit.done():
                # Closed by a kill that settled the end itself (a frozen
                # sandbox's, see _kill_frozen): the output ends here.
                return
            # Closed on purpose (a kill that an orphan outlived): no fault of the agent's.
            failure = exc if self._killing else await self._runtime.failed(exc)
            if not self._exit.done():
                self._exit.set_exception(failure)
                self._exit.exception()  # retrieved here; wait() raises it again
            await self._put(failure)
        finally:
            reuse = exited and self._reusable and not self._killing
            if not reuse:
                self._channel.close()
            await self._put(None)
        if reuse:
            # Declared at the start (see start_process): the agent sends
            # nothing more for it, and serves the next request on it.
            self._runtime.keep(self._channel)

    async def read(self) -> OutputChunk | None:
        if self._eof:
            return None
        item = await self._queue.get()
        self._space.set()
        if item is None:
            self._eof = True
            return None
        if isinstance(item, BaseException):
            self._eof = True
            raise item
        return item

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), MAX_PAYLOAD):
            await self._channel.send({"t": "in"}, view[start:start + MAX_PAYLOAD])

    async def resize(self, rows: int, cols: int) -> None:
        await self._channel.send({"t": "resize", "rows": rows, "cols": cols})

    def _kill_request(self, grace: float) -> Header:
        return {"op": "kill", "pid": self._pid, "marker": f"{EXEC_MARKER}={self._marker}",
                "grace": grace}

    async def kill(self, grace: float) -> None:
        if self._exit_code is None and await self._runtime.held():
            # Also when its reader gave up on the frozen agent's silence: the
            # tree is still there, held. (Held by whoever paused it: this
            # program, or another on the host the provider's look sees.)
            await self._kill_held(grace)
            return
        if self._exit.done():
            return
        self._killing = True
        self._space.set()
        # The agent answers once the whole tree is gone and reaped, or says
        # what outlived its bound (KillIncomplete, raised after the cleanup).
        incomplete: KillIncomplete | None = None
        failed: HutchError | None = None
        try:
            await self._runtime.request(
                self._kill_request(grace), ok, timeout=grace + REAP_SECONDS + ANSWER_TIMEOUT,
            )
        except KillIncomplete as exc:
            incomplete = exc
        except AgentUnconfirmed as exc:
            # Not answered is not done: an agent alive but stopped, or starved
            # of CPU, may not have sent a signal, and the tree may run on.
            incomplete = KillIncomplete(
                f"the sandbox's agent did not confirm the command's kill ({exc}); its "
                "processes may still be running and holding their share of the sandbox")
        except HutchError as exc:
            if await self._runtime.held():
                # Paused while it was asked (the provider said so): nothing
                # was confirmed, and the held tree is there.
                await self._kill_held(grace)
                return
            failed = exc  # done only if the command is seen to end (its agent gone, say)
        with contextlib.suppress(TimeoutError, HutchError):
            await asyncio.wait_for(asyncio.shield(self._exit), ENDED_AFTER_KILL_SECONDS)
        if not self._exit.done():
            self._channel.close()  # an orphan kept the output open: stop listening
            if failed is not None:
                # The kill failed and the command did not end: nothing says
                # its processes are gone.
                incomplete = KillIncomplete(
                    f"the command's kill failed ({failed}) and it did not end: its "
                    "processes may still be running and holding their share of the sandbox")
        if incomplete is not None:
            raise incomplete

    async def _kill_held(self, grace: float) -> None:
        """The kill of a command in a sandbox held frozen: from this host
        where its processes are this host's to signal, else left for the
        agent at the thaw (and said not done)."""
        if self._runtime.signals_here:
            await self._kill_frozen(grace)
        else:
            await self._kill_at_thaw(grace)

    async def _kill_at_thaw(self, grace: float) -> NoReturn:
        """The kill of a command in a sandbox held frozen whose processes are
        not this host's to signal (gVisor's are its own kernel's): the kill
        is left for the agent, which reads it at the thaw, and what is said
        now is that it is not done (KillIncomplete): once the sandbox runs,
        the tree would run beside the agent's kill, not die before it."""
        self._killing = True
        self._space.set()
        runtime = self._runtime
        where = f"{runtime.provider_name} sandbox {runtime.sandbox_id} is paused"
        if await runtime.leave_request(self._kill_request(grace)):
            raise KillIncomplete(
                f"{where}: its agent ends the command's processes once it resumes (the kill "
                "is sent); until then they hold their share of the sandbox")
        raise KillIncomplete(
            f"{where}, and its agent could not be sent the command's kill: its processes "
            "run on once it resumes; kill them then")

    async def _kill_frozen(self, grace: float) -> None:
        """The kill of a command in a sandbox held frozen (its user's pause),
        sent from this host: the frozen agent can neither answer nor signal
        until the thaw, but the tree's processes are this host's, and none
        forks while frozen, so one look finds them all. It answers once each
        has its SIGKILL, which ends it at the thaw before it runs again (see
        :meth:`ProcessTree.kill`; a thaw meanwhile is waited out as any kill).
        Its exit is then the SIGKILL's: the agent tells none until the thaw."""
        self._killing = True
        self._space.set()
        frozen = self._runtime.frozen_here
        tree = ProcessTree(f"{EXEC_MARKER}={self._marker}", held=frozen,
                           cgroup=self._runtime.host_cgroup())
        try:
            await tree.kill(grace)
        finally:
            if not frozen():  # thawed meanwhile: the agent tells the exit
                with contextlib.suppress(TimeoutError, HutchError, AgentFailure):
                    await asyncio.wait_for(asyncio.shield(self._exit), 5)
            self._settle_doomed()
            self._channel.close()
