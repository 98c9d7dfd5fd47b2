"""The host's rules are applied again when another hutch changed them in
between (iptables-restore refused): three tries, the last failure raised."""

from __future__ import annotations

import subprocess

import pytest

from hutch.providers import network


def test_rules_are_applied_again_after_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[str] = []

    def restore(version: object, text: str) -> None:
        tries.append(text)
        if len(tries) < 3:
            raise subprocess.CalledProcessError(4, ["iptables-restore"])

    monkeypatch.setattr(network, "_listing", lambda version: f"listing {len(tries)}")
    monkeypatch.setattr(network, "_restore", restore)
    network._apply(4, lambda listing: f"built from {listing}")
    # Each try reads the rules again: they may have changed in between.
    assert tries == ["built from listing 0", "built from listing 1", "built from listing 2"]


def test_the_third_refusal_is_raised_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[str] = []

    def restore(version: object, text: str) -> None:
        tries.append(text)
        raise subprocess.CalledProcessError(4, ["iptables-restore"], stderr="busy")

    monkeypatch.setattr(network, "_listing", lambda version: "")
    monkeypatch.setattr(network, "_restore", restore)
    with pytest.raises(subprocess.CalledProcessError) as raised:
        network._apply(4, lambda listing: "rules")
    assert raised.value.stderr == "busy" and len(tries) == 3
