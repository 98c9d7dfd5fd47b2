"""The daemon's metrics (Prometheus), kept in a registry of its own that the
server exposes at ``/metrics``.

What the daemon already knows is read when the metrics are scraped (its
sandboxes by provider and state, the process's memory), not counted again by
hand; what happens (operations, transitions, store calls) is counted where it
happens: transitions where the daemon records them durably
(``Daemon._persist_transition``), store calls in the one async face every
daemon store call goes through (:class:`~hutch.store.aio.AsyncStore`), HTTP
operations by the server's middleware. Only prometheus_client's metric types
are used here: rendering the text format is the server's.
"""

from __future__ import annotations

import re
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ..states import FINAL, HELD, SandboxState

#: Latency buckets (seconds): from a hot exec (sub-millisecond) to a slow create.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 5.0)

#: A reason that is a word (``idle``, ``timeout_expired``) is its own label;
#: free text (a runtime's error) is not, or the label set would grow unbounded.
_REASON_WORD = re.compile(r"[a-z][a-z0-9_]{0,39}")


def reason_label(reason: str | None, *, default: str) -> str:
    """A transition's reason as a label of bounded cardinality."""
    if reason is None:
        return default
    return reason if _REASON_WORD.fullmatch(reason) else "other"


class _SandboxesCollector(Collector):
    """Sandboxes by provider and state, read from the daemon at scrape time."""

    def __init__(self, sandboxes: Callable[[], Iterable[tuple[str, SandboxState]]]) -> None:
        self._sandboxes = sandboxes

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "hutch_sandboxes", "Sandboxes this daemon serves, by provider and state.",
            labels=["provider", "state"])

    def describe(self) -> Iterator[Metric]:
        yield self._family()  # what registering checks, without reading the daemon

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        counts = Tally(self._sandboxes())
        # Every live state of each provider in use, zeros included: a state a
        # dashboard plots does not vanish when it empties.
        for provider in sorted({p for p, _ in counts}):
            for state in SandboxState:
                if state not in FINAL:
                    family.add_metric([provider, state.value], counts[(provider, state)])
        yield family


#: A warm pool as the metrics read it: name, size, ready now, creates that
#: took one, creates of its settings that found it empty.
PoolCounts = tuple[str, int, int, int, int]


class _PoolsCollector(Collector):
    """Warm pools' sizes, what they hold ready and their hits, read at scrape time."""

    def __init__(self, pools: Callable[[], Iterable[PoolCounts]]) -> None:
        self._pools = pools

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                             CounterMetricFamily]:
        return (
            GaugeMetricFamily("hutch_pool_size", "Sandboxes a warm pool keeps ready.",
                              labels=["pool"]),
            GaugeMetricFamily("hutch_pool_ready", "Sandboxes a warm pool holds ready now.",
                              labels=["pool"]),
            CounterMetricFamily("hutch_pool_hits", "Creates that took a warm pool's sandbox.",
                                labels=["pool"]),
            CounterMetricFamily("hutch_pool_misses",
                                "Creates of a warm pool's settings that found it empty.",
                                labels=["pool"]),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        size, ready, hits, misses = self._families()
        for name, wanted, held, taken, missed in self._pools():
            size.add_metric([name], wanted)
            ready.add_metric([name], held)
            hits.add_metric([name], taken)
            misses.add_metric([name], missed)
        yield from (size, ready, hits, misses)


class DaemonMetrics:
    """One daemon's metrics; ``registry`` is what the server renders."""

    def __init__(
        self, sandboxes: Callable[[], Iterable[tuple[str, SandboxState]]],
        pools: Callable[[], Iterable[PoolCounts]] = tuple,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(_SandboxesCollector(sandboxes))
        r.register(_PoolsCollector(pools))
        # process_resident_memory_bytes and friends (from /proc; nothing where there is none).
        ProcessCollector(namespace="hutch_daemon", registry=r)
        self.operations = Histogram(
            "hutch_operation_duration_seconds",
            "API operations by method, route template and outcome (ok or the HTTP status).",
            ["method", "route", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.suspends = Counter(
            "hutch_suspends", "Sandboxes held (paused or suspended), by provider, how and cause.",
            ["provider", "to", "cause"], registry=r)
        self.resumes = Counter(
            "hutch_resumes", "Sandboxes resumed, by provider, the state left and cause.",
            ["provider", "from", "cause"], registry=r)
        self.reaps = Counter(
            "hutch_reaps", "Sandboxes ended, by provider, final state and reason.",
            ["provider", "state", "reason"], registry=r)
        self.store_calls = Histogram(
            "hutch_store_call_duration_seconds", "Store calls made by the daemon, by call.",
            ["call"], buckets=STORE_BUCKETS, registry=r)

    def transition(
        self, provider: str, old: SandboxState, new: SandboxState, reason: str | None
    ) -> None:
        """Count a transition recorded durably."""
        if new in HELD:
            self.suspends.labels(provider, new.value,
                                 reason_label(reason, default="requested")).inc()
        elif new is SandboxState.RUNNING and old in HELD:
            self.resumes.labels(provider, old.value,
                                reason_label(reason, default="requested")).inc()
        elif new in FINAL:
            self.reaps.labels(provider, new.value,
                              reason_label(reason, default="unknown")).inc()

    def store_call(self, call: str, seconds: float) -> None:
        self.store_calls.labels(call).observe(seconds)

    def operation(self, method: str, route: str, outcome: str, seconds: float) -> None:
        self.operations.labels(method, route, outcome).observe(seconds)
