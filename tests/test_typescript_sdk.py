"""The TypeScript SDK (clients/typescript): built with tsc, its generated wire
types held to the daemon's OpenAPI document, and its tests (node's own test
runner, clients/typescript/test/) run against a real ``hutch serve``, on the
``local`` and ``docker`` providers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "clients" / "typescript"
GENERATOR = ROOT / "scripts" / "gen_ts_types.py"


def build_sdk() -> Path:
    """scripts/build-ts-sdk.sh: Node and the devDependencies if missing, then tsc
    (one build at a time across pytest's workers)."""
    built = subprocess.run(["bash", str(ROOT / "scripts" / "build-ts-sdk.sh")],
                           capture_output=True, text=True, timeout=900, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    return SDK


@pytest.fixture(scope="module")
def sdk() -> Path:
    return build_sdk()


def generator(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True,
                          text=True, timeout=300, env=env, check=False)


def test_the_generated_types_follow_the_daemon(sdk: Path, tmp_path: Path) -> None:
    """``gen_ts_types.py --check`` passes on what is committed, and fails,
    naming the file, on a copy that no longer matches the daemon's document
    or its error table."""
    checked = generator("--check")
    assert checked.returncode == 0, checked.stderr
    stale = tmp_path / "generated"
    shutil.copytree(sdk / "src" / "generated", stale)
    wire = (stale / "wire.ts").read_text()
    assert "timeout_seconds: number;" in wire
    (stale / "wire.ts").write_text(wire.replace("timeout_seconds: number;",
                                                "timeout_secs: number;", 1))
    failed = generator("--check", "--dir", str(stale))
    assert failed.returncode == 1
    assert "stale: wire.ts" in failed.stderr and "timeout_seconds" in failed.stderr
    (stale / "wire.ts").write_text(wire)
    (stale / "errors.ts").write_text((stale / "errors.ts").read_text().replace(
        '"not_found"', '"gone"'))
    failed = generator("--check", "--dir", str(stale))
    assert failed.returncode == 1 and "stale: errors.ts" in failed.stderr


def run_node_tests(sdk: Path, daemon: DaemonProcess, provider: str,
                   settings: dict[str, object]) -> None:
    env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token,
               HUTCH_TEST_PROVIDER=provider, HUTCH_TEST_SETTINGS=json.dumps(settings))
    files = sorted(str(p.relative_to(sdk)) for p in (sdk / "build" / "test").glob("*.test.js"))
    assert files, "no compiled tests"
    ran = subprocess.run(["node", "--test", "--test-reporter=tap", *files], cwd=sdk, env=env,
                         capture_output=True, text=True, timeout=1500,
                         stdin=subprocess.DEVNULL, check=False)
    summary = dict(re.findall(r"^# (tests|pass|fail|skipped|cancelled) (\d+)$", ran.stdout,
                              flags=re.M))
    assert ran.returncode == 0 and summary.get("fail") == "0", (
        ran.stdout[-12000:] + ran.stderr[-4000:] + daemon.log())
    # Every test ran: none skipped (both providers snapshot and fork), none cancelled.
    assert int(summary["pass"]) == int(summary["tests"]) > 25, summary
    assert summary.get("skipped") == "0" and summary.get("cancelled") == "0", summary


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.close()


def test_the_sdk_on_local(sdk: Path, daemon: DaemonProcess) -> None:
    run_node_tests(sdk, daemon, "local", {})


@pytest.mark.docker
def test_the_sdk_on_docker(sdk: Path, daemon: DaemonProcess) -> None:
    run_node_tests(sdk, daemon, "docker", {"image": TEST_IMAGE})


def test_a_ref_of_an_in_process_owner(sdk: Path) -> None:
    """A ref from a sandbox made in-process names the owner's unix socket: the
    SDK attaches through it (``attach(ref)``), works in the same files, and
    its close only detaches."""
    import hutch

    owner = hutch.create_sandbox_sync("local")
    try:
        owner.write_text("owner.txt", "from the owner")
        script = (
            'import { attach } from "hutch";'
            "const sb = await attach(process.argv[1]);"
            'console.log(await sb.readText("owner.txt"));'
            'await sb.writeText("node.txt", "from node");'
            "await sb.close();"
        )
        ran = subprocess.run(["node", "--input-type=module", "-e", script, owner.ref()],
                             cwd=sdk, capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL, check=False)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "from the owner\n"
        assert owner.read_text("node.txt") == "from node"
        assert owner.exec("true").exit_code == 0  # the owner's sandbox goes on
    finally:
        owner.close()
