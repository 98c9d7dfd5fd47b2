"""The agent's own Go unit tests (``go test``, beside its source): what is
easier to pin in Go than through a sandbox, such as how a watch pairs a
rename's halves that come in two reads."""

from __future__ import annotations

import subprocess

from hutch.providers.agent.build import SOURCE_DIR, cache_root, go_environment, go_toolchain


def test_the_agents_go_tests_pass() -> None:
    go = go_toolchain()
    assert go is not None, "no Go toolchain (scripts/build-agent.sh installs golang-go)"
    result = subprocess.run(
        [go, "test", "-count=1", "."], cwd=SOURCE_DIR, env=go_environment(cache_root()),
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
