"""One kept SSH connection per destination, shared by every sandbox on it.

Sessions (exec channels, the SFTP channel) are multiplexed over it. A
connection found closed is made again, with a bounded number of attempts; a
failure that retrying cannot fix (a host key that does not match, a key the
host refuses) is raised at once. Every failure is a typed hutch error whose
message names the destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..._errors import HutchError, ProviderError, SandboxUnavailable
from ..._lazy import lazy_module
from .config import SshConfig

if TYPE_CHECKING:
    import asyncssh
else:
    asyncssh = lazy_module("asyncssh")  # imported at its first use: see hutch._lazy

#: Connections beside the kept one, made only when the host refuses more
#: sessions on it (sshd's MaxSessions, 10 by default, counts each running
#: command and the SFTP session).
MAX_OVERFLOW_CONNECTIONS = 15
#: Attempts to (re)connect before giving up, and the pause after each failure.
CONNECT_ATTEMPTS = 3
_BACKOFF_SECONDS = (0.2, 0.6)


@dataclass(frozen=True)
class SshTarget:
    """What identifies one kept connection: the same target shares it."""

    destination: str
    config_file: str | None
    known_hosts: str | None
    check_host_key: bool
    connect_timeout: float

    @classmethod
    def from_config(cls, config: SshConfig) -> SshTarget:
        return cls(
            config.destination,
            os.path.abspath(os.path.expanduser(config.config_file)) if config.config_file else None,
            os.path.abspath(os.path.expanduser(config.known_hosts)) if config.known_hosts else None,
            config.check_host_key,
            config.connect_timeout,
        )

    def connect_kwargs(self) -> dict[str, Any]:
        port: int | None = None
        if self.destination.startswith("ssh://"):  # ssh://[user@]host[:port], as ssh takes
            parts = urlsplit(self.destination)
            user, host, port = parts.username or "", parts.hostname or "", parts.port
        else:
            user, _, host = self.destination.rpartition("@")
        kwargs: dict[str, Any] = {
            "host": host,
            "connect_timeout": self.connect_timeout,
            "login_timeout": self.connect_timeout,
            # A host that vanishes without closing the socket is noticed.
            "keepalive_interval": 15,
            "keepalive_count_max": 3,
        }
        if user:
            kwargs["username"] = user
        if port is not None:
            kwargs["port"] = port
        if self.config_file is not None:
            kwargs["config"] = [self.config_file]
        if not self.check_host_key:
            kwargs["known_hosts"] = None
        elif self.known_hosts is not None:
            kwargs["known_hosts"] = self.known_hosts
        return kwargs


def connect_error(exc: BaseException, target: SshTarget) -> HutchError:
    """The typed error for a failed connection attempt, naming the destination."""
    dest = target.destination
    if isinstance(exc, HutchError):
        return exc
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        where = target.known_hosts or "the config's UserKnownHostsFile or ~/.ssh/known_hosts"
        return ProviderError(
            f"ssh {dest}: the host key is not trusted ({exc.reason}); add the host's key "
            f"to {where}, or check that you reach the host you mean"
        )
    if isinstance(exc, asyncssh.PermissionDenied):
        return ProviderError(
            f"ssh {dest}: authentication failed ({exc.reason}); check the user and the "
            "IdentityFile (or agent key) the host accepts"
        )
    if isinstance(exc, TimeoutError):
        return SandboxUnavailable(
            f"ssh {dest}: no answer within {target.connect_timeout} s (host down or unreachable)"
        )
    if isinstance(exc, asyncssh.ConfigParseError):
        return ProviderError(f"ssh {dest}: cannot read ssh config {target.config_file}: {exc}")
    if isinstance(exc, OSError):
        return SandboxUnavailable(f"ssh {dest}: cannot connect: {exc.strerror or exc}")
    if isinstance(exc, asyncssh.Error):
        return SandboxUnavailable(f"ssh {dest}: connection failed: {exc.reason}")
    return ProviderError(f"ssh {dest}: {exc}")


def _is_permanent(exc: BaseException) -> bool:
    return isinstance(
        exc, asyncssh.HostKeyNotVerifiable | asyncssh.PermissionDenied | asyncssh.ConfigParseError
    )


class KeptConnection:
    """A connection to one target and its SFTP session, made again when lost."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._lock = asyncio.Lock()
        #: Overflow connections, for sessions past the host's per-connection cap.
        self._overflow: list[asyncssh.SSHClientConnection] = []
        self.users = 0
        #: How many times a connection was made (1 + reconnects); for tests.
        self.connects = 0

    def _alive(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.is_closed()

    async def connection(self) -> asyncssh.SSHClientConnection:
        if self._alive():
            assert self._conn is not None
            return self._conn
        async with self._lock:
            if not self._alive():
                self._drop()
                conn = await self._connect()
                # The SFTP session is opened with the connection, while a
                # session is free: later, running commands may fill the
                # host's MaxSessions.
                try:
                    self._sftp = await conn.start_sftp_client()
                except (OSError, asyncssh.Error) as exc:
                    conn.close()
                    raise lost(self.target, exc) from None
                self._conn = self._sftp_conn = conn
            assert self._conn is not None
            return self._conn

    async def _connect(self) -> asyncssh.SSHClientConnection:
        # Attempts share one deadline: connect_timeout bounds the whole retry.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.target.connect_timeout
        last: BaseException | None = None
        for attempt in range(CONNECT_ATTEMPTS):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            kwargs = self.target.connect_kwargs()
            kwargs["connect_timeout"] = kwargs["login_timeout"] = remaining
            try:
                conn = await asyncio.wait_for(asyncssh.connect(**kwargs), remaining)
            except (OSError, asyncssh.Error) as exc:
                last = exc
                if _is_permanent(exc):
                    break
            else:
                self.connects += 1
                return conn
            if attempt < len(_BACKOFF_SECONDS):
                await asyncio.sleep(min(_BACKOFF_SECONDS[attempt], max(0, deadline - loop.time())))
        raise connect_error(last or TimeoutError(), self.target) from None

    async def sftp(self) -> asyncssh.SFTPClient:
        conn = await self.connection()
        if self._sftp is not None and self._sftp_conn is conn:
            return self._sftp
        async with self._lock:
            if self._sftp is None or self._sftp_conn is not conn:
                try:
                    self._sftp = await conn.start_sftp_client()
                except (OSError, asyncssh.Error) as exc:
                    self.forget(conn)
                    raise lost(self.target, exc) from None
                self._sftp_conn = conn
            return self._sftp

    _sftp_conn: asyncssh.SSHClientConnection | None = None

    async def open_session(
        self, command: str, *, term_size: tuple[int, int] | None = None
    ) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess[bytes]]:
        """An exec channel for ``command``: on the kept connection, or where the
        host caps sessions per connection and the kept one is full, on an
        overflow connection. A connection found dead is made again once."""
        for attempt in (1, 2):
            conn = await self.connection()
            try:
                return conn, await _create(conn, command, term_size)
            except asyncssh.ChannelOpenError as exc:
                if conn.is_closed():
                    last: BaseException = exc
                else:  # refused, not lost: the host's session cap
                    return await self._overflow_session(command, term_size)
            except (OSError, asyncssh.Error) as exc:
                last = exc
            self.forget(conn)
            if attempt == 2:
                raise lost(self.target, last) from None
        raise AssertionError("unreachable")

    async def _overflow_session(
        self, command: str, term_size: tuple[int, int] | None
    ) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess[bytes]]:
        self._overflow = [c for c in self._overflow if not c.is_closed()]
        for conn in list(self._overflow):
            try:
                return conn, await _create(conn, command, term_size)
            except (OSError, asyncssh.Error):
                continue
        if len(self._overflow) >= MAX_OVERFLOW_CONNECTIONS:
            raise SandboxUnavailable(
                f"ssh {self.target.destination}: the host refuses more sessions "
                f"({len(self._overflow) + 1} connections, each at its MaxSessions)"
            )
        conn = await self._connect()
        self._overflow.append(conn)
        try:
            return conn, await _create(conn, command, term_size)
        except (OSError, asyncssh.Error) as exc:
            raise SandboxUnavailable(
                f"ssh {self.target.destination}: the host refused a session: {exc}"
            ) from None

    def forget(self, conn: asyncssh.SSHClientConnection) -> None:
        """Drop ``conn`` after a failure on it: the next call connects again."""
        if self._conn is conn:
            self._drop()
        elif conn in self._overflow:
            self._overflow.remove(conn)
            conn.close()

    def forget_sftp(self, sftp: asyncssh.SFTPClient) -> None:
        """Drop the connection ``sftp`` ran on after it failed."""
        if self._sftp is sftp:
            self._drop()

    def _drop(self) -> None:
        if self._sftp is not None:
            self._sftp.exit()
        if self._conn is not None:
            self._conn.close()
        self._sftp = None
        self._sftp_conn = None
        self._conn = None

    async def aclose(self) -> None:
        conns = [c for c in [self._conn, *self._overflow] if c is not None]
        self._drop()
        for conn in self._overflow:
            conn.close()
        self._overflow = []
        for conn in conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.wait_closed(), 5)


