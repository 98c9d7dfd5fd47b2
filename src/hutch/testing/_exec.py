"""Exec: the same on every provider that runs processes (one that does not
must refuse it)."""

from __future__ import annotations

import time
from typing import Any

import hutch

from ._support import Case, raises, runs_processes


async def check_stdout_stderr_and_exit_code_are_data(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec("echo out; echo err >&2; exit 7")
    assert result.exit_code == 7
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert not result.success


async def check_argv_runs_without_a_shell(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["echo", "$HOME", "a b", "it's"])
    assert result.stdout == "$HOME a b it's\n"


async def check_string_runs_in_bash(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec("echo ${BASH_VERSION:+bash}; x=(1 2 3); echo ${#x[@]}")
    assert result.stdout == "bash\n3\n"


async def check_utf8_output(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["printf", "%s", "héllo wörld € 漢字 🎉"])
    assert result.stdout == "héllo wörld € 漢字 🎉"


async def check_non_utf8_output_is_kept_as_bytes(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec("printf '\\377\\376\\000x'")
    assert result.stdout_bytes == b"\xff\xfe\x00x"


async def check_stdin_text(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["cat"], stdin="line one\nline two\n")
    assert result.stdout == "line one\nline two\n"


async def check_stdin_binary(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    payload = bytes(range(256)) * 4
    result = await sandbox.exec(["cat"], stdin=payload)
    assert result.stdout_bytes == payload


async def check_stdin_large(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    payload = b"0123456789abcdef" * (4 * 1024 * 1024 // 16)  # 4 MiB
    result = await sandbox.exec("wc -c", stdin=payload)
    assert result.stdout.strip() == str(len(payload))


async def check_no_stdin_means_eof(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["cat"], timeout=10)
    assert result.exit_code == 0
    assert result.stdout == ""


async def check_env_is_passed(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(
        'printf "%s|%s" "$HUTCH_A" "$HUTCH_B"', env={"HUTCH_A": "one two", "HUTCH_B": "ü=\"q\""}
    )
    assert result.stdout == 'one two|ü="q"'


async def check_default_cwd_is_the_working_directory(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["pwd"])
    assert result.stdout.strip() == sandbox.workdir


async def check_relative_cwd(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    await sandbox.exec(["mkdir", "-p", "sub/dir"])
    result = await sandbox.exec(["pwd"], cwd="sub/dir")
    assert result.stdout.strip() == f"{sandbox.workdir}/sub/dir"


async def check_absolute_cwd(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["pwd"], cwd="/tmp")
    assert result.stdout.strip() == "/tmp"


async def check_missing_cwd_is_file_not_found(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    with raises(FileNotFoundError) as info:
        await sandbox.exec(["pwd"], cwd="does/not/exist")
    assert isinstance(info.value, hutch.HutchError)
    assert getattr(info.value, "code", None) == "file_not_found"
    assert "does/not/exist" in str(info.value)


async def check_user(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["id", "-un"], user="nobody")
    assert result.stdout.strip() == "nobody"
    root = await sandbox.exec(["id", "-u"])
    assert root.exit_code == 0


async def check_an_unknown_user_is_a_command_that_failed_to_start(sandbox: Any) -> None:
    # As on every other execution API: a result (exit 126, the reason on
    # stderr), not an error; in the background and streamed alike.
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec(["true"], user="hutch-no-such-user")
    assert result.exit_code == 126, result
    assert "no such user 'hutch-no-such-user'" in result.stderr
    process = await sandbox.start(["true"], user="hutch-no-such-user")
    assert (await process.wait()).exit_code == 126
    events = [e async for e in sandbox.exec_stream(["true"], user="hutch-no-such-user")]
    assert getattr(events[-1], "exit_code", None) == 126, events


async def check_user_cannot_read_root_only_file(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    await sandbox.exec("echo secret > /tmp/hutch-root-only && chmod 600 /tmp/hutch-root-only")
    result = await sandbox.exec(["cat", "/tmp/hutch-root-only"], user="nobody")
    assert result.exit_code != 0
    assert "secret" not in result.stdout
    await sandbox.exec(["rm", "-f", "/tmp/hutch-root-only"])


async def check_missing_executable_is_file_not_found(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    with raises(FileNotFoundError) as info:
        await sandbox.exec(["hutch-no-such-command"])
    assert getattr(info.value, "code", None) == "file_not_found"


async def check_executing_a_non_executable_is_permission_denied(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    await sandbox.write_text("script.sh", "#!/bin/sh\necho hi\n")
    with raises(PermissionError) as info:
        await sandbox.exec(["./script.sh"])
    assert getattr(info.value, "code", None) == "permission_denied"


async def check_shell_command_not_found_is_exit_127(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec("hutch-no-such-command")
    assert result.exit_code == 127


async def check_timeout_kills_the_whole_tree(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    # A child that ignores SIGTERM, and a grandchild that left the process group.
    marker = f"hutch-timeout-{time.monotonic_ns()}"
    cmd = (
        f"(trap '' TERM; exec -a {marker} sleep 300) & "
        f"setsid sh -c 'exec -a {marker}-setsid sleep 300' 2>/dev/null & "
        f"trap '' TERM; sleep 300"
    )
    started = time.monotonic()
    with raises(TimeoutError) as info:
        await sandbox.exec(["bash", "-c", cmd], timeout=1)
    assert getattr(info.value, "code", None) == "exec_timeout"
    assert time.monotonic() - started < 15
    leftover = await sandbox.exec(
        f"for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done "
        f"| grep -c '^{marker}' || true"
    )
    assert leftover.stdout.strip() == "0", "a process of the timed-out command survived"


async def check_output_cap(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    with raises(hutch.OutputLimitExceeded) as info:
        await sandbox.exec("head -c 3000000 /dev/zero", output_limit=1_000_000)
    assert getattr(info.value, "code", None) == "output_limit_exceeded"
    assert "1000000" in str(info.value)


async def check_output_under_the_cap(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    result = await sandbox.exec("head -c 999999 /dev/zero", output_limit=1_000_000)
    assert len(result.stdout_bytes) == 999_999


async def check_streamed_output_arrives_as_produced(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    events = []
    first_at = None
    started = time.monotonic()
    async for event in sandbox.exec_stream("echo one; sleep 1; echo two; echo err >&2"):
        if first_at is None:
            first_at = time.monotonic() - started
        events.append(event)
    assert first_at is not None and first_at < 0.9, "first chunk waited for the command to end"
    chunks = [e for e in events if isinstance(e, hutch.OutputChunk)]
    out = b"".join(c.data for c in chunks if c.stream == "stdout")
    err = b"".join(c.data for c in chunks if c.stream == "stderr")
    assert out == b"one\ntwo\n"
    assert err == b"err\n"
    assert events[-1] == hutch.ExitStatus(0)


async def check_background_command_wait(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("sleep 0.3; echo done; exit 3")
    assert process.running
    result = await process.wait(timeout=20)
    assert (result.exit_code, result.stdout) == (3, "done\n")
    assert not process.running


async def check_background_command_stream(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("for i in 1 2 3; do echo $i; sleep 0.1; done")
    seen = [e async for e in process.stream()]
    assert b"".join(e.data for e in seen if isinstance(e, hutch.OutputChunk)) == b"1\n2\n3\n"
    assert seen[-1] == hutch.ExitStatus(0)


async def check_background_command_kill(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("trap '' TERM; sleep 300")
    await process.kill()
    assert not process.running
    result = await process.wait(timeout=5)
    assert result.exit_code != 0


async def check_background_wait_timeout_leaves_it_running(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("sleep 2")
    with raises(TimeoutError):
        await process.wait(timeout=0.2)
    assert process.running
    await process.kill()


async def check_invalid_timeout_is_rejected(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    with raises(ValueError):
        await sandbox.exec(["true"], timeout=0)


async def check_empty_command_is_rejected(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    with raises(hutch.InvalidArgument):
        await sandbox.exec([])


async def check_a_command_killed_by_a_signal_exits_128_plus_n(sandbox: Any) -> None:
    """The same number on every provider and runtime, run, streamed or started."""
    if not await runs_processes(sandbox):
        return
    assert (await sandbox.exec("kill -TERM $$")).exit_code == 128 + 15
    assert (await sandbox.exec(["sh", "-c", "kill -KILL $$"])).exit_code == 128 + 9
    streamed = [e async for e in sandbox.exec_stream("kill -INT $$")
                if isinstance(e, hutch.ExitStatus)]
    assert [e.exit_code for e in streamed] == [128 + 2]
    started = await sandbox.start(["sh", "-c", "kill -HUP $$"])
    assert (await started.wait()).exit_code == 128 + 1


async def check_commands_start_with_default_signals(sandbox: Any) -> None:
    """No signal ignored or blocked in a command, whatever the process that
    started it does with its own (a daemon under nohup ignores SIGHUP, an
    agent ignores SIGPIPE for itself): otherwise ``yes | head`` complains
    of a broken pipe and an interrupt does not interrupt."""
    if not await runs_processes(sandbox):
        return
    # Where the kernel reports them: gVisor's /proc (2022) has no Sig lines,
    # and there the behaviour they cause is checked below all the same.
    reported = await sandbox.exec(["grep", "-c", "^Sig", "/proc/self/status"])
    for run in ("exec", "start") if reported.stdout.strip() != "0" else ():
        argv = ["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"]
        if run == "exec":
            result = await sandbox.exec(argv)
        else:
            result = await (await sandbox.start(argv)).wait()
        assert result.exit_code == 0, result
        fields = dict(line.split(":", 1) for line in result.stdout.splitlines())
        assert {name: int(value, 16) for name, value in fields.items()} == {
            "SigIgn": 0, "SigBlk": 0,
        }, (run, result.stdout)
    piped = await sandbox.exec("yes | head -n 1")
    assert (piped.exit_code, piped.stdout, piped.stderr) == (0, "y\n", "")


EXEC_CASES: list[Case] = [
    check_stdout_stderr_and_exit_code_are_data,
    check_argv_runs_without_a_shell,
    check_string_runs_in_bash,
    check_utf8_output,
    check_non_utf8_output_is_kept_as_bytes,
    check_stdin_text,
    check_stdin_binary,
    check_stdin_large,
    check_no_stdin_means_eof,
    check_env_is_passed,
    check_default_cwd_is_the_working_directory,
    check_relative_cwd,
    check_absolute_cwd,
    check_missing_cwd_is_file_not_found,
    check_user,
    check_an_unknown_user_is_a_command_that_failed_to_start,
    check_user_cannot_read_root_only_file,
    check_missing_executable_is_file_not_found,
    check_executing_a_non_executable_is_permission_denied,
    check_shell_command_not_found_is_exit_127,
    check_timeout_kills_the_whole_tree,
    check_output_cap,
    check_output_under_the_cap,
    check_streamed_output_arrives_as_produced,
    check_background_command_wait,
    check_background_command_stream,
    check_background_command_kill,
    check_background_wait_timeout_leaves_it_running,
    check_invalid_timeout_is_rejected,
    check_empty_command_is_rejected,
    check_a_command_killed_by_a_signal_exits_128_plus_n,
    check_commands_start_with_default_signals,
]
