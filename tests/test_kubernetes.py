"""The kubernetes provider against the API stand-in (tests/kube_standin.py).

The whole conformance suite runs on it with
``HUTCH_CONFORMANCE_PROVIDERS=kubernetes``; these are the quick checks of
every run: the pod's life, exec over the channel protocol, files, and the
parts of the API contract the provider leans on.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.kube_standin import KubeStandin

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture(scope="module")
def standin() -> Iterator[KubeStandin]:
    server = KubeStandin().start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)


async def _sandbox(standin: KubeStandin) -> Any:
    return await hutch.create_sandbox(
        "kubernetes", kubeconfig=standin.kubeconfig, image=TEST_IMAGE, read_before_write=False)


async def test_a_sandbox_is_a_pod_that_runs_commands_and_holds_files(
        standin: KubeStandin) -> None:
    async with await _sandbox(standin) as sb:
        pods = list(standin.objects["pods"].values())
        assert len(pods) == 1
        labels = pods[0]["metadata"]["labels"]
        assert labels["hutch.dev/sandbox"] == sb.id.lower() and labels["hutch.dev/home"]
        result = await sb.exec(["sh", "-c", "cat; echo oops >&2; exit 3"], stdin="fed")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "fed", "oops\n")
        assert (await sb.exec("pwd")).stdout.strip() == sb.workdir
        await sb.write_text("deep/er/a.txt", "hello\n")
        assert await sb.read_text("deep/er/a.txt") == "hello\n"
        assert (await sb.exec(["cat", "deep/er/a.txt"])).stdout == "hello\n"
        assert (await sb.exec(["id", "-un"], user="nobody")).stdout.strip() == "nobody"
        with pytest.raises(FileNotFoundError):
            await sb.exec(["hutch-no-such-command"])
        process = await sb.start(["sleep", "300"])
        await process.kill()
        assert (await process.wait()).exit_code != 0
    # Closed: the pod and its container are gone.
    assert standin.objects["pods"] == {}


def test_the_standin_keeps_the_api_contract(standin: KubeStandin) -> None:
    base = f"{standin.url}/api/v1/namespaces/{standin.namespace}/persistentvolumeclaims"
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "hutch-contract"}, "spec": {}}
    with httpx.Client() as http:
        made = http.post(base, json=claim)
        assert made.status_code == 201
        uid = made.json()["metadata"]["uid"]
        again = http.post(base, json=claim)
        assert (again.status_code, again.json()["reason"]) == (409, "AlreadyExists")
        wrong = http.request("DELETE", base + "/hutch-contract",
                             json={"preconditions": {"uid": "not-" + uid}})
        assert (wrong.status_code, wrong.json()["reason"]) == (409, "Conflict")
        assert http.request("DELETE", base + "/hutch-contract",
                            json={"preconditions": {"uid": uid}}).status_code == 200
        gone = http.get(base + "/hutch-contract")
        assert (gone.status_code, gone.json()["reason"]) == (404, "NotFound")
