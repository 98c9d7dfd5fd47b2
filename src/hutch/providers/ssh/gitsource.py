"""The local repository as a clone source (``hutch create --clone-current``).

The host clones over https: it has no reason to hold the user's ssh keys for
the git server, so an ssh remote URL is turned into its https form.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from urllib.parse import urlsplit

# git@github.com:owner/repo.git (scp-like syntax: no scheme, a colon before the path)
_SCP_LIKE = re.compile(r"^(?:[^@/:]+@)?(?P<host>[^/:]+):(?!//)(?P<path>.+)$")


@dataclass(frozen=True)
class GitSource:
    repository: str
    branch: str | None


def https_url(url: str) -> str:
    """``url`` as an https URL when it is an ssh one; any other URL unchanged."""
    parts = urlsplit(url)
    if parts.scheme in ("ssh", "git+ssh", "ssh+git"):
        host = parts.hostname or ""
        return f"https://{host}/{parts.path.lstrip('/')}"
    if not parts.scheme or len(parts.scheme) == 1:  # no scheme (or a drive letter)
        match = _SCP_LIKE.match(url)
        if match and not url.startswith(("/", ".")):
            return f"https://{match['host']}/{match['path'].lstrip('/')}"
    return url


def current_source(directory: str) -> GitSource | None:
    """The ``origin`` of the repository at ``directory`` (as https) and its
    current branch; None when it is not a git repository with an origin."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", directory, *args], capture_output=True, text=True, timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    origin = git("remote", "get-url", "origin")
    if not origin:
        return None
    branch = git("symbolic-ref", "--quiet", "--short", "HEAD")  # None when detached
    return GitSource(https_url(origin), branch or None)
