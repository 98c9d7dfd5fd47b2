"""``docker``: one container per sandbox, kept alive by ``sleep infinity``,
its working directory bind-mounted from the host at the mount point.

Transport: the Engine's exec API over a hijacked socket (stdin written then
half-closed, output demultiplexed here) and its archive API for files. The
docker SDK is imported lazily, so importing this module (for its config
model) costs nothing when docker is not used.

Suspend commits the container's changes to an image and removes the
container: memory is freed, files survive (the working directory never left
the host), processes do not, and the capabilities say so.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import struct
import tarfile
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping, Sequence
from datetime import datetime
from typing import IO, Annotated, Any, Literal

import anyio
import anyio.to_thread
from pydantic import AfterValidator, ConfigDict, Field

from ..._errors import (
    HutchError,
    InvalidArgument,
    NoSuchUser,
    NotFound,
    OutputLimitExceeded,
    ProviderError,
    ResourceExhausted,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from ..._faults import fault_point
from ..._globmatch import compile_glob
from ..._paths import hutch_home, sandbox_workdir
from ..._types import (
    KILL_GRACE_SECONDS,
    Capabilities,
    FileInfo,
    FileType,
    GrepMatch,
    OutputChunk,
)
from .. import layers
from .._diskcap import image_for, mount_capped, unmount_capped
from .._docker_engine import call as _call
from .._docker_engine import engine
from .._docker_engine import explanation as _explanation
from .._docker_engine import status_of as _status
from .._grep import GREP_OUTPUT_LIMIT
from .._grepfilter import LINE_BREAKS as _LINE_BREAKS
from .._grepfilter import required_literals as _required_literals
from .._grepstream import GrepStream
from .._hostproc import EXEC_MARKER, SANDBOX_MARKER
from ..agent import AgentFailure, AgentRuntime, AgentUnavailable, agent_binary
from ..agent import workload as _workload
from ..base import (
    FutureExitProcess,
    NativeBackend,
    ProcessRequest,
    ProviderSettings,
    ProviderSnapshot,
    RuntimeLost,
    RuntimeNotice,
    RuntimeReport,
    RuntimeState,
    SandboxRuntime,
    bounded_pieces,
)
from ..network import NetworkPolicy
from ..policy import (
    DiskSize,
    ImageName,
    Limit,
    MemorySize,
    NotBool,
    ReachesHost,
    SandboxDirectory,
    format_bytes,
    keeps_dropped,
    no_key_prefix,
    one_of,
    parse_bytes,
)
from . import netguard
from .outside import (
    kept_for_preserved_container,
    preserved_container_removed,
)

log = logging.getLogger("hutch.docker")

#: Capabilities agents have no use for, dropped on top of Docker's defaults.
#: Package managers (apt, pip) and useradd still work as root without them.
DEFAULT_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"]

MANAGED_LABEL = "hutch.managed"
#: The hutch home (data directory) of the process that made a container or a
#: snapshot image: reconciliation only ever touches its own.
HOME_LABEL = "hutch.home"
PRESERVE_LABEL = "hutch.preserve"
SNAPSHOT_LABEL = "hutch.snapshot"
#: How long removing a snapshot's image may wait on the Engine.
SNAPSHOT_REMOVAL_TIMEOUT = 30.0


def snapshot_repository() -> str:
    """Where this hutch home's snapshot images are tagged (one repository
    per home, so that two daemons never take each other's for orphans)."""
    return "hutch-snapshot-" + hashlib.sha256(hutch_home().encode()).hexdigest()[:12]
