"""The ``hutch`` sandbox environment of inspect_ai: an eval of a small task
with ``sandbox="hutch"`` on docker end to end (mockllm: no network), and
inspect's own provider self-check suite through the environment, on docker
and on bubblewrap, in-process as a user gets it by default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("inspect_ai")

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput
from inspect_ai.scorer import includes
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.util import SandboxEnvironment, SandboxEnvironmentSpec, sandbox
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from hutch.inspect import HutchSandboxConfig, HutchSandboxEnvironment
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.docker]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: An image of the test image's with a user of E2B's shape (``user``, uid
#: 1000), built as ``hutch image build`` builds one from a Dockerfile: the
#: self-check runs as that user, whom file modes stop (root they do not).
USER_IMAGE = "hutch-inspect-user"
USER_DOCKERFILE = (f"FROM {TEST_IMAGE}\n"
                   "RUN useradd --create-home --shell /bin/bash --uid 1000 --user-group user\n")


# -- inspect's self-check suite ----------------------------------------------------------


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def user_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from hutch import images

    dockerfile = tmp_path_factory.mktemp("user-image") / "Dockerfile"
    dockerfile.write_text(USER_DOCKERFILE)
    images.build(USER_IMAGE, dockerfile=str(dockerfile), rebuild=True)
    try:
        yield USER_IMAGE
    finally:
        images.remove(USER_IMAGE, force=True)


@pytest.fixture(scope="module", params=["docker", "bubblewrap"])
async def held(
    request: pytest.FixtureRequest, anyio_backend: str, user_image: str
) -> AsyncIterator[Any]:
    """One sandbox for a provider's whole run of the suite (each check cleans
    up its own files), made and ended as a sample's is, its commands and
    files the non-root ``user``'s."""
    config = HutchSandboxConfig(provider=request.param, image=user_image, user="user")
    environments = await HutchSandboxEnvironment.sample_init("self-check", config, {})
    try:
        yield request.param, environments["default"]
    finally:
        await HutchSandboxEnvironment.sample_cleanup("self-check", config, environments, False)
        await HutchSandboxEnvironment.task_cleanup("self-check", config, True)


@pytest.fixture
async def sandbox_env(held: tuple[str, SandboxEnvironment]) -> SandboxEnvironment:
    return held[1]


async def test_a_configured_user_runs_commands_and_owns_what_it_writes(
    held: tuple[str, SandboxEnvironment],
) -> None:
    _, environment = held
    assert (await environment.exec(["id", "-un"])).stdout.strip() == "user"
    assert (await environment.exec(["id", "-un"], user="root")).stdout.strip() == "root"
    await environment.write_file("mine/owned.txt", "by user")
    owner = await environment.exec(["stat", "-c", "%U %G", "mine/owned.txt", "mine", "."])
    assert owner.stdout.split("\n")[:3] == ["user user"] * 3, owner
    await environment.exec(["rm", "-rf", "mine"])


def test_a_configured_user_is_a_user_name() -> None:
    with pytest.raises(ValueError, match="user"):
        HutchSandboxConfig(user="no body; rm -rf /")


# -- an eval end to end ------------------------------------------------------------------


@solver
def write_and_run() -> Any:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        box = sandbox()
        await box.write_file("work/answer.py", "print(6 * 7)\n")
        ran = await box.exec(["python3", "answer.py"], cwd="work")
        assert ran.success, ran.stderr
        state.metadata["sandbox_id"] = box.as_type(HutchSandboxEnvironment).sandbox.id
        state.output = ModelOutput.from_content("mockllm/model", ran.stdout)
        return state

    return solve


def run_eval(task: Task, log_dir: str) -> Any:
    """inspect's ``eval`` runs its own event loop: in a thread of its own, away
    from the loop this module's self-check fixtures keep running."""
    with ThreadPoolExecutor(1) as pool:
        [log] = pool.submit(eval, task, model="mockllm/model", log_dir=log_dir,
                            display="none").result()
    return log


