"""The ``hutch`` sandbox environment of inspect_ai: one hutch sandbox per
sample, made in the eval's process (hutch's Python API, the default: no
daemon needed) or through a daemon (``daemon = true`` or a ``url``).

inspect's contract, as hutch keeps it: ``exec`` answers an ``ExecResult``
(a non-zero exit is a result), raises ``TimeoutError`` when its timeout
passes (hutch kills the command's whole process tree), ``PermissionError``
for a command that cannot be executed, ``SandboxUserUnsupportedError`` where
the provider runs no other users, ``OutputLimitExceededError`` past inspect's
output limit, and ``SandboxUnavailableError`` when the sandbox is gone;
``read_file`` and ``write_file`` raise ``FileNotFoundError``,
``PermissionError``, ``IsADirectoryError`` (hutch's typed errors are those
built-ins), ``UnicodeDecodeError`` for text that is not UTF-8, and
``OutputLimitExceededError`` past inspect's read limit. ``write_file``
replaces a file whether or not it was read (inspect's tools are not a
session that reads first: the guardrail is for agents' own sessions).
"""

from __future__ import annotations

import logging
import shlex
from typing import Any, Literal, Protocol, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel

from .._errors import CapabilityUnsupported, HutchError, OutputLimitExceeded, SandboxUnavailable
from .._refwire import decode_ref
from . import as_user
from .config import HutchSandboxConfig, config_of

log = logging.getLogger("hutch.inspect")


class HutchSandbox(Protocol):
    """What this environment uses of a sandbox: an in-process ``hutch.Sandbox``
    and a client's ``AsyncRemoteSandbox`` both are one."""

    id: str

    async def exec(self, cmd: list[str], *, cwd: str | None = ..., env: Any = ...,
                   stdin: bytes | str | None = ..., user: str | None = ...,
                   timeout: float | None = ..., output_limit: int | None = ...) -> Any: ...

    async def read_bytes(self, path: str, *, limit: int = ...) -> bytes: ...

    async def write_bytes(self, path: str, data: bytes, *, overwrite: bool = ...) -> None: ...

    async def ref(self, *, expires_in: float | None = ...) -> str: ...

    async def close(self) -> None: ...


class Holding:
    """One sample's sandbox and what ends it: a close, a definition's
    ``complete``, a client to close."""

    def __init__(self, sandbox: HutchSandbox, config: HutchSandboxConfig, *,
                 client: Any = None, definitions: Any = None, definition: Any = None,
                 thread: str | None = None) -> None:
        self.sandbox = sandbox
        self.config = config
        self.client = client
        #: In-process: the definitions and the definition (which the config
        #: file may hold without the store knowing it); through a daemon, its id.
        self.definitions = definitions
        self.definition = definition if definition is not None else config.definition
        self.thread = thread

    async def end(self) -> None:
        try:
            if self.definition is not None and self.thread is not None:
                owner = self.client if self.client is not None else self.definitions
                await owner.complete(self.definition, self.thread)
            else:
                await self.sandbox.close()
        finally:
            if self.client is not None:
                await self.client.aclose()


def _thread_of(task_name: str) -> str:
    from inspect_ai.log._samples import sample_active

    active = sample_active()
    if active is None:
        return f"{task_name}/-"
    return f"{task_name}/{active.sample.id}/{active.epoch}"


async def _open(task_name: str, config: HutchSandboxConfig) -> Holding:
    """A sample's sandbox, as the configuration says."""
    file_data = config.file_data()
    if config.through_daemon:
        from ..client import AsyncClient

        client = AsyncClient(config.url, token=config.token)
        try:
            if config.definition is not None:
                thread = _thread_of(task_name)
                ensured = await client.ensure(config.definition, thread)
                return Holding(ensured.sandbox, config, client=client, thread=thread)
            layer = {**(file_data.get("sandbox") or {}),
                     "providers": file_data.get("providers") or {}, **config.flags()}
            provider = layer.pop("provider", None)
            sandbox = await client.create_sandbox(provider, **layer)
            return Holding(sandbox, config, client=client)
        except BaseException:
            await client.aclose()
            raise
    if config.definition is not None:
        from ..definitions import open_definitions
        from ..definitions.model import definitions_from_config

        definitions = open_definitions()
        known = definitions_from_config(file_data)
        definition = known.get(config.definition)
        if definition is None:
            definition = definitions.get(config.definition)
        thread = _thread_of(task_name)
        here = await definitions.ensure(definition, thread)
        return Holding(here.sandbox, config, definitions=definitions, definition=definition,
                       thread=thread)
    from .._api import create_sandbox

    return Holding(await create_sandbox(spec=_spec(config)), config)


def _spec(config: HutchSandboxConfig) -> Any:
    """An in-process sandbox's spec: the fields over the config file; where
    neither names a provider, an isolating one (as a daemon picks it), never
    ``local``: an eval runs code no one has read."""
    from ..config import load_config_file, resolve_spec
    from ..providers.registry import pick_default_provider

    file_layer = load_config_file(config.config_file) if config.config_file else None
    return resolve_spec(flags=config.flags(), config_file=file_layer,
                        default_provider=pick_default_provider())


