"""The ``e2b`` provider's settings."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ..base import ProviderSettings


class E2BConfig(ProviderSettings):
    """Where E2B is and what to start there. Unset addresses and key come
    from the SDK's own environment (``E2B_API_KEY``, ``E2B_API_URL``,
    ``E2B_SANDBOX_URL``, ``E2B_DOMAIN``), as the ``e2b`` SDK reads it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["e2b"] = "e2b"
    #: The E2B template (or snapshot) a sandbox starts from.
    template: str = "base"
    api_key: str | None = None
    api_url: str | None = None
    sandbox_url: str | None = None
    domain: str | None = None
    #: The sandbox's lifetime on E2B's side, seconds, renewed on every resume;
    #: hutch's own limits (idle suspend, set_timeout) act well within it.
    e2b_timeout: int = Field(default=3600, gt=0, le=86400)
    #: The working directory (made if missing).
    workdir: str = "/home/user"
    env: dict[str, str] = {}
    metadata: dict[str, str] = {}
