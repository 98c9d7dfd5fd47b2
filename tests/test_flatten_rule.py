"""The one flatten rule (issue 21): every layer system asks
``hutch.providers.layers.flattens`` whether a capture flattens its chain."""

from __future__ import annotations

import pytest

from hutch.providers import layers
from hutch.providers.docker.snapshots import MAX_SUSPEND_LAYERS
from hutch.providers.layers import flattening


def test_a_chain_flattens_when_asked_or_at_its_ceiling() -> None:
    assert layers.flattens(1, asked=True)
    assert not layers.flattens(layers.MAX_LAYERS - 1, asked=False)
    assert layers.flattens(layers.MAX_LAYERS, asked=False)
    assert layers.flattens(layers.MAX_LAYERS + 5, asked=False)


def test_each_system_has_its_own_ceiling() -> None:
    # docker's images: overlay2 stops at 128, so a commit flattens at 100.
    limit = MAX_SUSPEND_LAYERS
    assert not layers.flattens(limit - 1, asked=False, limit=limit)
    assert layers.flattens(limit, asked=False, limit=limit)
    # bubblewrap's: no ceiling by depth, only when asked.
    assert not layers.flattens(10_000, asked=False, limit=layers.NO_CEILING)
    assert layers.flattens(0, asked=True, limit=layers.NO_CEILING)


def test_the_default_ceiling_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flattening, "MAX_LAYERS", 2)
    assert layers.flattens(2, asked=False)
    assert not layers.flattens(1, asked=False)
