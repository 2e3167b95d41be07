"""GET /metrics, read with prometheus-client's own parser."""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import frontend.openai_api
from frontend.app import create_app
from frontend.config import FrontendConfig
from protocol.settings import load
from tests.metrics_scrape import scrape, value
from tests.sse import sse_events
from tests.stack import Stack, free_port, live_stack, running_stack

CAPACITY = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"FAKE_STEP_DELAY_S": "0.01", "MAX_BATCH_SIZE": str(CAPACITY)}
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


def test_requests_tokens_and_latencies_are_counted(stack: Stack) -> None:
    before = scrape(stack.url)
    url = stack.url
    answer = httpx.post(f"{url}/generate", json={"prompt": "abc", "max_new_tokens": 5}, timeout=10)
    assert answer.status_code == 200
    body = {"prompt": "abcd", "max_new_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=10) as response:
        assert len(list(sse_events(response))) == 7
    bad = httpx.post(f"{url}/generate", json={"prompt": "abc", "top_p": 0}, timeout=10)
    assert bad.status_code == 422
    after = scrape(stack.url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"endpoint": "/generate", "status": "200", "finish_reason": "length"}
    assert grew("minibatch_requests_total", **ok) == 2
    invalid = {"endpoint": "/generate", "status": "422", "finish_reason": "none"}
    assert grew("minibatch_requests_total", **invalid) == 1
    assert grew("minibatch_prompt_tokens_total") == 3 + 4
    assert grew("minibatch_generation_tokens_total") == 5 + 6
    assert grew("minibatch_e2e_request_latency_seconds_count") == 2
    assert grew("minibatch_request_queue_time_seconds_count") == 2
    assert grew("minibatch_time_to_first_token_seconds_count") == 1  # the streaming one
    assert grew("minibatch_inter_token_latency_seconds_count") == 6 - 1
    assert grew("minibatch_e2e_request_latency_seconds_sum") > 0


def test_the_queue_wait_counts_the_wait_in_the_frontends_line(stack: Stack) -> None:
    """The frontend holds a request until a slot is free: one that waited there
    for 30 steps was reported to have waited one, in the worker's queue."""
    before = scrape(stack.url)
    body = {"prompt": "abc", "max_new_tokens": 30, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3 * CAPACITY) as pool:
        sent = [
            pool.submit(httpx.post, f"{stack.url}/generate", json=body, timeout=30)
            for _ in range(3 * CAPACITY)
        ]
        answers = [future.result().json() for future in sent]
    after = scrape(stack.url)
    metrics = [answer["metrics"] for answer in answers]
    # The last waited for two rounds of 30 steps of 10 ms (in the worker's queue,
    # a step at most).
    assert max(m["queue_wait_ms"] for m in metrics) > 300, metrics
    waits_ms = [m["queue_wait_ms"] for m in metrics]
    grew = value(after, "minibatch_request_queue_time_seconds_sum") - value(
        before, "minibatch_request_queue_time_seconds_sum"
    )
    assert grew == pytest.approx(sum(waits_ms) / 1000, abs=0.01)


def test_a_tokenizer_call_counts_as_a_request_and_in_no_token_metric(stack: Stack) -> None:
    before = scrape(stack.url)
    calls = [
        ("/tokenize", {"prompt": "abcdef"}),
        ("/detokenize", {"tokens": [97]}),
        ("/detokenize", {"tokens": []}),  # answered by the frontend alone
    ]
    for path, body in calls:
        assert httpx.post(f"{stack.url}{path}", json=body, timeout=10).status_code == 200
    after = scrape(stack.url)
    for path, num_calls in (("/tokenize", 1), ("/detokenize", 2)):
        labels = {"endpoint": path, "status": "200", "finish_reason": "none"}
        assert value(after, "minibatch_requests_total", **labels) == (
            value(before, "minibatch_requests_total", **labels) + num_calls
        )
    for name in (
        "minibatch_prompt_tokens_total",
        "minibatch_prefix_cache_queries_total",
        "minibatch_e2e_request_latency_seconds_count",
        "minibatch_request_queue_time_seconds_count",
    ):
        assert value(after, name) == value(before, name), name


def test_model_listings_count_as_requests_like_their_refusals(stack: Stack) -> None:
    model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
    before = scrape(stack.url)
    assert httpx.get(f"{stack.url}/v1/models", timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/v1/models/{model}", timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    after = scrape(stack.url)

    def grew(endpoint: str) -> float:
        labels = {"endpoint": endpoint, "status": "200", "finish_reason": "none"}
        return value(after, "minibatch_requests_total", **labels) - value(
            before, "minibatch_requests_total", **labels
        )

    assert grew("/v1/models") == 1
    assert grew("/v1/models/{model:path}") == 1
    assert grew("/health") == 0  # probes are not requests


def test_errors_are_labelled_by_route_not_by_the_path_asked_for(stack: Stack) -> None:
    """Else each name asked for would be a series of its own, for ever."""
    before = scrape(stack.url)
    for name in ("a", "b", "c" * 1000):
        assert httpx.get(f"{stack.url}/v1/models/{name}", timeout=10).status_code == 404
    after = scrape(stack.url)
    route = "/v1/models/{model:path}"
    labels = {"endpoint": route, "status": "404", "finish_reason": "none"}
    counted = value(after, "minibatch_requests_total", **labels)
    assert counted - value(before, "minibatch_requests_total", **labels) == 3
    endpoints = {dict(labels).get("endpoint", "") for _, labels in after}
    assert {e for e in endpoints if e.startswith("/v1/models/")} == {route}


def test_unknown_paths_and_wrong_methods_count_as_refusals(stack: Stack) -> None:
    before = scrape(stack.url)
    assert httpx.get(f"{stack.url}/nope", timeout=10).status_code == 404
    assert httpx.get(f"{stack.url}/{'x' * 500}", timeout=10).status_code == 404
    assert httpx.delete(f"{stack.url}/v1/completions", timeout=10).status_code == 405
    assert httpx.post(f"{stack.url}/health", timeout=10).status_code == 405
    after = scrape(stack.url)

    def grew(endpoint: str, status: str) -> float:
        labels = {"endpoint": endpoint, "status": status, "finish_reason": "none"}
        return value(after, "minibatch_requests_total", **labels) - value(
            before, "minibatch_requests_total", **labels
        )

    assert grew("other", "404") == 2  # one series for every unknown path
    assert grew("/v1/completions", "405") == 1
    assert grew("/health", "405") == 1


def test_worker_gauges_follow_heartbeats(stack: Stack) -> None:
    samples = scrape(stack.url)
    assert value(samples, "minibatch_worker_up") == 1
    running = value(samples, "minibatch_num_requests_running")
    assert value(samples, "minibatch_free_slots") == CAPACITY - running
    body = {"prompt": "busy", "max_new_tokens": 300, "stream": True}
    with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=10) as response:
        reader = sse_events(response)
        next(reader)
        stack.wait_for_health("running", lambda h: h["active"] == 1)
        samples = scrape(stack.url)
        assert value(samples, "minibatch_num_requests_running") == 1
        assert value(samples, "minibatch_num_requests_waiting") == 0
        assert value(samples, "minibatch_free_slots") == CAPACITY - 1
        assert value(samples, "minibatch_frontend_inflight") == 1


def test_a_stopping_worker_is_counted_and_its_slots_are_not_free(tmp_path: Path) -> None:
    """A drain showed as 1 worker up with its slots free, which take nothing new."""
    overrides = {"FAKE_STEP_DELAY_S": "0.01", "MAX_BATCH_SIZE": str(CAPACITY)}
    body = {"prompt": "drained", "max_new_tokens": 500, "stream": True}
    with (
        live_stack(tmp_path, overrides) as stack,
        httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=30) as response,
    ):
        reader = sse_events(response)  # kept: a collected reader closes the stream
        next(reader)
        stack.wait_for_health("running", lambda h: h["active"] == 1)
        assert value(scrape(stack.url), "minibatch_worker_stopping") == 0
        stack.processes["worker"].send_signal(signal.SIGTERM)  # it runs on for its grace
        stack.wait_for_health("stopping", lambda h: h["workers"][0]["stopping"])
        samples = scrape(stack.url)
        assert value(samples, "minibatch_worker_stopping") == 1
        assert value(samples, "minibatch_worker_up") == 1
        assert value(samples, "minibatch_free_slots") == 0