def _containers(name: str) -> list[str]:
    done = subprocess.run(["docker", "ps", "-aq", "--filter", f"name={name}"],
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_an_eval_with_sandbox_hutch_runs_on_docker(tmp_path: Any) -> None:
    task = Task(
        dataset=[Sample(input="what is 6 * 7?", target="42", id=n) for n in (1, 2)],
        solver=write_and_run(), scorer=includes(),
        sandbox=SandboxEnvironmentSpec(
            "hutch", HutchSandboxConfig(provider="docker", image=TEST_IMAGE)),
    )
    log = run_eval(task, str(tmp_path))
    assert log.status == "success", log.error
    assert log.samples is not None and len(log.samples) == 2
    assert all(s.scores and s.scores["includes"].value == "C" for s in log.samples)
    made = {s.metadata["sandbox_id"] for s in log.samples}
    assert len(made) == 2  # one sandbox a sample
    for sandbox_id in made:  # and each removed with its sample
        assert not _containers(f"hutch-{sandbox_id}")


def test_a_hutch_toml_beside_the_task_configures_it(tmp_path: Any) -> None:
    config = tmp_path / "hutch.toml"
    config.write_text(f'[sandbox]\nprovider = "docker"\nimage = "{TEST_IMAGE}"\n'
                      '[inspect]\ndaemon = false\n')
    task = Task(dataset=[Sample(input="6 * 7?", target="42")], solver=write_and_run(),
                scorer=includes(), sandbox=("hutch", str(config)))
    log = run_eval(task, str(tmp_path / "logs"))
    assert log.status == "success", log.error
    assert log.samples and log.samples[0].scores["includes"].value == "C"


def test_installing_hutch_registers_the_environment_by_its_entry_point() -> None:
    """In a fresh interpreter, nothing of hutch imported: inspect finds
    ``hutch`` through the ``inspect_ai`` entry point of hutch's metadata."""
    code = ("from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
            "print(registry_find_sandboxenv('hutch').__module__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert done.stdout.strip() == "hutch.inspect.environment", done.stderr


# -- connection, daemon, definitions ------------------------------------------------------


async def _shell_through(command: str) -> tuple[int, str]:
    """Run what ``connection()`` says to type, with a script for its stdin."""
    import anyio

    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = await anyio.run_process(["bash", "-c", command], input=b"echo shell-says-hi; exit 3\n",
                                   env=env, check=False)
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


async def test_connection_opens_a_shell_in_the_sandbox(
    held: tuple[str, SandboxEnvironment],
) -> None:
    _, environment = held
    connection = await environment.connection()
    assert connection.type == "hutch" and "hutch shell" in connection.command
    code, output = await _shell_through(connection.command)
    assert (code, "shell-says-hi" in output) == (3, True), output


@pytest.mark.anyio
async def test_through_a_daemon_each_sample_gets_one_and_nothing_stays() -> None:
    from tests.daemon_fixture import DaemonProcess, client

    d = DaemonProcess().start()
    try:
        config = HutchSandboxConfig(url=d.url, token=d.token, provider="docker",
                                    image=TEST_IMAGE)
        environments = await HutchSandboxEnvironment.sample_init("via-daemon", config, {})
        box = environments["default"]
        await box.write_file("a/b.txt", "through the daemon")
        assert await box.read_file("a/b.txt") == "through the daemon"
        assert (await box.exec(["cat", "b.txt"], cwd="a")).stdout == "through the daemon"
        with pytest.raises(TimeoutError):
            await box.exec(["sleep", "30"], timeout=1)
        code, output = await _shell_through(
            f"HUTCH_TOKEN={d.token} " + (await box.connection()).command)
        assert (code, "shell-says-hi" in output) == (3, True), output
        await HutchSandboxEnvironment.sample_cleanup("via-daemon", config, environments, False)
        await HutchSandboxEnvironment.task_cleanup("via-daemon", config, True)
        with client(d) as c:
            assert not c.list_sandboxes()
    finally:
        d.close()


@pytest.mark.anyio
async def test_a_definition_is_ensured_per_sample_and_completed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A home of its own: the definition's set-up snapshot is kept there for
    # the next ensure (as a user's would be), and goes with the test's files.
    monkeypatch.setenv("HUTCH_HOME", str(tmp_path / "home"))
    config_file = tmp_path / "hutch.toml"
    config_file.write_text(
        '[definitions.prepared]\nprovider = "local"\n'
        '[definitions.prepared.workspace]\nsetup = ["echo set up > ready.txt"]\n'
        '[definitions.prepared.lifecycle]\ndestroy_on_complete = true\n'
        '[inspect]\ndefinition = "prepared"\n')
    config = HutchSandboxConfig(config_file=str(config_file))
    environments = await HutchSandboxEnvironment.sample_init("defined", config, {})
    box = environments["default"]
    assert await box.read_file("ready.txt") == "set up\n"
    sandbox = box.as_type(HutchSandboxEnvironment).sandbox
    await HutchSandboxEnvironment.sample_cleanup("defined", config, environments, False)
    assert sandbox.closed


@pytest.mark.anyio
async def test_with_no_provider_named_a_sample_gets_an_isolating_one() -> None:
    environments = await HutchSandboxEnvironment.sample_init("default", None, {})
    try:
        box = environments["default"].as_type(HutchSandboxEnvironment)
        # The Engine answers here: docker, as a daemon would pick (never local).
        assert box.sandbox.provider == "docker"  # type: ignore[attr-defined]
    finally:
        await HutchSandboxEnvironment.sample_cleanup("default", None, environments, False)


@pytest.mark.anyio
async def test_a_bad_config_fails_the_task_before_its_samples() -> None:
    from hutch import InvalidArgument

    with pytest.raises(InvalidArgument, match="unknown provider"):
        await HutchSandboxEnvironment.task_init("bad", HutchSandboxConfig(provider="nope"))


def test_a_bad_config_is_a_clear_error(tmp_path: Any) -> None:
    from hutch import InvalidArgument
    from hutch.inspect.config import config_of

    with pytest.raises(InvalidArgument, match="does not exist"):
        config_of(str(tmp_path / "absent.toml"))
    with pytest.raises(ValueError, match="extra"):
        config_of({"provider": "docker", "imgae": "typo"})
