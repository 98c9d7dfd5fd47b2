"""An in-process owner's sandbox, served to the holders of its refs.

A program that uses hutch without a daemon owns its sandboxes in its own
process. So that a session in another process can attach with a ref, the
owner serves that one sandbox itself: the daemon's application (the one
router, its ref checks and per-session guards) over a daemon core that holds
only this sandbox, on a unix socket in a private directory (the directory
0700, the socket 0600), answering its refs alone: the core's token is made
here and never handed out, so nothing but that sandbox can be reached. The
first ref starts it; the owner's close stops it and removes the directory;
the ref carries the socket's address (``http+unix://``).

An owner killed outright (SIGKILL, a crash) removes nothing, so the
directory's name says whose it is (``hutch-owner-<pid>-<start time>-...``)
and each owner's start removes the directories of owners that are gone: a
process no longer running (by pid and start time, so a reused pid does not
keep a dead owner's directory) whose socket no longer answers.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import tempfile
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import uvicorn

from .._errors import HutchError
from .._limits import SERVER_IDLE_SECONDS
from .._liveness import still_running, this_process
from .._refwire import decode_ref, unix_url
from ..core.refs import register_ref_serving
from ..daemon import Daemon
from ..store import RefRow
from .app import create_app
from .connections import guarded_protocol
from .settings import ServerSettings

if TYPE_CHECKING:
    from collections.abc import Generator

    from .._sandbox import Sandbox

#: Connections one owner's server takes at once (its attached sessions).
MAX_CONNECTIONS = 256
#: Seconds the server waits for calls under way once its owner closes.
GRACEFUL_SECONDS = 2
#: The longest socket path the kernel takes (sun_path), with room to spare.
MAX_SOCKET_PATH = 100

#: The name of an owner's socket directory: whose it is (pid, start time), then mkdtemp's part.
OWNER_DIRECTORY = re.compile(r"hutch-owner-(\d+)-(\d+)-\w+")

#: Servers running in this process, by their address (what their refs carry).
_SERVED: dict[str, OwnerServer] = {}
#: Their directories, removed at exit if a server was never stopped.
_DIRECTORIES: set[str] = set()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside someone else's program: the signals stay the program's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _private_directory() -> str:
    pid, start = this_process()
    prefix = f"hutch-owner-{pid}-{start}-"
    parents = [tempfile.gettempdir(), "/tmp"]
    for parent in dict.fromkeys(parents):
        remove_dead_owners_directories(parent)
    directory = tempfile.mkdtemp(prefix=prefix)  # 0700
    if len(os.path.join(directory, "sock").encode()) > MAX_SOCKET_PATH:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    _DIRECTORIES.add(directory)
    return directory


def remove_dead_owners_directories(parent: str) -> list[str]:
    """Remove the socket directories in ``parent`` whose owners are gone
    (this user's only); the ones removed. A live owner's directory stays,
    served or still being made."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        match = OWNER_DIRECTORY.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(
                follow_symlinks=False
            ).st_uid != uid:
                continue
        except OSError:
            continue
        owner_pid, owner_start = int(match[1]), int(match[2])
        if still_running(owner_pid, owner_start) or _answers(os.path.join(entry.path, "sock")):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _answers(path: str) -> bool:
    """Whether a server listens on the unix socket at ``path`` (an owner this
    host cannot see as running, in another pid namespace, still serves)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except BlockingIOError:  # its backlog is full: it is there
        return True
    except OSError as exc:
        # Refused (nothing listens) or absent: no one serves there. Anything
        # else leaves the question open, and the directory with it.
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return True


class OwnerServer:
    """One in-process sandbox on a private unix socket, for its refs' holders."""

    def __init__(self, sandbox: Sandbox, directory: str, core: Daemon) -> None:
        self.sandbox = sandbox
        self.directory = directory
        self.core = core
        self.path = os.path.join(directory, "sock")
        self.url = unix_url(self.path)
        #: The loop it serves on: the owner's, where its sandbox's operations run.
        self.loop = asyncio.get_running_loop()
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, sandbox: Sandbox) -> OwnerServer:
        directory = _private_directory()
        try:
            core = await anyio.to_thread.run_sync(Daemon, directory)  # opens its store
            core.host(sandbox)
            server = cls(sandbox, directory, core)
            await server._serve()
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            _DIRECTORIES.discard(directory)
            raise
        _SERVED[server.url] = server
        return server

    async def _serve(self) -> None:
        # A token no one is given: every request needs one of this sandbox's refs.
        settings = ServerSettings(data_dir=self.directory, token=secrets.token_urlsafe(32))
        app = create_app(settings, core=self.core)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._server = _EmbeddedServer(uvicorn.Config(
            app, http=guarded_protocol(MAX_CONNECTIONS), loop="asyncio", lifespan="off",
            log_config=None,
            log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_SECONDS,
            timeout_keep_alive=SERVER_IDLE_SECONDS,
        ))
        self._task = self.loop.create_task(self._server.serve(sockets=[listener]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its failure, raised here
                raise HutchError(f"could not serve sandbox {self.sandbox.id} on {self.path}")
            await asyncio.sleep(0.005)

    async def hand_out(self, expires_in: float | None) -> str:
        """A new ref: a credential for this sandbox, carrying this server's address."""
        answer = await self.core.create_ref(self.sandbox.id, expires_in, self.url)
        return str(answer["ref"])

    async def revoke(self, ref: str) -> None:
        decoded = decode_ref(ref)
        await self.core.revoke_ref(self.sandbox.id, decoded.ref_id if decoded else ref)

    async def check(self, ref: str) -> RefRow:
        """The ref's row if it is one of this sandbox's, unrevoked and unexpired."""
        return await self.core.check_ref(ref)

    def open_refs(self) -> list[RefRow]:
        return self.core.open_refs(self.sandbox.id)

    def refs_json(self) -> list[dict[str, Any]]:
        return self.core.refs_json(self.sandbox.id)

    def attachments(self) -> list[dict[str, Any]]:
        """The sessions of other processes attached through this server."""
        return self.core.attachments(self.sandbox.id)

    async def close(self) -> None:
        """Stop answering (calls under way get a moment to finish) and remove the socket."""
        _SERVED.pop(self.url, None)
        try:
            if self._server is not None and self._task is not None:
                self._server.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._task), GRACEFUL_SECONDS + 5)
                if not self._task.done():
                    self._task.cancel()
            await self.core.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
            _DIRECTORIES.discard(self.directory)


def served_here(ref: str) -> OwnerServer | None:
    """The server in this process that handed ``ref`` out, if any."""
    decoded = decode_ref(ref) if isinstance(ref, str) else None
    return None if decoded is None else _SERVED.get(decoded.url)


class _OwnerServing:
    """Owner servers, as the core finds them (:mod:`hutch.core.refs`)."""

    async def start(self, sandbox: Sandbox) -> OwnerServer:
        return await OwnerServer.start(sandbox)

    def served_here(self, ref: str) -> OwnerServer | None:
        return served_here(ref)


register_ref_serving(_OwnerServing())


@atexit.register
def _remove_directories() -> None:
    for directory in list(_DIRECTORIES):
        shutil.rmtree(directory, ignore_errors=True)
