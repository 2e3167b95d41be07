"""GET /metrics: request outcomes and latencies seen by the frontend, and the
worker's load as its latest heartbeat reports it.

Each app has its own registry, so that several apps in one process (tests) do
not share counters. Worker gauges are read at scrape time from the liveness
state, which heartbeats keep current; nothing polls the worker for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from frontend.health import pool_load
from frontend.worker_client import WorkerClient
from protocol import GenerateResult

CONTENT_TYPE = CONTENT_TYPE_LATEST
NO_FINISH_REASON = "none"  # no generation finished: an HTTP error, or a tokenizer call
# Calls that run the tokenizer, not the model: counted as requests, and kept out
# of the token and latency metrics, which are the model's.
TOKENIZER_ENDPOINTS = ("/tokenize", "/detokenize")
UNROUTED = "other"  # the endpoint label of a request refused before it was routed

_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    def __init__(self, client: WorkerClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "minibatch_requests",
            "Requests answered, by endpoint, HTTP status and finish reason "
            "(status 499: the client hung up and the request was aborted)",
            ["endpoint", "status", "finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "minibatch_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.generation_tokens = Counter(
            "minibatch_generation_tokens",
            "Tokens generated for finished requests",
            registry=registry,
        )
        # In tokens, as vLLM counts them: prompt tokens looked up, and those found.
        self.prefix_cache_queries = Counter(
            "minibatch_prefix_cache_queries",
            "Prompt tokens of finished requests looked up in the workers' prefix caches "
            "(none with the cache off, nor of a scored prompt)",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "minibatch_prefix_cache_hits",
            "Prompt tokens of finished requests whose keys and values a prefix cache held",
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "minibatch_e2e_request_latency_seconds",
            "From accepting a request to its result",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.queue_time = Histogram(
            "minibatch_request_queue_time_seconds",
            "Time a request waited for a slot, in the frontend's line and the worker's queue",
            buckets=_TTFT_BUCKETS_S,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "minibatch_time_to_first_token_seconds",
            "From accepting a streaming request to its first token",
            buckets=_TTFT_BUCKETS_S,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "minibatch_inter_token_latency_seconds",
            "Time between consecutive tokens of a streaming request",
            buckets=_ITL_BUCKETS_S,
            registry=registry,
        )
        registry.register(_WorkerCollector(client))

    def count_request(self, endpoint: str, status: int, finish_reason: str) -> None:
        self.requests.labels(endpoint, str(status), finish_reason).inc()

    def observe_results(
        self, endpoint: str, results: Sequence[GenerateResult], e2e_s: float
    ) -> None:
        """One request's answer, whatever its number of choices: one request, with
        its first choice's finish reason; its prompt once; every choice's tokens;
        the longest of its choices' waits for a slot. A tokenizer call counts as a
        request alone."""
        if endpoint in TOKENIZER_ENDPOINTS:
            self.count_request(endpoint, 200, NO_FINISH_REASON)
            return
        self.count_request(endpoint, 200, results[0].finish_reason)
        self.prompt_tokens.inc(results[0].prompt_tokens)
        for result in results:  # each choice looked its prompt up
            self.prefix_cache_queries.inc(result.looked_up_tokens)
            self.prefix_cache_hits.inc(result.cached_tokens)
        self.generation_tokens.inc(sum(result.completion_tokens for result in results))
        self.e2e_latency.observe(e2e_s)
        self.queue_time.observe(max(result.queue_wait_ms for result in results) / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
    """Gauges from the worker's hello and latest heartbeat, read at scrape time."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        load = pool_load(self.client)
        yield GaugeMetricFamily(
            "minibatch_worker_up",
            "Workers live, judged from connections and heartbeats",
            len(load.live),
        )
        yield GaugeMetricFamily(
            "minibatch_worker_stopping",
            "Live workers that are stopping: they finish what they run and take nothing new",
            sum(worker.is_stopping for worker in load.live),
        )
        yield CounterMetricFamily(
            "minibatch_worker_restarts",
            "Times a new worker instance replaced the previous one at its address",
            load.num_restarts,
        )
        yield GaugeMetricFamily(
            "minibatch_frontend_inflight",
            "Requests accepted by the frontend and not yet answered",
            load.num_inflight,
        )
        yield GaugeMetricFamily(
            "minibatch_num_requests_waiting",
            "Requests waiting for a slot: in the live workers' queues and in this frontend",
            load.num_queued,
        )
        yield GaugeMetricFamily(
            "minibatch_free_slots",
            "Batch slots free for new sequences in the live workers that are not stopping",
            load.num_free_slots,
        )
        # A dead worker's last numbers would be stale: only live ones count.
        if load.num_running is not None:
            yield GaugeMetricFamily(
                "minibatch_num_requests_running",
                "Sequences in the live workers' batches",
                load.num_running,
            )
        # Each worker's memory, so that growth shows (labelled by its address).
        rss = GaugeMetricFamily(
            "minibatch_worker_rss_bytes",
            "The worker process's resident memory (weights shared with other workers included)",
            labels=["worker"],
        )
        kv_cache = GaugeMetricFamily(
            "minibatch_worker_kv_cache_bytes",
            "The worker's preallocated KV cache",
            labels=["worker"],
        )
        shapes = GaugeMetricFamily(
            "minibatch_worker_matmul_shapes",
            "Matrix-product shapes the worker's math library keeps kernels for",
            labels=["worker"],
        )
        reporting = [
            (w.endpoint, w.hello, w.heartbeat) for w in load.live if w.hello and w.heartbeat
        ]
        for endpoint, hello, heartbeat in reporting:
            rss.add_metric([endpoint], heartbeat.rss_bytes)
            kv_cache.add_metric([endpoint], hello.kv_cache_bytes)
            shapes.add_metric([endpoint], heartbeat.num_matmul_shapes)
        if reporting:  # no family without a sample
            yield from (rss, kv_cache, shapes)
