"""``local``: commands run on the host, in a working directory. No isolation.

The built-in default. The environment passed on is this process's, less
secrets (see :func:`filter_env`). A working directory the caller gave is
theirs and stays as it is; without one the sandbox gets a fresh directory of
its own under hutch's data directory, removed when the sandbox closes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import anyio.to_thread
from pydantic import ConfigDict

from .._errors import SandboxUnavailable
from .._paths import sandbox_workdir
from .._types import Capabilities, GrepMatch, ProviderSnapshot
from . import layers
from ._hostfs import HostFiles
from ._hostproc import EXEC_MARKER, SANDBOX_MARKER, HostProcess, pids_with_env, spawn
from .base import FilesRuntime, NativeBackend, ProcessRequest, ProviderSettings
from .policy import HostPath

SECRET_SUFFIXES = ("_API_KEY", "_SECRET", "_TOKEN", "_PASSWORD", "_CREDENTIAL")
#: A name containing any of these (case-insensitively) is a secret's.
SECRET_WORDS = (
    "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE_KEY",
    "ACCESS_KEY",
)
#: ``PAT`` (a personal access token) only as a word of the name: GITHUB_PAT,
#: not PATH or PATTERN.
_PAT_WORD = re.compile(r"(?:^|[^A-Z0-9])PAT(?:[^A-Z0-9]|$)")
#: A URL carrying a password: ``scheme://user:password@host``.
_URL_WITH_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]+@")
SAFE_VARIABLES = frozenset(
    {"PATH", "HOME", "USER", "SHELL", "LANG", "TERM", "TMPDIR", "GOPATH", "CARGO_HOME", "NVM_DIR"}
)


def is_secret(name: str, value: str) -> bool:
    """Whether a variable looks like a secret: by its name (see
    :data:`SECRET_SUFFIXES`, :data:`SECRET_WORDS`, the word PAT) or by its
    value (a URL with an embedded password). The safelist is not consulted."""
    upper = name.upper()
    return (
        upper.endswith(SECRET_SUFFIXES)
        or any(word in upper for word in SECRET_WORDS)
        or _PAT_WORD.search(upper) is not None
        or _URL_WITH_PASSWORD.search(value) is not None
    )


def filter_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment minus variables that look like secrets (:func:`is_secret`).

    Names in :data:`SAFE_VARIABLES` always pass. Variables a caller sets on
    purpose (``env=`` on the call, the config's ``env``) are added after this
    filter and are never dropped.
    """
    return {k: v for k, v in environ.items() if k in SAFE_VARIABLES or not is_secret(k, v)}


class LocalConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid")

    type: Literal["local"] = "local"
    #: The host directory commands run in and relative paths resolve from; a
    #: fresh one of the sandbox's own under hutch's data directory when unset
    #: (and then removed with the sandbox).
    workdir: Annotated[str | None, HostPath()] = None
    #: Extra variables for every command (not filtered: you set them).
    env: dict[str, str] = {}


