"""The sync face: one proxy over the async core, not a hand-kept copy.

:class:`SyncProxy` runs every coroutine method of the object it wraps on an
event loop in a background thread (an anyio blocking portal), turns async
iterators into plain iterators, and wraps returned hutch objects (background
processes, sandboxes) the same way. Each async method therefore has exactly
one implementation, and the sync face cannot drift from it.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

_WRAPPED_TYPES: tuple[type, ...] = ()


def _wrapped_types() -> tuple[type, ...]:
    global _WRAPPED_TYPES
    if not _WRAPPED_TYPES:
        from ._process import Process
        from ._sandbox import Sandbox
        from ._snapshots import Fork

        _WRAPPED_TYPES = (Process, Sandbox, Fork)
    return _WRAPPED_TYPES


class SyncProxy:
    def __init__(
        self,
        target: Any,
        portal: BlockingPortal,
        portal_cm: AbstractContextManager[BlockingPortal] | None = None,
    ) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_portal", portal)
        object.__setattr__(self, "_portal_cm", portal_cm)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, _wrapped_types()):
            return SyncProxy(value, self._portal)
        if isinstance(value, list) and value and isinstance(value[0], _wrapped_types()):
            return [SyncProxy(v, self._portal) for v in value]
        return value

    def _iterate(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        while True:
            try:
                item = self._portal.call(agen.__anext__)
            except StopAsyncIteration:
                return
            yield self._wrap(item)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if inspect.isasyncgenfunction(attr):

            @functools.wraps(attr)
            def iterate(*args: Any, **kwargs: Any) -> Iterator[Any]:
                return self._iterate(attr(*args, **kwargs))

            return iterate
        if inspect.iscoroutinefunction(attr):

            @functools.wraps(attr)
            def call(*args: Any, **kwargs: Any) -> Any:
                return self._wrap(self._portal.call(functools.partial(attr, *args, **kwargs)))

            return call
        return self._wrap(attr)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(type(self))) | set(dir(self._target)))

    def __repr__(self) -> str:
        return f"<sync {self._target!r}>"

    def close(self) -> None:
        try:
            closer = getattr(self._target, "close", None)
            if closer is not None and inspect.iscoroutinefunction(closer):
                self._portal.call(closer)
        finally:
            cm = self._portal_cm
            if cm is not None:
                object.__setattr__(self, "_portal_cm", None)
                cm.__exit__(None, None, None)

    def __enter__(self) -> SyncProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_sync_factory(factory: Callable[..., Any], *args: Any, **kwargs: Any) -> SyncProxy:
    """Start a portal, build the async object on its loop, and proxy it."""
    cm = start_blocking_portal()
    portal = cm.__enter__()
    try:
        target = portal.call(functools.partial(factory, *args, **kwargs))
    except BaseException:
        cm.__exit__(None, None, None)
        raise
    proxy = SyncProxy(target, portal, cm)
    # A script that never closes its sandbox must still exit: the portal's
    # thread is not a daemon thread, so close it at interpreter exit.
    _unclosed.add(proxy)
    return proxy


_unclosed: weakref.WeakSet[SyncProxy] = weakref.WeakSet()


def _close_unclosed() -> None:
    for proxy in list(_unclosed):
        try:
            proxy.close()
        except Exception:
            pass


# Non-daemon threads are joined before atexit handlers run; threading's own
# pre-join hook (what concurrent.futures uses) runs in time.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_unclosed)
else:  # pragma: no cover - older or other Pythons
    atexit.register(_close_unclosed)
