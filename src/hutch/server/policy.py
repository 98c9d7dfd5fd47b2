"""Moved to :mod:`hutch.daemon.policy`; re-exported while callers move."""

from __future__ import annotations

from ..daemon.policy import (
    DEFAULT_CEILINGS,
    DEFAULT_LIMITS,
    ISOLATING_DEFAULTS,
    OperatorPolicy,
    host_reaching_setting_names,
    parse_limit,
    pick_default_provider,
)

__all__ = [
    "DEFAULT_CEILINGS", "DEFAULT_LIMITS", "ISOLATING_DEFAULTS", "OperatorPolicy",
    "host_reaching_setting_names", "parse_limit", "pick_default_provider",
]
