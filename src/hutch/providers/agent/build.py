"""Building hutch's agent: once per version of its source, cached.

The agent (``go/``) is Go's standard library only, built by Debian's
``golang-go`` with ``CGO_ENABLED=0`` into one static executable that runs in
any Linux image. The cache key is a hash of its source files and of the
toolchain's version, so an edit to the source (or a new toolchain) builds it
again and nothing else does. The cache lives in ``HUTCH_AGENT_CACHE``, else
``/var/cache/hutch/agent`` when writable, else under hutch's data directory.

``python -m hutch.providers.agent`` builds it ahead of time (the install
scripts do); a provider that finds no binary and no toolchain falls back to
its native runtime.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..._errors import ProviderError
from ..._paths import hutch_home

log = logging.getLogger("hutch.agent")

SOURCE_DIR = Path(__file__).with_name("go")
BINARY_NAME = "hutch-agent"
#: Where the toolchain lives when it is not on PATH (Debian's golang-go).
_GO_FALLBACKS = ("/usr/lib/go/bin/go", "/usr/local/go/bin/go")


class AgentUnavailable(ProviderError):
    """No agent binary could be found or built here."""


def cache_root() -> Path:
    explicit = os.environ.get("HUTCH_AGENT_CACHE")
    if explicit:
        return Path(explicit)
    system = Path("/var/cache/hutch/agent")
    with contextlib.suppress(OSError):
        system.mkdir(parents=True, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    return Path(hutch_home()) / "agent-cache"


def go_toolchain() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    return next((p for p in _GO_FALLBACKS if os.access(p, os.X_OK)), None)


def source_hash(go: str | None) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".go", ".mod") and not path.name.endswith("_test.go"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    if go is not None:
        version = subprocess.run([go, "version"], capture_output=True, check=False).stdout
        digest.update(version)
    return digest.hexdigest()[:16]


_built: dict[str, Path] = {}
#: ``uname -m`` of the machines Go builds for, as Go names them (GOARCH).
MACHINE_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
                "armv7l": "arm", "armv6l": "arm", "i686": "386", "i386": "386",
                "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}


def host_arch() -> str:
    return MACHINE_ARCH.get(platform.machine(), platform.machine())


def agent_binary(*, build: bool = True, arch: str | None = None) -> Path:
    """The agent executable for the current source, built if missing; for
    another machine's architecture (``arch``, as Go names it: ``arm64``)
    where the sandbox runs on one (a cluster's node), cross-built.

    Raises :class:`AgentUnavailable` when it is not built and cannot be.
    One answer per process and architecture: the source of a running hutch
    does not change.
    """
    target = "current" if arch is None or arch == host_arch() else arch
    if target in _built:
        return _built[target]
    if target != "current" and target not in set(MACHINE_ARCH.values()):
        raise AgentUnavailable(f"hutch's agent is not built for {target!r} machines")
    go = go_toolchain()
    key = source_hash(go) + ("" if target == "current" else f"-{target}")
    root = cache_root()
    binary = root / key / BINARY_NAME
    if binary.is_file():
        _built[target] = binary
        return binary
    if go is None:
        raise AgentUnavailable(
            "hutch's agent is not built and no Go toolchain is here to build it "
            "(apt-get install golang-go, then python -m hutch.providers.agent)"
        )
    if not build:
        raise AgentUnavailable(f"hutch's agent is not built yet ({binary})")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others wait for it
        if not binary.is_file():
            _build(go, binary, root, None if target == "current" else target)
    _built[target] = binary
    return binary


def go_environment(root: Path, arch: str | None = None) -> dict[str, str]:
    """The environment Go builds (and tests) the agent in: offline, with
    its cache under ``root``."""
    env = {
        **os.environ,
        "CGO_ENABLED": "0",
        "GOCACHE": str(root / "go-build"),
        "GOFLAGS": "-mod=mod",
        "GO111MODULE": "on",
        "GOPROXY": "off",
        "GOTOOLCHAIN": "local",
    }
    if arch is not None:
        env["GOARCH"] = arch  # Go's standard library cross-builds with no more than this
    env.setdefault("HOME", str(root))
    return env


def _build(go: str, binary: Path, root: Path, arch: str | None = None) -> None:
    log.info("building hutch's agent into %s", binary)
    env = go_environment(root, arch)
    fd, tmp = tempfile.mkstemp(prefix=".build-", dir=binary.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", tmp, "."],
            cwd=SOURCE_DIR, env=env, capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise AgentUnavailable(f"building hutch's agent failed: {result.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, binary)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
