"""The ``runsc`` command line: one place that names its flags.

Every call carries the same global flags: a checkpoint restores only under
the flags, bundle and binary it was made with."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import anyio.to_thread

from ..._errors import InvalidArgument, ProviderError
from ..._paths import hutch_home

#: The binary: ``$HUTCH_RUNSC`` (a newer build), else ``runsc`` on PATH.
RUNSC_ENV = "HUTCH_RUNSC"
#: Debian's 2022 build runs without a network only on this kind of kernel;
#: the root is an overlay held in the sandbox's memory (saved in a
#: checkpoint); the agent makes its socket on the host through the gofer.
GLOBAL_FLAGS = ("--network=none", "--overlay2=root:memory", "--host-uds=create")
#: Where a started sandbox's kernel writes its panic, beside its log: a
#: sentry that dies says why there (and nowhere else: its log stays empty).
PANIC_LOG = "panic.log"
#: How long a start waits for its ``ready`` sign before asking runsc too.
READY_GRACE = 2.0
INSTALL_HINT = "apt-get install runsc (Debian), or set HUTCH_RUNSC to a runsc binary"


def gvisor_home() -> str:
    return os.path.join(hutch_home(), "gvisor")


def state_root() -> str:
    """runsc's own state directory (``--root``), hutch's alone."""
    return os.path.join(gvisor_home(), "state")


def runsc_binary() -> str:
    configured = os.environ.get(RUNSC_ENV)
    found = configured or shutil.which("runsc")
    if not found or not os.access(found, os.X_OK):
        raise InvalidArgument(f"the gvisor provider needs runsc: {INSTALL_HINT}")
    return found


_builds: dict[tuple[str, int, int], str] = {}


def runsc_build() -> str:
    """The build, as ``runsc --version`` says it (checkpoints are tied to it);
    asked once per binary file (a new one, a package upgrade, is asked again)."""
    binary = runsc_binary()
    found = os.stat(binary)
    key = (os.path.realpath(binary), found.st_mtime_ns, found.st_size)
    if key not in _builds:
        _, said = complete([binary, "--version"], timeout=30)
        _builds[key] = said.decode(errors="replace").strip()
    return _builds[key]


def argv(*args: str) -> list[str]:
    return [runsc_binary(), "--root", state_root(), *GLOBAL_FLAGS, *args]


def complete(
    args: list[str], *, timeout: float, stdout: IO[bytes] | int = subprocess.PIPE,
    stderr: IO[bytes] | int = subprocess.DEVNULL,
) -> tuple[int, bytes]:
    """``args`` run to their end (blocking): the exit status and what they
    wrote to ``stdout`` where it is a pipe. Waited for with a blocking
    ``waitpid``, which returns the moment the command ends: subprocess's
    own wait with a timeout polls with sleeps growing to 50 ms (a runsc
    checkpoint came back 25 ms late on average). The timeout kills it from
    a timer instead; ``subprocess.TimeoutExpired`` then."""
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        process.kill()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        said, _ = process.communicate()
    finally:
        timer.cancel()
    if expired.is_set():
        raise subprocess.TimeoutExpired(args, timeout)
    return process.returncode, said or b""


def run(*args: str, what: str, timeout: float = 120.0) -> str:
    """Run a runsc command to its end (blocking); ProviderError with its words."""
    # Into a file, not a pipe: a detached sandbox inherits runsc's output
    # and would hold a pipe open long after runsc returned.
    with tempfile.TemporaryFile() as output:
        try:
            returncode, _ = complete(argv(*args), stdout=output, stderr=output, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ProviderError(
                f"gvisor: {what}: runsc did not finish in {timeout:g}s"
            ) from None
        output.seek(0)
        text = output.read().decode(errors="replace")
    if returncode != 0:
        said = text.strip().splitlines()
        raise ProviderError(f"gvisor: {what}: {' '.join(said[:3])[:600]}")
    return text


async def run_async(*args: str, what: str, timeout: float = 120.0) -> str:
    return await anyio.to_thread.run_sync(lambda: run(*args, what=what, timeout=timeout))


def start(*args: str, container: str, log_path: str, what: str,
          ready: Callable[[], bool] | None = None, timeout: float = 120.0) -> None:
    """``runsc run`` or ``runsc restore`` of ``container``, returning once it
    runs (blocking). Not ``--detach``: runsc stays the sandbox's parent and
    reaps it the moment it ends (a checkpoint, a delete), and then deletes
    the container itself. A detached sandbox is reaped by whatever adopts
    it, and ``runsc delete`` waits for that: seconds where pid 1 reaps
    lazily. Its output (and the sandbox's) goes to ``log_path``.

    ``ready``: a cheaper sign that it runs (its agent's pid file), looked at
    first; runsc's state is asked too once it has not come for a while.
    Go's runtime messages (a panic of the sandbox's kernel) go to
    :data:`PANIC_LOG` beside ``log_path``; the listeners of :func:`on_end`
    are told when this runsc ends."""
    panic_log = os.path.join(os.path.dirname(log_path), PANIC_LOG)
    with open(log_path, "ab") as log_file:
        said_from = log_file.tell()  # what this start says, not an earlier one
        process = subprocess.Popen(
            argv(f"--panic-log={panic_log}", *args), stdin=subprocess.DEVNULL,
            stdout=log_file, stderr=log_file, start_new_session=True,
        )
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if ready is not None and ready():
            break
        if ready is None or time.monotonic() - started >= READY_GRACE:
            found = state(container)
            if found is not None and found.get("status") == "running":
                break
        if process.poll() is not None:
            raise ProviderError(f"gvisor: {what}: {_tail(log_path, said_from)}")
        if time.monotonic() >= deadline:
            process.kill()
            process.wait()
            raise ProviderError(f"gvisor: {what}: not running after {timeout:g}s")
        time.sleep(0.002 if ready is not None else 0.01)
    ended = threading.Event()
    with _parents_lock:
        _parents[container] = ended

    def reap() -> None:
        process.wait()
        ended.set()  # kept until the container is removed (see forget)
        with _parents_lock:
            listeners = list(_end_listeners)
        for listener in listeners:
            listener(container, panic_log)

    threading.Thread(target=reap, name=f"runsc {container}", daemon=True).start()


#: Told (from a reaping thread) of each runsc :func:`start` started that
#: ended: its container and where its kernel's panic would be.
EndListener = Callable[[str, str], None]
_end_listeners: list[EndListener] = []


def on_end(listener: EndListener) -> Callable[[], None]:
    """``listener`` told of each started runsc that ends, from now until the
    function this returns is called."""
    with _parents_lock:
        _end_listeners.append(listener)

    def stop() -> None:
        with _parents_lock:
            _end_listeners.remove(listener)

    return stop


#: The runsc that started each container: set once it has ended (the
#: sandbox reaped, gone to its last byte, and the container deleted).
_parents: dict[str, threading.Event] = {}
_parents_lock = threading.Lock()


def await_end(container: str, timeout: float) -> bool:
    """Until the runsc this process started ``container`` with has ended
    (a stopped sandbox lets go of its memory and its control socket only
    then: a big one takes seconds after its checkpoint). Blocking; at once
    where there is none. Whether it has ended (False where there was none)."""
    with _parents_lock:
        ended = _parents.get(container)
    return ended is not None and ended.wait(timeout)


def remove_when_ended(container: str) -> None:
    """``container`` gone in the background: the runsc this process started
    it with deletes it as it ends; one without (a daemon before a restart
    started it) is removed here."""

    def reap() -> None:
        if not await_end(container, 600.0):
            remove(container)
        forget(container)

    threading.Thread(target=reap, name=f"runsc reap {container}", daemon=True).start()


def forget(container: str) -> None:
    with _parents_lock:
        _parents.pop(container, None)


def sandbox_process(pid_file: str) -> int | None:
    """A pidfd of the sandbox process whose pid runsc wrote to ``pid_file``
    (``--pid-file`` of a run or restore): held before a checkpoint, it says
    when that process has ended, its memory freed. None where there is none
    to be had (no file, the process gone, or the pid since taken by another
    process: not a runsc sandbox)."""
    try:
        with open(pid_file) as found:
            pid = int(found.read().strip())
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as found:
            program = found.read().split(b"\0", 1)[0]
    except OSError:
        program = b""
    if not program.endswith(b"runsc-sandbox"):
        os.close(pidfd)
        return None
    return pidfd


def await_exit(pidfd: int, timeout: float) -> bool:
    """Until the process of ``pidfd`` has ended (blocking); whether it has."""
    ready, _, _ = select.select([pidfd], [], [], timeout)
    return bool(ready)


def list_ids() -> list[str]:
    """The ids of the containers runsc knows under hutch's state root."""
    returncode, said = complete(argv("list", "--quiet"), timeout=30)
    return said.decode(errors="replace").split() if returncode == 0 else []


def _tail(path: str, start: int) -> str:
    try:
        with open(path, "rb") as found:
            found.seek(max(start, os.path.getsize(path) - 2000))
            said = found.read().decode(errors="replace").strip().splitlines()
    except OSError:
        said = []
    return " ".join(said[-3:])[:600] or "runsc ended"


def state(container: str) -> dict[str, Any] | None:
    """runsc's state of ``container`` (``status``: running, paused, stopped),
    or None where runsc knows none by that name (runsc answers a name it
    does not know with the container it is the prefix of: not that one)."""
    returncode, said = complete(argv("state", container), timeout=30)
    if returncode != 0:
        return None
    try:
        found = json.loads(said)
    except ValueError:
        return None
    return found if isinstance(found, dict) and found.get("id") == container else None


def remove(container: str) -> None:
    """The container gone, whatever its state (blocking)."""
    if state(container) is None:
        forget(container)
        return  # runsc would take the name as another's prefix
    # Killed first: the runsc that started it reaps it and deletes it at
    # once, where a delete of a running sandbox waits seconds for its end.
    complete(argv("kill", container, "KILL"), stdout=subprocess.DEVNULL, timeout=60)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        found = state(container)
        if found is None or found.get("status") == "stopped":
            break
        time.sleep(0.01)
    complete(argv("delete", "--force", container), stdout=subprocess.DEVNULL, timeout=60)
    forget(container)


def pids(container: str) -> set[int]:
    """The pids of the container's processes, as runsc ps lists them."""
    returncode, said = complete(argv("ps", "--format", "json", container), timeout=30)
    if returncode != 0:
        return set()
    try:
        listed = json.loads(said) or []
    except ValueError:
        return set()
    return {int(item["PID"]) for item in listed if isinstance(item, dict) and "PID" in item}
