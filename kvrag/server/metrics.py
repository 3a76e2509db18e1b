"""The server's metrics, in Prometheus' text format at ``GET /metrics``.

One registry per app (so several apps in one process, as in tests, never share counters):

- ``kvrag_requests_total{endpoint, outcome}``: requests by endpoint and outcome (``ok``,
  ``cancelled`` when the client went away first, ``error``).
- ``kvrag_requests_waiting`` / ``kvrag_requests_running``: admitted requests before / after their
  first token (the queue, and the streams being decoded).
- ``kvrag_time_to_first_token_seconds``, ``kvrag_request_seconds``: histograms (engine time).
- ``kvrag_prompt_tokens_total``, ``kvrag_cached_tokens_total``, ``kvrag_recomputed_tokens_total``,
  ``kvrag_completion_tokens_total``: tokens of finished requests.
- ``kvrag_chunk_hits_total``, ``kvrag_chunk_misses_total``: chunks whose KV was / was not reused.
- ``kvrag_store_bytes{tier}``, ``kvrag_store_tokens{tier}``, ``kvrag_store_entries{tier}``,
  ``kvrag_store_budget_bytes{tier}``: what the KV store holds now, per tier (``memory``, ``disk``,
  ``remote``; a figure a tier does not keep is left out), and ``kvrag_store_evictions_total{tier}``:
  entries it evicted. Read from the engine's ``store.stats()`` at each scrape.
- ``kvrag_writeback_queued``, ``kvrag_writeback_queued_bytes``: write-back jobs waiting now and the
  bytes of KV they hold; ``kvrag_writeback_dropped_total``: jobs dropped because the queue was full
  (the answers were unaffected). Read from the engine's ``writeback.stats()`` at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvrag.engine import Engine, Generation

__all__ = ["Metrics", "RequestTrack", "StoreCollector", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


_TIERS = ("memory", "disk", "remote")
#: store.stats() key -> (gauge name, help) of the figures held now, per tier
_STORE_GAUGES = {
    "bytes": ("kvrag_store_bytes", "Bytes of KV the store holds, per tier"),
    "tokens": ("kvrag_store_tokens", "Tokens of KV the store holds, per tier"),
    "entries": ("kvrag_store_entries", "Entries the store holds, per tier"),
    "budget_bytes": ("kvrag_store_budget_bytes", "Bytes of KV a tier may hold"),
}


class StoreCollector(Collector):
    """The engine's KV store, per tier, and its write-back queue, read at each scrape
    (:meth:`~kvrag.engine.store.base.KVStore.stats`, :meth:`~kvrag.engine.serving.writeback.WriteBack.stats`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.store.stats()
        # a tiered store reports each tier under its name; a single memory store reports its own figures
        tiers = {t: stats[t] for t in _TIERS if isinstance(stats.get(t), dict)}
        if not tiers and "bytes" in stats:
            tiers = {"memory": stats}
        for key, (name, text) in _STORE_GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=["tier"])
            for tier, figures in tiers.items():
                if isinstance(figures.get(key), (int, float)):
                    family.add_metric([tier], figures[key])
            yield family
        evictions = CounterMetricFamily("kvrag_store_evictions", "Entries the store evicted, per tier", labels=["tier"])
        for tier, figures in tiers.items():
            if isinstance(figures.get("evictions"), int):
                evictions.add_metric([tier], figures["evictions"])
        yield evictions
        wb = self.engine.writeback.stats()
        yield GaugeMetricFamily("kvrag_writeback_queued", "Write-back jobs waiting now", value=wb["queued"])
        yield GaugeMetricFamily(
            "kvrag_writeback_queued_bytes", "Bytes of KV the waiting write-back jobs hold", value=wb["queued_bytes"]
        )
        yield CounterMetricFamily(
            "kvrag_writeback_dropped", "Write-back jobs dropped: the queue was full", value=wb["dropped"]
        )


class Metrics:
    """The counters of one server; :meth:`render` is the ``/metrics`` body.

    Args:
        engine: the engine whose store figures are read at each scrape (``None``: none).
    """

    def __init__(self, engine: Engine | None = None) -> None:
        r = self.registry = CollectorRegistry()
        if engine is not None:
            r.register(StoreCollector(engine))
        self.requests = Counter(
            "kvrag_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.waiting = Gauge("kvrag_requests_waiting", "Admitted requests before their first token", registry=r)
        self.running = Gauge("kvrag_requests_running", "Requests past their first token, decoding", registry=r)
        self.ttft = Histogram(
            "kvrag_time_to_first_token_seconds", "Engine time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "kvrag_request_seconds", "Engine time of a whole request", buckets=_TTFT_BUCKETS, registry=r
        )
        self.tokens = {
            name: Counter(f"kvrag_{name}", f"{name.replace('_', ' ').capitalize()} of finished requests", registry=r)
            for name in ("prompt_tokens", "cached_tokens", "recomputed_tokens", "completion_tokens")
        }
        self.chunk_hits = Counter("kvrag_chunk_hits", "Chunks whose cached KV was reused", registry=r)
        self.chunk_misses = Counter("kvrag_chunk_misses", "Chunks whose KV was computed", registry=r)

    def track(self, endpoint: str) -> RequestTrack:
        """Count a request admitted now: waiting until :meth:`RequestTrack.started`, then running."""
        return RequestTrack(self, endpoint)

    def finished(self, generation: Generation) -> None:
        s = generation.stats
        self.ttft.observe(generation.ttft_s)
        self.latency.observe(generation.total_s)
        for name, value in (
            ("prompt_tokens", s.prompt_tokens),
            ("cached_tokens", s.cached_tokens),
            ("recomputed_tokens", s.recomputed_tokens),
            ("completion_tokens", s.completion_tokens),
        ):
            self.tokens[name].inc(value)
        self.chunk_hits.inc(s.chunk_hits)
        self.chunk_misses.inc(s.chunk_misses)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTrack:
    """One request in the ``waiting`` / ``running`` gauges, and its outcome in ``kvrag_requests_total``."""

    def __init__(self, metrics: Metrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._started = False
        self._ended = False
        metrics.waiting.inc()

    def started(self) -> None:
        """The first token (or the end) came: the request leaves the queue."""
        if not self._started and not self._ended:
            self._started = True
            self._metrics.waiting.dec()
            self._metrics.running.inc()

    def end(self, outcome: str) -> None:
        """``ok``, ``cancelled`` or ``error``; only the first call counts."""
        if self._ended:
            return
        self._ended = True
        (self._metrics.running if self._started else self._metrics.waiting).dec()
        self._metrics.requests.labels(self._endpoint, outcome).inc()
