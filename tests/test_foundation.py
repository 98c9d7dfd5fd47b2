"""The foundation around the providers: errors, config precedence, registry,
guardrail, secret filtering, capabilities and the sync face."""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

import hutch
from hutch._errors import ERRORS_BY_CODE, SetupFailed, error_from_code, error_from_wire
from hutch.config import load_config_file, resolve_spec
from hutch.providers import available_providers, get_provider, register_provider
from hutch.providers.base import SandboxRuntime
from hutch.providers.local import LocalSandbox, filter_env
from hutch.providers.virtual import VirtualSandbox

# -- errors ------------------------------------------------------------------------

SPEC_CODES = {
    "not_found": (404, LookupError),
    "file_not_found": (404, FileNotFoundError),
    "is_a_directory": (400, IsADirectoryError),
    "permission_denied": (403, PermissionError),
    "exec_timeout": (408, TimeoutError),
    "output_limit_exceeded": (413, None),
    "sandbox_unavailable": (409, None),
    "read_before_write": (409, None),
    "timeout_too_large": (400, None),
    "invalid_argument": (400, ValueError),
    "idle_timeout": (410, None),
    "max_lifetime_exceeded": (410, None),
    "timeout_expired": (410, None),
    "unauthorized": (401, None),
    "capability_unsupported": (501, NotImplementedError),
    "provider_error": (502, None),
    "resource_exhausted": (429, None),
}


@pytest.mark.parametrize("code", sorted(SPEC_CODES))
def test_every_spec_code_has_a_typed_error(code: str) -> None:
    status, builtin = SPEC_CODES[code]
    cls = ERRORS_BY_CODE[code]
    err = error_from_code(code, f"about {code}")
    assert isinstance(err, cls) and isinstance(err, hutch.HutchError)
    assert err.code == code
    assert cls.http_status == status
    assert str(err) == f"about {code}"
    if builtin is not None:
        assert isinstance(err, builtin)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and str(again) == str(err)


def test_an_error_s_details_survive_the_wire_and_pickling() -> None:
    err = SetupFailed("setup step setup[1] exited 3", step="make", exit_code=3,
                      output_tail="cc: error\n")
    body = json.loads(json.dumps(err.wire()))
    assert body == {"code": "setup_failed", "message": "setup step setup[1] exited 3",
                    "step": "make", "exit_code": 3, "output_tail": "cc: error\n"}
    for again in (error_from_wire(body), pickle.loads(pickle.dumps(err))):
        assert isinstance(again, SetupFailed) and str(again) == str(err)
        assert (again.step, again.exit_code, again.output_tail) == ("make", 3, "cc: error\n")
    # An error without details is code and message; odd details are not trusted.
    assert hutch.NotFound("gone").wire() == {"code": "not_found", "message": "gone"}
    odd = error_from_wire({"code": "setup_failed", "message": "m", "exit_code": "3"})
    assert isinstance(odd, SetupFailed) and odd.exit_code is None


def test_the_wire_documents_every_code_with_its_status() -> None:
    text = (Path(__file__).parent.parent / "docs" / "wire.md").read_text()
    listed = text.split("The codes and their statuses:", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, int] = {}
    pending: list[str] = []
    for code, status in re.findall(r"`(\w+)`|\b(\d{3})\b", listed):
        if code:
            pending.append(code)
        else:
            documented.update((c, int(status)) for c in pending)
            pending = []
    assert documented == {code: cls.http_status for code, cls in ERRORS_BY_CODE.items()}


def test_unknown_code_becomes_the_root_error() -> None:
    err = error_from_code("brand_new_code", "x")
    assert type(err) is hutch.HutchError


# -- configuration precedence --------------------------------------------------------


def test_builtin_default_is_local() -> None:
    spec = resolve_spec()
    assert spec.provider.type == "local"
    assert spec.options.idle_timeout is None and spec.options.max_lifetime is None


def test_precedence_flag_over_file_over_server() -> None:
    server = {"provider": "virtual", "idle_timeout": 10, "max_lifetime": 100}
    file = {
        "provider": "docker", "idle_timeout": 20, "providers": {"docker": {"image": "img:file"}}
    }
    flags = {"idle_timeout": 30, "pids_limit": 64}
    spec = resolve_spec(flags=flags, config_file=file, server_defaults=server)
    assert spec.provider.type == "docker"
    assert spec.provider.image == "img:file"  # type: ignore[union-attr]
    assert spec.provider.pids_limit == 64  # type: ignore[union-attr]
    assert spec.options.idle_timeout == 30
    assert spec.options.max_lifetime == 100
    spec = resolve_spec(flags={"provider": "local"}, config_file=file, server_defaults=server)
    assert spec.provider.type == "local"