def test_each_workers_memory_is_reported(stack: Stack) -> None:
    samples = scrape(stack.url)
    [(worker, rss)] = [
        (dict(labels)["worker"], sample)
        for (name, labels), sample in samples.items()
        if name == "minibatch_worker_rss_bytes"
    ]
    assert 10 * 2**20 < rss < 4 * 2**30  # a Python process's, from /proc
    # The fake engine has no KV cache and no math library.
    assert value(samples, "minibatch_worker_kv_cache_bytes", worker=worker) == 0
    assert value(samples, "minibatch_worker_matmul_shapes", worker=worker) == 0


def test_worker_down_and_restart_are_reported(stack: Stack) -> None:
    assert value(scrape(stack.url), "minibatch_worker_restarts_total") == 0
    stack.kill("worker")
    stack.wait_for_health("down", lambda h: h["worker"] == "dead")
    samples = scrape(stack.url)
    assert value(samples, "minibatch_worker_up") == 0
    assert ("minibatch_num_requests_running", ()) not in samples  # stale: left out
    stack.start("worker", "worker.serve.main")
    stack.wait_for_health("back", lambda h: h["status"] == "ok")
    samples = scrape(stack.url)
    assert value(samples, "minibatch_worker_up") == 1
    assert value(samples, "minibatch_worker_restarts_total") == 1


