"""Prometheus metrics named like vLLM's (`vllm:` becomes `reasoning_engine:`), so existing dashboards carry over.

Each app owns its CollectorRegistry (tests start several apps in one process). Request-level figures are
recorded by the serving code as requests progress; engine state (queue lengths, KV usage, prefix-cache,
vision-encoder and speculative-decoding counters) is read from `engine.stats()` at scrape time, so it is never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "reasoning_engine:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the engine's state when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_requests_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_requests_waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0..1).", stats.kv_cache_usage),
            "kv_cache_free_blocks": ("KV-cache blocks free.", stats.free_blocks),
            "kv_cache_total_blocks": ("KV-cache blocks in all.", stats.total_blocks),
            "kv_offload_host_bytes": ("Bytes of KV blocks held in the host-memory tier (rank 0's).",
                                      getattr(stats, "kv_offload_host_bytes", 0)),
            "kv_offload_disk_bytes": ("Bytes of KV block files in the disk tier (rank 0's).",
                                      getattr(stats, "kv_offload_disk_bytes", 0)),
        }
        if getattr(stats, "state_cache_usage", None) is not None:  # hybrid models' linear-attention state group
            gauges["state_cache_usage_perc"] = ("Fraction of linear-attention state slots in use, live and snapshots "
                                                "(0..1).", stats.state_cache_usage)
            gauges["state_cache_snapshots"] = ("Linear-attention state snapshots kept for prefix-cache hits.",
                                               stats.state_cache_snapshots)
        for name, (doc, value) in gauges.items():
            yield self._one(GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"]), value)
        by_group = GaugeMetricFamily(PREFIX + "kv_cache_group_usage_perc",
                                     "Fraction of KV-cache blocks held by each cache group (0..1).",
                                     labels=["model_name", "group"])
        for group, value in sorted(getattr(stats, "kv_cache_group_usage", {}).items()):
            by_group.add_metric([self._model, group], float(value))
        yield by_group
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            "encoder_cache_hits": ("Images and video chunks whose vision-encoder output was cached.",
                                   stats.encoder_cache_hits),
            "encoder_cache_misses": ("Images and video chunks run through the vision encoder.",
                                     stats.encoder_cache_misses),
            "encoder_seconds": ("Seconds spent in the vision encoder.", stats.encoder_seconds),
            "kv_offload_host_hits": ("Prompt tokens copied back from the host-memory KV tier instead of recomputed.",
                                     getattr(stats, "kv_offload_host_hits", 0)),
            "kv_offload_disk_hits": ("Prompt tokens read back from the disk KV tier instead of recomputed.",
                                     getattr(stats, "kv_offload_disk_hits", 0)),
            "kv_offload_host_stored_blocks": ("KV blocks copied from the device to the host-memory tier.",
                                              getattr(stats, "kv_offload_host_stored_blocks", 0)),
            "kv_offload_disk_stored_blocks": ("KV blocks written from the host-memory tier to disk.",
                                              getattr(stats, "kv_offload_disk_stored_blocks", 0)),
            "kv_offload_damaged_entries": ("Disk KV files skipped for a bad checksum, header or length.",
                                           getattr(stats, "kv_offload_damaged_entries", 0)),
            "num_preemptions": ("Requests preempted (their KV freed, recomputed later) for want of KV blocks.",
                                stats.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            yield self._one(CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]), value)
        yield from self._spec_decode(stats.spec_decode)
        for name, value in sorted(getattr(stats, "adaptive", {}).items()):
            yield self._one(GaugeMetricFamily(f"{PREFIX}adaptive_{name}", f"Adaptive engine: {name}.",
                                              labels=["model_name"]), value)
        for name, value in sorted(getattr(stats, "adaptive_counters", {}).items()):
            yield self._one(CounterMetricFamily(f"{PREFIX}adaptive_{name}", f"Adaptive engine: {name}.",
                                                labels=["model_name"]), value)

    def _spec_decode(self, counters: Mapping[str, Any]) -> Iterator[Metric]:
        """`{"num_drafts": 3, "num_accepted_tokens_per_pos": [5, 2]}` -> spec_decode_num_drafts_total and a
        per-position counter labelled `position`."""
        for key, value in sorted(counters.items()):
            if not isinstance(value, (int, float, list)):  # the method name, per-method breakdowns
                continue
            labels = ["model_name", "position"] if isinstance(value, list) else ["model_name"]
            family = CounterMetricFamily(f"{PREFIX}spec_decode_{key}", f"Speculative decoding: {key}.", labels=labels)
            if isinstance(value, list):
                for position, count in enumerate(value):
                    family.add_metric([self._model, str(position)], float(count))
            else:
                family.add_metric([self._model], float(value))
            yield family

    def _one(self, family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
        family.add_metric([self._model], float(value))
        return family


class ServerMetrics:
    """The app's registry and the per-request instruments the serving code updates."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (thinking included).")
        self.reasoning_tokens = counter("reasoning_tokens", "Generated tokens inside the thinking.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.ttfat = histogram("time_to_first_answer_token_seconds",
                               "Arrival to the first answer token after the thinking.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _E2E_BUCKETS)
        for metric in (self.prompt_tokens, self.generation_tokens, self.reasoning_tokens, self.ttft, self.ttfat,
                       self.itl, self.e2e):
            metric.labels(model_name)  # every series exists from the start, at zero
        reg.register(_EngineCollector(stats, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's instants, fed as output arrives, recorded into ServerMetrics when it ends."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.first_answer: float | None = None
        self._last: float | None = None

    def tokens(self, now: float, count: int) -> None:
        """`count` new tokens arrived at `now` (several at once with speculative decoding: the gap is shared)."""
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
            self._metrics.ttft.labels(self._metrics.model_name).observe(now - self.arrival)
        elif self._last is not None:
            gap = (now - self._last) / count
            for _ in range(count):
                self._metrics.itl.labels(self._metrics.model_name).observe(gap)
        self._last = now

    def answer(self, now: float) -> None:
        if self.first_answer is None:
            self.first_answer = now
            self._metrics.ttfat.labels(self._metrics.model_name).observe(now - self.arrival)

    def finish(self, now: float, prompt_tokens: int, generated: int, reasoning: int, reasons: list[str]) -> None:
        m, name = self._metrics, self._metrics.model_name
        m.e2e.labels(name).observe(now - self.arrival)
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(generated)
        m.reasoning_tokens.labels(name).inc(reasoning)
        for reason in reasons:
            m.request_success.labels(name, reason).inc()
