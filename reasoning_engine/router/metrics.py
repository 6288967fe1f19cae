"""The router's Prometheus metrics: per replica its state and counts (read from ReplicaState at scrape time), plus
the router's retries and broken streams. Each replica's engine metrics stay at the replica's own /metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reasoning_engine.router.policy import ReplicaState
from reasoning_engine.server.metrics import PREFIX

ROUTER_PREFIX = PREFIX + "router_"


class _ReplicaCollector(Collector):
    def __init__(self, replicas: list[ReplicaState]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        families = [
            (GaugeMetricFamily, "replica_up", "1 while the replica is taking requests, 0 once marked down.",
             lambda r: float(r.healthy)),
            (GaugeMetricFamily, "replica_in_flight", "Requests in flight on the replica through this router.",
             lambda r: r.in_flight),
            (GaugeMetricFamily, "replica_prefix_blocks", "Prompt blocks the router remembers sending the replica.",
             lambda r: len(r.prefix)),
            (CounterMetricFamily, "replica_requests", "Requests sent to the replica, retries included.",
             lambda r: r.requests),
            (CounterMetricFamily, "replica_failures", "Requests the replica failed (refused, timed out, 502-504, "
             "a broken stream).", lambda r: r.failures),
        ]
        for kind, name, doc, value in families:
            family = kind(ROUTER_PREFIX + name, doc, labels=["replica"])
            for replica in self._replicas:
                family.add_metric([replica.url], float(value(replica)))
            yield family


class RouterMetrics:
    def __init__(self, replicas: list[ReplicaState]) -> None:
        self.registry = CollectorRegistry()
        self.retries = Counter(ROUTER_PREFIX + "retries", "Requests sent again to another replica after one failed "
                               "before answering.", registry=self.registry)
        self.broken_streams = Counter(ROUTER_PREFIX + "broken_streams", "Streams ended with an in-band error "
                                      "because their replica failed mid-way.", registry=self.registry)
        self.registry.register(_ReplicaCollector(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)
