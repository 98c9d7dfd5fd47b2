"""The runtime without hutch's agent: a ``pods/exec`` per command, and files
through commands (``find``, ``cat``, ...): for images the agent cannot be
copied into, or ``runtime = "native"``."""

from __future__ import annotations

import uuid

from ..._errors import SandboxFileNotFound, SandboxPermissionDenied
from ..base import BackendProcess, ProcessRequest, SandboxRuntime, UnstartedProcess
from .api import Cluster
from .execws import ExecSession, kill_argv, wrapped
from .files import CommandFiles


class PodExecRuntime(CommandFiles, SandboxRuntime):
    runtime_name = "native"

    def __init__(self, sandbox_id: str, workdir: str, cluster: Cluster, pod: str) -> None:
        super().__init__(sandbox_id, workdir)
        self.cluster = cluster
        #: The pod's name (the same across its recreations).
        self.pod = pod

    async def open_exec(self, argv: list[str], *, keep_stdin: bool = False,
                        stdin: bytes | None = None) -> ExecSession:
        """One ``pods/exec`` of ``argv``, as it is (no prologue)."""
        return await ExecSession.open(
            self.cluster.http, self.cluster.pod_path(self.pod), argv, stdin=stdin,
            keep_stdin=keep_stdin, kill=None)

    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        exec_id = uuid.uuid4().hex

        async def kill(grace: float) -> int:
            """The kill script's exit status (see execws._KILL_MARKED)."""
            status, _, _ = await self.run(kill_argv(exec_id, grace))
            return status

        session = await ExecSession.open(
            self.cluster.http, self.cluster.pod_path(self.pod),
            wrapped(request, exec_id, {}), stdin=request.stdin,
            keep_stdin=request.keep_stdin, kill=kill, marked=True)
        said = await session.started
        if said in ("ok", ""):
            return session
        await session.wait()
        command = request.argv[0] if request.argv else ""
        if said == "nouser":
            return UnstartedProcess(f"no such user {request.user!r}")
        if said == "nocwd":
            raise SandboxFileNotFound(f"working directory {request.cwd} does not exist")
        if said == "notfound":
            raise SandboxFileNotFound(f"{command}: command not found")
        raise SandboxPermissionDenied(f"{command}: not executable")

    async def run(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        session = await self.open_exec(argv, stdin=stdin)
        out: list[bytes] = []
        err: list[bytes] = []
        while (chunk := await session.read()) is not None:
            (out if chunk.stream == "stdout" else err).append(chunk.data)
        return await session.wait(), b"".join(out), b"".join(err)
