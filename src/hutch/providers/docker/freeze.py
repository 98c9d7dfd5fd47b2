"""A container's pauses and exec starts kept apart (:class:`FreezeGuard`), in
this process and across programs sharing the container (:class:`_StartLocks`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from ..._paths import hutch_home
from .cgroups import frozen_state


class FreezeGuard:
    """The one owner of a container's pauses in this process: the user's
    pause and unpause, and hutch's own freezes (a commit, a capture of the
    working directory, a kill from the host) all go through it, and it keeps
    exec starts apart from them.

    runc's exec joins the container's cgroup; into a frozen one it never
    returns, and the Engine (20.10, cgroup v1 here) then holds its exec store
    for good: inspect, exec and image removal hang behind it for every
    container until someone thaws that cgroup by hand. A start counts until
    the Engine says its process runs (the exec's stream opens before the
    process is started), and a freeze waits for the starts under way: this
    process's (counted here) and every other program's on the same
    container (the daemon and an in-process owner of one thread's sandbox,
    say), through :class:`_StartLocks`.

    The Engine's own word on whether a container is paused lags: its pause
    and unpause set the flag, and containerd's paused and resumed events set
    it again when the Engine gets round to them, so under load an unpause
    can be followed by "is paused, unpause the container before exec" on a
    thawed container, and a pause by "is not paused" on a frozen one (seen
    here, 20.10.24: a few in a few hundred cycles with other containers
    busy). The guard remembers what it last made the Engine do, and an
    answer that contradicts it is waited out (up to
    :attr:`SETTLE_SECONDS`), not taken as the truth. A hutch freeze of a
    container already paused (the user's pause, or another program's)
    leaves it paused: it never pauses twice, and never undoes a pause that
    is not its own.
    """

    #: How long a start may take to be told running before the guard lets a
    #: freeze through anyway (a start that never runs must not block pause).
    START_WAIT_SECONDS = 10.0
    #: How long the Engine's paused flag may lag what it was last told.
    SETTLE_SECONDS = 10.0

    def __init__(self, container: str) -> None:
        self._changed = threading.Condition()
        #: Other programs' starts and freezes of the same container.
        self._across = _StartLocks(container)
        self._starting = 0
        self._freezing = False
        #: Freezes waiting: new starts let them in first, or a stream of
        #: execs would keep a pause out for good.
        self._freezes_waiting = 0
        #: What this process last made the Engine do to the container: True
        #: pause, False unpause, None neither (a pause found on adoption is
        #: someone else's). Written under ``freezing``, or let go (None)
        #: under ``starting`` once the kernel says another program undid it.
        self._paused: bool | None = None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        with self._changed:
            while self._freezing or self._freezes_waiting:
                self._changed.wait()
            self._starting += 1
        try:
            with self._across.starting():
                yield
        finally:
            with self._changed:
                self._starting -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def freezing(self) -> Iterator[None]:
        with self._changed:
            self._freezes_waiting += 1
            try:
                while self._freezing or self._starting:
                    self._changed.wait()
            finally:
                self._freezes_waiting -= 1
            self._freezing = True
        try:
            with self._across.freezing():
                yield
        finally:
            with self._changed:
                self._freezing = False
                self._changed.notify_all()

    # The Engine's pause and unpause, with its lag waited out. Called only
    # under ``freezing``, which keeps them one at a time and apart from starts.

    def _engine_pause(self, api: Any, container: str, *, leave_paused: bool) -> bool:
        """Pause ``container`` in the Engine; whether this call paused it. With
        ``leave_paused``, one already paused (or not running) is left as it is
        (False); without, that is an error."""
        import docker.errors

        deadline = time.monotonic() + self.SETTLE_SECONDS
        delay = 0.005
        while True:
            try:
                api.pause(container)
            except docker.errors.APIError as exc:
                text = str(exc)
                lagging = self._paused is False and "is already paused" in text
                # runc gives up freezing a cgroup whose tasks do not stop in
                # its short wait (a loaded host, a task in the middle of a
                # fork) and thaws it back: a try again, not a failure.
                unfrozen = "unable to freeze" in text
                if (lagging or unfrozen) and time.monotonic() < deadline:
                    time.sleep(delay)  # a late "paused" event of our last pause
                    delay = min(delay * 2, 0.1)
                    continue
                if leave_paused and ("is already paused" in text or "is not running" in text):
                    return False
                raise
            self._paused = True
            return True

    def _engine_unpause(self, api: Any, container: str) -> None:
        import docker.errors

        deadline = time.monotonic() + self.SETTLE_SECONDS
        delay = 0.005
        while True:
            try:
                api.unpause(container)
            except docker.errors.APIError as exc:
                lagging = self._paused is True and "is not paused" in str(exc)
                if lagging and time.monotonic() < deadline:
                    time.sleep(delay)  # a late "resumed" event of an earlier unpause
                    delay = min(delay * 2, 0.1)
                    continue
                raise
            self._paused = False
            return

    def pause(self, api: Any, container: str) -> None:
        """The user's pause: the container stays paused until :meth:`unpause`."""
        with self.freezing():
            self._engine_pause(api, container, leave_paused=False)

    def unpause(self, api: Any, container: str) -> None:
        """The user's unpause (of a pause this process made, or found)."""
        with self.freezing():
            self._engine_unpause(api, container)

    @contextlib.contextmanager
    def frozen(self, api: Any, container: str, *, marker: str | None = None) -> Iterator[None]:
        """``container`` paused for the block, by hutch. One paused already
        (the user's pause, another program's) is left paused, as it was.
        ``marker``: a file that exists while hutch holds the container paused,
        for a program that finds it after this one died inside the block
        (by default the container's own, which :meth:`thaw_left_freeze` reads)."""
        with self.freezing():
            if self.paused_here(frozen_state(container)):
                # The user's pause (this program's or another's): already
                # frozen, and theirs to undo.
                yield
                return
            marker = marker or _writable_marker(frozen_marker_path(container))
            if marker is not None:
                with open(marker, "w"):
                    pass
            try:
                paused_here = self._engine_pause(api, container, leave_paused=True)
            except BaseException:
                if marker is not None:
                    os.unlink(marker)
                raise
            if marker is not None and not paused_here:
                os.unlink(marker)
            try:
                yield
            finally:
                if paused_here:
                    self._engine_unpause(api, container)
                    if marker is not None:
                        os.unlink(marker)

    def thaw_left_freeze(self, api: Any, container: str) -> bool:
        """Unpause ``container`` if a program died inside :meth:`frozen` (its
        marker is left: the pause was hutch's, for a step cut short, never
        the user's); whether it did. Under ``freezing``, which waits out a
        freeze another living program holds (its marker is not left)."""
        import docker.errors

        marker = frozen_marker_path(container)
        with self.freezing():
            if not os.path.exists(marker):
                return False
            try:
                api.unpause(container)
            except docker.errors.APIError as exc:
                if "is not paused" not in str(exc):
                    raise
            self._paused = False
            os.unlink(marker)
            return True

    def paused_here(self, kernel_says: bool | None = None) -> bool:
        """Whether the container is held paused (the user's pause): what this
        process last made the Engine do, unless the kernel's freezer
        (``kernel_says``, where it can be read) says otherwise, for another
        program (a daemon, another program sharing the store, the docker
        CLI) resumed or paused it since: what this process did is then no
        longer what the Engine last did, and no refusal of it is a lag.
        Asked under ``starting`` or ``freezing``, when no other freeze is
        under way in any program."""
        if kernel_says is not None and kernel_says != (self._paused is True):
            self._paused = None
            return kernel_says
        return self._paused is True

    def refusal_is_lag(self) -> bool:
        """Whether the Engine refusing an exec as "paused" contradicts what
        this process last made it do (an unpause), and so is its lag. Asked
        under ``starting``, when no freeze is under way."""
        return self._paused is False


