"""The clusters this hutch home has made sandboxes in, remembered on disk
(``$HUTCH_HOME/kubernetes/clusters.json``): what a daemon starting up reaps,
lists snapshots of and watches, though a sandbox's settings name its cluster
and the provider's class-wide calls (``reap_orphans``, ``held_snapshots``,
``watch_runtimes``) are given none."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..._atomic import write_json
from ..._paths import hutch_home
from .config import KubernetesConfig

#: The settings that say which cluster and namespace (the rest is per sandbox).
CONNECTION = ("kubeconfig", "context", "in_cluster", "namespace")
#: Told of every cluster as it is first reached in this process (the watcher).
LISTENERS: list[Callable[[KubernetesConfig], None]] = []
_seen: set[str] = set()


def _path() -> str:
    return os.path.join(hutch_home(), "kubernetes", "clusters.json")


def key(config: KubernetesConfig) -> str:
    return json.dumps({k: getattr(config, k) for k in CONNECTION}, sort_keys=True)


@contextlib.contextmanager
def _locked() -> Iterator[list[dict[str, Any]]]:
    path = _path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                found: list[dict[str, Any]] = json.load(f)
        except (OSError, ValueError):
            found = []
        before = list(found)
        yield found
        if found != before:
            write_json(path, found, durable=False)


def remember(config: KubernetesConfig) -> None:
    """``config``'s cluster is one this home uses."""
    k = key(config)
    if k in _seen:
        return
    _seen.add(k)
    connection = json.loads(k)
    with _locked() as found:
        if connection not in found:
            found.append(connection)
    for listener in list(LISTENERS):
        listener(config)


def forget(config: KubernetesConfig) -> None:
    """A cluster that cannot be reached any more by its settings (its
    kubeconfig is gone): nothing of it is asked again."""
    connection = json.loads(key(config))
    _seen.discard(key(config))
    with _locked() as found:
        if connection in found:
            found.remove(connection)


def remembered() -> list[KubernetesConfig]:
    with _locked() as found:
        return [KubernetesConfig.model_validate(c) for c in found]
