"""Files as a configured user (``HutchSandboxConfig(user=...)``): read and
written by a command run as that user, so that file modes stop the user as
they stop its commands. A sandbox's own file calls are its default user's
(root in hutch's images), whom no mode stops."""

from __future__ import annotations

from typing import Any

from .._errors import (
    HutchError,
    ProviderError,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxPermissionDenied,
)

#: Makes the file's directory and writes stdin to it; ``$1`` is the path.
_WRITE = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'

#: What coreutils and sh say, to the error hutch raises for it.
_SAID: list[tuple[str, type[HutchError], str]] = [
    ("Permission denied", SandboxPermissionDenied, "permission denied"),
    ("Is a directory", SandboxIsADirectory, "is a directory"),
    ("Not a directory", SandboxNotADirectory, "a part of its path is not a directory"),
    ("No such file or directory", SandboxFileNotFound, "no such file or directory"),
]


def _failure(path: str, user: str, stderr: str) -> HutchError:
    for said, error, meaning in _SAID:
        if said in stderr:
            return error(f"{path}: {meaning} (as user {user})")
    return ProviderError(f"{path} as user {user}: {stderr.strip()[:500]}")


async def init_workdir(sandbox: Any, user: str) -> None:
    """The sample's working directory made ``user``'s (by root): the user
    writes there as inspect's tools expect."""
    made = await sandbox.exec(["chown", "-R", "--", f"{user}:", "."], user="root")
    if made.exit_code != 0:
        raise ProviderError(f"the working directory cannot be made {user}'s: "
                            f"{made.stderr.strip()[:500]}")


async def read_file(sandbox: Any, path: str, user: str, limit: int) -> bytes:
    """``path``'s bytes as ``user`` reads them; OutputLimitExceeded past ``limit``."""
    done = await sandbox.exec(["cat", "--", path], user=user, output_limit=limit)
    if done.exit_code != 0:
        raise _failure(path, user, done.stderr)
    return bytes(done.stdout_bytes)


async def write_file(sandbox: Any, path: str, data: bytes, user: str) -> None:
    """``data`` to ``path`` as ``user`` writes it (its directories made)."""
    done = await sandbox.exec(["sh", "-c", _WRITE, "sh", path], stdin=data, user=user)
    if done.exit_code != 0:
        raise _failure(path, user, done.stderr)