def test_an_image_alone_takes_its_provider_from_configuration() -> None:
    # Nothing names a provider: the built-in one that has images.
    spec = resolve_spec(flags={"image": "img:flag"})
    assert spec.provider.type == "docker"
    assert spec.provider.image == "img:flag"  # type: ignore[union-attr]
    # The server's (or the file's) provider stands: an image says which, not where.
    spec = resolve_spec(flags={"image": "img:flag"}, server_defaults={"provider": "bubblewrap"})
    assert spec.provider.type == "bubblewrap"
    assert spec.provider.image == "img:flag"  # type: ignore[union-attr]
    # A provider that has no images says so.
    with pytest.raises(hutch.InvalidArgument, match="image"):
        resolve_spec(flags={"image": "img:flag"}, server_defaults={"provider": "virtual"})


def test_config_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hutch.toml").write_text(
        '[sandbox]\nprovider = "virtual"\nidle_suspend_after = 5\n'
        '[providers.virtual]\nworkdir = "/w"\n'
    )
    monkeypatch.chdir(tmp_path)
    spec = resolve_spec(config_file=load_config_file())
    assert spec.provider.type == "virtual"
    assert spec.provider.workdir == "/w"  # type: ignore[union-attr]
    assert spec.options.idle_suspend_after == 5


def test_bad_config_is_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(hutch.InvalidArgument, match="no_such_setting"):
        resolve_spec(flags={"provider": "docker", "no_such_setting": 1})
    with pytest.raises(hutch.InvalidArgument, match="unknown provider"):
        resolve_spec(flags={"provider": "nope"})
    with pytest.raises(hutch.InvalidArgument, match="idle_timeout"):
        resolve_spec(flags={"idle_timeout": -1})
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(hutch.InvalidArgument, match="not valid TOML"):
        load_config_file(bad)
    with pytest.raises(hutch.InvalidArgument, match="does not exist"):
        load_config_file(tmp_path / "missing.toml")


# -- registry ---------------------------------------------------------------------------


def test_registry_finds_builtins_lazily() -> None:
    assert {"local", "virtual", "docker"} <= set(available_providers())
    assert get_provider("local") is LocalSandbox
    assert get_provider("virtual") is VirtualSandbox


def test_registry_unknown_provider_names_the_choices() -> None:
    with pytest.raises(hutch.InvalidArgument, match=r"available: .*local"):
        get_provider("no-such-provider")


def test_registry_runtime_registration() -> None:
    class Custom(VirtualSandbox):
        provider = "custom-virtual"

    register_provider("custom-virtual", Custom)
    assert get_provider("custom-virtual") is Custom
    assert "custom-virtual" in available_providers()


# -- local environment filtering ----------------------------------------------------


def test_filter_env_drops_secrets_and_keeps_the_safelist() -> None:
    env = {
        "OPENAI_API_KEY": "x", "AWS_SECRET": "x", "GITHUB_TOKEN": "x", "DB_PASSWORD": "x",
        "GCP_CREDENTIAL": "x", "lower_api_key": "x", "PATH": "/bin", "HOME": "/root",
        "EDITOR": "vi", "PATTERN": "keep", "REPO_URL": "https://github.com/x/y",
    }
    assert filter_env(env) == {
        "PATH": "/bin", "HOME": "/root", "EDITOR": "vi", "PATTERN": "keep",
        "REPO_URL": "https://github.com/x/y",
    }


@pytest.mark.anyio
async def test_local_commands_do_not_see_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUTCH_TEST_API_KEY", "sk-very-secret")
    monkeypatch.setenv("HUTCH_TEST_VISIBLE", "yes")
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            result = await sb.exec("env")
    assert "sk-very-secret" not in result.stdout
    assert "HUTCH_TEST_VISIBLE=yes" in result.stdout
    assert f"PATH={os.environ['PATH']}" in result.stdout


