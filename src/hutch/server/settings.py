"""The daemon's settings, as ``hutch serve`` and hutch.toml give them."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, Field

from .. import _membudget
from .._types import (
    MAX_READ_LIMIT,
)
from ..daemon import DEFAULT_RETENTION_SECONDS, OperatorPolicy
from ..daemon.meters import DEFAULT_METER_INTERVAL

log = logging.getLogger("hutch.server")



class ServerSettings(BaseModel):
    data_dir: str | None = None
    token: str | None = None
    sandbox_defaults: dict[str, Any] = {}
    timeout_ceiling: float = 86400.0
    #: Seconds an ended sandbox stays readable (with its events) before it is pruned.
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    #: The largest request body (a file upload) taken, bytes.
    max_body_bytes: int = Field(default=MAX_READ_LIMIT, gt=0)
    #: What callers' bytes may hold of the daemon's memory at once, all
    #: calls together (hutch._membudget); output past it goes to disk, a
    #: request body past it is refused (daemon_busy).
    memory_budget: int = Field(default=_membudget.DEFAULT_MEMORY_BUDGET, gt=0)
    #: Settings that reach the host which API clients may nonetheless set.
    allow: list[str] = []
    #: Providers that run on the host (local, ssh) which API clients may nonetheless use.
    providers: list[str] = []
    #: The provider of requests that name none (``hutch serve --provider``),
    #: where the sandbox defaults name none; unset: the daemon picks one that
    #: isolates (see hutch.daemon.policy).
    default_provider: str | None = None
    #: Resource limits (memory, cpus, pids) for requests that set none, and
    #: the most a request may ask for; see hutch.daemon.policy.
    limits: dict[str, Any] = {}
    ceilings: dict[str, Any] = {}
    #: The most sandboxes the daemon serves at once, warm pools' included
    #: (see hutch.daemon.pools); None: no limit.
    max_sandboxes: int | None = Field(default=None, gt=0)
    #: Where the daemon keeps its state (hutch.store.open_store): None for
    #: SQLite in the data directory, or a ``postgresql://`` URL.
    store: str | None = None
    #: Where the other daemons of a fleet reach this one (``--advertise-url``;
    #: default: the address it listens on).
    advertise_url: str | None = None
    #: The operator's sandbox definitions (``[definitions.NAME]`` in hutch.toml).
    definitions: dict[str, dict[str, Any]] = {}
    #: Seconds between two samples of a running sandbox's memory and disk
    #: (the history the dashboard's plots start from; see hutch.daemon.meters).
    meter_interval: float = Field(default=DEFAULT_METER_INTERVAL, gt=0, le=3600)
    #: Warm pools (``[pools.NAME]`` in hutch.toml: ``size`` and a create's settings).
    pools: dict[str, dict[str, Any]] = {}

    def policy(self) -> OperatorPolicy:
        return OperatorPolicy(self.allow, self.limits, self.ceilings, self.providers,
                              max_sandboxes=self.max_sandboxes)

