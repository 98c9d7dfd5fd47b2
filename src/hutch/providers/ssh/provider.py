"""The ``ssh`` backend: provisioning (check the host, make or clone the working
directory) and the runtime (exec, files, grep, glob, the busy count)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Mapping
from typing import Any

from ..._errors import (
    CapabilityUnsupported,
    InvalidArgument,
    ProviderError,
    SandboxFileNotFound,
    SandboxUnavailable,
)
from ..._types import Capabilities, GrepMatch
from .._grep import GrepBatches
from ..base import SANDBOX_MARKER, FilesRuntime, NativeBackend, ProcessRequest
from .config import SshConfig
from .connection import KeptConnection, SshTarget, acquire, lost, release
from .files import SftpFiles
from .process import (
    COUNT_SCRIPT,
    FAILED,
    STARTED,
    SshProcess,
    SshPtyProcess,
    closed_on_failure,
    command_line,
    open_process,
    run_helper,
    start_error,
)

# Says whether the host has bash, and makes the working directory ($1).
_PREPARE_SCRIPT = (
    'command -v bash >/dev/null 2>&1 && echo bash; '
    'mkdir -p -- "$1" || exit 3; [ -d "$1" ] || exit 3'
)

# Makes the working directory ($1) a clone of $2 at branch $3 (the remote's
# default branch when empty). A working directory that already is a clone of
# $2 is kept as it is: a sandbox made again on it resumes the work there.
_CLONE_SCRIPT = (
    'wd=$1; repo=$2; branch=$3; export GIT_TERMINAL_PROMPT=0; '
    'command -v git >/dev/null 2>&1 || { echo "git is not installed" >&2; exit 4; }; '
    'if [ -e "$wd/.git" ]; then '
    '[ "$(git -C "$wd" remote get-url origin 2>/dev/null)" = "$repo" ] && exit 0; '
    'echo "$wd is a clone of another repository" >&2; exit 4; fi; '
    'if [ -n "$(ls -A -- "$wd" 2>/dev/null)" ]; then '
    'echo "$wd is not empty and not a clone of $repo" >&2; exit 4; fi; '
    'if [ -n "$branch" ]; then exec git clone -q --branch "$branch" -- "$repo" "$wd"; fi; '
    'exec git clone -q -- "$repo" "$wd"'
)

#: Files grep reads at once over the SFTP session.
_GREP_READS_AT_ONCE = 16

#: How long the host may take to start a command before hutch gives up.
_START_TIMEOUT = 60.0


class SshSandbox(NativeBackend, FilesRuntime):
    provider = "ssh"
    #: Its runtime is found again from its description by any daemon that
    #: reaches the same host (a fleet's takes it over when its daemon dies).
    reachable_from_any_host = True
    # ``host_outlives_sandbox``: no lifecycle on the host; close leaves the
    # host and its files as they are. ``preview_url`` only for a sandbox
    # with preview_url_base (see sandbox_capabilities).
    capabilities = Capabilities(
        processes=True, users=True, preview_url=False, runs_on_host=True,
        extra=frozenset({"host_outlives_sandbox"}),
    )
    config_model = SshConfig

    def __init__(
        self, sandbox_id: str, config: SshConfig, kept: KeptConnection, has_bash: bool
    ) -> None:
        super().__init__(sandbox_id, config.working_directory)
        self.config = config
        self._kept = kept
        self.files = SftpFiles(kept)
        self._has_bash = has_bash
        self._closed = False

    def sandbox_capabilities(self) -> Capabilities:
        return dataclasses.replace(
            super().sandbox_capabilities(), preview_url=bool(self.config.preview_url_base)
        )

    @property
    def destination(self) -> str:
        return self.config.destination

    # -- provisioning ------------------------------------------------------------
    @classmethod
    async def create(cls, config: SshConfig, sandbox_id: str) -> SshSandbox:
        kept = acquire(SshTarget.from_config(config))
        try:
            has_bash = await _prepare(kept, config)
        except BaseException:
            await release(kept)
            raise
        return cls(sandbox_id, config, kept, has_bash)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "config": self.config.model_dump(),
            "has_bash": self._has_bash,
        }

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> SshSandbox:
        config = SshConfig.model_validate(description["config"])
        kept = acquire(SshTarget.from_config(config))
        return cls(sandbox_id, config, kept, bool(description.get("has_bash", True)))

    async def is_alive(self) -> bool:
        # The host itself is not hutch's: the sandbox lives while its working
        # directory is there. An unreachable host raises SandboxUnavailable
        # (cannot tell), which is not the same as gone.
        try:
            await self.files.stat(self.workdir)
        except FileNotFoundError:
            return False
        return True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await release(self._kept)

    # -- processes ----------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        return ["bash" if self._has_bash else "sh", "-c", command]

    async def start_process(self, request: ProcessRequest) -> SshProcess:
        return await self._start(request)

    async def start_pty(self, request: ProcessRequest, rows: int, cols: int) -> SshPtyProcess:
        process = await self._start(request, term_size=(cols, rows))
        assert isinstance(process, SshPtyProcess)
        return process

    async def _start(
        self, request: ProcessRequest, term_size: tuple[int, int] | None = None
    ) -> SshProcess:
        argv, cwd, user = request.argv, request.cwd, request.user
        exec_id = uuid.uuid4().hex
        command = command_line(
            argv, cwd=cwd, env={**self.config.env, **request.env}, user=user,
            exec_id=exec_id, sandbox_id=self.sandbox_id,
        )
        conn, process = await open_process(self._kept, command, term_size=term_size)
        try:
            with closed_on_failure(self._kept, conn, process):
                async with asyncio.timeout(_START_TIMEOUT):
                    head = await process.stdout.read(1)
                    if head == FAILED:
                        reason = (await process.stdout.readline()).strip().decode()
                        raise start_error(reason, argv, cwd, user, self.destination)
                    if head != STARTED:
                        # The wrapper never ran (no sh on the host?) or the link dropped.
                        err = await process.stderr.read(4096)
                        await process.wait_closed()
                        if process.returncode is None:
                            self._kept.forget(conn)
                            raise lost(self._kept.target)
                        raise ProviderError(
                            f"ssh {self.destination}: the command did not start: "
                            f"{err.decode('utf-8', 'replace').strip()}"
                        )
        except TimeoutError:
            raise SandboxUnavailable(
                f"ssh {self.destination}: the host did not start the command within "
                f"{_START_TIMEOUT} s"
            ) from None
        if term_size is not None:
            return SshPtyProcess(self._kept, conn, process, exec_id, None, interactive=True)
        return SshProcess(self._kept, conn, process, exec_id, request.stdin,
                          keep_stdin=request.keep_stdin)

    async def count_busy_processes(self) -> int:
        # A failure propagates: the lifecycle engine takes "cannot tell" as busy.
        _code, out, _err = await run_helper(
            self._kept,
            ["sh", "-c", COUNT_SCRIPT, "hutch-count", f"{SANDBOX_MARKER}={self.sandbox_id}"],
            timeout=30,
        )
        return int(out.strip() or b"0")

    # -- files: SFTP (FilesRuntime forwards to self.files) ----------------------------
    async def grep_files(
        self, pattern: re.Pattern[str], paths: list[str], limit: int
    ) -> list[GrepMatch]:
        """The base rule, with the files read a few at a time over the one SFTP
        session (a round trip each, overlapped) instead of one after another."""

        async def read(path: str) -> bytes | None:
            try:
                return await self.files.read_file(path, limit)
            except (IsADirectoryError, PermissionError, FileNotFoundError, InvalidArgument):
                return None

        batches = GrepBatches(pattern)
        for start in range(0, len(paths), _GREP_READS_AT_ONCE):
            chunk = paths[start:start + _GREP_READS_AT_ONCE]
            contents = await asyncio.gather(*(read(p) for p in chunk))
            for path, data in zip(chunk, contents, strict=True):
                if data is not None:
                    await batches.add(path, data)
        return await batches.matches()

    async def preview_url(self, port: int) -> str:
        base = self.config.preview_url_base
        if not base:
            raise CapabilityUnsupported(
                f"provider 'ssh' does not support 'preview_url' for {self.destination} "
                "without preview_url_base (where the host's ports are reachable)"
            )
        return f"{base.rstrip('/')}:{port}"


async def _prepare(kept: KeptConnection, config: SshConfig) -> bool:
    """Check the host answers, make the working directory (or clone into it);
    whether the host has bash."""
    dest = config.destination
    wd = config.working_directory
    code, out, err = await run_helper(
        kept, ["sh", "-c", _PREPARE_SCRIPT, "hutch-prepare", wd], timeout=config.connect_timeout * 4
    )
    if code != 0:
        raise SandboxFileNotFound(
            f"working directory {wd} does not exist on {dest} and cannot be made: "
            f"{err.decode('utf-8', 'replace').strip()}"
        )
    if config.clone:
        assert config.repository is not None
        code, _out, err = await run_helper(
            kept,
            ["sh", "-c", _CLONE_SCRIPT, "hutch-clone", wd, config.repository, config.branch or ""],
            timeout=1800,
        )
        if code != 0:
            message = err.decode("utf-8", "replace").strip()
            if code == 4:
                raise InvalidArgument(f"ssh {dest}: cannot clone into {wd}: {message}")
            raise ProviderError(
                f"ssh {dest}: git clone of {config.repository} "
                f"{'branch ' + config.branch + ' ' if config.branch else ''}failed: {message}"
            )
    return out.strip() == b"bash"