SANDBOX_LABEL = "hutch.sandbox_id"
SUSPENDED_REPOSITORY = "hutch-suspended"
#: overlay2 stacks at most 128 layers; a suspend that would pass this many
#: flattens the container into a one-layer image instead of committing on top.
MAX_SUSPEND_LAYERS = 100
#: Candidate lines a container's grep may send back for one search, bytes.
GREP_CANDIDATE_LIMIT = 16 * GREP_OUTPUT_LIMIT
#: An archive for put_archive kept in memory up to this size; on disk past it.
_ARCHIVE_IN_MEMORY = 1024 * 1024
#: Symlinks followed by one read or write before it gives up (as the kernel's 40).
_MAX_LINK_HOPS = 40
#: What one piece of a file read out of a container (an archive stream) holds.
_READ_PIECE = 1024 * 1024
#: Where the agent's executable and its socket's directory are mounted.
AGENT_BINARY_PATH = "/.hutch/bin/hutch-agent"
AGENT_DIR_PATH = "/.hutch/run"
AGENT_SOCKET_NAME = "agent.sock"
#: How long a fresh container's agent has to answer (a loaded engine is slow
#: to start containers), and a restarted one's after a failure.
AGENT_START_TIMEOUT = 15.0
AGENT_RECOVER_TIMEOUT = 4.0
#: Go's os.ModeDir and os.ModeSymlink bits, as the archive stat header uses them.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
#: Go's device, named pipe, socket, character device and irregular bits.
_GO_MODE_SPECIAL = (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
#: Go's setuid, setgid and sticky bits, and POSIX's.
_GO_MODE_PERMISSION_BITS = ((1 << 23, 0o4000), (1 << 22, 0o2000), (1 << 20, 0o1000))
#: Ceilings of the settings, as the kernel takes them (pid_max's own ceiling).
MAX_CPUS = 4096.0
MAX_PIDS = 4 * 1024 * 1024


def _bind_target(path: str) -> str:
    # The Engine reads a bind as "host:container:options".
    if ":" in path or "," in path:
        raise ValueError(f"{path!r}: a mount point has no ':' or ','")
    return path


class DockerConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["docker"] = "docker"
    image: ImageName = "hutch-test:bookworm"
    #: Where the sandbox's working directory is mounted inside the container
    #: (a directory of its own: never /proc, /sys, /dev or a system directory).
    mount_point: Annotated[SandboxDirectory, AfterValidator(_bind_target)] = "/workspace"
    #: Host directory bound at the mount point; a fresh one under hutch's data
    #: directory when unset (and then removed with the sandbox).
    host_workdir: Annotated[
        str | None, ReachesHost("binds a host directory of the caller's choosing")
    ] = None
    network_mode: Annotated[
        str, ReachesHost("shares a network namespace not its own (the host's or another "
                         "container's)", one_of("bridge", "none", "default")),
    ] = "bridge"
    #: What the sandbox may reach: ``"none"``, ``"all"`` (but the metadata
    #: address, the host's own addresses and other sandboxes), or
    #: ``{"allow": [CIDR, ...]}``. See hutch.providers.network.
    network: NetworkPolicy = "all"
    #: Extra bind mounts, ``host:container[:ro]``.
    mounts: Annotated[list[str], ReachesHost("binds host paths into the sandbox")] = []
    #: Memory limit, as Docker takes it (``512m``, ``2g``).
    memory: Annotated[MemorySize | None, Limit("memory", parse_bytes, format_bytes)] = None
    #: Size cap on the working directory hutch makes (``10g``): a file system
    #: of its own, nosuid and nodev, loop-mounted (needs root). Not applied
    #: to a ``host_workdir``, nor to what is written outside the mount point.
    disk: Annotated[DiskSize | None, Limit("disk", parse_bytes, format_bytes)] = None
    #: CPU quota in CPUs (``1.5``).
    cpus: Annotated[float | None, Limit("cpus"), NotBool] = Field(default=None, gt=0, le=MAX_CPUS)
    pids_limit: Annotated[int, Limit("pids", int, int), NotBool] = Field(
        default=1024, gt=0, le=MAX_PIDS
    )
    pull_if_missing: bool = True
    env: dict[str, str] = {}
    #: Container labels; hutch's own (``hutch.*``) say what it manages and
    #: keeps, so through the daemon they are the operator's.
    labels: Annotated[dict[str, str], ReachesHost(
        "sets hutch's own labels (hutch.*), which say which containers hutch manages "
        "and keeps", no_key_prefix("hutch."),
    )] = {}
    #: Keep the container after the sandbox closes (and log how to reach it).
    preserve: Annotated[bool, ReachesHost(
        "keeps the container on the host after the sandbox ends, past hutch's cleanup",
        one_of(False),
    )] = False
    cap_drop: Annotated[
        list[str], ReachesHost(
            "gives back capabilities hutch drops (raw sockets, mknod, ...)",
            keeps_dropped(DEFAULT_CAP_DROP),
        ),
    ] = Field(default_factory=lambda: list(DEFAULT_CAP_DROP))
    #: Docker's init (tini) as PID 1, the keeper under it: orphans a kill
    #: leaves behind are reaped, where ``sleep`` as PID 1 would keep them as
    #: zombies (filling the pids limit, and looking busy forever).
    init: bool = True
    #: What executes and moves files: ``agent`` (hutch's agent as the keeper,
    #: on a unix socket: about a millisecond a call), ``native`` (docker exec
    #: and the archive API: ~50 ms a call), or ``auto``: the agent where it
    #: can be built and started, else native.
    runtime: Literal["auto", "agent", "native"] = "auto"


# -- the engine connection ------------------------------------------------------

#: The running watchers (``watch_runtimes``): their loops and report callbacks.
_WATCHERS: list[tuple[asyncio.AbstractEventLoop, RuntimeReport]] = []
_TELLING: set[asyncio.Future[None]] = set()


def cgroup_dir(container_id: str, controller: str) -> str | None:
    """The host directory of a container's cgroup for ``controller``
    (cgroup v1 with the cgroupfs driver, or v2 with either driver)."""
    for path in (
        f"/sys/fs/cgroup/{controller}/docker/{container_id}",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope",
        f"/sys/fs/cgroup/docker/{container_id}",
    ):
        if os.path.isdir(path):
            return path
    return None


def oom_kills(container_id: str) -> int | None:
    """How many processes the OOM killer has killed in the container so far."""
    where = cgroup_dir(container_id, "memory")
    if where is None:
        return None
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            with open(os.path.join(where, name)) as fh:
                count = _workload.oom_kill_count(fh.read())
        except (OSError, ValueError):
            continue
        if count is not None:
            return count
    return None


def pids_refusals(container_id: str) -> int | None:
    """How many forks the container's pids limit has refused so far (the
    kernel's count, ``pids.events``), or None where it cannot be read."""
    where = cgroup_dir(container_id, "pids")
    if where is None:
        return None
    try:
        with open(os.path.join(where, "pids.events")) as fh:
            return _workload.event_count(fh.read(), "max")
    except (OSError, ValueError):
        return None


# -- exec starts and freezes -------------------------------------------------------


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
        #: someone else's). Written only under ``freezing``.
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
            if self._paused is True:  # the user's pause: already frozen, and theirs
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

    def paused_here(self) -> bool:
        """Whether this process holds the container paused (the user's pause).
        Asked under ``starting``, when no freeze is under way."""
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


def read_ahead(hijacked: Any) -> bytes:
    """What the HTTP client already read from an exec's hijacked connection
    past its response's headers: the start of the command's output, when it
    came in the same read as the headers (a fast command, the client's
    thread slow to get to it). The SDK hands out the socket beneath the
    client's buffered reader, so reading the socket alone loses it: seen
    under load as a fast exec answering exit 0 and no output (about one in
    a hundred while pauses ran; one in three with the reading thread slowed
    by others holding the GIL). Call before the socket is read."""
    try:
        buffered = hijacked._response.raw._fp.fp
        sock = hijacked._sock
    except AttributeError:
        # Fail loudly rather than lose output without a word.
        raise ProviderError(
            "docker exec: the docker SDK no longer gives the exec's connection "
            "the way hutch reads it (its response's buffered reader)"
        ) from None
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        # read1 hands back what its buffer holds without touching the socket,
        # or else one non-blocking read (b"" when nothing waits).
        return bytes(buffered.read1(1 << 20) or b"")
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(timeout)


def wait_until_started(api: Any, exec_id: str) -> int | None:
    """Return once the Engine has started (or failed to start) ``exec_id``:
    its process's pid on the Engine's host (None if it never got one)."""
    deadline = time.monotonic() + FreezeGuard.START_WAIT_SECONDS
    pause = 0.0005
    while time.monotonic() < deadline:
        # Not "Running": the Engine sets it before it asks runc to start the
        # process; the pid comes once runc is done, the exit code if it failed.
        state = api.exec_inspect(exec_id)
        if state.get("Pid") or state.get("ExitCode") is not None:
            return int(state.get("Pid") or 0) or None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    log.warning("docker exec %s not started after %.0f s", exec_id[:12],
                FreezeGuard.START_WAIT_SECONDS)
    return None


def list_managed_containers(*, with_labels: bool = False) -> list[tuple[str, str, Any]]:
    """(sandbox_id, container_id, status) of every container hutch made;
    with ``with_labels`` the third item is the container's labels instead."""
    containers = engine().containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
    return [
        (c["Labels"].get(SANDBOX_LABEL, ""), c["Id"], c["Labels"] if with_labels else c["State"])
        for c in containers
    ]




def _own_image_bytes(api: Any, image_id: str) -> int:
    """What image ``image_id`` holds of its own: its size less its parent's
    (a commit's layer over the image it ran from), or all of it where it
    stands alone (flattened). Docker's ``Size`` counts every layer below."""
    import docker.errors

    image = api.inspect_image(image_id)
    total = int(image.get("Size") or 0)
    parent = image.get("Parent")
    if not parent:
        return total
    try:
        below = int(api.inspect_image(parent).get("Size") or 0)
    except docker.errors.ImageNotFound:
        return total
    return max(0, total - below)


def configured_image(config: DockerConfig) -> str:
    """The Docker image ``config.image`` names: this home's hutch image of that
    name (its tag is scoped to the home), else Docker's own."""
    from ..images import docker_reference

    return docker_reference(config.image)


def _pull(api: Any, image: str) -> None:
    """Pull ``image``. The engine reports some failures inside a 200 stream,
    so the stream is read to its end and its errors raised."""
    import docker.errors

    failure = ""
    try:
        for event in api.pull(image, stream=True, decode=True):
            if isinstance(event, dict) and event.get("error"):
                failure = str(event["error"])
    except docker.errors.APIError as exc:
        failure = _explanation(exc)
    if failure:
        raise NotFound(
            f"image {image!r} is not on this Docker Engine and pulling it failed: {failure}"
        )


def _image_user(image: str, pull: bool) -> str:
    """The user an image's commands run as (its USER), pulling it if asked."""
    import docker.errors

    api = engine()
    try:
        details = api.inspect_image(image)
    except docker.errors.ImageNotFound:
        if not pull:
            raise NotFound(f"image {image!r} is not on this Docker Engine") from None
        _pull(api, image)
        details = api.inspect_image(image)
    return str((details.get("Config") or {}).get("User") or "")


# -- processes ------------------------------------------------------------------

# Kills every process whose environment carries the exec's marker, and every
# process of the sessions they were in (each exec is a session of its own, so
# a child that cleared its environment is still found): SIGTERM, up to $2
# tenths of a second of grace, then SIGKILL. Children that ignore SIGTERM or
# left the process group still carry the marker, so none escapes. GNU grep -z
# reads every /proc/PID/environ in one process; without it (busybox) each is
# read by a loop.
_KILL_SCRIPT = r"""
m="$1"; grace="$2"
grep -qz x /dev/null 2>/dev/null; [ $? -eq 1 ] && fast=1 || fast=
by_marker() {
  if [ -n "$fast" ]; then
    grep -lzxF -e "$m" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/##; s#/environ$##'
    return
  fi
  for d in /proc/[0-9]*; do
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF -e "$m" && echo "${d#/proc/}"
  done
}
session_of() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f4; }
first=$(by_marker); [ -z "$first" ] && exit 0
# The sessions, taken once: the marked leaders may be gone by the next look.
sessions=$(for p in $first; do session_of "$p"; done | grep -vx -e 0 -e 1 | sort -u)
me=$(session_of $$)
want=" $(echo $sessions) "
marked() {
  by_marker
  [ "$want" = "  " ] && return
  # One pass over every /proc/PID/stat: "PID (comm) state ppid pgrp session ...".
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v want="$want" -v me="$me" '{
    pid = $1; rest = $0; sub(/.*\) /, "", rest); split(rest, f, " ")
    if (f[4] != me && index(want, " " f[4] " ")) print pid
  }' 2>/dev/null
}
pids=$(marked); [ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null
i=0
while [ "$i" -lt "$grace" ]; do
  sleep 0.1; i=$((i + 1))
  pids=$(marked); [ -z "$pids" ] && exit 0
done
kill -KILL $(marked) 2>/dev/null
exit 0
"""

# Run a shell string in bash where the image has it, else in sh, with no
# extra round trip to find out.
_SHELL_SHIM = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; else exec sh -c "$1"; fi'

#: How the engine's first output line reads when the exec never started (exit 126).
_START_FAILURES = (b"OCI runtime exec failed", b"unable to find user", b"unable to find group")


def _oci_error(message: str, request: ProcessRequest, *, pids_refused: bool) -> HutchError:
    """The error of an exec the runtime could not start, from what it said;
    ``pids_refused``: the kernel refused a fork at the container's pids limit
    meanwhile (runc's own processes, once inside the container's cgroup, are
    refused there, and it says only that its child went away)."""
    if "unable to find user" in message or "unable to find group" in message:
        return NoSuchUser(f"no such user {request.user!r}")
    if "chdir to cwd" in message:
        return SandboxFileNotFound(f"working directory {request.cwd} does not exist")
    if "permission denied" in message:
        return SandboxPermissionDenied(f"cannot execute {request.argv[0]}: permission denied")
    if "not found" in message or "no such file" in message:
        return SandboxFileNotFound(f"command not found: {request.argv[0]}")
    if pids_refused:
        return ResourceExhausted(
            f"cannot start {request.argv[0]}: the sandbox is at its pids limit "
            f"({message.strip()}); it starts once a process in the sandbox ends"
        )
    return ProviderError(f"docker exec failed: {message.strip()}")


class _ChunkReader(io.RawIOBase):
    """A binary file over an iterator of byte chunks (an HTTP body as it
    arrives), read without copying what is held."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._held = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._held:
            try:
                self._held = memoryview(next(self._chunks))
            except StopIteration:
                return 0
        count = min(len(buffer), len(self._held))
        buffer[:count] = self._held[:count]
        self._held = self._held[count:]
        return count


#: How long an exec's output stream may stay open, and the Engine may take to
#: record its exit, once its process is gone. The Engine itself ends the
#: stream at most 2 s after the exit (cutting off what orphans still hold);
#: the rest is room for a loaded host. Past it the exec fails, said so.
EXEC_DRAIN_SECONDS = 15.0
#: The longest a quiet exec goes without a look at whether its process is there.
EXEC_CHECK_MAX_SECONDS = 2.0
#: Output pieces an exec's reader thread hands on before it waits for them
#: to be taken: a consumer slower than the command holds this much, not all.
EXEC_QUEUE_CHUNKS = 16


@dataclasses.dataclass(frozen=True)
class ExecStarted:
    """What starting an exec found out, for its :class:`DockerProcess`."""

    exec_id: str
    sock: socket.socket
    #: The stream's first bytes, read with the response's headers (see read_ahead).
    early: bytes
    #: The exec's process on the Engine's host (None: the Engine never said).
    pid: int | None
    #: Whether this host sees the container's processes (the Engine is local).
    host_sees: bool
    #: The container's OOM kills before the command started (None: unknown).
    oom_before: int | None
    #: The forks its pids limit had refused before it started (None: unknown).
    pids_before: int | None


class DockerProcess(FutureExitProcess):
    """One exec: a reader thread demultiplexes the hijacked socket into a queue.

    The Engine can fail to end an exec's stream, or to record its exit (seen
    under load with pauses running: a fast command's output all there, its
    process long gone, the Engine still saying it ran, for good). So the
    reader never waits on the Engine alone: while the stream is quiet it
    looks whether the process is still there (in /proc where this host sees
    the container's processes, a look with no call; else the Engine's
    word), and once it is gone the stream and the exit status must come
    within :data:`EXEC_DRAIN_SECONDS`, or the exec fails saying what was
    missing, rather than answering output that may be cut short.
    """

    def __init__(
        self,
        sandbox: DockerSandbox,
        started: ExecStarted,
        marker: str,
        request: ProcessRequest,
    ) -> None:
        self._sandbox = sandbox
        self._exec_id = started.exec_id
        self._marker = marker
        self._sock = started.sock
        self._early = started.early
        self._pid = started.pid
        self._host_sees = started.host_sees
        #: When the exec's process was first seen gone (monotonic).
        self._gone_at: float | None = None
        #: What was asked, for the error a failed start says.
        self._request = request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._exit_code: int | None = None
        self._oom_before = started.oom_before
        self._pids_before = started.pids_before
        self._oom_killed = False
        self._exit: asyncio.Future[int] = self._loop.create_future()
        self._first = True
        self._held: bytes | None = None
        self._eof = False
        #: Room in the queue for output; given back as the reader takes it.
        self._room = threading.Semaphore(EXEC_QUEUE_CHUNKS)
        #: Set by kill: nobody may read on, so the thread stops waiting for room.
        self._abandoned = threading.Event()
        if request.stdin is not None:
            threading.Thread(target=self._feed, args=(request.stdin,), daemon=True).start()
        threading.Thread(target=self._pump, daemon=True).start()

    def _feed(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                sent = self._sock.send(view[: 1 << 20])
                view = view[sent:]
        except OSError:
            pass  # the command exited without reading all of its stdin
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def _post(self, item: OutputChunk | BaseException | None) -> None:
        # The loop may be gone (a sync caller's loop ended): nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _host_says_gone(self) -> bool | None:
        """Whether the exec's process has ended, as this host's /proc says
        (gone, a zombie, or its pid now another process's); None where this
        host cannot tell."""
        if self._pid is None or not self._host_sees:
            return None
        try:
            with open(f"/proc/{self._pid}/environ", "rb") as fh:
                environ = fh.read()
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:
            return None
        return f"{EXEC_MARKER}={self._marker}".encode() not in environ.split(b"\0")

    def _note_if_gone(self) -> None:
        if self._gone_at is not None:
            return
        gone = self._host_says_gone()
        if gone is None:
            gone = not engine().exec_inspect(self._exec_id).get("Running")
        if gone:
            self._gone_at = time.monotonic()

    def _never_ended(self) -> ProviderError:
        info = engine().exec_inspect(self._exec_id)
        name = self._request.argv[0] if self._request.argv else "the command"
        if not info.get("Running") and info.get("ExitCode") is not None:
            said = f"exited with status {info['ExitCode']}"
        else:
            said = "is gone, but the Engine still says it runs (it lost its exit)"
        return ProviderError(
            f"docker exec of {name} in sandbox {self._sandbox.sandbox_id}: its process "
            f"{said}, and its output stream was still open {EXEC_DRAIN_SECONDS:.0f} s "
            "later; its output may be incomplete, run it again"
        )

    def _await_readable(self, poller: select.poll) -> None:
        """Return once the socket has bytes or its end to read. While it is
        quiet, look now and then whether the process is still there; once it
        is gone, the stream has :data:`EXEC_DRAIN_SECONDS` to end."""
        quiet = 0.2
        while True:
            if self._gone_at is None:
                wait = quiet
            else:
                wait = self._gone_at + EXEC_DRAIN_SECONDS - time.monotonic()
                if wait <= 0:
                    raise self._never_ended()
            if poller.poll(wait * 1000):
                return
            quiet = min(quiet * 2, EXEC_CHECK_MAX_SECONDS)
            self._note_if_gone()

    def _recv_exact(self, size: int, poller: select.poll) -> bytes | None:
        parts = []
        while size:
            if self._early:
                chunk, self._early = self._early[:size], self._early[size:]
            else:
                self._await_readable(poller)
                chunk = self._sock.recv(min(size, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def _pump(self) -> None:
        code = -1
        failure: HutchError | None = None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        try:
            while True:
                header = self._recv_exact(8, poller)
                if header is None:
                    break
                kind, size = header[0], struct.unpack(">I", header[4:])[0]
                payload = self._recv_exact(size, poller)
                if payload is None:
                    break
                if self._wait_for_room():
                    self._post(OutputChunk("stderr" if kind == 2 else "stdout", payload))
            code = self._inspect_exit_code()
            if code == 128 + 9 and self._oom_before is not None:
                after = oom_kills(self._sandbox.container_id or "")
                self._oom_killed = after is not None and after > self._oom_before
        except HutchError as exc:  # the reader and a waiter both learn it
            failure = exc
            self._post(exc)
        except BaseException as exc:  # handed to the reader on the loop
            self._post(exc)
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()
            # The exit code is known before the reader sees the end of output.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._set_exit, code, failure)
            self._post(None)

    def _wait_for_room(self) -> bool:
        """Wait until the queue has room for a piece of output; False (drop
        it) once the exec is being killed and nobody takes what is queued."""
        while not self._room.acquire(timeout=0.5):
            if self._abandoned.is_set():
                return False
        return True

    def _inspect_exit_code(self) -> int:
        """The exit status the Engine records; it may come a moment after the
        stream ends, and the stream may end long before the process does (a
        command that closed its output and runs on): waited for while the
        process is there, and for :data:`EXEC_DRAIN_SECONDS` once it is gone."""
        api = engine()
        delay = 0.002
        while True:
            info = api.exec_inspect(self._exec_id)
            if not info["Running"] and info["ExitCode"] is not None:
                return int(info["ExitCode"])
            if self._gone_at is None and self._host_says_gone():
                self._gone_at = time.monotonic()
            if self._gone_at is not None and (
                    time.monotonic() - self._gone_at > EXEC_DRAIN_SECONDS):
                name = self._request.argv[0] if self._request.argv else "the command"
                raise ProviderError(
                    f"docker exec of {name} in sandbox {self._sandbox.sandbox_id}: its "
                    f"process is gone, but the Engine still says it runs "
                    f"{EXEC_DRAIN_SECONDS:.0f} s later (it lost its exit): exit status unknown"
                )
            time.sleep(delay)
            delay = min(delay * 2, EXEC_CHECK_MAX_SECONDS)

    def _set_exit(self, code: int, failure: HutchError | None = None) -> None:
        self._exit_code = None if failure is not None else code
        if self._exit.done():
            return
        if failure is not None:
            self._exit.set_exception(failure)
            self._exit.exception()  # retrieved here; wait() raises it again
        else:
            self._exit.set_result(code)

    async def read(self) -> OutputChunk | None:
        while not self._eof:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._eof = True
                break
            self._room.release()
            if self._first:
                self._first = False
                # The runtime reports a failed start as output plus exit 126:
                # hold that first chunk until the exit code says which it is.
                if item.stream == "stdout" and item.data.startswith(_START_FAILURES):
                    self._held = item.data
                    continue
            return item
        if self._held is not None:
            held, self._held = self._held, None
            if await asyncio.shield(self._exit) == 126:
                before = self._pids_before
                after = pids_refusals(self._sandbox.container_id or "")
                error = _oci_error(
                    held.decode("utf-8", "replace"), self._request,
                    pids_refused=before is not None and after is not None and after > before,
                )
                if isinstance(error, NoSuchUser):
                    # A command that could not start: its reason, and exit 126.
                    return OutputChunk("stderr", f"{error.message}\n".encode())
                raise error
            return OutputChunk("stdout", held)
        return None

    async def kill(self, grace: float) -> None:
        self._abandoned.set()
        if self._exit.done():
            return
        with contextlib.suppress(HutchError):
            await self._sandbox.run_quiet(
                ["sh", "-c", _KILL_SCRIPT, "hutch-kill", f"{EXEC_MARKER}={self._marker}",
                 str(max(1, int(grace * 10)))]
            )
        # What forks faster than a kill from inside can run (a fork bomb at the
        # pids limit leaves no room to start one) is killed from the host.
        with contextlib.suppress(HutchError):
            await _call(self._sandbox.kill_marked_from_host, self._marker)
        # Closing the socket ends the reader even if an orphan kept a pipe open.
        with contextlib.suppress(TimeoutError, HutchError):
            await asyncio.wait_for(asyncio.shield(self._exit), 5)
        if not self._exit.done():
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)


# -- files ----------------------------------------------------------------------


def _parse_mtime(value: object) -> float:
    """The archive stat header's RFC 3339 time (nanoseconds) as a Unix time."""
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", value)).timestamp()
    except ValueError:
        return 0.0


# grep over the regular files below $1 (links to them included, links to
# directories not entered), their names matching $2: never a FIFO or a device,
# whose read may never end.
_GREP_TREE = (
    'r=$1; n=$2; shift 2; '
    'find "$r" -mindepth 1 -xtype f -name "$n" -print0 | xargs -0 -r grep "$@" --'
)
#: What grep, find, xargs or sh say when they are not the GNU tools this needs.
_TOOL_FAILURES = (
    b"unknown predicate", b"invalid predicate", b"nvalid option", b"nrecognized option",
    b"not found", b"sage:",
)
#: grep's word (C locale) for a binary file with a matching line it did not print.
_BINARY_MATCHES = re.compile(rb"^grep: (.*?): binary file matches$", re.MULTILINE)
# Prints (NUL-terminated) each argument file with no NUL in its first 8 KiB.
_NO_NUL_HEAD = (
    'for f; do n=$(head -c 8192 -- "$f" | tr -d "\\000" | wc -c); '
    'm=$(head -c 8192 -- "$f" | wc -c); [ "$n" = "$m" ] && printf "%s\\0" "$f"; done; true'
)
# -- deaths ------------------------------------------------------------------------


async def _oom_message(container_id: str) -> str:
    try:
        details = await _call(engine().inspect_container, container_id)
        limit = (details.get("HostConfig") or {}).get("Memory") or 0
    except HutchError:
        limit = 0
    within = f" of {limit} bytes" if limit else ""
    return f"the OOM killer killed a process in it: it reached its memory limit{within}"


def _suspended_state_removed(image_id: str, sandbox_id: str) -> str:
    """The reason a sandbox whose suspend image went fails."""
    return (f"its suspended state (image {image_id.removeprefix('sha256:')[:12]}, "
            f"{SUSPENDED_REPOSITORY}:{sandbox_id}) was removed outside hutch")


async def _death_reason(container_id: str, action: str) -> str:
    """What happened to a container that died or went, in words for a person."""
    short = container_id[:12]
    removed = f"its container {short} was removed outside hutch"
    details: dict[str, Any] = {}
    # A `docker rm -f` is a kill, a die and a destroy in quick succession:
    # after a die, watch a moment for the removal before calling it a stop.
    for _ in range(20 if action == "die" else 1):
        try:
            details = await _call(engine().inspect_container, container_id)
        except SandboxUnavailable:
            return removed
        except HutchError as exc:
            return f"its container {short} {action}d ({exc})"
        state = details.get("State") or {}
        if state.get("Status") == "removing" or state.get("Dead"):
            return removed
        if action == "die":
            await asyncio.sleep(0.1)
    state = details.get("State") or {}
    if state.get("OOMKilled") or action == "oom":
        limit = (details.get("HostConfig") or {}).get("Memory") or 0
        within = f" (memory limit {limit} bytes)" if limit else ""
        return f"its container {short} was OOM-killed{within}"
    code = state.get("ExitCode")
    if isinstance(code, int) and code > 128:
        return f"its container {short} was killed by signal {code - 128} outside hutch"
    return f"its container {short} stopped outside hutch (exit code {code})"


# -- suspend ----------------------------------------------------------------------


def commit_state(
    api: Any,
    container: str,
    base_image: str,
    repository: str,
    tag: str,
    labels: Mapping[str, str],
    *,
    flatten: bool = False,
    stopped: bool = False,
    fault: str = "snapshot.docker.frozen",
) -> str:
    """Write ``container``'s file system to ``repository:tag``; its image id.

    The one place that decides between a commit (one more layer on
    ``base_image``) and a flatten (a single-layer image): suspend and
    snapshot (and so workspace suspend) both come here. A commit that would
    stack ``base_image``'s layers past :data:`MAX_SUSPEND_LAYERS` flattens,
    since overlay2 stops at 128; ``flatten`` asks for one regardless.
    ``stopped``: the caller has paused the container, under its freeze guard.
    ``fault``: the fault point (:mod:`hutch._faults`) of the step, inside its freeze.
    """
    depth = len(api.inspect_image(base_image)["RootFS"].get("Layers") or [])
    if layers.flattens(depth, asked=flatten, limit=MAX_SUSPEND_LAYERS):
        config = api.inspect_container(container)["Config"]
        return _flatten(api, container, config, labels, repository, tag)
    if stopped:  # the caller holds the container paused (and its freeze guard)
        image = api.commit(container, repository=repository, tag=tag, conf={"Labels": labels},
                           pause=False)
        return str(image["Id"])
    # Paused by the guard, not by the commit's own pause: that one trusts the
    # Engine's lagging flag, and could undo the user's pause.
    with freeze_guard(container).frozen(api, container):
        fault_point(fault)
        image = api.commit(container, repository=repository, tag=tag, conf={"Labels": labels},
                           pause=False)
    return str(image["Id"])


def _flatten(
    api: Any, container: str, config: Mapping[str, Any], labels: Mapping[str, str],
    repository: str, tag: str,
) -> str:
    """Export ``container``'s file system into a one-layer suspend image.

    An import keeps files only, so the container's environment, user and
    working directory go along as Dockerfile changes.
    """

    def quoted(value: str) -> str:
        return json.dumps(value).replace("$", "\\$")  # "...", with ENV's $ kept literal

    changes = [f"ENV {k}={quoted(v)}" for k, _, v in
               (str(item).partition("=") for item in config.get("Env") or [])]
    if config.get("User"):
        changes.append(f"USER {config['User']}")
    if config.get("WorkingDir"):
        changes.append(f"WORKDIR {config['WorkingDir']}")
    changes += [f"LABEL {quoted(k)}={quoted(v)}" for k, v in labels.items()]
    api.import_image(
        src=api.export(container, chunk_size=1 << 20), repository=repository,
        tag=tag, changes=changes, stream_src=True,
    )
    return str(api.inspect_image(f"{repository}:{tag}")["Id"])


def free_untagged_images(api: Any) -> int:
    """Remove this hutch home's images that no tag names any more: a snapshot
    removed while a branch's container still ran on it is only untagged, and
    goes here once nothing stands on it. Not forced: an image a container or
    a child image still uses stays (the Engine refuses), for a later call.
    Returns how many went."""
    import docker.errors

    images = api.images(all=True, filters={
        "dangling": True, "label": [f"{MANAGED_LABEL}=1", f"{HOME_LABEL}={hutch_home()}"],
    })
    freed = 0
    for image in images:
        try:
            api.remove_image(image["Id"], noprune=False)
            freed += 1
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if _status(exc) != 409:
                raise
    return freed


# -- the sandbox ------------------------------------------------------------------


def _own_network_namespace(network_mode: str) -> bool:
    """Whether a container in ``network_mode`` has a namespace of its own to police
    (not the host's, not another container's, not none)."""
    return network_mode not in ("host", "none") and not network_mode.startswith("container:")


def _disk_cap(config: DockerConfig) -> int | None:
    return int(parse_bytes(config.disk)) if config.disk is not None else None


def _parse_mount(spec: str) -> tuple[str, dict[str, str]]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise InvalidArgument(f"mount {spec!r} is not host:container[:ro]")
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise InvalidArgument(f"mount {spec!r}: mode must be ro or rw")
    return os.path.abspath(parts[0]), {"bind": parts[1], "mode": mode}


class DockerSandbox(NativeBackend):
    provider = "docker"
    capabilities = Capabilities(
        processes=True,
        pause=True,
        suspend=True,
        suspend_keeps_processes=False,
        snapshot=True,
        fork=True,
        resource_limits=True,
        disk_limit=True,
        network_policy=True,
        users=True,
        preview_url=True,
    )
    config_model = DockerConfig

    @classmethod
    def answers_here(cls) -> bool:
        try:
            return bool(engine().ping())
        except Exception:  # no engine, no socket, no permission: not here
            return False

    def __init__(
        self,
        sandbox_id: str,
        config: DockerConfig,
        host_workdir: str,
        owns_workdir: bool,
        container_id: str | None,
        suspended_image: str | None = None,
        agent: Mapping[str, Any] | None = None,
        base_image: str | None = None,
        branch: bool = False,
        chain: list[str] | None = None,
        layered: bool = False,
    ) -> None:
        super().__init__(sandbox_id, config.mount_point)
        self.config = config
        self.host_workdir = host_workdir
        self.owns_workdir = owns_workdir
        self.container_id = container_id
        #: The container's freeze guard, held so that it keeps what it knows
        #: (whose pause the container's is) between calls.
        self._freeze_guard: FreezeGuard | None = None
        self.container_name = f"hutch-{sandbox_id}"
        self.suspended_image = suspended_image
        #: The image the container started from: the configured one, or a snapshot's.
        self.base_image = base_image or configured_image(config)
        #: Started from a snapshot: the working directory is a branch mounted
        #: on ``chain`` (see ``layers``), never shared with another sandbox.
        self.branch = branch
        self.chain = chain
        #: The working directory is layered (``layers.prepare``): the
        #: container binds its anchor, its overlay reaches it by propagation,
        #: and a snapshot moves what changed instead of copying it.
        self.layered = layered
        self._closed = False
        #: The agent's host directory (its socket) and the image's own user,
        #: when the agent is this sandbox's runtime; None for the native one.
        self.agent_dir: str | None = None
        self.default_user = ""
        self._agent: AgentRuntime | None = None
        self._agent_binary: str | None = None
        self._recovering: asyncio.Lock | None = None  # made on first use, on its loop
        if agent is not None:
            self._use_agent(str(agent["dir"]), str(agent.get("default_user") or ""))

    # -- the agent -------------------------------------------------------------------
    def _use_agent(self, agent_dir: str, default_user: str) -> None:
        self.agent_dir = agent_dir
        self.default_user = default_user
        self._agent = AgentRuntime(
            self.sandbox_id, self.workdir, self._agent_link(),
            provider_name=self.provider, recover=self._recover_agent,
            default_user=default_user or None, on_oom=self._workload_oom,
        )

    def _agent_link(self) -> str:
        """Where hutch reaches the agent's socket: a hard link made in a host
        directory the sandbox cannot reach, while only the agent ran in it, so
        that a socket the sandbox later plants in its own directory leads
        nowhere."""
        assert self.agent_dir is not None
        return os.path.join(os.path.dirname(self.agent_dir), "agent-link", AGENT_SOCKET_NAME)

    def _relink_agent(self) -> None:
        assert self.agent_dir is not None
        link = self._agent_link()
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        with contextlib.suppress(FileNotFoundError):
            os.link(os.path.join(self.agent_dir, AGENT_SOCKET_NAME), link)

    @property
    def runtime(self) -> SandboxRuntime:
        return self._agent if self._agent is not None else self

    def _agent_wanted(self) -> str | None:
        """The agent executable to run as the keeper, or None for the native runtime."""
        if self.config.runtime == "native":
            return None
        try:
            return str(agent_binary())
        except AgentUnavailable as exc:
            if self.config.runtime == "agent":
                raise
            log.warning("docker sandbox %s: native runtime (%s)", self.sandbox_id, exc)
            return None

    def _workload_oom(self) -> None:
        """The OOM killer ended a command in the workload's cgroup: Docker's
        events do not say so (cgroup v1 tells the cgroup it happened in, not
        the container's), so it is told to the watchers here."""
        limit = parse_bytes(self.config.memory) if self.config.memory is not None else 0
        within = f" of {int(limit)} bytes" if limit else ""
        notice = RuntimeNotice(
            self.sandbox_id,
            f"the OOM killer killed a process in it: it reached its memory limit{within}",
            may_have_died=False,
        )
        for loop, report in list(_WATCHERS):
            def tell(report: RuntimeReport = report) -> None:
                task = asyncio.ensure_future(report(notice))
                _TELLING.add(task)
                task.add_done_callback(_TELLING.discard)

            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(tell)

    def _split_workload(self) -> bool:
        """Whether what the agent runs gets a cgroup of its own below the
        container's (see :mod:`.agent.workload`): with the agent, on cgroup v1."""
        return self._agent is not None and _workload.splittable()

    async def _place_workload(self) -> None:
        """Make the workload's cgroups below the just-started container's,
        with the caller's limits, and have the agent start commands in them."""
        assert self._agent is not None and self.container_id is not None
        container_id = self.container_id
        cfg = self.config

        def make() -> dict[str, str]:
            dirs = {c: cgroup_dir(container_id, c) for c in _workload.CONTROLLERS}
            found = {c: d for c, d in dirs.items() if d is not None}
            if len(found) != len(dirs):
                raise ProviderError(f"docker sandbox {self.sandbox_id}: the cgroups of "
                                    f"container {container_id[:12]} are not where expected")
            return _workload.make_workload(
                found, pids=cfg.pids_limit,
                memory=int(parse_bytes(cfg.memory)) if cfg.memory is not None else None,
            )

        await self._agent.place_workload(await anyio.to_thread.run_sync(make))

    async def _await_agent(self, timeout: float = AGENT_START_TIMEOUT) -> None:
        """Until the agent in a just-started container answers (nothing else
        runs in it yet: this is when hutch's link to its socket is made, and
        the workload's cgroup)."""
        assert self._agent is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._relink_agent()
                await self._agent.ping(timeout=max(0.5, deadline - time.monotonic()))
                if self._split_workload():
                    await self._place_workload()
                return
            except AgentFailure as exc:
                if time.monotonic() >= deadline:
                    raise ProviderError(
                        f"docker sandbox {self.sandbox_id}: its agent did not start: {exc}"
                    ) from None
            await asyncio.sleep(0.005)

    async def _start_container(self, image: str) -> None:
        """Run the container; with the agent, wait for it to answer, and where
        it cannot run in this image fall back to the native runtime."""
        self.container_id = await self._run_container(image)
        if self._agent is None:
            return
        self._agent.drop_connections()
        try:
            await self._await_agent()
        except ProviderError as exc:
            with contextlib.suppress(HutchError):
                await _call(engine().remove_container, self.container_id, force=True)
            self.container_id = None
            if self.config.runtime == "agent":
                raise
            log.warning("docker sandbox %s: %s; falling back to the native runtime",
                        self.sandbox_id, exc)
            self._agent = None
            await anyio.to_thread.run_sync(self._remove_agent_dir)
            self.container_id = await self._run_container(image)

    async def _recover_agent(self, reason: str) -> bool:
        """The agent failed a request (``reason``): find out why and bring it
        back, within a few seconds, or raise what makes the sandbox lost.

        A paused container's agent is frozen, not dead: nothing to do. A
        running container whose agent does not answer a ping is restarted; a
        stopped one (its keeper was killed) is started again, unless the OOM
        killer stopped it (then the sandbox is lost, and fails). Files survive
        both; processes do not, and the caller's error says so.
        """
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            container = self._container()
            assert self._agent is not None

            async def state_now() -> dict[str, Any]:
                try:
                    details = await _call(engine().inspect_container, container)
                except HutchError as exc:
                    raise SandboxUnavailable(
                        f"docker sandbox {self.sandbox_id}: its agent failed ({reason}) and "
                        f"its container is gone: {exc}"
                    ) from None
                return dict(details.get("State") or {})

            state = await state_now()
            if state.get("Paused"):
                raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} is paused")
            if state.get("Running"):
                with contextlib.suppress(AgentFailure):
                    await self._agent.ping(timeout=0.5)
                    return False  # it answers: the failure was the request's
                # A keeper that died takes its container down within moments
                # (its init exits): not wedged, gone, and told apart below.
                for _ in range(10):
                    await asyncio.sleep(0.1)
                    state = await state_now()
                    if not state.get("Running"):
                        break
            if state.get("Running"):
                log.warning("docker sandbox %s: its agent is wedged (%s); restarting it",
                            self.sandbox_id, reason)
                action: Any = lambda: engine().restart(container, timeout=0)  # noqa: E731
            elif state.get("OOMKilled"):
                # The OOM killer ended its keeper: the runtime died, and saying
                # so (the sandbox fails) is the truth; a restart would hide it.
                raise SandboxUnavailable(
                    f"docker sandbox {self.sandbox_id}: "
                    f"{await _death_reason(container, 'die')}"
                )
            else:
                log.warning("docker sandbox %s: its agent is gone (%s, exit code %s); "
                            "starting its container again", self.sandbox_id, reason,
                            state.get("ExitCode"))
                action = lambda: engine().start(container)  # noqa: E731
            try:
                await _call(action)
                await self._await_agent(AGENT_RECOVER_TIMEOUT)
            except HutchError as exc:
                raise SandboxUnavailable(
                    f"docker sandbox {self.sandbox_id}: its agent failed ({reason}) and could "
                    f"not be brought back: {exc}"
                ) from None
            return True

    # -- provisioning -------------------------------------------------------------
    @classmethod
    async def create(cls, config: DockerConfig, sandbox_id: str) -> DockerSandbox:
        layered = False
        chain: list[str] | None = None
        if config.host_workdir:
            host_workdir, owns = os.path.abspath(config.host_workdir), False
            os.makedirs(host_workdir, exist_ok=True)
        elif await anyio.to_thread.run_sync(layers.overlay_available):
            # Layered from the start, so that its first snapshot moves the
            # tree instead of copying it.
            host_workdir, chain = await anyio.to_thread.run_sync(
                functools.partial(layers.prepare, sandbox_id, None, cap=_disk_cap(config))
            )
            owns = layered = True
        else:
            host_workdir, owns = sandbox_workdir(sandbox_id), True
            os.makedirs(host_workdir, exist_ok=True)
        sandbox = cls(sandbox_id, config, host_workdir, owns, None, chain=chain, layered=layered)
        try:
            await sandbox._launch(configured_image(config))
        except BaseException:
            await anyio.to_thread.run_sync(sandbox._remove_agent_dir)
            await anyio.to_thread.run_sync(sandbox._remove_workdir)
            raise
        return sandbox

    async def _launch(self, image: str) -> None:
        """Start this new sandbox's container from ``image``, its runtime with it."""
        binary = self._agent_wanted()
        if binary is not None:
            self._agent_binary = binary
            # The image first: a create that fails on it leaves no directory.
            default_user = await _call(_image_user, image, self.config.pull_if_missing)
            agent_dir = os.path.join(hutch_home(), "sandboxes", self.sandbox_id, "agent")
            os.makedirs(agent_dir, mode=0o700, exist_ok=True)
            self._use_agent(agent_dir, default_user)
        await self._start_container(image)

    def _container_spec(self, image: str) -> dict[str, Any]:
        api = engine()
        cfg = self.config
        # A layered working directory's anchor is bound as a slave, so that
        # the overlay mounted on it (and unmounted) reaches the container.
        mode = "rw,rslave" if self.layered else "rw"
        binds = {self.host_workdir: {"bind": cfg.mount_point, "mode": mode}}
        binds.update(dict(_parse_mount(m) for m in cfg.mounts))
        command = ["sleep", "infinity"]
        extra: dict[str, Any] = {}
        if self._agent is not None and self.agent_dir is not None:
            # The agent is the keeper, as root (it runs commands as the image's
            # user, or the one asked for), bind-mounted read-only; its socket
            # is in a host directory of its own, so no network is needed.
            binary = self._agent_binary or str(agent_binary())
            self._agent_binary = binary
            binds[binary] = {"bind": AGENT_BINARY_PATH, "mode": "ro"}
            binds[self.agent_dir] = {"bind": AGENT_DIR_PATH, "mode": "rw"}
            command = [AGENT_BINARY_PATH, "serve", f"{AGENT_DIR_PATH}/{AGENT_SOCKET_NAME}"]
            extra["user"] = "0"
        mem_limit: int | str | None = cfg.memory
        pids_limit = cfg.pids_limit
        if self._split_workload():
            # The caller's limits hold the workload's cgroup (made once the
            # agent answers); the container's leave the agent a reserve.
            pids_limit += _workload.PIDS_RESERVE
            if cfg.memory is not None:
                mem_limit = int(parse_bytes(cfg.memory)) + _workload.MEMORY_RESERVE
        host_config = api.create_host_config(
            binds=binds,
            network_mode="none" if cfg.network == "none" else cfg.network_mode,
            mem_limit=mem_limit,
            nano_cpus=int(cfg.cpus * 1e9) if cfg.cpus else None,
            pids_limit=pids_limit,
            init=cfg.init,
            security_opt=["no-new-privileges"],
            cap_drop=cfg.cap_drop,
        )
        labels = {**cfg.labels, MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id,
                  HOME_LABEL: hutch_home()}
        if cfg.preserve:
            labels[PRESERVE_LABEL] = "1"
        return {
            **extra,
            "image": image,
            "command": command,
            "entrypoint": [],
            "name": self.container_name,
            "labels": labels,
            "environment": {**cfg.env, SANDBOX_MARKER: self.sandbox_id},
            "working_dir": cfg.mount_point,
            "host_config": host_config,
            "detach": True,
        }

    async def _run_container(self, image: str) -> str:
        """Create and start this sandbox's container from ``image``: two API
        calls on the happy path, as the raw SDK would make."""
        import docker.errors

        api = engine()
        cfg = self.config

        def create(spec: dict[str, Any]) -> str:
            try:
                return str(api.create_container(**spec)["Id"])
            except docker.errors.ImageNotFound:
                if image == self.suspended_image:
                    # Its state, which no registry has: never a pull.
                    raise RuntimeLost(
                        _suspended_state_removed(image, self.sandbox_id)
                    ) from None
                if not cfg.pull_if_missing or image.startswith(SUSPENDED_REPOSITORY):
                    raise NotFound(f"image {image!r} is not on this Docker Engine") from None
                _pull(api, image)
                return str(api.create_container(**spec)["Id"])
            except docker.errors.APIError as exc:
                if _status(exc) != 409 or not self._remove_stale_namesake():
                    raise
                return str(api.create_container(**spec)["Id"])

        def run() -> str:
            self._cap_workdir()
            if self.layered:
                layers.before_start(self.sandbox_id)
            container = create(self._container_spec(image))
            try:
                api.start(container)
                if self.layered:
                    layers.after_start(self.sandbox_id)
                self._enforce_network_policy(api, container)
            except BaseException:
                api.remove_container(container, force=True)
                self._release_network_policy()
                raise
            return container

        result: str = await _call(run)
        return result

    def _cap_workdir(self) -> None:
        """Mount the working directory hutch made at its size cap, if it has one
        (again after a reboot: its image keeps the files)."""
        if self.config.disk is None or not self.owns_workdir or self.branch or self.layered:
            return
        try:
            mount_capped(self.host_workdir, int(parse_bytes(self.config.disk)))
        except OSError as exc:
            raise ProviderError(
                f"cannot cap the working directory of sandbox {self.sandbox_id} at "
                f"{self.config.disk} (a loop mount, which needs root): {exc}"
            ) from None

    def _polices_network(self) -> bool:
        """Whether hutch enforces a policy on this sandbox's network: it has one,
        in a namespace of its own (another is the operator's choice)."""
        cfg = self.config
        return cfg.network != "none" and _own_network_namespace(cfg.network_mode)

    def _enforce_network_policy(self, api: Any, container: str) -> None:
        """Install the sandbox's network policy in its container's namespace and
        on the host, from the host: the sandbox (no CAP_NET_ADMIN) cannot change it."""
        if self._polices_network():
            netguard.enforce(api, container, self.sandbox_id, self.config.network)

    def _release_network_policy(self) -> None:
        """Remove the host's rules of a container gone: its address goes to
        another container. Said, not raised: the container is gone already."""
        if not self._polices_network():
            return
        try:
            netguard.release(self.sandbox_id)
        except ProviderError as exc:
            log.warning("docker sandbox %s: %s", self.sandbox_id, exc)

    def _remove_stale_namesake(self) -> bool:
        """Remove a container left under this sandbox's name (a crash between
        a resume's create and its record); never one that is not ours."""
        import docker.errors

        api = engine()
        try:
            labels = api.inspect_container(self.container_name)["Config"]["Labels"] or {}
        except docker.errors.NotFound:
            return True  # gone meanwhile: the retry will tell
        if labels.get(SANDBOX_LABEL) != self.sandbox_id:
            return False
        api.remove_container(self.container_name, force=True)
        return True

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "config": self.config.model_dump(),
            "host_workdir": self.host_workdir,
            "owns_workdir": self.owns_workdir,
            "container_id": self.container_id,
            "container_name": self.container_name,
            "suspended_image": self.suspended_image,
            "base_image": self.base_image,
            "branch": self.branch,
            "chain": self.chain,
            "layered": self.layered,
            "agent": (
                {"dir": self.agent_dir, "default_user": self.default_user}
                if self._agent is not None else None
            ),
        }

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> DockerSandbox:
        """Rebuild the backend of a sandbox made earlier (by a daemon now gone)."""
        sandbox = cls(
            sandbox_id,
            DockerConfig.model_validate(description["config"]),
            str(description["host_workdir"]),
            bool(description.get("owns_workdir", False)),
            description.get("container_id"),
            description.get("suspended_image"),
            description.get("agent"),
            description.get("base_image"),
            bool(description.get("branch")),
            description.get("chain"),
            bool(description.get("layered")),
        )
        if not await sandbox.is_alive():
            # The container on record is gone (or none is), but the sandbox
            # may have one under its name that the record missed (a suspend
            # undone because the store could not keep it, a resume cut short
            # after its container started)...
            try:
                details = await _call(engine().inspect_container, sandbox.container_name)
            except SandboxUnavailable:
                details = None
            labels = ((details or {}).get("Config") or {}).get("Labels") or {}
            state = (details or {}).get("State") or {}
            up = bool(state.get("Running") or state.get("Paused"))
            if details is not None and labels.get(SANDBOX_LABEL) == sandbox_id and (
                up or sandbox.container_id is not None
            ):
                sandbox.container_id = str(details["Id"])
            elif sandbox.container_id is not None:
                # ... or none, and its state in its suspend image (suspended
                # by a program whose suspend the record missed).
                suspended = await sandbox._own_suspend_image()
                if suspended is not None:
                    sandbox.container_id = None
                    sandbox.suspended_image = suspended
        if sandbox.layered:
            await sandbox._mend_capture_cut_short()
        if sandbox.container_id is not None and await sandbox._container_exists():
            # A freeze of hutch's own (a commit, a capture) that its program
            # died inside is undone: the container was never the user's to pause.
            await _call(freeze_guard(sandbox.container_id).thaw_left_freeze, engine(),
                        sandbox.container_id)
        return sandbox

    async def observed_state(self) -> RuntimeState:
        """The container's own state: paused, running, or gone (stopped or
        removed), or suspended in its suspend image."""
        if self.container_id is not None:
            try:
                details = await _call(engine().inspect_container, self.container_id)
            except SandboxUnavailable:
                details = None  # no such container
            if details is not None:
                state = details.get("State") or {}
                if state.get("Paused"):
                    return RuntimeState.PAUSED
                return RuntimeState.RUNNING if state.get("Running") else RuntimeState.GONE
        if await self.is_suspended():
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    async def _own_suspend_image(self) -> str | None:
        """The id of this sandbox's suspend image, if the engine has one."""
        try:
            details = await _call(
                engine().inspect_image, f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}"
            )
        except HutchError:
            return None
        labels = (details.get("Config") or {}).get("Labels") or {}
        return str(details["Id"]) if labels.get(SANDBOX_LABEL) == self.sandbox_id else None

    async def is_suspended(self) -> bool:
        return (
            self.container_id is None and self.suspended_image is not None
            and await self._own_suspend_image() == self.suspended_image
        )

    def _container(self) -> str:
        if self.container_id is None:
            raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} has no container")
        self._freeze_guard = freeze_guard(self.container_id)
        return self.container_id

    # -- processes -----------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        return ["/bin/sh", "-c", _SHELL_SHIM, "sh", command]

    async def start_process(self, request: ProcessRequest) -> DockerProcess:
        import docker.errors

        api = engine()
        container = self._container()
        marker = uuid.uuid4().hex
        full_env = {**request.env, EXEC_MARKER: marker, SANDBOX_MARKER: self.sandbox_id}

        def start() -> ExecStarted:
            # Counted before it starts: a command can be OOM-killed before
            # the call that started it returns.
            oom_before = oom_kills(container)
            pids_before = pids_refusals(container)
            guard = freeze_guard(container)
            with guard.starting():
                if guard.paused_here():
                    # Refused here, not by the Engine: its flag may lag to "running",
                    # and an exec it lets into the frozen container never returns.
                    raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} is paused")
                deadline = time.monotonic() + FreezeGuard.SETTLE_SECONDS
                delay = 0.005
                while True:
                    try:
                        created = api.exec_create(
                            container, list(request.argv), stdin=request.stdin is not None,
                            environment=full_env, workdir=request.cwd,
                            user=request.user or "",
                        )
                        response = api.exec_start(created["Id"], socket=True)
                        break
                    except docker.errors.APIError as exc:
                        # "is paused" just after this process unpaused it: the
                        # Engine's flag lags (see FreezeGuard); it is running.
                        if ("is paused" not in str(exc) or not guard.refusal_is_lag()
                                or time.monotonic() > deadline):
                            raise
                        time.sleep(delay)
                        delay = min(delay * 2, 0.1)
                sock = getattr(response, "_sock", None)
                if not isinstance(sock, socket.socket):
                    raise ProviderError("docker exec gave no socket to read (TLS engine?)")
                early = read_ahead(response)
                pid = wait_until_started(api, created["Id"])
            # The client's request timeout would end a command silent that long.
            sock.settimeout(None)
            return ExecStarted(
                created["Id"], sock, early, pid, cgroup_dir(container, "pids") is not None,
                oom_before, pids_before,
            )

        started: ExecStarted = await _call(start)
        return DockerProcess(self, started, marker, request)

    async def run_quiet(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        output_limit: int | None = None,
    ) -> tuple[int, bytes, bytes]:
        """Run one of hutch's own helpers (kill, find, grep) to completion:
        (exit code, stdout, stderr). As root, like the archive API, so that
        what stat sees, list and walk see too, whatever the image's USER.
        Past ``output_limit`` bytes it is killed (OutputLimitExceeded)."""
        proc = await self.start_process(ProcessRequest(argv, cwd="/", env=env or {}, user="0"))
        out: list[bytes] = []
        err: list[bytes] = []
        total = 0
        try:
            while (chunk := await proc.read()) is not None:
                total += len(chunk.data)
                if output_limit is not None and total > output_limit:
                    raise OutputLimitExceeded(
                        f"{argv[0]} answered more than {output_limit} bytes; "
                        "narrow the path, the glob or the pattern"
                    )
                (out if chunk.stream == "stdout" else err).append(chunk.data)
            return await proc.wait(), b"".join(out), b"".join(err)
        except BaseException:
            # Cancelled (a grep's timeout, its caller gone): what it started
            # inside the sandbox is killed, not left to run unseen.
            with anyio.CancelScope(shield=True):
                await proc.kill(KILL_GRACE_SECONDS)
            raise

    def kill_marked_from_host(self, marker: str) -> int:
        """SIGKILL, from the host, every process of the container whose
        environment carries ``marker``; return how many there were.

        If any are left, the container is frozen first (cgroup freezer, as
        pause), so that none can fork while the list is taken and killed; on
        thaw they die before running again. Needs the host's /proc of the
        container's processes (the daemon as root, the engine local); without
        it nothing is done.
        """
        api = engine()
        container = self._container()
        needle = f"{EXEC_MARKER}={marker}".encode()

        def marked() -> list[int]:
            found = []
            for row in api.top(container, ps_args="-e -o pid").get("Processes") or []:
                try:
                    with open(f"/proc/{int(row[0])}/environ", "rb") as fh:
                        if needle in fh.read().split(b"\0"):
                            found.append(int(row[0]))
                except (OSError, ValueError):
                    continue
            return found

        if not marked():
            return 0
        # Frozen already (the user's pause), it stays so: the kills wait for the thaw.
        with freeze_guard(container).frozen(api, container):
            pids = marked()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        log.info("killed %d processes of sandbox %s from the host", len(pids), self.sandbox_id)
        return len(pids)

    async def count_busy_processes(self) -> int:
        # The Engine's top runs ps on the host: no probe inside to count out.
        # A failure propagates: the lifecycle engine takes "cannot tell" as busy.
        top = await _call(engine().top, self._container(), ps_args="-e -o pid,stat")
        alive = [row for row in top.get("Processes") or [] if not row[1].startswith("Z")]
        keepers = 2 if self.config.init else 1  # init and its sleep, or sleep alone
        return max(0, len(alive) - keepers)

    # -- files -----------------------------------------------------------------------
    async def _stat_header(self, path: str) -> dict[str, Any]:
        api = engine()
        container = self._container()

        def head() -> dict[str, Any]:
            response = api.head(
                api._url("/containers/{0}/archive", container), params={"path": path}
            )
            if response.status_code == 404:
                raise SandboxFileNotFound(f"no such file or directory: {path}")
            if response.status_code >= 400:
                # A HEAD answer has no body to say why (a parent that is a
                # file, a loop of links): ask again with GET, on this error
                # path only, for the engine's message.
                api.get_archive(container, path)
            api._raise_for_status(response)
            header = response.headers.get("X-Docker-Container-Path-Stat", "")
            result: dict[str, Any] = json.loads(base64.b64decode(header))
            return result

        result: dict[str, Any] = await _call(head, path=path)
        return result

    @staticmethod
    def _info(path: str, header: Mapping[str, Any]) -> FileInfo:
        mode = int(header.get("mode", 0))
        if mode & _GO_MODE_DIR:
            kind = FileType.DIRECTORY
        elif mode & _GO_MODE_SYMLINK:
            kind = FileType.SYMLINK
        elif mode & _GO_MODE_SPECIAL:
            kind = FileType.OTHER
        else:
            kind = FileType.FILE  # setuid, setgid and sticky are bits of their own in Go
        permissions = mode & 0o777
        for go_bit, posix_bit in _GO_MODE_PERMISSION_BITS:
            if mode & go_bit:
                permissions |= posix_bit
        return FileInfo(path, kind, int(header.get("size", 0)), permissions,
                        _parse_mtime(header.get("mtime")))

    async def stat(self, path: str) -> FileInfo:
        return self._info(path, await self._stat_header(path))

    def _open_content(
        self, path: str, limit: int
    ) -> tuple[Generator[bytes, None, None], IO[bytes] | None]:
        """In a thread: the engine's archive stream of ``path`` (symlinks
        followed) and the file's content read from it as it arrives (None for
        what has no content, a FIFO); the caller closes the stream. Errors
        (missing, a directory, over ``limit``) come before a byte moves."""
        api = engine()
        container = self._container()
        target = path
        for _ in range(_MAX_LINK_HOPS):
            stream, header = api.get_archive(container, target, chunk_size=_READ_PIECE)
            try:
                mode = int(header.get("mode", 0))
                if mode & _GO_MODE_SYMLINK:
                    link = str(header.get("linkTarget") or "")  # resolved by the engine
                    if not link:
                        raise ProviderError(f"docker did not resolve the symlink {target}")
                    target = link
                    stream.close()
                    continue
                if mode & _GO_MODE_DIR:
                    raise SandboxIsADirectory(f"{path} is a directory")
                # The stat header tells the size before a byte of content moves.
                size = int(header.get("size", 0))
                if size > limit:
                    raise OutputLimitExceeded(
                        f"{path} is {size} bytes, over the read limit of {limit} bytes"
                    )
                # Read on after this returns; closing the stream under it ends it.
                tar = tarfile.open(  # noqa: SIM115
                    fileobj=_ChunkReader(stream), mode="r|", bufsize=_READ_PIECE
                )
                member = tar.next()
                if member is None:
                    raise ProviderError(f"docker returned an empty archive for {path}")
                return stream, tar.extractfile(member)
            except BaseException:
                stream.close()
                raise
        raise ProviderError(f"{path}: too many levels of symbolic links")

    async def read_file(self, path: str, limit: int) -> bytes:
        def read() -> bytes:
            stream, content = self._open_content(path, limit)
            try:
                data = content.read(limit + 1) if content is not None else b""
            finally:
                stream.close()
            if len(data) > limit:
                raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
            return data

        data: bytes = await _call(read, path=path)
        return data

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """The file in pieces as the engine's archive stream brings them: a
        large file is never whole in the daemon's memory."""
        stream, content = await _call(self._open_content, path, limit, path=path)
        async def read() -> bytes:
            if content is None:
                return b""
            piece: bytes = await _call(content.read, _READ_PIECE, path=path)
            return piece

        try:
            async for piece in bounded_pieces(read, path, limit):
                yield piece
        finally:
            stream.close()

    async def write_file(self, path: str, data: bytes) -> None:
        await self.write_file_from(path, io.BytesIO(data))

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        api = engine()
        container = self._container()
        mode = 0o644
        target = path
        for _ in range(_MAX_LINK_HOPS):
            try:
                header = await self._stat_header(target)
            except FileNotFoundError:
                break
            info = self._info(target, header)
            if info.type == FileType.SYMLINK and header.get("linkTarget"):
                # Writing through a link writes its target, as open() does;
                # an archive would replace the link with a file.
                target = str(header["linkTarget"])
                continue
            # Untarring a file over a directory would replace the whole tree.
            if info.type == FileType.DIRECTORY:
                raise SandboxIsADirectory(f"{path} is a directory")
            mode = info.mode  # an overwrite keeps the file's mode, as open() does
            break
        else:
            raise ProviderError(f"{path}: too many levels of symbolic links")

        def put() -> None:
            # The archive goes to a spool (disk past its first MiB) and the
            # engine reads it from there: a large file is never whole in memory.
            with tempfile.SpooledTemporaryFile(max_size=_ARCHIVE_IN_MEMORY) as archive:
                start = source.tell()
                size = source.seek(0, io.SEEK_END) - start
                source.seek(start)
                # PAX headers carry any name (spaces, quotes, newlines, non-ASCII)
                # byte for byte; relative to / so missing parents are created.
                with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    member = tarfile.TarInfo(target.lstrip("/"))
                    member.size = size
                    member.mode = mode
                    member.mtime = int(time.time())
                    tar.addfile(member, source)
                archive.seek(0)
                if not api.put_archive(container, "/", archive):
                    raise ProviderError(f"docker refused to write {path}")

        await _call(put, path=path)

    async def list_dir(self, path: str) -> list[FileInfo]:
        info = await self.stat(path)
        if info.type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        # Paths travel as argv items and come back NUL-separated: no quoting.
        code, out, err = await self.run_quiet(
            ["find", path, "-mindepth", "1", "-maxdepth", "1",
             "-printf", "%y\\t%s\\t%m\\t%T@\\t%f\\0"]
        )
        if code != 0 and not out:
            raise ProviderError(f"listing {path} failed: {err.decode('utf-8', 'replace')}")
        kinds = {"f": FileType.FILE, "d": FileType.DIRECTORY, "l": FileType.SYMLINK}
        entries = []
        for record in out.split(b"\0"):
            if not record:
                continue
            kind, size, mode, mtime, name = record.decode("utf-8", "surrogateescape").split(
                "\t", 4
            )
            entries.append(
                FileInfo(
                    path.rstrip("/") + "/" + name, kinds.get(kind, FileType.OTHER),
                    int(size), int(mode, 8), float(mtime),
                )
            )
        return sorted(entries, key=lambda e: e.path)

    async def remove(self, path: str, recursive: bool) -> None:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            argv = ["rm", "-rf", "--", path] if recursive else ["rmdir", "--", path]
        else:
            argv = ["rm", "-f", "--", path]
        code, _, err = await self.run_quiet(argv)
        if code != 0:
            message = err.decode("utf-8", "replace")
            if "not empty" in message:
                raise SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
            if "ermission denied" in message or "not permitted" in message:
                raise SandboxPermissionDenied(f"permission denied: {path}")
            if "ead-only" in message:
                raise SandboxPermissionDenied(f"read-only file system: {path}")
            raise ProviderError(f"removing {path} failed: {message.strip()}")

    async def walk_files(self, root: str) -> list[str]:
        # Regular files and links to them (-xtype f), as the base rule asks;
        # the root followed if it is a link (-H).
        code, out, _ = await self.run_quiet(
            ["find", "-H", root, "-mindepth", "1", "-xtype", "f", "-print0"]
        )
        if code != 0 and not out:
            await self.stat(root)  # the typed error for a missing root, off the happy path
        return [p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p]

    async def grep(
        self, pattern: re.Pattern[str], root: str, glob: str | None, limit: int
    ) -> list[GrepMatch]:
        """grep in the container over lines that may match, re-checked here.

        The container's ``grep -F`` (C locale, bytes) sends back only lines
        holding a literal that every match must contain, so file content
        never crosses the API in bulk. Each line is then matched with
        Python's ``re`` exactly as the base class would on local (in a worker
        process, never on the event loop); a file whose
        lines Python would split differently than grep does (a lone CR, form
        feed, U+2028...) or that grep stops reading as binary part way is
        read whole and searched by the base rule. Where the tools are not GNU
        ones (busybox), the base class's walk-and-read answers instead.
        """
        info = await self.stat(root)
        literals = _required_literals(pattern)
        grep_args = ["-H", "-n", "-Z", "-F", "-D", "skip"]
        if pattern.flags & re.IGNORECASE:
            grep_args.append("-i")
        if literals is None:
            grep_args += ["-e", ""]
        else:
            for literal in [*literals, *_LINE_BREAKS]:
                grep_args += ["-e", literal]
        if info.type == FileType.DIRECTORY:
            name = "*"
            if glob and "/" not in glob and "[" not in glob and "\\" not in glob:
                name = glob  # the same files find -name picks, checked again below
            argv = ["sh", "-c", _GREP_TREE, "hutch-grep", root, name, *grep_args]
        else:
            argv = ["grep", *grep_args, "--", root]
        matcher = compile_glob(glob) if glob and info.type == FileType.DIRECTORY else None
        found = GrepStream(pattern, root.rstrip("/") + "/",
                           None if matcher is None else matcher.match)
        err = await self._grep_into(found, argv)
        if not found.answered and any(marker in err for marker in _TOOL_FAILURES):
            return await super().grep(pattern, root, glob, limit)
        # grep calls a file binary at a NUL anywhere in what it has read; the
        # base rule, only at a NUL in the first 8 KiB. Those it named are
        # checked by that rule, and the ones it holds to be text read whole.
        binary = {
            m.decode("utf-8", "surrogateescape") for m in _BINARY_MATCHES.findall(err)
        }
        matches = await found.end(binary)
        reread = found.reread | (await self._text_by_base_rule(sorted(binary)) if binary
                                 else set())
        whole = [
            path for path in sorted(reread)
            if matcher is None or matcher.match(path[len(found.prefix):])
        ]
        matches.extend(await self.grep_files(pattern, whole, limit))
        return sorted(matches, key=lambda m: (m.path, m.line_number))

    async def _grep_into(self, found: GrepStream, argv: list[str]) -> bytes:
        """Run hutch's grep, its answer fed to ``found`` as it comes (never
        whole in memory); its stderr. Past :data:`GREP_CANDIDATE_LIMIT`
        bytes it is stopped (OutputLimitExceeded)."""
        proc = await self.start_process(
            ProcessRequest(argv, cwd="/", env={"LC_ALL": "C"}, user="0")
        )
        err = bytearray()
        total = 0
        try:
            while (chunk := await proc.read()) is not None:
                total += len(chunk.data)
                if total > GREP_CANDIDATE_LIMIT:
                    raise OutputLimitExceeded(
                        f"grep answered more than {GREP_CANDIDATE_LIMIT} bytes; "
                        "narrow the path, the glob or the pattern"
                    )
                if chunk.stream == "stdout":
                    await found.feed(chunk.data)
                elif len(err) < GREP_OUTPUT_LIMIT:  # its words on binary files, errors
                    err += chunk.data
            await proc.wait()
        except BaseException:
            # Cancelled (a grep's timeout, its caller gone) or over its cap:
            # what it started inside the sandbox is killed, not left to run.
            with anyio.CancelScope(shield=True):
                await proc.kill(KILL_GRACE_SECONDS)
            raise
        return bytes(err)

    async def _text_by_base_rule(self, paths: list[str]) -> set[str]:
        """Those of ``paths`` with no NUL in their first 8 KiB."""
        _, out, _ = await self.run_quiet(["sh", "-c", _NO_NUL_HEAD, "hutch-grep", *paths])
        return {p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p}

    async def preview_url(self, port: int) -> str:
        details = await _call(engine().inspect_container, self._container())
        networks = details["NetworkSettings"].get("Networks") or {}
        for network in networks.values():
            if network.get("IPAddress"):
                return f"http://{network['IPAddress']}:{port}"
        raise ProviderError(f"sandbox {self.sandbox_id} has no IP address (network_mode none?)")

    # -- lifecycle primitives ---------------------------------------------------------
    async def pause(self) -> None:
        container = self._container()
        await _call(freeze_guard(container).pause, engine(), container)

    async def unpause(self) -> None:
        container = self._container()
        await _call(freeze_guard(container).unpause, engine(), container)

    async def suspend(self) -> None:
        """Commit the container's changes to an image and remove the container."""
        api = engine()
        container = self._container()
        previous = self.suspended_image
        labels = {**self.config.labels, MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id,
                  HOME_LABEL: hutch_home()}

        image_id = await _call(
            commit_state, api, container, previous or self.base_image, SUSPENDED_REPOSITORY,
            self.sandbox_id, labels, fault="suspend.docker.frozen",
        )
        fault_point("suspend.docker.committed")
        self.suspended_image = image_id
        await _call(api.remove_container, container, force=True)
        fault_point("suspend.docker.removed")
        drop_start_locks(container)
        self.container_id = None
        await anyio.to_thread.run_sync(self._release_network_policy)
        if self.layered:
            # Nothing runs on its working directory now: it holds no mounted store.
            await anyio.to_thread.run_sync(layers.rest, self.sandbox_id)
        if self._agent is not None:
            self._agent.drop_connections()
        if previous and previous != image_id:
            # Refused while the new image builds on it (a commit); after a
            # flatten it goes, with the untagged layers below it.
            with contextlib.suppress(HutchError):
                await _call(api.remove_image, previous)

    async def resume(self) -> None:
        if self.container_id is not None:
            return
        image = self.suspended_image or configured_image(self.config)
        await self._start_container(image)
        fault_point("resume.docker.started")

    async def memory_bytes(self) -> int | None:
        if self.container_id is None:
            return 0  # suspended: nothing in memory
        # cgroup v1 with the cgroupfs driver: a file read, not a stats call.
        for path in (
            f"/sys/fs/cgroup/memory/docker/{self.container_id}/memory.usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{self.container_id}.scope/memory.current",
            f"/sys/fs/cgroup/docker/{self.container_id}/memory.current",
        ):
            try:
                with open(path) as fh:  # noqa: ASYNC230 - a cgroup file, microseconds
                    return int(fh.read().strip())
            except (OSError, ValueError):
                continue
        return None

    async def is_alive(self) -> bool:
        if self.container_id is None:
            return False
        try:
            details = await _call(engine().inspect_container, self.container_id)
        except SandboxUnavailable:
            return False  # no such container
        state = details.get("State", {})
        return bool(state.get("Running") or state.get("Paused"))

    # -- snapshots: the container's file system as an image, the working
    # -- directory as layers (see layers) ------------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """The container's file system (committed; a layer on its image, or
        flattened past the layer cap) and the working directory (a layer of
        what changed since the branch started, or a copy), both. A paused
        container is committed as it is; a suspended one is its suspend image."""
        api = engine()
        repository = snapshot_repository()
        labels = {MANAGED_LABEL: "1", SNAPSHOT_LABEL: snapshot_id, HOME_LABEL: hutch_home()}
        if self.container_id is not None and not await self._container_exists():
            # Gone outside hutch's hands: what survives is the working
            # directory and the image it ran from, and that is what is kept.
            self.container_id = None
        # The directory first, the image last: held_snapshots lists images, so a
        # capture cut short between the two leaves nothing listed half-made.
        frozen = (
            await _call(self._freeze_and_commit, snapshot_id, diff, repository, labels)
            if self.layered else None
        )
        if frozen is not None:
            size, image_id = frozen
        else:
            size = await anyio.to_thread.run_sync(
                lambda: layers.capture(snapshot_id, self.sandbox_id, self.host_workdir,
                                        self._current_chain(), diff=diff)
            )
            try:
                image_id = await _call(self._commit, snapshot_id, diff, repository, labels)
            except BaseException:
                await anyio.to_thread.run_sync(layers.remove, snapshot_id)
                raise
        try:
            image_bytes = await _call(_own_image_bytes, api, image_id)
        except BaseException:
            await anyio.to_thread.run_sync(layers.remove, snapshot_id)
            raise
        return ProviderSnapshot(
            snapshot_id, self.provider, size + image_bytes,
            {"image": f"{repository}:{snapshot_id}", "image_id": str(image_id)},
        )

    def _commit(
        self, snapshot_id: str, diff: bool, repository: str, labels: Mapping[str, str],
        *, stopped: bool = False,
    ) -> str:
        """The container's file system as the snapshot's image (a suspended
        sandbox's is its suspend image, tagged); its id."""
        api = engine()
        base = self.suspended_image or self.base_image
        if self.container_id is None:
            api.tag(base, repository, snapshot_id)
            return base
        return commit_state(api, self.container_id, base, repository, snapshot_id, labels,
                            flatten=not diff, stopped=stopped)

    def _current_chain(self) -> list[str] | None:
        if self.layered:
            self.chain = layers.mounted_chain(self.sandbox_id)
        return self.chain

    def _freeze_and_commit(
        self, snapshot_id: str, diff: bool, repository: str, labels: Mapping[str, str]
    ) -> tuple[int, str] | None:
        """Capture the layered working directory by moving what changed into
        the snapshot (``layers.freeze``), and commit the container, in one
        stop of it (paused as by docker pause, unless it is already): a
        process that wrote in the directory during the move would write into
        the snapshot, or be lost, and the two are taken at the same instant.
        (size, image id), or None when a process holds the directory (the
        caller copies it, with the container running). Blocking."""
        api = engine()
        container = self.container_id

        def freeze_then_commit(holder: int | None) -> tuple[int, str] | None:
            if not layers.freeze(snapshot_id, self.sandbox_id, flatten=not diff,
                                  holder=holder):
                return None
            self._current_chain()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Counting the layer's size (a stat a file) while the commit runs.
                size = pool.submit(layers.layer_size, snapshot_id)
                try:
                    image_id = self._commit(snapshot_id, diff, repository, labels, stopped=True)
                except BaseException:
                    layers.remove(snapshot_id)  # the sandbox goes on over its layer
                    raise
                return size.result(), image_id

        if container is None:
            return freeze_then_commit(None)
        # Held across the pause: a program that dies inside it leaves the
        # container paused and the marker saying so, for the next one that
        # takes the lock (``_mend_capture_cut_short``) to unpause.
        with layers.sandbox_lock(self.sandbox_id):
            state = api.inspect_container(container)["State"]
            holder = int(state.get("Pid") or 0) or None
            if not state.get("Running"):
                return freeze_then_commit(holder)
            # Not the Engine's "Paused" (it lags): the guard knows whose pause it is.
            with freeze_guard(container).frozen(api, container,
                                                marker=self._paused_for_capture()):
                fault_point("snapshot.docker.frozen-layered")
                return freeze_then_commit(holder)

    def _paused_for_capture(self) -> str:
        return os.path.join(layers.mount_dir(self.sandbox_id), "paused-for-capture")

    async def _mend_capture_cut_short(self) -> None:
        """A program that died in the middle of a capture may have left the
        working directory unmounted (its freeze's journal says how far it
        got) and the container paused: both put right, the directory first."""
        import docker.errors

        def mend() -> None:
            with layers.sandbox_lock(self.sandbox_id):
                if layers.mounted_chain(self.sandbox_id) is None:
                    return  # its directory is gone: nothing to mend
                if self.container_id is None:
                    layers.rest(self.sandbox_id)  # suspended: its directory at rest
                else:
                    layers.after_start(self.sandbox_id)
                marker = self._paused_for_capture()
                if os.path.exists(marker):
                    if self.container_id is not None:
                        with contextlib.suppress(docker.errors.APIError):
                            freeze_guard(self.container_id).unpause(engine(), self.container_id)
                    os.unlink(marker)

        await _call(mend)

    async def _container_exists(self) -> bool:
        import docker.errors

        def probe() -> bool:
            try:
                engine().inspect_container(self.container_id)
            except docker.errors.NotFound:
                return False
            return True

        exists: bool = await _call(probe)
        return exists

    @classmethod
    async def create_from_snapshot(
        cls, config: DockerConfig, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> DockerSandbox:
        image = str(snapshot.data.get("image") or f"{snapshot_repository()}:"
                    f"{snapshot.snapshot_id}")
        # Its own working directory always: a branch never shares the origin's.
        # Layered where overlayfs mounts; a copy of the snapshot's where not.
        layered = await anyio.to_thread.run_sync(layers.overlay_available)
        start = (
            functools.partial(layers.prepare, cap=_disk_cap(config)) if layered
            else layers.start_branch
        )
        workdir, chain = await anyio.to_thread.run_sync(start, sandbox_id, snapshot.snapshot_id)
        config = config.model_copy(update={"host_workdir": None})
        sandbox = cls(sandbox_id, config, workdir, True, None, base_image=image,
                      branch=True, chain=chain, layered=layered)
        try:
            await sandbox._launch(image)
        except BaseException:
            await anyio.to_thread.run_sync(sandbox._remove_agent_dir)
            await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
            raise
        return sandbox

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        import docker.errors

        api = engine()
        reference = f"{snapshot_repository()}:{snapshot.snapshot_id}"

        def untag() -> None:
            # Untagged, not forced: layers a branch's container or a child
            # snapshot still stands on stay until they go.
            try:
                api.remove_image(reference, noprune=False)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if _status(exc) != 409:
                    raise
                api.remove_image(reference, force=True)  # in use: untag only

        # Bounded: an Engine wedged on a paused container's lock makes image
        # removal wait; the image is then left, still listed by
        # held_snapshots, for the next reconciliation to free.
        def untag_and_free() -> None:
            untag()
            free_untagged_images(api)

        with anyio.move_on_after(SNAPSHOT_REMOVAL_TIMEOUT) as scope:
            try:
                await anyio.to_thread.run_sync(untag_and_free, abandon_on_cancel=True)
            except docker.errors.DockerException as exc:
                raise ProviderError(f"docker: removing {reference}: {exc}") from None
        if scope.cancelled_caught:
            log.warning("removing snapshot image %s: the Docker Engine did not answer in "
                        "%.0f s; left for the next reconciliation", reference,
                        SNAPSHOT_REMOVAL_TIMEOUT)
        await anyio.to_thread.run_sync(layers.remove, snapshot.snapshot_id)

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        api = engine()
        repository = snapshot_repository()
        images = await _call(api.images, repository)
        return sorted(
            tag.partition(":")[2] for image in images for tag in image.get("RepoTags") or []
            if tag.startswith(repository + ":")
        )

    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        import docker.errors

        api = engine()
        name = f"hutch-{sandbox_id}"

        def remove() -> None:
            try:
                labels = api.inspect_container(name)["Config"]["Labels"] or {}
            except docker.errors.NotFound:
                return
            ours = labels.get(SANDBOX_LABEL) == sandbox_id
            if ours and labels.get(HOME_LABEL) == hutch_home():
                api.remove_container(name, force=True)
                with contextlib.suppress(ProviderError):
                    netguard.release(sandbox_id)

        await _call(remove)
        await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
        await anyio.to_thread.run_sync(_release_own_dir, sandbox_id)

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        api = engine()
        home = hutch_home()
        containers = await _call(
            api.containers, all=True, filters={"label": [f"{MANAGED_LABEL}=1",
                                                         f"{HOME_LABEL}={home}"]},
        )
        removed = []
        for container in containers:
            labels = container.get("Labels") or {}
            sandbox_id = labels.get(SANDBOX_LABEL, "")
            if sandbox_id in known or labels.get(PRESERVE_LABEL) == "1":
                continue
            with contextlib.suppress(HutchError):
                await _call(api.remove_container, container["Id"], force=True)
                drop_start_locks(container["Id"])
                if sandbox_id:
                    with contextlib.suppress(ProviderError):
                        await anyio.to_thread.run_sync(netguard.release, sandbox_id)
                removed.append(sandbox_id or container["Id"][:12])
        with contextlib.suppress(HutchError):
            for sandbox_id in await _call(netguard.sweep, api, "hutch-"):
                removed.append(f"{sandbox_id} (its network policy's host rules)")
        for sandbox_id in await anyio.to_thread.run_sync(layers.branches):
            if sandbox_id not in known:
                await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
        for sandbox_id in await anyio.to_thread.run_sync(_capped_sandbox_dirs):
            if sandbox_id not in known:
                await anyio.to_thread.run_sync(_release_own_dir, sandbox_id)
                removed.append(f"{sandbox_id} (its capped working directory)")
        # Snapshot images untagged while their branches ran, now unused.
        with contextlib.suppress(HutchError):
            await _call(free_untagged_images, api)
        return removed

    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Docker's event stream: every hutch container that dies or is
        removed is reported, with what its last inspect says happened, and
        every image of a sandbox's that is deleted (a suspended sandbox's
        state, if it was that one)."""
        loop = asyncio.get_running_loop()
        deaths: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        stop = threading.Event()
        current: list[Any] = []

        #: Image id -> the sandbox whose labelled image lost a tag: an image's
        #: delete event carries no labels, its untag before it does.
        untagged: dict[str, str] = {}

        def pump() -> None:
            backoff = 0.5
            while not stop.is_set():
                try:
                    # No label filter: an image's delete event has no labels to match.
                    stream = engine().events(decode=True, filters={
                        "type": ["container", "image"],
                        "event": ["die", "destroy", "oom", "untag", "delete"],
                    })
                    current[:] = [stream]
                    backoff = 0.5
                    for event in stream:
                        actor = event.get("Actor") or {}
                        attributes = actor.get("Attributes") or {}
                        thing = str(actor.get("ID") or "")
                        action = str(event.get("Action") or event.get("status") or "")
                        sandbox_id = attributes.get(SANDBOX_LABEL)
                        if event.get("Type") == "image":
                            if action == "untag" and sandbox_id and attributes.get(
                                MANAGED_LABEL
                            ) == "1":
                                if len(untagged) > 1000:
                                    untagged.pop(next(iter(untagged)))
                                untagged[thing] = sandbox_id
                                continue
                            if action != "delete" or thing not in untagged:
                                continue
                            sandbox_id, action = untagged.pop(thing), "image deleted"
                        elif attributes.get(MANAGED_LABEL) != "1":
                            continue
                        if sandbox_id:
                            with contextlib.suppress(RuntimeError):  # the loop is gone
                                loop.call_soon_threadsafe(
                                    deaths.put_nowait, (sandbox_id, thing, action)
                                )
                except Exception as exc:
                    if not stop.is_set():
                        log.info("docker event stream broke (%s); reconnecting", exc)
                if not stop.wait(backoff):
                    backoff = min(backoff * 2, 10.0)

        async def tell(sandbox_id: str, container_id: str, action: str) -> None:
            try:
                if action == "destroy" and await anyio.to_thread.run_sync(
                    preserved_container_removed, sandbox_id
                ):
                    return  # its sandbox was deleted before: nothing to fail
                if action == "image deleted":
                    # Told of every image of the sandbox's; it fails only if this
                    # was the state it is suspended in (checked by is_suspended).
                    await report(RuntimeNotice(
                        sandbox_id, _suspended_state_removed(container_id, sandbox_id),
                        of_suspended=True,
                    ))
                elif action == "oom":
                    # A process in it hit the memory limit; a die follows if it was PID 1.
                    await report(RuntimeNotice(
                        sandbox_id, await _oom_message(container_id), may_have_died=False
                    ))
                else:
                    await report(RuntimeNotice(
                        sandbox_id, await _death_reason(container_id, action)
                    ))
            except Exception:
                log.exception("sandbox %s: reporting its container's %s failed",
                              sandbox_id, action)

        thread = threading.Thread(target=pump, name="hutch-docker-events", daemon=True)
        thread.start()
        tasks: set[asyncio.Task[None]] = set()
        watcher = (loop, report)
        _WATCHERS.append(watcher)
        try:
            while True:
                sandbox_id, container_id, action = await deaths.get()
                task = loop.create_task(tell(sandbox_id, container_id, action))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            _WATCHERS.remove(watcher)
            stop.set()
            for stream in current:
                with contextlib.suppress(Exception):
                    stream.close()
            for task in tasks:
                task.cancel()

    async def release_runtime(self) -> None:
        """Its container is gone (or dead): connections to it dropped, the
        record of it too if it is gone. The working directory stays, and is
        readable on the host whatever state the sandbox failed in (a layered
        one at rest, a suspended sandbox's, is mounted again), and a dead
        container that is still there stays too, until :meth:`close` frees both."""
        if self._agent is not None:
            self._agent.drop_connections()
        if self.container_id is None:
            if self.layered:
                try:
                    await anyio.to_thread.run_sync(layers.after_start, self.sandbox_id)
                except (OSError, HutchError) as exc:  # kept at rest: its files are still there
                    log.warning("sandbox %s: its working directory stays at rest: %s",
                                self.sandbox_id, exc)
            return
        try:
            state = (await _call(engine().inspect_container, self.container_id))["State"]
        except SandboxUnavailable:
            state = {"Dead": True}  # no such container
        if state.get("Dead") or state.get("Status") == "removing":
            # Gone, or going (``docker rm -f``): nothing of it to keep or commit.
            drop_start_locks(self.container_id)
            self.container_id = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        api = engine()
        if self.config.preserve and (
            self.container_id is not None or self.suspended_image is not None
        ):  # (one whose container is gone has nothing left to keep)
            # Said loudly: the user asked to keep it and needs to know how to reach it.
            if self.container_id is not None:
                kept_for_preserved_container(self.sandbox_id)
                log.warning(
                    "sandbox %s kept (preserve): docker exec -it %s bash",
                    self.sandbox_id, self.container_name,
                )
            elif self.suspended_image is not None:
                if self.layered:  # at rest while suspended: mounted again, to be bound
                    await anyio.to_thread.run_sync(layers.after_start, self.sandbox_id)
                log.warning(
                    "sandbox %s kept suspended (preserve): docker run -it --rm -v %s:%s %s bash",
                    self.sandbox_id, self.host_workdir, self.config.mount_point,
                    f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}",
                )
            return
        if self.container_id is not None:
            with contextlib.suppress(HutchError):
                await _call(api.remove_container, self.container_id, force=True, v=True)
                drop_start_locks(self.container_id)
            self.container_id = None
            await anyio.to_thread.run_sync(self._release_network_policy)
        # Its suspend image goes with it, whether or not the record names one:
        # a suspend undone after its commit (the store could not keep it) runs
        # on from that image while the record still says the container before.
        # By its tag, not by id: a snapshot of the suspended sandbox may name
        # the same image, and keeps it.
        with contextlib.suppress(HutchError):
            await _call(api.remove_image, f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}")
        self.suspended_image = None
        if self.branch or self.base_image.startswith(snapshot_repository()):
            # It ran on a snapshot's image, which may have been removed
            # (untagged) while it ran: now nothing stands on it.
            with anyio.move_on_after(SNAPSHOT_REMOVAL_TIMEOUT), contextlib.suppress(HutchError):
                await _call(free_untagged_images, api)
        if self._agent is not None:
            self._agent.drop_connections()
        await anyio.to_thread.run_sync(self._remove_agent_dir)
        await anyio.to_thread.run_sync(self._remove_workdir)

    def _remove_agent_dir(self) -> None:
        """Free the agent's directory (and the sandbox's own, if now empty)."""
        agent_dir, self.agent_dir = self.agent_dir, None
        if agent_dir is None:
            return
        shutil.rmtree(agent_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(os.path.dirname(agent_dir), "agent-link"), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(agent_dir))  # the sandbox's own, if now empty

    def _remove_workdir(self) -> None:
        """Free the working directory hutch made (a layered one, a branch's,
        or a plain one); a given one is the caller's and stays."""
        if self.branch or self.layered:
            layers.end_branch(self.sandbox_id)
            return
        if not self.owns_workdir:
            return
        with contextlib.suppress(OSError):
            unmount_capped(self.host_workdir)  # first: rmtree would empty the mount, not end it
        shutil.rmtree(os.path.dirname(self.host_workdir), ignore_errors=True)


def _capped_sandbox_dirs() -> list[str]:
    """The sandboxes whose own working directory is (or was) a capped mount
    here: a mount, or an image it is mounted from, in ``sandboxes/<id>``."""
    parent = os.path.join(hutch_home(), "sandboxes")
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    found = []
    for name in names:
        workdir = sandbox_workdir(name)
        if os.path.ismount(workdir) or os.path.exists(image_for(workdir)):
            found.append(name)
    return found


def _release_own_dir(sandbox_id: str) -> None:
    """Free a sandbox's own host directory: its capped working directory's
    mount, image and loop device first (removing files would only empty a
    mount, not end it), then the directory with what else it holds."""
    workdir = sandbox_workdir(sandbox_id)
    with contextlib.suppress(OSError):
        unmount_capped(workdir)
    if not os.path.ismount(workdir):
        shutil.rmtree(os.path.dirname(workdir), ignore_errors=True)


__all__ = ["DockerConfig", "DockerSandbox", "list_managed_containers"]