def test_requests_waiting_with_no_worker_live_are_counted(tmp_path: Path) -> None:
    """They are all that waits then: /health said queued null, and /metrics left
    minibatch_num_requests_waiting out, as if nothing waited."""
    with running_stack(tmp_path, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        body = {"prompt": "waits", "max_new_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{stack.url}/generate", json=body, timeout=30)
            health = stack.wait_for_health("a request waiting", lambda h: h["queued"] == 1)
            assert (health["status"], health["active"]) == ("unavailable", None)
            samples = scrape(stack.url)
            assert samples[("minibatch_num_requests_waiting", ())] == 1
            assert samples[("minibatch_free_slots", ())] == 0
            assert ("minibatch_num_requests_running", ()) not in samples
            stack.start("worker", "worker.serve.main")
            assert waiting.result().status_code == 200
        assert stack.wait_for_health("served", lambda h: h["queued"] == 0)["inflight"] == 0


def test_an_unexpected_exception_is_a_counted_500_in_the_error_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the frontend still answers as every error does, and /metrics sees it."""

    async def broken(*args: object) -> None:
        raise RecursionError("injected")

    monkeypatch.setattr(frontend.openai_api, "read_openai_request", broken)
    app = create_app(
        load(FrontendConfig, [], {"WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"})
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert response.status_code == 500
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "internal")
        assert "RecursionError" in error["message"]
        # Clients are told not to send it again, and so is whoever reads it.
        assert response.headers["x-should-retry"] == "false"
        assert "retry" not in error["message"]
        families = text_string_to_metric_families(client.get("/metrics").text)
        samples = [s for family in families for s in family.samples]
    assert any(
        sample.name == "minibatch_requests_total"
        and sample.labels["endpoint"] == "/v1/completions"
        and sample.labels["status"] == "500"
        and sample.value == 1
        for sample in samples
    )