class LocalSandbox(NativeBackend, FilesRuntime):
    provider = "local"
    capabilities = Capabilities(
        processes=True, users=True, preview_url=True, snapshot=True, fork=True,
        runs_on_host=True,
    )
    config_model = LocalConfig
    watch_kind = "inotify"

    def __init__(
        self,
        sandbox_id: str,
        workdir: str,
        env: Mapping[str, str],
        owns_workdir: bool = False,
        branch: bool = False,
        chain: list[str] | None = None,
    ) -> None:
        super().__init__(sandbox_id, workdir)
        self._extra_env = dict(env)
        #: hutch made the working directory, so it goes with the sandbox.
        self._owns_workdir = owns_workdir
        #: Started from a snapshot: the working directory is a branch (see
        #: ``layers``), mounted on ``chain`` (None: a plain copy).
        self._branch = branch
        self._chain = chain
        #: The working directory was adopted by its first snapshot: moved into
        #: that snapshot's layer, an overlay mounted in its place (``layers.adopt``).
        self._adopted = False
        self.files: HostFiles = HostFiles()

    @classmethod
    async def create(cls, config: LocalConfig, sandbox_id: str) -> LocalSandbox:
        if config.workdir:
            workdir, owns = os.path.abspath(os.path.expanduser(config.workdir)), False
        else:
            # Never the daemon's (or the caller's) current directory: sandboxes
            # made without a directory would share it, and write into it.
            workdir, owns = sandbox_workdir(sandbox_id), True
        os.makedirs(workdir, exist_ok=True)
        return cls(sandbox_id, workdir, config.env, owns)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(), "env": self._extra_env, "owns_workdir": self._owns_workdir,
            "branch": self._branch, "chain": self._chain, "adopted": self._adopted,
        }

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> LocalSandbox:
        sandbox = cls(
            sandbox_id, str(description["workdir"]), description.get("env") or {},
            bool(description.get("owns_workdir")), bool(description.get("branch")),
            description.get("chain"),
        )
        # Adopted after its description was written: what is on disk says so.
        found = await anyio.to_thread.run_sync(layers.adopted, sandbox_id)
        if found is not None and await anyio.to_thread.run_sync(layers.giving_back, sandbox_id):
            # Its close had begun when the process died: finished now, and ended.
            await anyio.to_thread.run_sync(
                lambda: layers.end_adopted(sandbox_id, keep=True))
            raise SandboxUnavailable(
                f"sandbox {sandbox_id} was being closed when its program stopped; its "
                f"working directory {sandbox.workdir} has been given back")
        if found is not None:
            sandbox._chain, sandbox._adopted = found[1], True
        if sandbox._chain:
            await anyio.to_thread.run_sync(layers.ensure_mounted, sandbox_id)
        return sandbox

    # -- snapshots: the working directory, as layers (see layers) ---------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """A plain directory's first capture moves it into the snapshot's layer
        and goes on over an overlay (one rename, whatever the tree's size; see
        ``layers.adopt``); later ones copy what changed since (the upper
        directory). A copy of the whole tree only where overlayfs cannot serve."""

        def capture() -> int:
            if self._chain is None and not self._branch:
                size = layers.adopt(snapshot_id, self.sandbox_id, self.workdir)
                if size is not None:
                    self._chain, self._adopted = [snapshot_id], True
                    return size
            return layers.capture(snapshot_id, self.sandbox_id, self.workdir, self._chain,
                                  diff=diff)

        size = await anyio.to_thread.run_sync(capture)
        return ProviderSnapshot(snapshot_id, self.provider, size)

    @classmethod
    async def create_from_snapshot(
        cls, config: LocalConfig, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> LocalSandbox:
        # Never the origin's directory: a branch gets one of its own.
        workdir, chain = await anyio.to_thread.run_sync(
            layers.start_branch, sandbox_id, snapshot.snapshot_id
        )
        return cls(sandbox_id, workdir, config.env, True, True, chain)

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        await anyio.to_thread.run_sync(layers.remove, snapshot.snapshot_id)

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        return await anyio.to_thread.run_sync(layers.held)

    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        """Free the working directories of sandboxes no record names, and
        finish every give-back cut short, named or not: its close had begun
        (a record ended before its close is done)."""
        branches = await anyio.to_thread.run_sync(layers.branches)
        ended = [s for s in branches
                 if s not in known or await anyio.to_thread.run_sync(layers.giving_back, s)]
        for sandbox_id in ended:
            await cls.discard(sandbox_id)
        return ended

    @functools.cached_property
    def _shell(self) -> str:
        # Looked up on the first shell command, not when the sandbox is made:
        # a PATH walk (~30 us) that every attach of a branch paid, run or not.
        return "bash" if shutil.which("bash") is not None else "sh"

    def shell_argv(self, command: str) -> list[str]:
        return [self._shell, "-c", command]

    async def start_process(self, request: ProcessRequest) -> HostProcess:
        exec_id = uuid.uuid4().hex
        full_env = filter_env(os.environ)
        full_env.update(self._extra_env)
        full_env.update(request.env)
        full_env[EXEC_MARKER] = exec_id
        full_env[SANDBOX_MARKER] = self.sandbox_id
        return await spawn(dataclasses.replace(request, env=full_env), exec_id=exec_id)

    async def count_busy_processes(self) -> int:
        return len(pids_with_env(SANDBOX_MARKER, self.sandbox_id))

    async def grep_files(
        self, pattern: re.Pattern[str], paths: list[str], limit: int
    ) -> list[GrepMatch]:
        return await self.files.grep_files(pattern, paths, limit)

    async def preview_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    async def is_alive(self) -> bool:
        # Nothing runs between commands: the sandbox is its working directory.
        return os.path.isdir(self.workdir)

    async def close(self) -> None:
        if self._adopted:
            # A directory the caller gave is given back with its files;
            # hutch's own goes with the sandbox.
            keep = not self._owns_workdir
            await anyio.to_thread.run_sync(
                lambda: layers.end_adopted(self.sandbox_id, keep=keep)
            )
        if self._branch:
            await anyio.to_thread.run_sync(layers.end_branch, self.sandbox_id)
            return
        if self._owns_workdir:
            sandbox_dir = os.path.dirname(self.workdir)
            await anyio.to_thread.run_sync(
                lambda: shutil.rmtree(sandbox_dir, ignore_errors=True)
            )
