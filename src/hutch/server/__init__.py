"""``hutch serve``: the control plane over HTTP (see docs/wire.md)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import math
import os
import secrets
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from .._errors import HutchError, InvalidArgument
from .._limits import SERVER_IDLE_SECONDS
from .._paths import token_file_path
from ..config import CONFIG_FILE_NAME, load_config_data, sandbox_layer
from ..daemon import default_data_dir
from ..definitions import definitions_from_config
from ..providers._signals import shrug_ignored_signals
from ..providers.registry import available_providers, provider_known
from ..store import reach_store
from .app import create_app
from .connections import connection_cap, guarded_protocol
from .settings import ServerSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
TOKEN_ENV = "HUTCH_TOKEN"
#: Where the daemon keeps its state (hutch.store.open_store), when no flag says.
STORE_ENV = "HUTCH_STORE"
PR_SET_DUMPABLE = 4


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    """The token in ``path``: one line, in a file no other user can read."""
    try:
        info = os.stat(path)
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {path}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(
            f"token file {path} is open to other users (mode {info.st_mode & 0o777:04o}); "
            f"chmod 600 {path}"
        )
    if not token or "\n" in token:
        raise InvalidArgument(f"token file {path} must hold the token on one line")
    return token


def load_server_config(path: str | None) -> dict[str, Any]:
    """The daemon's settings from ``path`` (else ``./hutch.toml`` if present)::

        [server]
        allow = ["mounts"]          # host-reaching settings clients may set
        providers = ["local"]       # providers that run on the host clients may use
        memory_budget = 536870912   # bytes of callers' data held in memory at once
        store = "postgresql://hutch@db.example/hutch"   # default: SQLite in the data dir
        advertise_url = "http://host-a:8787"   # where a fleet's other daemons reach this one
        max_sandboxes = 100         # served at once, warm pools' included (default: no limit)
        meter_interval = 10         # seconds between samples of a sandbox's memory and disk
        [server.limits]             # for requests that set none
        memory = "2g"
        cpus = 1
        pids = 1024
        [server.ceilings]           # the most a request may ask for
        memory = "8g"

    The file's ``[sandbox]`` and ``[providers]`` tables are the server's
    sandbox defaults (the operator's: settings there are allowed).
    """
    candidate = path or CONFIG_FILE_NAME
    data = load_config_data(path)  # read once: {} when ./hutch.toml is not there
    file = sandbox_layer(data)
    server: dict[str, Any] = dict(data.get("server", {}))
    definitions: dict[str, Any] = {}
    if data:
        # Validated here, so that a bad definition stops the daemon before it listens.
        definitions = {
            # As written: a definition that names no provider gets the daemon's default.
            name: d.model_dump(mode="json", exclude_unset=True)
            for name, d in definitions_from_config(data).items()
        }
    known = {"allow", "providers", "limits", "ceilings", "memory_budget", "store",
             "advertise_url", "max_sandboxes", "meter_interval"}
    unknown = set(server) - known
    if unknown:
        raise InvalidArgument(
            f"unknown [server] settings in {candidate}: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(known))})"
        )
    if file:
        server["sandbox_defaults"] = file
    if definitions:
        server["definitions"] = definitions
    pools = data.get("pools", {})
    for name, table in pools.items():
        if not isinstance(table, dict) or not isinstance(table.get("size"), int):
            raise InvalidArgument(f"[pools.{name}] in {candidate} needs a size (a whole number)")
    if pools:
        server["pools"] = pools
    return server


def _scrub_initial_environ(name: str) -> None:
    """Zero ``name``'s value where the process started with it.

    Unsetting a variable drops it from the environment children get, but its
    bytes stay in the block ``/proc/PID/environ`` shows, which a process of the
    same user (a ``local`` command) can read. Overwritten in place, it is gone.
    """
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_void_p
    address = libc.getenv(name.encode())
    if address:
        ctypes.memset(address, 0, len(ctypes.string_at(address)))


def take_token(token_file: str | None) -> str | None:
    """The daemon's token, from ``token_file`` or ``HUTCH_TOKEN``; never a
    command-line argument, which every user sees in ``/proc/PID/cmdline``.

    ``HUTCH_TOKEN`` is removed from this process's environment, so that no
    child (a ``local`` command, a tool a provider runs) inherits the secret.
    """
    from_env = os.environ.get(TOKEN_ENV) or None
    _scrub_initial_environ(TOKEN_ENV)
    os.environ.pop(TOKEN_ENV, None)
    if token_file is not None:
        return read_token_file(token_file)
    return from_env


def take_store_location() -> str | None:
    """``HUTCH_STORE``, taken out of this process's environment as the token
    is (a PostgreSQL URL may carry a password)."""
    from_env = os.environ.get(STORE_ENV) or None
    _scrub_initial_environ(STORE_ENV)
    os.environ.pop(STORE_ENV, None)
    return from_env


def made_token(data_dir: str) -> str:
    """The token of a daemon given none: made at its first start (random, from
    :mod:`secrets`) in a 0600 file of its data directory, and read from there
    on later starts. The CLI and SDK of a user who can read it find it there
    on their own (hutch.client); no other user can."""
    path = token_file_path(data_dir)
    if not os.path.exists(path):
        # Written whole under another name, then linked into place: a client
        # or a second daemon never reads half a token, and the first one made wins.
        fd, temp = tempfile.mkstemp(dir=data_dir, prefix=".api-token-")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(secrets.token_urlsafe(32) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
        finally:
            os.unlink(temp)
    return read_token_file(path)


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    data_dir: str | None = None,
    retention_seconds: float | None = None,
    *,
    token_file: str | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    allow: Sequence[str] = (),
    config_file: str | None = None,
    max_connections: int | None = None,
    allow_providers: Sequence[str] = (),
    provider: str | None = None,
    store: str | None = None,
    advertise_url: str | None = None,
) -> None:
    """Run the daemon until interrupted. Refuses a non-loopback bind without a token.

    ``token`` is for in-process callers; otherwise it comes from
    ``token_file`` or ``HUTCH_TOKEN`` (see :func:`take_token`), else it is the
    one the daemon made in its data directory (:func:`made_token`): no daemon
    answers without a credential. ``allow`` names settings that reach the
    host which clients may set, ``allow_providers`` providers that run on the
    host which they may use, on top of the config file's (``hutch.toml``: see
    :func:`load_server_config`); ``provider`` is the provider of requests
    that name none (over the file's ``[sandbox] provider``); ``store`` where it
keeps its state (over ``HUTCH_STORE``, over the file's ``[server] store``;
default SQLite in the data directory); ``advertise_url`` where a fleet's
other daemons reach this one (over ``HUTCH_ADVERTISE_URL``; default: the
address it listens on). Everything
    that can be refused (the address, the data directory, the settings) is
    checked before the daemon starts; ``on_ready(url, data_dir)`` is called
    once it serves.
    """
    import uvicorn

    server_config = load_server_config(config_file)
    server_config["allow"] = sorted({*server_config.get("allow", []), *allow})
    server_config["providers"] = sorted({*server_config.get("providers", []), *allow_providers})
    if provider is not None:
        if not provider_known(provider):
            raise InvalidArgument(
                f"unknown provider {provider!r}; available: {', '.join(available_providers())}"
            )
        # Over the file's [sandbox] provider, as a flag is over the file.
        server_config.get("sandbox_defaults", {}).pop("provider", None)
        server_config["default_provider"] = provider

    store = store or take_store_location()
    if store is not None:
        server_config["store"] = store
    if server_config.get("store") is not None:
        reach_store(server_config["store"])

    taken = take_token(token_file)
    token = token or taken
    if not is_loopback(host) and not token:
        raise InvalidArgument(
            f"refusing to listen on {host} without a token: anyone who reaches it could run "
            f"commands; set {TOKEN_ENV} or pass --token-file, or bind to 127.0.0.1"
        )
    # Whatever the daemon writes (its store, working directories) is its user's alone.
    os.umask(0o077)
    # Not dumpable: a process of the same user (a ``local`` command is one)
    # cannot read this one's memory, where the token lives, through /proc or
    # ptrace. A child's exec makes it dumpable again, as usual.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if retention_seconds is not None and not 0 < retention_seconds < math.inf:
        raise InvalidArgument(
            f"retention must be a positive number of seconds, got {retention_seconds!r}"
        )
    try:
        settings = ServerSettings(data_dir=data_dir, token=token, **server_config)
    except ValidationError as exc:
        raise InvalidArgument(f"bad [server] settings: {exc}") from None
    settings.policy()  # a bad allowance or limit fails here, before anything listens
    settings.data_dir = prepare_data_dir(data_dir)
    if not settings.token:
        settings.token = made_token(settings.data_dir)
    listener = bind(host, port)
    if retention_seconds is not None:
        settings.retention_seconds = retention_seconds
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    settings.advertise_url = (advertise_url or os.environ.get("HUTCH_ADVERTISE_URL")
                              or settings.advertise_url or url).rstrip("/")
    app = create_app(
        settings,
        on_ready=None if on_ready is None else lambda d: on_ready(url, d.data_dir),
    )
    if threading.current_thread() is threading.main_thread():
        # This process's own: its commands then start as its children, their
        # signals at their defaults without a reset (see _signals).
        shrug_ignored_signals()
    # The asyncio loop, not uvloop: uvloop notices a child's exit ~4 ms late,
    # which would be most of an exec's cost.
    server = uvicorn.Server(uvicorn.Config(
        app, http=guarded_protocol(connection_cap(max_connections)), loop="asyncio",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_IDLE_SECONDS,
    ))
    server.run(sockets=[listener])
    if not server.started:
        raise HutchError(f"the daemon on {url} did not start (its log says why)")


def prepare_data_dir(data_dir: str | None) -> str:
    """The data directory, made if missing; refused unless this user can write it."""
    path = os.path.abspath(data_dir or default_data_dir())
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"cannot use {path} as the data directory: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgument(f"cannot use {path} as the data directory: it is not writable")
    return path


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the daemon says it serves."""
    if not 0 < port < 65536:
        raise InvalidArgument(f"port must be 1..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise InvalidArgument(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError as exc:
        listener.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise InvalidArgument(f"cannot listen on {host}:{port}: {why}") from None
    listener.set_inheritable(True)
    return listener


__all__ = [
    "DEFAULT_HOST", "DEFAULT_PORT", "ServerSettings", "create_app", "is_loopback",
    "read_token_file", "serve", "take_token",
]