class _StartLocks:
    """Exec starts and freezes of one container kept apart across programs:
    ``flock`` on two files per container under the hutch home (let go by
    the kernel when a holder dies). A start holds ``<id>`` shared until its
    process runs; a freeze holds it exclusively, so it waits for the starts
    under way in every program. The gate ``<id>.gate`` gives a waiting freeze
    the way: a start passes it (shared, for a moment) before it takes its
    share, a freeze holds it exclusively while it waits and freezes, so a
    stream of other programs' starts cannot keep a pause out for good.
    Within one process the guard has already ordered them (a freeze here
    never waits on a share this process holds)."""

    def __init__(self, container: str) -> None:
        self.path = start_lock_path(container)

    def _open(self, path: str) -> int | None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError:
            # Nowhere to keep it (a read-only home): this process's order only.
            return None

    @contextlib.contextmanager
    def _opened(self) -> Iterator[tuple[int | None, int | None]]:
        """The gate's descriptor and the lock's (None: nowhere to keep it),
        closed after the block: closing lets go of what they hold."""
        fds = (self._open(self.path + ".gate"), self._open(self.path))
        try:
            yield fds
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        with self._opened() as (gate, share):
            _flock(gate, fcntl.LOCK_SH)
            _flock(share, fcntl.LOCK_SH)
            _flock(gate, fcntl.LOCK_UN)
            yield

    @contextlib.contextmanager
    def freezing(self) -> Iterator[None]:
        with self._opened() as (gate, whole):
            _flock(gate, fcntl.LOCK_EX)
            _flock(whole, fcntl.LOCK_EX)
            yield


def _flock(fd: int | None, operation: int) -> None:
    if fd is not None:
        fcntl.flock(fd, operation)


def start_lock_path(container: str) -> str:
    """Where programs sharing ``container`` (by id) order its starts and freezes."""
    return os.path.join(hutch_home(), "docker", "starts", container)


def frozen_marker_path(container: str) -> str:
    """The file that says hutch holds ``container`` paused for a step of its own."""
    return start_lock_path(container) + ".frozen"


def _writable_marker(path: str) -> str | None:
    """``path`` if a marker can be kept there (None: a read-only home)."""
    return path if os.access(os.path.dirname(path), os.W_OK) else None


def drop_start_locks(container: str) -> None:
    """A removed container's lock files go with it."""
    for path in (start_lock_path(container), start_lock_path(container) + ".gate",
                 frozen_marker_path(container)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_freeze_guards: weakref.WeakValueDictionary[str, FreezeGuard] = weakref.WeakValueDictionary()
_freeze_guards_lock = threading.Lock()


def freeze_guard(container: str) -> FreezeGuard:
    """The one guard of ``container`` in this process (kept while anyone holds it)."""
    with _freeze_guards_lock:
        guard = _freeze_guards.get(container)
        if guard is None:
            guard = _freeze_guards[container] = FreezeGuard(container)
        return guard
