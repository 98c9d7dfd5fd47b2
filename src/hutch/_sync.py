"""What the generated sync faces run on: an event loop in a thread of its own.

The async core is the one implementation; :mod:`hutch._sync_generated`
(written by ``scripts/gen_sync.py`` from the async classes' source) gives
each async class a typed sync twin whose methods hand their coroutine to a
:class:`LoopThread` and wait for its outcome. The loop keeps running between
calls, so what a sandbox does on its own (background commands' output read
as it comes, idle timers, a ref served to other processes) goes on while the
caller does something else, as it does on the async face.

A call is one handoff each way: the coroutine is scheduled with
``call_soon_threadsafe`` and the caller waits on a plain lock the loop
releases when the task is done (cheaper than a ``concurrent.futures`` future
or an anyio portal, which start a task group's worth of machinery per call).
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, Protocol, TypeVar, cast

from ._errors import SandboxUnavailable

T = TypeVar("T")


class _Raised:
    """What a call raised, carried back to its caller's thread."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception


class _Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=_Closable)


class LoopThread:
    """An asyncio event loop running in a (non-daemon) thread until :meth:`stop`."""

    loop: asyncio.AbstractEventLoop

    def __init__(self) -> None:
        started = threading.Event()
        self._stopping: asyncio.Future[None] | None = None
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="hutch-sync-loop", daemon=False
        )
        self._thread.start()
        started.wait()
        #: The sync object whose close ends this loop (the sandbox made with it).
        self.owner: object | None = None

    def _run(self, started: threading.Event) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            self._stopping = self.loop.create_future()
            started.set()
            await self._stopping

        # asyncio.run: on the way out, what is left is cancelled, async
        # generators finalized and the default executor shut down.
        asyncio.run(serve())

    @property
    def running(self) -> bool:
        return self._stopping is not None and not self._stopping.done()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (or its exception)."""
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise RuntimeError("a sync face was called from its own event loop's thread")
        waiter = _thread.allocate_lock()
        waiter.acquire()
        tasks: list[asyncio.Task[None]] = []
        outcome: list[Any] = []

        async def run() -> None:
            # The waiter is let go from the task itself, not from a done
            # callback (which would wait for one more turn of the loop).
            try:
                outcome.append(await coro)
            except BaseException as exc:
                outcome.append(_Raised(exc))
                if not isinstance(exc, Exception):
                    raise
            finally:
                waiter.release()

        def begin() -> None:
            tasks.append(self.loop.create_task(run()))

        try:
            if not self.running:
                raise RuntimeError
            self.loop.call_soon_threadsafe(begin)
        except RuntimeError:
            coro.close()
            raise SandboxUnavailable(
                "closed: the event loop of this sync face stopped when its sandbox was closed"
            ) from None
        try:
            waiter.acquire()
        except BaseException:
            # Interrupted (Ctrl-C): the call is cancelled rather than left running.
            self.loop.call_soon_threadsafe(lambda: tasks and tasks[0].cancel())
            raise
        value = outcome[0]
        if isinstance(value, _Raised):
            raise value.exception
        return cast(T, value)

    def closing(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a close on the loop; once the loop has stopped (its owner
        closed), there is nothing left to close: closing is idempotent."""
        if not self.running:
            coro.close()
            return
        self.call(coro)

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """The items of an async iterator, each fetched on the loop; closing
        the iterator early closes the async one there."""

        async def step() -> T:
            return await agen.__anext__()

        finished = False
        try:
            while True:
                try:
                    item = self.call(step())
                except StopAsyncIteration:
                    finished = True
                    return
                except BaseException:
                    finished = True
                    raise
                yield item
        finally:
            aclose: Callable[[], Awaitable[None]] | None = getattr(agen, "aclose", None)
            if (not finished and aclose is not None and self.running
                    and threading.get_ident() != self._thread.ident):

                async def close() -> None:
                    await aclose()

                self.call(close())

    @contextmanager
    def enter(self, manager: AbstractAsyncContextManager[T]) -> Iterator[T]:
        """An async context manager, entered and left on the loop."""

        async def enter() -> T:
            return await manager.__aenter__()

        value = self.call(enter())
        try:
            yield value
        except BaseException as exc:
            error = exc

            async def leave_raising() -> bool | None:
                return await manager.__aexit__(type(error), error, error.__traceback__)

            if not self.call(leave_raising()):
                raise
        else:

            async def leave() -> bool | None:
                return await manager.__aexit__(None, None, None)

            self.call(leave())

    def release(self, closed: object) -> None:
        """``closed`` has been closed: the loop stops if it was its owner's."""
        if closed is self.owner:
            self.stop()

    def stop(self) -> None:
        """Stop the loop (what still runs on it is cancelled) and join its thread."""
        stopping = self._stopping
        if stopping is not None and self.running:

            def finish() -> None:
                if not stopping.done():
                    stopping.set_result(None)

            try:
                self.loop.call_soon_threadsafe(finish)
            except RuntimeError:  # already closed
                pass
        if threading.get_ident() != self._thread.ident:
            self._thread.join()


def start(
    factory: Callable[[], Coroutine[Any, Any, T]], face: Callable[[T, LoopThread], S]
) -> S:
    """Start a loop thread, make the async object on it with ``factory`` and
    give its sync face (``face(target, loop)``), the owner of the loop: its
    close stops it. A script that never closes it still exits (see below)."""
    loop = LoopThread()
    try:
        target = loop.call(factory())
    except BaseException:
        loop.stop()
        raise
    sync = face(target, loop)
    loop.owner = sync
    _unclosed.add(sync)
    return sync


_unclosed: weakref.WeakSet[_Closable] = weakref.WeakSet()


def _close_unclosed() -> None:
    for sync in list(_unclosed):
        try:
            sync.close()
        except Exception:
            pass


# The loop's thread is not a daemon thread, and non-daemon threads are joined
# before atexit handlers run; threading's own pre-join hook (what
# concurrent.futures uses) runs in time to close what a script left open.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_unclosed)
else:  # pragma: no cover - older or other Pythons
    atexit.register(_close_unclosed)
