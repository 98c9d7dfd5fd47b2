"""What a task asks of the ``hutch`` sandbox environment: a pydantic model
(``SandboxEnvironmentSpec("hutch", HutchSandboxConfig(...))``) or a
``hutch.toml`` (``sandbox=("hutch", "hutch.toml")``, or one beside the task),
read as hutch reads it, with an optional ``[inspect]`` table for the fields
below that are not sandbox settings (``daemon``, ``url``, ``definition``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .._errors import InvalidArgument
from ..config import load_config_data


class HutchSandboxConfig(BaseModel):
    """The ``hutch`` sandbox environment's configuration.

    By default every sample's sandbox is made in the eval's own process with
    hutch's Python API (no daemon needed); ``daemon`` (or a ``url``) makes
    them through a ``hutch serve`` instead, with its token from ``token``,
    ``HUTCH_TOKEN`` or the file the daemon made, as every client finds it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The provider (``docker``, ``bubblewrap``, ...); unset: the config
    #: file's, else, in-process, docker where its Engine answers, else
    #: bubblewrap (never ``local`` unless named); through a daemon, the daemon's.
    provider: str | None = None
    #: The image of docker or bubblewrap sandboxes.
    image: str | None = None
    #: The user commands and file operations run as when a call names none
    #: (an eval's tools then meet file modes as a non-root user does); the
    #: sample's working directory is made that user's. Unset: the sandbox's
    #: default user (root in hutch's images). On providers that run users.
    user: str | None = Field(default=None, min_length=1, max_length=32,
                             pattern=r"^[a-z_][a-z0-9_.-]*\$?$")
    #: More settings, as hutch.toml's ``[sandbox]`` names them: the provider's
    #: (``memory``, ``cpus``, ``pids``, ``network``...) and the sandbox
    #: options (``idle_timeout``, ``max_lifetime``, ``output_limit``...).
    settings: dict[str, Any] = Field(default_factory=dict)
    #: A hutch.toml: its ``[sandbox]``, ``[providers.*]``, ``[definitions.*]``
    #: and ``[inspect]`` tables, under the fields given here.
    config_file: str | None = None
    #: A definition's id: each sample's sandbox is that definition's, ensured
    #: for the sample's thread (``task/sample/epoch``) and completed after it.
    definition: str | None = None
    #: Make the sandboxes through a daemon rather than in this process.
    daemon: bool = False
    #: The daemon's address (implies ``daemon``); unset: ``HUTCH_URL``, else
    #: the default one.
    url: str | None = None
    token: str | None = Field(default=None, repr=False)

    def __hash__(self) -> int:
        # inspect keys its environments by their config: the settings table
        # is a dict, hashed by its JSON form.
        return hash(self.model_dump_json())

    @property
    def through_daemon(self) -> bool:
        return self.daemon or self.url is not None

    def file_data(self) -> dict[str, Any]:
        """The config file's tables (empty without one)."""
        return load_config_data(self.config_file) if self.config_file else {}

    def resolved(self) -> HutchSandboxConfig:
        """These fields over the config file's ``[inspect]`` table."""
        table = self.file_data().get("inspect") or {}
        if not isinstance(table, dict):
            raise InvalidArgument("[inspect] in the config file must be a table")
        given = self.model_dump(exclude_unset=True)
        try:
            return HutchSandboxConfig.model_validate({**table, **given})
        except ValueError as exc:
            raise InvalidArgument(f"bad [inspect] table in {self.config_file}: {exc}") from None

    def flags(self) -> dict[str, Any]:
        """The fields that are sandbox settings, as one layer of hutch's config."""
        layer = dict(self.settings)
        if self.provider is not None:
            layer["provider"] = self.provider
        if self.image is not None:
            layer["image"] = self.image
        return layer


def config_of(config: object) -> HutchSandboxConfig:
    """The task's configuration: a model, a dict, a config file's path, or none."""
    if config is None:
        return HutchSandboxConfig()
    if isinstance(config, HutchSandboxConfig):
        return config.resolved()
    if isinstance(config, str):
        return HutchSandboxConfig(config_file=config).resolved()
    if isinstance(config, dict):
        return HutchSandboxConfig.model_validate(config).resolved()
    raise InvalidArgument(
        f"the hutch sandbox takes a HutchSandboxConfig or a hutch.toml path, not "
        f"{type(config).__name__}")
