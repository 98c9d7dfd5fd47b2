"""A definition's workspace: its source fetched into the sandbox, and its setup
steps run there (SPEC §6)."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable

import anyio
import anyio.to_thread

from .._errors import InvalidArgument, SandboxUnavailable, SetupFailed
from .._sandbox import Sandbox
from .._tar import pack_tree
from .._types import ExitStatus
from .model import DirSource, GitSource

#: How much of a failed setup step's output its error carries.
OUTPUT_TAIL_BYTES = 4096
#: Where the source is unpacked on its way in (removed once unpacked).
_SOURCE_ARCHIVE = ".hutch-source.tar"

#: Told of progress: ("step", name) as a step starts, ("output", text) as setup prints.
Progress = Callable[[str, str], None]


async def fetch_source(sandbox: Sandbox, source: GitSource | DirSource) -> None:
    """Clone or copy ``source`` on the host and unpack it into the sandbox's
    working directory (one upload and one ``tar`` whatever the provider)."""
    with tempfile.TemporaryDirectory(prefix="hutch-source-") as scratch:
        archive = os.path.join(scratch, "source.tar")
        await anyio.to_thread.run_sync(_pack_source, source, scratch, archive)
        packed = await anyio.to_thread.run_sync(open, archive, "rb")
        try:
            await sandbox.write_from(_SOURCE_ARCHIVE, packed)
        finally:
            packed.close()
    result = await sandbox.exec(
        ["tar", "-xf", _SOURCE_ARCHIVE, "--no-same-owner"], timeout=600
    )
    await sandbox.remove(_SOURCE_ARCHIVE)
    if result.exit_code != 0:
        raise SandboxUnavailable(
            f"sandbox {sandbox.id}: unpacking the source failed "
            f"(exit {result.exit_code}): {result.stderr[-500:]}"
        )


def _pack_source(source: GitSource | DirSource, scratch: str, archive: str) -> None:
    if isinstance(source, GitSource):
        tree = os.path.join(scratch, "tree")
        _git(["clone", "--quiet", "--no-checkout", "--", source.git, tree], source.git)
        _git(["-C", tree, "checkout", "--quiet", source.ref or "HEAD", "--"], source.git)
    else:
        tree = source.dir
        if not os.path.isdir(tree):
            raise InvalidArgument(f"source directory {tree} does not exist")
    pack_tree(tree, archive)


def _git(args: list[str], url: str) -> None:
    done = subprocess.run(
        # ext:: would run a command the URL names; never, whatever git's default.
        ["git", "-c", "protocol.ext.allow=never", *args], capture_output=True, text=True,
        timeout=600,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
    )
    if done.returncode != 0:
        raise InvalidArgument(
            f"source {url}: git {args[0] if args[0] != '-C' else args[2]} failed: "
            f"{done.stderr.strip()[-500:]}"
        )


async def run_setup_step(sandbox: Sandbox, name: str, command: str, tell: Progress) -> None:
    tail = bytearray()
    exit_code = None
    async for event in sandbox.exec_stream(command):
        if isinstance(event, ExitStatus):
            exit_code = event.exit_code
            break
        tail += event.data
        del tail[:-OUTPUT_TAIL_BYTES]
        tell("output", event.data.decode("utf-8", "replace"))
    if exit_code != 0:
        text = tail.decode("utf-8", "replace")
        raise SetupFailed(
            f"setup step {name} ({shlex.quote(command)}) exited {exit_code}; "
            f"the end of its output:\n{text}",
            step=command, exit_code=exit_code, output_tail=text,
        )
