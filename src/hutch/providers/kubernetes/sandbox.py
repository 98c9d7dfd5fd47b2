"""``kubernetes``: one Pod per sandbox, its commands through ``pods/exec``.

Processes run and files move through exec; the pod's life (its claim,
suspend to nothing, the watch for pods lost outside hutch) is
:mod:`.lifecycle`'s.
"""

from __future__ import annotations

import uuid

from ..._errors import (
    SandboxFileNotFound,
    SandboxPermissionDenied,
)
from ..._types import Capabilities
from ..base import (
    BackendProcess,
    ProcessRequest,
    UnstartedProcess,
)
from .execws import ExecSession, kill_argv, wrapped
from .lifecycle import PodLifecycle


class KubernetesSandbox(PodLifecycle):
    """One pod (and its claim) per sandbox: its life in :mod:`.lifecycle`,
    its commands here."""

    capabilities = Capabilities(processes=True, users=True, suspend=True)

    # -- processes ------------------------------------------------------------------------
    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        exec_id = uuid.uuid4().hex

        async def kill(signal: str) -> None:
            await self.run(kill_argv(exec_id, signal))

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
        session = await ExecSession.open(
            self.cluster.http, self.cluster.pod_path(self.pod), argv,
            stdin=stdin if stdin is not None else None, keep_stdin=False,
            kill=None)
        out: list[bytes] = []
        err: list[bytes] = []
        while (chunk := await session.read()) is not None:
            (out if chunk.stream == "stdout" else err).append(chunk.data)
        return await session.wait(), b"".join(out), b"".join(err)
