"""Settings of the ``ssh`` provider (no asyncssh import: config parsing needs none)."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, field_validator, model_validator

from ..base import ProviderSettings
from ..policy import HostPath, ReachesHost

# A destination is ``user@host``, a host name or an ssh config alias: one
# token, never an option (a leading dash) and never whitespace.
_DESTINATION = re.compile(r"^(?:[^@\s]+@)?[^@\s\-][^@\s]*$")


class SshConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid")

    type: Literal["ssh"] = "ssh"
    #: ``user@host``, a host name, a ``Host`` alias from the ssh config, or
    #: ``ssh://[user@]host[:port]``.
    #: Through the daemon, the connection is made with the daemon user's ssh
    #: keys and config: the operator's to hand out.
    destination: Annotated[
        str, ReachesHost("connects with the daemon user's ssh keys", lambda _v: False)
    ]
    #: Absolute path on the host that commands run in and relative paths
    #: resolve from; created if missing.
    working_directory: str
    #: An OpenSSH client config file (IdentityFile, Port, ProxyJump,
    #: UserKnownHostsFile...), read instead of ``~/.ssh/config``.
    config_file: Annotated[
        str | None, ReachesHost("runs ssh with a host file of the caller's choosing as its "
                                "config (a ProxyCommand there runs on the daemon's host)"),
        HostPath(),
    ] = None
    #: Where the host's ports are reachable: ``{preview_url_base}:{port}``.
    preview_url_base: str | None = None
    #: A known_hosts file to check the host key against (default: the
    #: config's UserKnownHostsFile, else ~/.ssh/known_hosts).
    known_hosts: Annotated[
        str | None, ReachesHost("reads a host file of the caller's choosing as known_hosts"),
        HostPath(),
    ] = None
    #: Refuse a host whose key is not in known_hosts. Turning this off lets
    #: anyone on the path impersonate the host.
    check_host_key: bool = True
    #: Seconds to wait for the host to answer and authenticate us.
    connect_timeout: float = Field(default=15.0, gt=0, le=600)
    #: Make the working directory a clone of ``repository`` at ``branch``.
    clone: bool = False
    repository: str | None = None
    branch: str | None = None
    #: Extra variables for every command.
    env: dict[str, str] = {}

    @field_validator("destination")
    @classmethod
    def _destination(cls, value: str) -> str:
        if value.startswith("ssh://"):
            try:
                parts = urlsplit(value)
                parts.port  # noqa: B018 - raises on a port that is not a number
            except ValueError:
                raise ValueError(f"destination {value!r} is not a valid ssh:// URL") from None
            if parts.hostname and parts.path in ("", "/") and not parts.query:
                return value
            raise ValueError(f"destination {value!r} must be ssh://[user@]host[:port]")
        if not _DESTINATION.match(value):
            raise ValueError(
                f"destination {value!r} must be user@host, a host name or an ssh config alias"
            )
        return value

    @field_validator("working_directory")
    @classmethod
    def _working_directory(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value:
            raise ValueError(f"working_directory {value!r} must be an absolute path")
        return posixpath.normpath(value)

    @model_validator(mode="after")
    def _clone(self) -> SshConfig:
        if self.clone and not self.repository:
            raise ValueError("clone: true needs a repository")
        if self.repository and not self.clone:
            raise ValueError("repository is only used with clone: true")
        return self
