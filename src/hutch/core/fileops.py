"""mkdir and rename as every sandbox does them: the rules (what is already
there, what may replace what, the working directory left where it is)
checked once here against the runtime's ``stat``, before the runtime's own
``make_dir`` or ``rename`` does the change; and the time bound of a search
(grep, glob)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from .._errors import (
    ExecTimeout,
    InvalidArgument,
    SandboxFileExists,
    SandboxIsADirectory,
    SandboxNotADirectory,
)
from .._sandbox_paths import within
from .._types import FileInfo, FileType

if TYPE_CHECKING:
    from ..providers.base import SandboxRuntime


def not_the_workdir(workdir: str, path: str, full: str, what: str) -> None:
    """InvalidArgument when ``full`` is the working directory or holds it:
    every command runs there, on every provider, so it stays where it is."""
    if within(workdir, full):
        raise InvalidArgument(
            f"{path!r} is the sandbox's working directory ({workdir}) or holds it: "
            f"not a file to {what}"
        )


async def _found(runtime: SandboxRuntime, path: str) -> FileInfo | None:
    try:
        return await runtime.stat(path)
    except FileNotFoundError:
        return None


async def make_directory(
    runtime: SandboxRuntime, full: str, *, parents: bool, exist_ok: bool
) -> None:
    """``Sandbox.mkdir``'s rules on ``full`` (absolute)."""
    info = await _found(runtime, full)
    if info is not None:
        if info.type == FileType.DIRECTORY and exist_ok:
            return
        kind = "directory" if info.type == FileType.DIRECTORY else "file"
        raise SandboxFileExists(f"{full} already exists (a {kind})")
    try:
        await runtime.make_dir(full, parents)
    except SandboxFileExists:
        # Made meanwhile (by a command, another session): as if found above.
        info = await _found(runtime, full)
        if not exist_ok or info is None or info.type != FileType.DIRECTORY:
            raise


async def rename_entry(
    runtime: SandboxRuntime, source: str, destination: str, *, overwrite: bool
) -> None:
    """``Sandbox.rename``'s rules on ``source`` and ``destination`` (absolute)."""
    source_info = await runtime.stat(source)  # file_not_found if missing
    if source == destination:
        return
    source_is_dir = source_info.type == FileType.DIRECTORY
    if source_is_dir and within(destination, source):
        raise InvalidArgument(f"cannot move {source} into itself ({destination})")
    there = await _found(runtime, destination)
    if there is not None:
        if not overwrite:
            raise SandboxFileExists(
                f"{destination} already exists; pass overwrite=True to replace it")
        if there.type == FileType.DIRECTORY and not source_is_dir:
            raise SandboxIsADirectory(f"{destination} is a directory: a file cannot replace it")
        if source_is_dir and there.type != FileType.DIRECTORY:
            raise SandboxNotADirectory(
                f"{destination} is not a directory: a directory cannot replace it")
    await runtime.rename(source, destination)


@asynccontextmanager
async def search_bounded(what: str, timeout: float) -> AsyncIterator[None]:
    """Stop the body after ``timeout`` s (cancelling what it started) with ExecTimeout."""
    if not 0 < timeout < math.inf:
        raise InvalidArgument(f"timeout must be a positive number, got {timeout}")
    try:
        with anyio.fail_after(timeout):
            yield
    except TimeoutError:
        raise ExecTimeout(
            f"{what} timed out after {timeout:g} s and was stopped "
            "(narrow the path or the glob, or simplify the pattern)"
        ) from None
