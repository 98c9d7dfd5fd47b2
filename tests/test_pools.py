"""Warm pools on a real daemon (bubblewrap): kept full from hutch.toml and the
API, a matching create takes one and the pool refills, the sandbox taken is
as fresh as a cold one, pools are managed from the CLI and drain on stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hutch
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]
#: A hang guard for a pool to fill (not a timing check).
FILL_GUARD_SECONDS = 120


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    config = tmp_path_factory.mktemp("pools") / "hutch.toml"
    config.write_text('[pools.warm]\nsize = 2\nprovider = "bubblewrap"\n')
    d = DaemonProcess(extra_args=["--config", str(config)]).start()
    try:
        yield d
    finally:
        d.close()


def until(what: str, check: Callable[[], bool]) -> None:
    give_up = time.monotonic() + FILL_GUARD_SECONDS
    while not check():
        assert time.monotonic() < give_up, f"never: {what}"
        time.sleep(0.05)


def pool(c: hutch.Client, name: str) -> dict[str, object]:
    return next(p for p in c.list_pools() if p["name"] == name)


def scrape_pool_hits(d: DaemonProcess, name: str) -> float:
    answer = httpx.get(f"{d.url}/metrics", headers={"Authorization": f"Bearer {d.token}"})
    return sum(s.value for f in text_string_to_metric_families(answer.text)
               for s in f.samples
               if s.name == "hutch_pool_hits_total" and s.labels == {"pool": name})


def test_a_create_takes_a_ready_sandbox_and_the_pool_refills(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        until("the pool is full", lambda: pool(c, "warm")["ready"] == 2)
        assert c.list_sandboxes() == []  # kept ready: not sandboxes yet
        before = time.time()
        warm = c.create_sandbox("bubblewrap", max_lifetime=300)
        cold = c.create_sandbox("bubblewrap", max_lifetime=300, memory="512m")  # no pool's
        try:
            assert pool(c, "warm")["hits"] == 1
            assert scrape_pool_hits(daemon, "warm") == 1
            info = warm.info()
            # Fresh: made now as far as anyone sees, its deadline from now, nothing run in it.
            assert info["created_at_unix"] >= before
            assert info["deadline_unix"] >= before + 300
            assert warm.processes() == []
            assert warm.exec("ls -A .").stdout == cold.exec("ls -A .").stdout
            assert sorted(s["id"] for s in c.list_sandboxes()) == sorted([warm.id, cold.id])
            until("the pool refills", lambda: pool(c, "warm")["ready"] == 2)
        finally:
            c.delete_sandbox(warm.id)
            c.delete_sandbox(cold.id)


def test_pools_from_the_cli(daemon: DaemonProcess) -> None:
    env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token, COLUMNS="200")

    def hutch_cli(*args: str) -> str:
        ran = subprocess.run([*HUTCH, "pool", *args], env=env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    hutch_cli("set", "small", "1", "--provider", "bubblewrap", "--set", "memory=256m")
    with hutch.Client(daemon.url, token=daemon.token) as c:
        until("the new pool fills", lambda: pool(c, "small")["ready"] == 1)
        listed = hutch_cli("ls")
        assert "small" in listed and "memory=256m" in listed and "warm" in listed
        hutch_cli("set", "small", "0")
        assert pool(c, "small")["ready"] == 0
        hutch_cli("rm", "small")
        assert [p["name"] for p in c.list_pools()] == ["warm"]
        with pytest.raises(hutch.NotFound):
            c.remove_pool("small")
        with pytest.raises(hutch.InvalidArgument):
            c.set_pool("bad name", 1, {"provider": "bubblewrap"})
