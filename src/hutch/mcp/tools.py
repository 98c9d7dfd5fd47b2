"""The MCP tools: one hutch sandbox, as a coding assistant works in it.

Every tool speaks to the daemon through hutch's HTTP client (``AsyncClient``);
nothing here runs a provider. The tools act on the *current* sandbox: the one
``sandbox_create`` made or ``sandbox_use`` picked (or, when neither was
called, one made on first use with the server's defaults); each also takes
a ``sandbox`` id to act on another.

The read-before-write guardrail is the daemon's (``hutch._guardrail``, per
client session): this server's client is one session, so a write that
would replace a file the assistant has not read here is refused by the
daemon, and the refusal comes back as a tool error that says to read first.
``edit_file`` reads the file itself, so it is never refused.

A failure is a tool error (``isError``) whose text names the error's code
and what it is about; nothing a caller sends can crash the server.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ParamSpec, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from .._errors import (
    ExecTimeout,
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
)
from .._types import MAX_DURATION, MAX_OUTPUT_LIMIT, ExitStatus, FileInfo, OutputChunk
from ..client import AsyncClient, AsyncRemoteSandbox
from .output import DEFAULT_OUTPUT_CAP, CappedStream, cap_text

log = logging.getLogger("hutch.mcp")

P = ParamSpec("P")
R = TypeVar("R")

#: A command's timeout when the call gives none (seconds).
DEFAULT_EXEC_TIMEOUT = 120.0
#: The most a file read answers (characters) before it is cut with a note.
DEFAULT_READ_CAP = 200_000
#: The most bytes of one file ``read_file`` fetches.
READ_LIMIT = 16 * 1024 * 1024

SandboxId = Annotated[str | None, Field(
    default=None,
    description="The id of the sandbox to act on (as sandbox_create or sandbox_list gave it). "
                "Leave it out to use the current sandbox.")]
FilePath = Annotated[str, Field(
    min_length=1,
    description="A file's path inside the sandbox: relative to its working directory, "
                "or absolute.")]


@dataclass
class ServerDefaults:
    """What ``hutch mcp`` was started with."""

    #: The provider and settings of a sandbox made without any given.
    provider: str | None = None
    image: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: The sandbox to start on (``--sandbox``), else one is made on first use.
    sandbox: str | None = None
    #: Keep the sandboxes this server made when it stops (else they are killed).
    keep: bool = False
    #: The daemon's read-before-write guardrail, on unless turned off.
    read_before_write: bool = True
    output_cap: int = DEFAULT_OUTPUT_CAP
    read_cap: int = DEFAULT_READ_CAP


def tool_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """hutch's typed errors as tool errors: ``code: message``."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except HutchError as exc:
            raise ToolError(f"{exc.code}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ToolError(f"invalid_argument: {exc}") from None

    return wrapper


def _describe(info: dict[str, Any]) -> str:
    caps = info.get("capabilities") or {}
    can = ", ".join(k for k in ("pause", "suspend", "snapshot", "fork") if caps.get(k)) or "none"
    return (f"sandbox {info['id']}: provider {info.get('provider')}, state {info.get('state')}, "
            f"working directory {info.get('workdir')} (lifecycle: {can})")


def _entry(entry: FileInfo) -> str:
    kind = entry.type.value
    name = entry.path.rstrip("/").rsplit("/", 1)[-1] + ("/" if kind == "directory" else "")
    return f"{kind:<9} {entry.size:>12}  {name}"


class HutchTools:
    """The tools of one server: its client, its current sandbox, and the
    sandboxes it made (killed when it stops, unless kept)."""

    def __init__(self, client: AsyncClient, defaults: ServerDefaults) -> None:
        self.client = client
        self.defaults = defaults
        self.current: str | None = defaults.sandbox
        self.made: list[str] = []
        self._handles: dict[str, AsyncRemoteSandbox] = {}

    # -- which sandbox ---------------------------------------------------------------
    async def _sandbox(self, sandbox_id: str | None) -> AsyncRemoteSandbox:
        wanted = sandbox_id or self.current
        if wanted is None:
            made = await self._create(None, None, None)
            self.current = made.id
            return made
        handle = self._handles.get(wanted)
        if handle is None:
            handle = await self.client.get_sandbox(wanted)
            self._handles[wanted] = handle
        return handle

    async def _create(
        self, provider: str | None, image: str | None, settings: dict[str, Any] | None
    ) -> AsyncRemoteSandbox:
        body = dict(self.defaults.settings)
        body.update(settings or {})
        if image is None and provider in (None, self.defaults.provider):
            image = self.defaults.image
        if image is not None:
            body["image"] = image
        if not self.defaults.read_before_write:
            body.setdefault("read_before_write", False)
        made: AsyncRemoteSandbox = await self.client.create_sandbox(
            provider or self.defaults.provider, **body)
        self.made.append(made.id)
        self._handles[made.id] = made
        return made

    async def close(self) -> None:
        """Kill what this server made, unless told to keep it."""
        if not self.defaults.keep:
            for sandbox_id in self.made:
                try:
                    await self.client.delete_sandbox(sandbox_id)
                except HutchError as exc:
                    if exc.code not in ("not_found", "sandbox_unavailable"):
                        log.warning("could not kill sandbox %s: %s", sandbox_id, exc)
        self.made.clear()

    # -- the tools -------------------------------------------------------------------
    @tool_errors
    async def sandbox_create(
        self,
        provider: Annotated[str | None, Field(
            default=None,
            description="Which provider runs it: 'docker', 'bubblewrap', 'local', ... "
                        "Leave it out for the server's default.")] = None,
        image: Annotated[str | None, Field(
            default=None,
            description="The image it starts from (docker, bubblewrap), e.g. "
                        "'python:3.12'. Leave it out for the server's default.")] = None,
        settings: Annotated[dict[str, Any] | None, Field(
            default=None,
            description="More settings, as hutch's configuration names them: provider settings "
                        "(memory, cpus, pids, network) and sandbox options (idle_timeout, "
                        "max_lifetime, idle_suspend_after), e.g. {\"idle_timeout\": 600}.")]
        = None,
    ) -> str:
        made = await self._create(provider, image, settings)
        self.current = made.id
        return "made and now current: " + _describe(await made.info())

    @tool_errors
    async def sandbox_use(
        self,
        sandbox: Annotated[str, Field(
            min_length=1, description="The id of an existing sandbox (see sandbox_list).")],
    ) -> str:
        handle = await self.client.get_sandbox(sandbox)
        self._handles[handle.id] = handle
        self.current = handle.id
        return "now current: " + _describe(await handle.info())

    @tool_errors
    async def sandbox_list(self) -> str:
        sandboxes = await self.client.list_sandboxes()
        if not sandboxes:
            return "no live sandboxes; sandbox_create makes one"
        return "\n".join(
            ("* " if s["id"] == self.current else "  ") + _describe(s) for s in sandboxes
        ) + "\n(* marks the current sandbox)"

    @tool_errors
    async def exec(
        self,
        command: Annotated[str, Field(
            min_length=1,
            description="A shell command, run by bash -c (sh -c where there is no bash) in "
                        "the sandbox, e.g. 'pytest -q tests/' or 'ls -la && cat setup.py'.")],
        cwd: Annotated[str | None, Field(
            default=None,
            description="The directory to run it in, relative to the sandbox's working "
                        "directory or absolute. Default: the working directory.")] = None,
        timeout: Annotated[float, Field(
            gt=0, le=MAX_DURATION,
            description="Seconds before the command (its whole process tree) is killed and "
                        "the call fails with what it printed so far.")] = DEFAULT_EXEC_TIMEOUT,
        stdin: Annotated[str | None, Field(
            default=None, description="Text given to the command's standard input.")] = None,
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        out, err = CappedStream(self.defaults.output_cap), CappedStream(self.defaults.output_cap)
        exit_line = ""
        try:
            events = sb.exec_stream(command, cwd=cwd, stdin=stdin, timeout=timeout,
                                    output_limit=MAX_OUTPUT_LIMIT)
            async for event in events:
                if isinstance(event, OutputChunk):
                    (err if event.stream == "stderr" else out).add(event.data)
                elif isinstance(event, ExitStatus):
                    exit_line = f"exit code: {event.exit_code}" + (
                        " (killed: out of memory)" if event.oom_killed else "")
        except ExecTimeout as exc:
            raise ToolError(f"exec_timeout: {exc}\n" + _streams(out, err)) from None
        except OutputLimitExceeded as exc:
            raise ToolError(f"output_limit_exceeded: {exc}\n" + _streams(out, err)) from None
        return exit_line + "\n" + _streams(out, err)

    @tool_errors
    async def read_file(
        self,
        path: FilePath,
        offset: Annotated[int, Field(
            ge=1, description="The first line to return (1 is the first line).")] = 1,
        limit: Annotated[int | None, Field(
            default=None, ge=1,
            description="How many lines to return from offset. Default: to the end.")] = None,
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        data = await sb.read_bytes(path, limit=READ_LIMIT)
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(
                f"invalid_argument: {path} is not UTF-8 text ({len(data)} bytes); look at it "
                f"with exec, e.g. 'xxd {path} | head'") from None
        if offset > 1 or limit is not None:
            lines = text.splitlines(keepends=True)
            if offset > len(lines) and lines:
                raise ToolError(
                    f"invalid_argument: {path} has {len(lines)} lines; offset {offset} is past "
                    "its end")
            text = "".join(lines[offset - 1: None if limit is None else offset - 1 + limit])
        return cap_text(text, self.defaults.read_cap, f"{path}")

    @tool_errors
    async def write_file(
        self,
        path: FilePath,
        content: Annotated[str, Field(description="The file's whole new text.")],
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        await sb.write_text(path, content, overwrite=not self.defaults.read_before_write)
        return f"wrote {len(content.encode())} bytes to {path}"

    @tool_errors
    async def edit_file(
        self,
        path: FilePath,
        old_string: Annotated[str, Field(
            min_length=1,
            description="The exact text to replace, as it is in the file (whitespace and "
                        "indentation included). It must occur exactly once unless "
                        "replace_all is true: give enough surrounding lines to make it unique.")],
        new_string: Annotated[str, Field(description="The text to put in its place.")],
        replace_all: Annotated[bool, Field(
            description="Replace every occurrence instead of requiring exactly one.")] = False,
        sandbox: SandboxId = None,
    ) -> str:
        if old_string == new_string:
            raise ToolError("invalid_argument: old_string and new_string are the same")
        sb = await self._sandbox(sandbox)
        text = await sb.read_text(path, limit=READ_LIMIT)
        count = text.count(old_string)
        if count == 0:
            raise ToolError(
                f"invalid_argument: old_string is not in {path}; read the file and copy the "
                "text exactly (whitespace and indentation included)")
        if count > 1 and not replace_all:
            raise ToolError(
                f"invalid_argument: old_string occurs {count} times in {path}; give more "
                "surrounding text so that it occurs once, or set replace_all")
        updated = text.replace(old_string, new_string, -1 if replace_all else 1)
        await sb.write_text(path, updated, overwrite=not self.defaults.read_before_write)
        return f"replaced {count if replace_all else 1} occurrence(s) in {path}"

    @tool_errors
    async def grep(
        self,
        pattern: Annotated[str, Field(
            min_length=1, description="A regular expression (Python's re syntax).")],
        path: Annotated[str, Field(
            description="The file or directory to search (recursively).")] = ".",
        glob: Annotated[str | None, Field(
            default=None, description="Only files whose names match this glob, e.g. '*.py'.")]
        = None,
        ignore_case: Annotated[bool, Field(description="Match regardless of case.")] = False,
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        matches = await sb.grep(pattern, path, glob=glob, ignore_case=ignore_case)
        if not matches:
            return "no matches"
        text = "\n".join(f"{m.path}:{m.line_number}: {m.line}" for m in matches)
        return cap_text(f"{len(matches)} matching lines\n{text}", self.defaults.read_cap,
                        "the match list")

    @tool_errors
    async def glob(
        self,
        pattern: Annotated[str, Field(
            min_length=1,
            description="A glob over paths, e.g. '**/*.py' (any depth) or 'src/*.toml'.")],
        path: Annotated[str, Field(description="The directory the pattern starts from.")] = ".",
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        paths = await sb.glob(pattern, path)
        if not paths:
            return "no paths match"
        return cap_text("\n".join(paths), self.defaults.read_cap, "the path list")

    @tool_errors
    async def list_dir(
        self,
        path: Annotated[str, Field(description="The directory to list.")] = ".",
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        entries = await sb.list_dir(path)
        if not entries:
            return f"{path} is empty"
        return cap_text("type        size (bytes)  name\n" + "\n".join(map(_entry, entries)),
                        self.defaults.read_cap, "the listing")

    # -- the lifecycle ---------------------------------------------------------------
    @tool_errors
    async def pause(self, sandbox: SandboxId = None) -> str:
        sb = await self._sandbox(sandbox)
        await sb.pause()
        return f"paused {sb.id}: its processes are held as they are; resume continues them"

    @tool_errors
    async def suspend(self, sandbox: SandboxId = None) -> str:
        sb = await self._sandbox(sandbox)
        await sb.suspend()
        return (f"suspended {sb.id}: its memory is freed and its files kept; the next "
                "command (or resume) brings it back")

    @tool_errors
    async def resume(self, sandbox: SandboxId = None) -> str:
        sb = await self._sandbox(sandbox)
        await sb.resume()
        return "resumed " + _describe(await sb.info())

    @tool_errors
    async def snapshot(
        self,
        label: Annotated[str | None, Field(
            default=None, max_length=200,
            description="A name for the snapshot, to find it again.")] = None,
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        snap = await sb.snapshot(label)
        return f"snapshot {snap.id} of {sb.id} (label {snap.label!r}, {snap.size_bytes} bytes)"

    @tool_errors
    async def fork(
        self,
        label: Annotated[str | None, Field(
            default=None, max_length=200, description="A name for the fork's snapshot.")]
        = None,
        sandbox: SandboxId = None,
    ) -> str:
        sb = await self._sandbox(sandbox)
        forked = await sb.fork(label, count=1)
        branch = forked.branches[0]
        self.made.append(branch.id)
        self._handles[branch.id] = branch
        return (f"forked {sb.id} into {branch.id} (from snapshot {forked.snapshot.id}): "
                f"an independent copy; the current sandbox is still {self.current}. "
                f"Use sandbox_use to switch to the copy, or pass sandbox=\"{branch.id}\".")

    @tool_errors
    async def kill(self, sandbox: SandboxId = None) -> str:
        wanted = sandbox or self.current
        if wanted is None:
            raise InvalidArgument("no sandbox to kill: none is current and none was given")
        await self.client.delete_sandbox(wanted)
        self._handles.pop(wanted, None)
        if wanted in self.made:
            self.made.remove(wanted)
        if wanted == self.current:
            self.current = None
        return f"killed {wanted}" + (
            "; no sandbox is current now (the next tool call makes one)"
            if self.current is None else "")


def _streams(out: CappedStream, err: CappedStream) -> str:
    parts = []
    if out.total:
        parts.append("--- stdout ---\n" + out.render("stdout"))
    if err.total:
        parts.append("--- stderr ---\n" + err.render("stderr"))
    return "\n".join(parts) if parts else "(no output)"


READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

#: Each tool: its annotations and what a model is told it does.
TOOLS: dict[str, tuple[ToolAnnotations, str]] = {
    "sandbox_create": (CHANGES, (
        "Make a new sandbox (an isolated machine to run commands and edit files in) and make "
        "it the current one: every other tool acts on the current sandbox unless given "
        "another's id. Without it, the first tool call makes one with the server's defaults.")),
    "sandbox_use": (CHANGES, "Make an existing sandbox (by id) the current one."),
    "sandbox_list": (READ_ONLY, "List the live sandboxes: id, provider, state and working "
                                "directory; the current one is marked."),
    "exec": (DESTROYS, (
        "Run a shell command in the sandbox and answer its exit code, stdout and stderr. A "
        "non-zero exit code is an answer, not an error. Each stream's answer is capped: past "
        "the cap the middle is cut and a note says how much (redirect big output to a file "
        "and grep or read it). The command is killed after `timeout` seconds.")),
    "read_file": (READ_ONLY, (
        "Read a text file (UTF-8) in the sandbox, whole or a range of lines (offset, limit). "
        "A file must be read here before write_file may replace it.")),
    "write_file": (DESTROYS, (
        "Write a text file in the sandbox (created with its parent directories, or replaced "
        "whole). Replacing an existing file is refused until it was read in this session "
        "(read_file, or found with grep); prefer edit_file for changes to a file.")),
    "edit_file": (DESTROYS, (
        "Replace one exact, unique occurrence of old_string with new_string in a text file "
        "(or every occurrence, with replace_all). Fails, changing nothing, if old_string is "
        "not in the file or occurs more than once.")),
    "grep": (READ_ONLY, (
        "Search files for a regular expression; answers 'path:line: text' for each matching "
        "line (and counts as reading those files for write_file).")),
    "glob": (READ_ONLY, "Find paths matching a glob pattern, e.g. '**/*.py'."),
    "list_dir": (READ_ONLY, "List a directory: each entry's type, size and name."),
    "pause": (CHANGES, (
        "Pause the sandbox: its processes stop where they are and use no CPU; resume "
        "continues them. A paused sandbox runs no command until resumed.")),
    "suspend": (CHANGES, (
        "Suspend the sandbox: its memory is freed and its files are kept on disk, so it "
        "costs nothing while idle; the next command resumes it.")),
    "resume": (CHANGES, "Resume a paused or suspended sandbox."),
    "snapshot": (CHANGES, "Capture the sandbox's state (its files) as a snapshot, with an id."),
    "fork": (CHANGES, (
        "Snapshot the sandbox and start an independent copy from it: writes in the copy are "
        "not seen by the original. Answers the copy's id; the current sandbox stays the same.")),
    "kill": (DESTROYS, "End the sandbox for good: its processes and files are gone."),
}


def add_tools(server: MCPServer, tools: HutchTools) -> None:
    for name, (hints, description) in TOOLS.items():
        server.add_tool(getattr(tools, name), name=name, description=description,
                        annotations=hints, structured_output=False)
