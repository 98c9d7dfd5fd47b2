"""Provider settings come from the registry: a provider installed by the
``hutch.providers`` entry point is configured (by its own config_model) and
created like a built-in one, in-process and through the daemon."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import hutch
from hutch.config import SandboxSpec, resolve_spec
from tests.daemon_fixture import DaemonProcess

PROVIDER_MODULE = '''
from typing import Literal

from pydantic import ConfigDict, Field

from hutch.providers.base import ProviderSettings
from hutch.providers.virtual import VirtualSandbox


class GreeterConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid")

    type: Literal["greeter"] = "greeter"
    greeting: str = Field(min_length=1)


class GreeterSandbox(VirtualSandbox):
    provider = "greeter"
    config_model = GreeterConfig

    @classmethod
    async def create(cls, config, sandbox_id):
        sandbox = cls(sandbox_id, "/workspace")
        await sandbox.write_file("/workspace/greeting.txt", config.greeting.encode())
        return sandbox
'''


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A third-party package, installed as pip would: a module and a dist-info
    whose entry point names the provider."""
    (tmp_path / "greeter_provider.py").write_text(PROVIDER_MODULE)
    info = tmp_path / "greeter_provider-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: greeter-provider\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[hutch.providers]\ngreeter = greeter_provider:GreeterSandbox\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield tmp_path
    sys.modules.pop("greeter_provider", None)


def test_an_entry_point_provider_is_configured_by_its_own_model(installed: Path) -> None:
    assert "greeter" in hutch.providers.available_providers()
    spec = resolve_spec(flags={"provider": "greeter", "greeting": "hello"})
    assert type(spec.provider).__name__ == "GreeterConfig"
    assert spec.provider_name == "greeter"
    # What the store keeps comes back as the provider's own model.
    again = SandboxSpec.model_validate(spec.model_dump())
    assert again.provider == spec.provider
    with pytest.raises(hutch.InvalidArgument, match="greeter settings: greeting"):
        resolve_spec(flags={"provider": "greeter", "greeting": ""})
    with pytest.raises(hutch.InvalidArgument, match="greeter settings: colour"):
        resolve_spec(flags={"provider": "greeter", "greeting": "hi", "colour": "red"})
    with pytest.raises(hutch.InvalidArgument, match="unknown provider 'nope'"):
        resolve_spec(flags={"provider": "nope"})


@pytest.mark.anyio
async def test_an_entry_point_provider_is_created_in_process(installed: Path) -> None:
    async with await hutch.create_sandbox("greeter", greeting="hello") as sb:
        assert await sb.read_text("greeting.txt") == "hello"
        fork = await sb.fork("inherited", count=1)
        assert await fork.branches[0].read_text("greeting.txt") == "hello"
        await fork.branches[0].close()


def test_an_entry_point_provider_through_the_daemon(installed: Path) -> None:
    daemon = DaemonProcess().start()
    try:
        headers = {"Authorization": f"Bearer {daemon.token}"}
        with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as http:
            made = http.post("/v1/sandboxes", json={"provider": "greeter", "greeting": "hey"})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            read = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "greeting.txt"})
            assert read.content == b"hey"
            bad = http.post("/v1/sandboxes", json={"provider": "greeter"})
            assert bad.status_code == 400 and "greeting" in bad.json()["error"]["message"]
    finally:
        daemon.stop()

