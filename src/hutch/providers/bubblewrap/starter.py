"""The bubblewrap starter: the one thread of this process that starts every
keeper, each in namespaces and cgroups of its own (see :class:`Starter`)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..._errors import ProviderError
from .. import _mounts
from . import mountns
from .cgroups import SandboxCgroup, leave_thread, thread_home

T = TypeVar("T")
log = logging.getLogger("hutch.bubblewrap")

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS = 0x00020000
_CLONE_FS = 0x00000200
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class Starter:
    """The one thread of this process that starts keepers, each in a mount
    namespace of its own, in a network namespace of its own made ahead of
    time, and born in its sandbox's cgroups.

    ``unshare(CLONE_NEWNS)`` in a thread gives that thread alone a new mount
    namespace (it unshares the thread's file system context, never the
    process's), and what the thread starts inherits it: so the sandbox's
    tmpfs and overlay are mounted with two system calls, not by a chain of
    ``unshare``, ``sh``, ``mount`` and ``mkdir`` processes. Likewise the
    thread moves itself into the sandbox's cgroups (see
    :meth:`SandboxCgroup.enter_thread`) and the keeper is born there, and
    it enters a fresh network namespace (loopback up, nothing else) that the
    keeper inherits: made ahead while the thread has no start to do (see
    :func:`new_netns`), because bringing a loopback up takes the kernel's
    network lock, which the teardown of ended sandboxes' namespaces holds
    for milliseconds at a time.
    Each namespace serves one sandbox only, as bwrap's ``--unshare-net``
    would. One long-lived thread rather than one per sandbox, because a
    keeper started with ``--die-with-parent`` dies when the *thread* that
    started it ends. After each start the thread goes back to the host's
    namespaces and to its own cgroups: each sandbox's mount namespace is
    copied from the host's (never from the last sandbox's), then rid of every
    host mount its keeper does not use (see :mod:`.mountns`), and nothing of
    a sandbox is kept alive by the thread."""

    #: Network namespaces kept ready (each is a few kilobytes of the kernel's).
    SPARE_NETNS = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._thread: threading.Thread | None = None

    def run(self, job: Callable[[bool], T], cgroup: SandboxCgroup, *, own_network: bool) -> T:
        """``job(joined)`` in the starter thread, in a fresh private mount
        namespace and, with ``own_network``, a fresh network namespace;
        ``joined`` says whether the thread is in ``cgroup`` (what it starts
        is born there) or the started process must join by itself."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # A forked child has none of its parent's threads.
                self._jobs = queue.Queue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._jobs,), name="hutch-bwrap-starter",
                    daemon=True,
                )
                self._thread.start()
            done: Future[T] = Future()
            self._jobs.put((job, cgroup, own_network, done))
        return done.result()

    def _serve(self, jobs: queue.Queue[_Job]) -> None:
        # Nothing may end this thread while it lives: every ephemeral keeper
        # it started dies with it (``--die-with-parent`` is the death of the
        # thread that started the process), and a start waiting on it would
        # wait for ever. An error fails one start (told to its caller) or
        # stops the spares, never the thread.
        host_mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        host_net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        spares: list[int] = []
        refill = True
        broken = ""
        home: list[str] = []
        try:
            home = thread_home()
        except (OSError, ValueError) as exc:
            broken = f"reading its own cgroups: {exc}"
        # A file system context of this thread's own: setns needs it unshared.
        if not broken and _libc.unshare(_CLONE_FS) != 0:
            broken = f"unshare(CLONE_FS): {_errno_text()}"
        while True:
            wanted = refill and not broken and len(spares) < self.SPARE_NETNS
            try:
                # A spare is made as soon as no start waits: right after the
                # start that took one, while its sandbox is still coming up
                # (its agent starting), not later, when the sandbox's first
                # requests come (a warm pool's sandbox is taken at once).
                job, cgroup, own_network, done = jobs.get(block=not wanted)
            except queue.Empty:
                try:
                    spares.append(new_netns(host_net))
                except Exception as exc:  # the thread lives on (see above)
                    # Each start makes its own then, and says what fails.
                    log.warning("bubblewrap starter: no spare network namespace: %s", exc)
                    refill = False
                continue
            try:
                broken = self._start(job, cgroup, own_network, done, spares, host_net,
                                     host_mnt, home, broken)
            except BaseException as exc:  # the thread lives on (see above)
                if not done.done():
                    done.set_exception(exc)
                log.exception("bubblewrap starter: a start failed unexpectedly")
            if broken:
                # Never start another sandbox from namespaces or cgroups not the host's.
                log.error("bubblewrap starter: %s", broken)

    @staticmethod
    def _start(
        job: Callable[[bool], Any], cgroup: SandboxCgroup, own_network: bool,
        done: Future[Any], spares: list[int], host_net: int, host_mnt: int,
        home: list[str], broken: str,
    ) -> str:
        """One start, answered through ``done``; what is broken after it."""
        if broken:
            done.set_exception(ProviderError(f"cannot start a bubblewrap keeper: {broken}"))
            return broken
        if _libc.unshare(_CLONE_NEWNS) != 0:
            done.set_exception(ProviderError(f"unshare(CLONE_NEWNS): {_errno_text()}"))
            return broken
        result: Any = None
        error: BaseException | None = None
        try:
            # Nothing mounted for a sandbox propagates back to the host's.
            mountns.mount(None, "/", None, _mounts.MS_REC | _mounts.MS_PRIVATE, None)
            if own_network:
                netns = spares.pop() if spares else new_netns(host_net)
                try:
                    _setns(netns, _CLONE_NEWNET)
                finally:
                    os.close(netns)  # what the keeper starts in holds it now
            result = job(cgroup.enter_thread())
        except BaseException as exc:  # told to the start's caller, whatever it is
            error = exc
        # Home before the answer (also from half way in): while this
        # thread is in the sandbox's cgroups, v1 lists this whole process
        # among the sandbox's.
        try:
            leave_thread(home)
            _setns(host_net, _CLONE_NEWNET)
        except (OSError, ProviderError) as exc:
            broken = f"going back to its own cgroups and network: {exc}"
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
        if _libc.setns(host_mnt, _CLONE_NEWNS) != 0:
            broken = f"setns back to the host's mount namespace: {_errno_text()}"
        os.chdir("/")
        return broken


_Job = tuple[Callable[[bool], Any], SandboxCgroup, bool, "Future[Any]"]


def _setns(fd: int, kind: int) -> None:
    if _libc.setns(fd, kind) != 0:
        raise ProviderError(f"setns: {_errno_text()}")


def new_netns(host_net: int) -> int:
    """A descriptor of a new network namespace with its loopback up (the
    calling thread's own file system context required; it ends in
    ``host_net`` again)."""
    if _libc.unshare(_CLONE_NEWNET) != 0:
        raise ProviderError(f"unshare(CLONE_NEWNET): {_errno_text()}")
    try:
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ProviderError(f"opening a sandbox's network namespace: {exc}") from None
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                request = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
                fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
        except OSError as exc:
            os.close(fd)
            raise ProviderError(f"bringing a sandbox's loopback up: {exc}") from None
    finally:
        _setns(host_net, _CLONE_NEWNET)
    return fd


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


STARTER = Starter()
