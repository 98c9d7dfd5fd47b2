"""Paths inside a sandbox, as callers give them: one rule for the in-process
sandbox and the client that checks before it sends (a module of its own, so
that the client does not import the providers to use it)."""

from __future__ import annotations

import posixpath

from ._errors import InvalidArgument


def join_path(workdir: str, path: str) -> str:
    """Resolve ``path`` against ``workdir`` inside the sandbox (POSIX rules)."""
    if not path:
        path = "."
    return posixpath.normpath(posixpath.join(workdir, path))


def sandbox_path(workdir: str, path: object) -> str:
    """A caller's ``path`` checked (a string, no NUL byte: InvalidArgument
    otherwise) and resolved against ``workdir``."""
    if not isinstance(path, str):
        raise InvalidArgument(f"path must be a string, not {type(path).__name__}")
    if "\0" in path:
        raise InvalidArgument(f"path {path!r} contains a NUL byte")
    return join_path(workdir, path)
