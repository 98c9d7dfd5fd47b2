"""hutch's agent as the pod's keeper, reached through one kept ``pods/exec``.

No registry is needed: the pod's container starts as a small shell that
waits for the agent's executable, hutch copies it in over exec (its bytes as
the stdin of a ``cat``), and the shell becomes the agent (pid 1: it reaps
orphans, as it does in a docker sandbox). Its socket is in a directory only
the container's user can enter; nothing outside the pod reaches it but
through exec, and that is the relay's (:mod:`.tunnel`): exec, files, grep,
glob and processes all go over the relay's one connection.

When the relay's exec drops, the next request finds the tunnel down and the
runtime asks :meth:`PodAgent.recover`: a pod still running gets a new relay
(what ran in it keeps running: only connections were lost); a pod gone is
the sandbox lost.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import anyio.to_thread

from ..._errors import ProviderError
from ..agent import AgentFailure, AgentRuntime, agent_binary
from ..agent.build import MACHINE_ARCH
from .execruntime import PodExecRuntime
from .execws import ExecSession
from .tunnel import AgentTunnel

HUTCH_DIR = "/.hutch"
AGENT_PATH = f"{HUTCH_DIR}/bin/hutch-agent"
AGENT_SOCKET = f"{HUTCH_DIR}/run/agent.sock"
#: How long a pod's agent has to answer once its executable is in.
AGENT_START_TIMEOUT = 30.0
#: How long the install's exec has to say the pod's machine (one word from
#: ``uname -m``): past it the exec is stuck, and the install fails saying so
#: rather than wait for ever.
MACHINE_ANSWER_TIMEOUT = 60.0
#: The container's command: wait for the agent, then become it. The socket's
#: directory is the container user's alone (mode 0700): commands run as
#: another user cannot reach the agent.
_KEEPER = f"""
mkdir -p {HUTCH_DIR}/bin {HUTCH_DIR}/run && chmod 700 {HUTCH_DIR}/run
trap 'exit 0' TERM
while [ ! -x {AGENT_PATH} ]; do sleep 0.05; done
exec {AGENT_PATH} serve-shared {AGENT_SOCKET}
"""
#: Says the pod's machine (its node's: the agent is built for it), reads
#: the executable's size on a line, then that many bytes into the agent's
#: path, whole or not at all. Sized rather than read to the end of stdin:
#: the v4 channel protocol cannot close a command's stdin. A ``uname`` that
#: fails ends it (with its status), rather than leave it waiting for a size
#: that never comes.
_INSTALL = f"""
uname -m || exit
read -r size || exit 1
mkdir -p {HUTCH_DIR}/bin && head -c "$size" > {AGENT_PATH}.part \
  && [ "$(wc -c < {AGENT_PATH}.part)" -eq "$size" ] \
  && chmod 755 {AGENT_PATH}.part && mv -f {AGENT_PATH}.part {AGENT_PATH}
"""


def keeper_command() -> list[str]:
    return ["sh", "-c", _KEEPER]


async def _outcome(session: ExecSession, stderr: bytes | bytearray) -> str:
    """How an ended exec ended, for a person: its exit status and stderr, or
    the API's own word when the command did not run or the stream broke."""
    try:
        said = f"exit status {await session.wait()}"
    except ProviderError as exc:
        said = str(exc)
    text = bytes(stderr).decode("utf-8", "replace").strip()
    return f"{said}; stderr: {text[:500]}" if text else f"{said}; no stderr"