async def _create(
    conn: asyncssh.SSHClientConnection, command: str, term_size: tuple[int, int] | None
) -> asyncssh.SSHClientProcess[bytes]:
    if term_size is None:
        return await conn.create_process(command, encoding=None)
    return await conn.create_process(
        command, encoding=None, term_type="xterm-256color", term_size=term_size
    )


def lost(target: SshTarget, exc: BaseException | None = None) -> SandboxUnavailable:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    return SandboxUnavailable(
        f"ssh {target.destination}: the connection was lost{detail}; "
        "the next call connects again"
    )


# Connections belong to the event loop that made them.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[SshTarget, KeptConnection]] = (
    weakref.WeakKeyDictionary()
)


def acquire(target: SshTarget) -> KeptConnection:
    """The kept connection for ``target`` on this loop (made on first use)."""
    pool = _pools.setdefault(asyncio.get_running_loop(), {})
    kept = pool.get(target)
    if kept is None:
        kept = pool[target] = KeptConnection(target)
    kept.users += 1
    return kept


async def release(kept: KeptConnection) -> None:
    """One sandbox is done with ``kept``; the last one closes the connection."""
    kept.users -= 1
    if kept.users > 0:
        return
    pool = _pools.get(asyncio.get_running_loop(), {})
    if pool.get(kept.target) is kept:
        del pool[kept.target]
    await kept.aclose()
