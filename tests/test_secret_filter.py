"""``local`` keeps the host's secrets out of the commands it runs (SPEC §1).

Each case sets a variable in this process's environment, runs ``env`` in a
real local sandbox, and looks for the value in what the command saw.
"""

from __future__ import annotations

import tempfile
import uuid

import pytest

import hutch

pytestmark = pytest.mark.anyio

#: Names the seed rule (suffixes) already caught, and the ones only hutch's
#: wider rule catches: words anywhere in the name, PAT as a word.
SECRET_NAMES = [
    "OPENAI_API_KEY", "APP_SECRET", "GITHUB_TOKEN", "DB_PASSWORD", "GCP_CREDENTIAL",
    "AWS_SECRET_ACCESS_KEY", "MYAPP_CREDENTIALS", "GITHUB_PAT",
    "GOOGLE_APPLICATION_CREDENTIALS", "SECRET_KEY_BASE", "TOKENIZER_AUTH", "MY_TOKEN_FILE",
    "MYSQL_PASSWD", "SSH_PRIVATE_KEY", "AWS_ACCESS_KEY_ID", "API_KEY", "PAT",
    "GITLAB_PAT_RW", "lower_case_token", "HUTCH_TOKEN",
]
#: Names that look close but are not secrets.
PLAIN_NAMES = ["PATTERN", "XPATH_HOME", "SPATULA", "KEYBOARD", "REPO_URL"]


async def env_seen(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                   **call_env: str) -> str:
    monkeypatch.setenv(name, value)
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            result = await sb.exec("env", env=call_env or None)
    assert result.exit_code == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("name", SECRET_NAMES)
async def test_a_secret_name_is_dropped(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    value = f"s3cr3t-{uuid.uuid4().hex}"
    assert value not in await env_seen(monkeypatch, name, value)


@pytest.mark.parametrize("name", PLAIN_NAMES)
async def test_a_plain_name_passes(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    value = f"plain-{uuid.uuid4().hex}"
    assert f"{name}={value}\n" in await env_seen(monkeypatch, name, value)


@pytest.mark.parametrize("value", [
    "postgres://u:pw@h/db",
    "redis://:hunter2@cache:6379/0",
    "https://deploy:ghp_abc123@github.com/org/repo.git",
    "primary=mysql://root:toor@db1,replica=mysql://db2",
])
async def test_a_url_with_a_password_is_dropped(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert value not in await env_seen(monkeypatch, "DATABASE_URL", value)


@pytest.mark.parametrize("value", ["postgres://u@h/db", "https://h/a:b@c", "http://h:80/"])
async def test_a_url_without_a_password_passes(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert f"DATABASE_URL={value}\n" in await env_seen(monkeypatch, "DATABASE_URL", value)


async def test_the_safelist_passes_whatever_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    value = "https://me:not-a-secret@example.invalid/"
    assert f"TMPDIR={value}\n" in await env_seen(monkeypatch, "TMPDIR", value)


async def test_a_variable_given_on_the_call_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = await env_seen(monkeypatch, "UNRELATED", "x",
                          GITHUB_TOKEN="on-purpose", DATABASE_URL="postgres://u:pw@h/db")
    assert "GITHUB_TOKEN=on-purpose\n" in seen
    assert "DATABASE_URL=postgres://u:pw@h/db\n" in seen


async def test_a_variable_in_the_config_passes() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox(
            "local", workdir=workdir, env={"DEPLOY_TOKEN": "configured"}
        ) as sb:
            seen = (await sb.exec("env")).stdout
    assert "DEPLOY_TOKEN=configured\n" in seen