class PodAgent:
    """The agent in one pod: its runtime, and the relay the runtime goes through.

    ``running`` raises the error that makes the sandbox lost when the pod no
    longer runs (SandboxUnavailable, naming its phase), else returns."""

    def __init__(self, sandbox_id: str, workdir: str, pod_exec: PodExecRuntime,
                 running: Callable[[str], Awaitable[None]]) -> None:
        self._pod_exec = pod_exec
        self._running = running
        self._tunnel: AgentTunnel | None = None
        self._recovering = asyncio.Lock()
        self.runtime = AgentRuntime(
            sandbox_id, workdir, AGENT_SOCKET, provider_name="kubernetes",
            recover=self.recover, connect=self._connect)
        # The agent's descriptors are the pod's: the bytes travel in frames.
        self.runtime.hands_over_fds = False

    def _connect(self) -> socket.socket:
        if self._tunnel is None:
            raise AgentFailure("no relay to the pod's agent is open yet")
        return self._tunnel.connect()

    async def start(self, timeout: float = AGENT_START_TIMEOUT) -> None:
        """Into a new pod (its keeper waiting): the executable copied in, the
        relay opened, and the agent answering."""
        await self._install()
        await self._reopen(timeout)

    async def _install(self) -> None:
        """The agent built for the pod's machine, copied in over one exec:
        it says ``uname -m``, then takes the executable on its stdin."""
        session = await self._pod_exec.open_exec(["sh", "-c", _INSTALL], keep_stdin=True)
        out, err = bytearray(), bytearray()
        try:
            try:
                async with asyncio.timeout(MACHINE_ANSWER_TIMEOUT):
                    while b"\n" not in out and (chunk := await session.read()) is not None:
                        (out if chunk.stream == "stdout" else err).extend(chunk.data)
            except TimeoutError:
                said = bytes(err).decode("utf-8", "replace").strip()[:500] or "no stderr"
                raise ProviderError(
                    "copying hutch's agent into the pod failed: its exec said no machine in "
                    f"{MACHINE_ANSWER_TIMEOUT:g} s (`uname -m`; {said})") from None
            if b"\n" not in out:  # the exec ended before its first line: say how
                raise ProviderError(
                    "copying hutch's agent into the pod failed: its exec ended before "
                    f"`uname -m` said the machine ({await _outcome(session, err)})")
            machine = bytes(out).partition(b"\n")[0].decode("ascii", "replace").strip()
            arch = MACHINE_ARCH.get(machine)
            if arch is None:
                raise ProviderError(
                    f"the pod's machine is {machine!r}: hutch's agent is not built "
                    "for it (runtime='native' needs no agent)")
            binary = await anyio.to_thread.run_sync(
                lambda: agent_binary(arch=arch).read_bytes())
            await session.write_stdin(b"%d\n" % len(binary) + binary)
            await session.close_stdin()
            while (chunk := await session.read()) is not None:
                if chunk.stream == "stderr":
                    err.extend(chunk.data)
            code = await session.wait()
        finally:
            await session.close()
        if code != 0:
            raise ProviderError(
                "copying hutch's agent into the pod failed (its image needs sh, uname, head, "
                f"wc, chmod and mv and a writable {HUTCH_DIR}; runtime='native' needs none): "
                f"{err.decode('utf-8', 'replace')[:500]}")

    async def _reopen(self, timeout: float) -> None:
        await self.close()
        self._tunnel = await self._open_tunnel()
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.runtime.ping(timeout=min(2.0, max(0.2, deadline - time.monotonic())))
                return
            except AgentFailure as exc:
                if time.monotonic() >= deadline:
                    raise ProviderError(f"the pod's agent did not answer: {exc}") from None
                await self._running(str(exc))
                if not self._tunnel.up:  # the relay itself ended: a new one
                    await self._tunnel.close()
                    self._tunnel = await self._open_tunnel()
                await asyncio.sleep(0.05)

    async def _open_tunnel(self) -> AgentTunnel:
        return await AgentTunnel.open(
            lambda: self._pod_exec.open_exec([AGENT_PATH, "relay", AGENT_SOCKET],
                                             keep_stdin=True),
            on_down=self.runtime.drop_connections)

    @property
    def connected(self) -> bool:
        """Whether the relay to the agent is open (it opens again on the next request)."""
        return self._tunnel is not None and self._tunnel.up

    async def recover(self, reason: str) -> bool:
        """The runtime's word that a request failed (``reason``). The agent
        answering a ping: it was the request's failure (False). Else the pod
        still running gets a new relay (False: the agent was not restarted,
        what runs in it runs on); a pod gone raises."""
        async with self._recovering:
            if self._tunnel is not None and self._tunnel.up:
                try:
                    await self.runtime.ping(timeout=2.0)
                    return False
                except AgentFailure:
                    pass
            await self._running(reason)
            await self._reopen(AGENT_START_TIMEOUT / 3)
            return False

    async def close(self) -> None:
        """The relay's exec ended (the agent runs on in the pod)."""
        self.runtime.drop_connections()
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
            await tunnel.close()