@sandboxenv(name="hutch")
class HutchSandboxEnvironment(SandboxEnvironment):
    """A hutch sandbox as an inspect_ai sandbox environment."""

    #: What each task's samples still hold (ended by ``sample_cleanup``, or
    #: by ``task_cleanup`` for a sample that never got there).
    _held: dict[str, set[HutchSandboxEnvironment]] = {}

    def __init__(self, task_name: str, holding: Holding) -> None:
        super().__init__()
        self.task_name = task_name
        self.holding = holding

    @property
    def sandbox(self) -> HutchSandbox:
        return self.holding.sandbox

    @property
    def user(self) -> str | None:
        """The configured default user (None: the sandbox's own)."""
        return self.holding.config.user

    # -- the lifecycle inspect drives -------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        return ["hutch.toml"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return HutchSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """A bad configuration fails the task before its first sample."""
        resolved = config_of(config)
        if not resolved.through_daemon and resolved.definition is None:
            _spec(resolved)

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        resolved = config_of(config)
        holding = await _open(task_name, resolved)
        if resolved.user is not None:
            try:
                await as_user.init_workdir(holding.sandbox, resolved.user)
            except BaseException:
                await holding.end()
                raise
        environment = cls(task_name, holding)
        cls._held.setdefault(task_name, set()).add(environment)
        return {"default": environment}

    @classmethod
    async def sample_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment], interrupted: bool,
    ) -> None:
        for environment in environments.values():
            if isinstance(environment, HutchSandboxEnvironment):
                await environment._end()

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        left = cls._held.pop(task_name, set())
        if not cleanup:
            for environment in left:
                log.warning("hutch sandbox %s left running (--no-sandbox-cleanup)",
                            environment.sandbox.id)
            return
        for environment in left:
            await environment._end()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup hutch [ID]``: end what this process still
        holds, and the sandbox ``ID`` through the daemon (``HUTCH_URL``)."""
        for task_name in list(cls._held):
            await cls.task_cleanup(task_name, None, True)
        if id is not None:
            from ..client import AsyncClient

            async with AsyncClient() as client:
                await client.delete_sandbox(id)

    async def _end(self) -> None:
        held = self._held.get(self.task_name)
        if held is not None:
            held.discard(self)
        await self.holding.end()

    # -- the operations ---------------------------------------------------------------
    async def exec(
        self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
        env: dict[str, str] | None = None, user: str | None = None,
        timeout: int | None = None, timeout_retry: bool = True, concurrency: bool = True,
    ) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            # Both streams under one cap of twice inspect's per-stream limit.
            result = await self.sandbox.exec(
                list(cmd), cwd=cwd, env=env, stdin=input,
                user=user if user is not None else self.user,
                timeout=timeout, output_limit=2 * limit)
        except CapabilityUnsupported as exc:
            if user is not None or self.user is not None:
                raise SandboxUserUnsupportedError(str(exc)) from exc
            raise
        except OutputLimitExceeded as exc:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, None) from exc
        except SandboxUnavailable as exc:
            raise SandboxUnavailableError(str(exc)) from exc
        return ExecResult(success=result.exit_code == 0, returncode=result.exit_code,
                          stdout=result.stdout, stderr=result.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        try:
            if self.user is not None:
                await as_user.write_file(self.sandbox, file, data, self.user)
            else:
                await self.sandbox.write_bytes(file, data, overwrite=True)
        except SandboxUnavailable as exc:
            raise SandboxUnavailableError(str(exc)) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        try:
            if self.user is not None:
                data = await as_user.read_file(self.sandbox, file, self.user, limit)
            else:
                data = await self.sandbox.read_bytes(file, limit=limit)
        except OutputLimitExceeded as exc:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None) from exc
        except SandboxUnavailable as exc:
            raise SandboxUnavailableError(str(exc)) from exc
        return bytes(data).decode("utf-8") if text else bytes(data)

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """``hutch shell`` on this sandbox: through the daemon that holds it,
        or, for one held in this process, through a ref to it (its own
        credential, for this sandbox alone, served while the eval runs)."""
        if user is not None:
            raise NotImplementedError("hutch shell opens the sandbox's default user's shell")
        config = self.holding.config
        if config.through_daemon:
            url = self.holding.client.url
            env = [f"HUTCH_URL={url}"]
        else:
            try:
                ref = await self.sandbox.ref()
            except HutchError as exc:
                raise ConnectionError(f"sandbox {self.sandbox.id}: {exc}") from exc
            where = decode_ref(ref)
            if where is None:  # a ref always decodes; kept for the type checker
                raise ConnectionError(f"sandbox {self.sandbox.id} gave no ref")
            env = [f"HUTCH_URL={where.url}", f"HUTCH_TOKEN={ref}"]
        command = " ".join([*map(shlex.quote, env), "hutch", "shell",
                            shlex.quote(self.sandbox.id)])
        return SandboxConnection(type="hutch", command=command)

    def default_polling_interval(self) -> float:
        return 0.2
