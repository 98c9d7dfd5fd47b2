"""A sandbox's commands start with every signal at its default, whatever the
process that runs hutch does with its own.

A host process may ignore or block signals: ``nohup`` ignores SIGHUP, a test
runner's workers ignore SIGINT, a program blocks a signal it waits for.
Ignored dispositions and the signal mask survive ``exec``, so a command that a
host-spawning provider (``local``, ``bubblewrap``) starts as a plain child
would inherit them: ``kill -INT $$`` would not end it, and an agent's Ctrl-C
would do nothing. Each case runs hutch in a fresh interpreter that first
ignores SIGHUP and SIGINT and blocks SIGUSR1, then reads the command's own
``SigIgn``/``SigBlk`` from /proc and kills a shell with SIGINT.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import TEST_IMAGE

SCRIPT = textwrap.dedent("""
    import asyncio, json, signal, sys
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    import hutch
    from hutch.testing._exec import (
        check_executing_a_non_executable_is_permission_denied,
        check_missing_executable_is_file_not_found,
    )

    async def main(provider, options):
        options.setdefault("read_before_write", False)
        async with await hutch.create_sandbox(provider, **options) as sb:
            status = await sb.exec(["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"])
            # The command is started as given: its argv[0] is not rewritten.
            argv0 = await sb.exec(["sh", "-c", "xargs -0 < /proc/$$/cmdline"])
            killed = await sb.exec("kill -INT $$; echo survived")
            background = await sb.start("kill -INT $$; echo survived")
            waited = await background.wait()
            # What exec answers for a command it cannot run stays the same
            # when the command is started through the reset.
            await check_missing_executable_is_file_not_found(sb)
            await check_executing_a_non_executable_is_permission_denied(sb)
        print(json.dumps({
            "status": status.stdout,
            "argv0": argv0.stdout,
            "killed": [killed.exit_code, killed.stdout],
            "background": [waited.exit_code, waited.stdout],
        }))

    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
""")


CASES = {
    "local": ("local", {}),
    "bubblewrap-agent": (
        "bubblewrap", {"image": TEST_IMAGE, "runtime": "agent", "ephemeral": True},
    ),
    "bubblewrap-native": (
        "bubblewrap", {"image": TEST_IMAGE, "runtime": "native", "ephemeral": True},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_commands_start_with_default_signals_under_a_host_that_ignores_and_blocks_some(
    case: str, tmp_path: Path,
) -> None:
    provider, options = CASES[case]
    if provider == "local":
        options = {"workdir": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, provider, json.dumps(options)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    fields = dict(line.split(":\t") for line in seen["status"].splitlines())
    assert int(fields["SigIgn"], 16) == 0, seen
    assert int(fields["SigBlk"], 16) == 0, seen
    assert seen["argv0"].startswith("sh -c "), seen
    assert seen["killed"] == [130, ""], seen
    assert seen["background"] == [130, ""], seen


def _proc_signals(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as fh:
        return {k: int(v, 16) for k, v in (line.split(":\t") for line in fh)
                if k in ("SigIgn", "SigCgt")}


def _bit(signum: int) -> int:
    return 1 << (signum - 1)


def test_a_daemon_started_ignoring_signals_shrugs_them_off_and_its_commands_do_not(
    tmp_path: Path,
) -> None:
    # As nohup (SIGHUP) and a background shell job (SIGQUIT) start it: the
    # daemon still lives through them, catching them rather than ignoring
    # them, so its commands start with them at their defaults as plain
    # children (no exec through env(1) to reset them).
    import signal

    import hutch
    from tests.daemon_fixture import DaemonProcess

    shrugged = (signal.SIGHUP, signal.SIGQUIT)
    before = {s: signal.signal(s, signal.SIG_IGN) for s in shrugged}
    try:
        daemon = DaemonProcess().start()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    try:
        assert daemon.proc is not None
        seen = _proc_signals(daemon.proc.pid)
        for s in shrugged:
            assert not seen["SigIgn"] & _bit(s), seen
            assert seen["SigCgt"] & _bit(s), seen
        with hutch.Client(daemon.url, token=daemon.token) as client:
            sb = client.create_sandbox("local", workdir=str(tmp_path))
            status = sb.exec(["grep", "-E", "^SigIgn:", "/proc/self/status"])
            assert int(status.stdout.split(":\t")[1], 16) == 0, status.stdout
            hung_up = sb.exec("kill -HUP $$; echo survived")
            assert (hung_up.exit_code, hung_up.stdout) == (128 + signal.SIGHUP, ""), hung_up
            for s in shrugged:
                daemon.proc.send_signal(s)
            assert sb.exec(["true"]).exit_code == 0, "the daemon lives on"
            sb.close()
    finally:
        daemon.close()