# -- guardrail -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_read_before_write_guards_overwrite_and_delete() -> None:
    async with await hutch.create_sandbox("virtual", files={"existing.txt": "old"}) as sb:
        await sb.write_text("new.txt", "created freely")
        await sb.write_text("new.txt", "and rewritten: this session wrote it")
        with pytest.raises(hutch.ReadBeforeWrite) as info:
            await sb.write_text("existing.txt", "clobber")
        assert info.value.code == "read_before_write"
        assert "existing.txt" in str(info.value)
        with pytest.raises(hutch.ReadBeforeWrite):
            await sb.remove("existing.txt")
        assert await sb.read_text("existing.txt") == "old"
        await sb.write_text("existing.txt", "now allowed")
        assert await sb.read_text("existing.txt") == "now allowed"


@pytest.mark.anyio
async def test_grep_counts_as_reading() -> None:
    async with await hutch.create_sandbox("virtual", files={"a/found.txt": "needle"}) as sb:
        assert [m.line for m in await sb.grep("needle")] == ["needle"]
        await sb.remove("a/found.txt")
        assert not await sb.exists("a/found.txt")


@pytest.mark.anyio
async def test_guardrail_can_be_turned_off() -> None:
    async with await hutch.create_sandbox(
        "virtual", files={"x.txt": "old"}, read_before_write=False
    ) as sb:
        await sb.write_text("x.txt", "new")
        assert await sb.read_text("x.txt") == "new"


# -- capabilities -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_missing_capability_names_provider_and_capability() -> None:
    async with await hutch.create_sandbox("virtual") as sb:
        assert not sb.capabilities.processes
        with pytest.raises(hutch.CapabilityUnsupported) as info:
            await sb.exec("true")
        assert isinstance(info.value, NotImplementedError)
        assert "virtual" in str(info.value) and "processes" in str(info.value)
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir) as local:
            assert not local.capabilities.pause and not local.capabilities.suspend
            with pytest.raises(hutch.CapabilityUnsupported, match=r"'local'.*'pause'"):
                await local.pause()
            with pytest.raises(hutch.CapabilityUnsupported, match="suspend"):
                await local.suspend()


class _HandedOverRuntime(VirtualSandbox):
    """A second in-memory file system standing in for another runtime."""

    runtime_name = "handed-over"


class _HandingOverSandbox(VirtualSandbox):
    """A backend whose runtime is another object, as docker's is with the agent."""

    def __init__(self, sandbox_id: str, workdir: str) -> None:
        super().__init__(sandbox_id, workdir)
        self.other = _HandedOverRuntime(sandbox_id, workdir)

    @property
    def runtime(self) -> SandboxRuntime:
        return self.other


@pytest.mark.anyio
async def test_operations_go_through_the_runtime_the_backend_names() -> None:
    backend = _HandingOverSandbox("sb-seam", "/workspace")
    async with hutch.Sandbox(backend, read_before_write=False) as sb:
        await sb.write_text("a.txt", "through the runtime")
        assert "/workspace/a.txt" in backend.other.files
        assert "/workspace/a.txt" not in backend.files  # the backend's own files untouched
        assert await sb.read_text("a.txt") == "through the runtime"
        assert [m.line for m in await sb.grep("runtime")] == ["through the runtime"]
        assert await sb.glob("*.txt") == ["/workspace/a.txt"]
        assert sb.capabilities.runtime == "handed-over"
        assert sb.capabilities.as_dict()["runtime"] == "handed-over"
    async with await hutch.create_sandbox("virtual") as plain:
        assert plain.capabilities.runtime == "native"


@pytest.mark.anyio
async def test_closed_sandbox_is_unavailable() -> None:
    sb = await hutch.create_sandbox("virtual")
    await sb.close()
    await sb.close()  # idempotent
    with pytest.raises(hutch.SandboxUnavailable):
        await sb.read_text("x")


# -- the sync face ----------------------------------------------------------------------


def test_sync_face_runs_the_same_core() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        sb: Any = hutch.create_sandbox_sync("local", workdir=workdir, read_before_write=False)
        with sb:
            assert sb.exec("echo sync").stdout == "sync\n"
            sb.write_bytes("b.bin", b"\0\1\2")
            assert sb.read_bytes("b.bin") == b"\0\1\2"
            events = list(sb.exec_stream("echo a; echo b"))
            assert events[-1] == hutch.ExitStatus(0)
            process = sb.start("sleep 0.1; echo bg")
            assert process.wait(timeout=10).stdout == "bg\n"
            with pytest.raises(FileNotFoundError):
                sb.read_text("missing")
            assert sb.provider == "local"
