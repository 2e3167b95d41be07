"""The whole request path: a worker and a frontend as two real OS processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.stack import REPO_ROOT
from protocol import ErrorCode, ErrorResult, GenerateRequest, GenerateResult, ToFrontend
from tests.sse import sse_events
from tests.stack import Stack, free_port, running_stack
from tests.stand_in_worker import StandInWorker, stand_in_hello
from worker.engine.fake_engine import expected_text


async def _generate_all(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))


def generate_all(stack: Stack, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    return asyncio.run(_generate_all(stack.url, bodies))


def test_fifty_concurrent_requests_each_get_their_own_text(tmp_path: Path) -> None:
    overrides = {"MAX_BATCH_SIZE": "4", "FAKE_STEP_DELAY_S": "0.002"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        bodies: list[dict[str, object]] = [
            {"prompt": f"request number {i}", "max_new_tokens": 1 + i % 13} for i in range(50)
        ]
        responses = generate_all(stack, bodies)
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["text"] == expected_text(
            str(body["prompt"]), int(str(body["max_new_tokens"]))
        )
        assert answer["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == body["max_new_tokens"]
        assert answer["model"] == "fake"
        assert set(answer["metrics"]) == {"queue_wait_ms", "generate_ms", "e2e_ms"}


def test_two_concurrent_requests_with_the_same_id_get_their_own_answers(tmp_path: Path) -> None:
    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.01"}, supervised=False) as stack:
        stack.wait_live()
        bodies: list[dict[str, object]] = [
            {"request_id": "same", "prompt": prompt, "max_new_tokens": 12}
            for prompt in ("first prompt", "second prompt")
        ]
        responses = generate_all(stack, bodies)
    for body, response in zip(bodies, responses, strict=True):
        assert response.json()["request_id"] == "same"
        assert response.json()["text"] == expected_text(str(body["prompt"]), 12)


def test_health_names_the_model_counts_the_work_and_is_503_without_a_worker(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        response = stack.health()
        assert response.status_code == 503
        assert response.json()["worker"] == "connecting"
        stack.start("worker", "worker.serve.main")
        health = stack.wait_live()
        assert (health["model"], health["random_weights"]) == ("fake", True)
        health = stack.wait_for_health(
            "a heartbeat", lambda h: h["workers"][0]["steps"] is not None
        )
        (before,) = health["workers"]
        generate_all(stack, [{"prompt": "counted", "max_new_tokens": 5}])
        # The worker's counters as its next heartbeats carry them.
        stack.wait_for_health(
            "a heartbeat after the request",
            lambda h: (
                h["workers"][0]["finished"] == before["finished"] + 1
                and h["workers"][0]["steps"] > before["steps"]
            ),
        )


def test_workers_not_yet_live_give_each_reason_once(tmp_path: Path) -> None:
    """Two workers that had not said hello read "no worker has said hello yet;
    no worker has said hello yet"."""
    endpoints = f"tcp://127.0.0.1:{free_port()},tcp://127.0.0.1:{free_port()}"
    overrides = {"WORKER_ENDPOINTS": endpoints}
    with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        ready = httpx.get(f"{stack.url}/ready", timeout=5)
    assert ready.status_code == 503
    assert ready.json()["reason"] == "no worker is live: no worker has said hello yet"


def test_ready_is_503_full_while_max_inflight_requests_are_unanswered(tmp_path: Path) -> None:
    overrides = {"MAX_INFLIGHT_REQUESTS": "1", "FAKE_STEP_DELAY_S": "0.05"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        assert httpx.get(f"{stack.url}/ready", timeout=5).status_code == 200
        body = {"prompt": "hold", "max_new_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=30) as held:
            events = sse_events(held)  # held: a dropped reader would close the stream
            next(events)
            ready = httpx.get(f"{stack.url}/ready", timeout=5)
            assert ready.status_code == 503
            assert (ready.json()["status"], ready.json()["ready"]) == ("full", False)
            assert "MAX_INFLIGHT_REQUESTS=1" in ready.json()["reason"]
            assert stack.health().status_code == 200  # live, only full
        stack.wait_until(
            lambda: httpx.get(f"{stack.url}/ready", timeout=5).status_code == 200,
            "room again once the held stream is aborted",
        )


def test_a_request_no_worker_can_serve_is_refused_while_every_slot_is_busy(
    tmp_path: Path,
) -> None:
    """The frontend checks a request as a worker would, with the limits its hello
    gave: such requests waited for a free slot first (24 s under load on a Zen 4
    EPYC), or got a 504 past REQUEST_TIMEOUT_S. Here the one slot is busy for 10 s."""
    overrides = {"MAX_BATCH_SIZE": "1", "FAKE_STEP_DELAY_S": "0.05"}
    outside = 0x110000  # the fake model's vocabulary: one token per code point
    refused = [
        ("/v1/completions", {"prompt": [1] * 1025}, "prompt: 1,025 tokens and 1 to generate"),
        ("/v1/completions", {"prompt": [outside]}, f"prompt: token id {outside} is outside"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(outside): 1}}, "logit_bias"),
        ("/generate", {"prompt": "x" * 1025}, "prompt: 1,025 characters, more tokens than"),
    ]
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        held_body = {"prompt": "hold", "max_new_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{stack.url}/generate", json=held_body, timeout=30) as held:
            events = sse_events(held)  # held: a dropped reader would close the stream
            next(events)
            for path, fields, problem in refused:
                body = {"model": "fake", "max_tokens": 1} if path != "/generate" else {}
                response = httpx.post(f"{stack.url}{path}", json=body | fields, timeout=5)
                assert response.status_code == 422, response.text
                assert problem in response.json()["error"]["message"]


# A worker whose context of one token holds no prompt and output together.
_TINY = stand_in_hello(model="tiny", capacity=1, context_window=1, vocab_size=2, max_token_chars=1)


@pytest.mark.parametrize("tiny_first", [True, False])
def test_a_request_is_refused_only_if_no_live_worker_could_serve_it(
    tmp_path: Path, tiny_first: bool
) -> None:
    """One peer's hello (here a worker of context 1) judged every request,
    whichever came first; a request another live worker serves must reach it,
    not the worker that would refuse it, whichever is first."""

    def answer(request: GenerateRequest) -> list[ToFrontend | bytes]:
        return [GenerateResult(request.request_id, "ab", [97, 98], "length", 2, 2, 0, 1)]

    roomy = stand_in_hello(model="roomy", context_window=64, vocab_size=99, max_token_chars=1)
    with (
        StandInWorker(answer, capacity=1, hello=_TINY) as first,
        StandInWorker(answer, capacity=1, hello=roomy) as second,
    ):
        endpoints = [first.endpoint, second.endpoint]
        overrides = {"WORKER_ENDPOINTS": ",".join(endpoints if tiny_first else endpoints[::-1])}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_for_health("both live", lambda h: h["workers_live"] == 2)
            served = httpx.post(
                f"{stack.url}/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=10
            )
            assert served.status_code == 200, served.text
            too_long = httpx.post(
                f"{stack.url}/generate", json={"prompt": "x" * 65, "max_new_tokens": 2}, timeout=10
            )
            assert too_long.status_code == 422, too_long.text
            assert "prompt: 65 characters" in too_long.json()["error"]["message"]


def test_a_live_worker_that_does_not_say_its_limits_may_serve_anything(tmp_path: Path) -> None:
    """Nothing tells what it refuses: a request it may serve goes to it, whatever
    another worker's limits say."""

    def answer(request: GenerateRequest) -> list[ToFrontend | bytes]:
        return [GenerateResult(request.request_id, "ab", [97, 98], "length", 2, 2, 0, 1)]

    silent = stand_in_hello(model="silent", context_window=64)  # no limits said
    with (
        StandInWorker(answer, capacity=1, hello=_TINY) as first,
        StandInWorker(answer, capacity=1, hello=silent) as second,
    ):
        overrides = {"WORKER_ENDPOINTS": f"{first.endpoint},{second.endpoint}"}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_for_health("both live", lambda h: h["workers_live"] == 2)
            body = {"prompt": "x" * 65, "max_new_tokens": 2}
            response = httpx.post(f"{stack.url}/generate", json=body, timeout=10)
            assert response.status_code == 200, response.text


def test_a_worker_of_another_model_than_a_live_one_is_logged(tmp_path: Path) -> None:
    """A frontend serves one model and names one in its answers: a pool of two
    went unremarked, answers naming the wrong one."""

    def serving(model: str) -> StandInWorker:
        return StandInWorker(lambda request: [], 1, stand_in_hello(model=model, capacity=1))

    with serving("one") as first, serving("one") as same, serving("two") as other:
        endpoints = ",".join(worker.endpoint for worker in (first, same, other))
        overrides = {"WORKER_ENDPOINTS": endpoints}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_for_health("all live", lambda h: h["workers_live"] == 3)
            log = stack.log("frontend")
    # One line for each hello that met the other model live: one or two, by their order.
    lines = [line for line in log.splitlines() if "a frontend serves one model" in line]
    assert 1 <= len(lines) <= 2, log
    pairs = ("model one, another worker two", "model two, another worker one")
    assert all(any(pair in line for pair in pairs) for line in lines), lines


def _refused_at_first(request: GenerateRequest) -> list[ToFrontend | bytes]:
    """A worker whose queue another frontend filled: each request's first
    attempt is refused, and sent again once there is room."""
    if request.request_id.endswith(".1"):
        return [ErrorResult(request.request_id, ErrorCode.QUEUE_FULL, "the queue is full")]
    return [GenerateResult(request.request_id, "done", [1], "stop", 3, 1, 0, 1)]


def test_a_request_without_a_seed_samples_with_one_seed_on_every_attempt(
    tmp_path: Path,
) -> None:
    """The worker drew a seed for a request that came without, anew at each
    attempt, so a sampled stream resumed elsewhere after a kill went on as
    another would have. The frontend now draws it once, for each choice."""
    with StandInWorker(_refused_at_first, capacity=4) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_live()
            for path, body in [
                ("/generate", {"prompt": "abc", "temperature": 1.0}),
                ("/generate", {"prompt": "abc", "temperature": 1.0, "seed": -1}),
                ("/v1/completions", {"model": "fake", "prompt": "abc", "n": 2}),
            ]:
                response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
                assert response.status_code == 200, response.text
    seeds: dict[str, set[int | None]] = {}
    for sent in worker.received:
        if isinstance(sent, GenerateRequest):  # its id: <request>[-<choice>].<attempt>
            seeds.setdefault(sent.request_id.rpartition(".")[0], set()).add(sent.seed)
    assert len(seeds) == 4  # two requests of one choice, one of two
    assert all(len(drawn) == 1 and None not in drawn for drawn in seeds.values()), seeds
    assert len(set.union(*seeds.values())) == 4  # each a seed of its own


def test_the_frontend_never_imports_torch_or_transformers() -> None:
    probe = (
        "import sys, frontend.main, frontend.app, protocol, protocol.liveness\n"
        "import protocol.settings, protocol.client_config\n"
        "import worker.launch.supervisor, worker.launch.probe\n"
        "leaked = sorted(m for m in ('torch', 'transformers', 'llguidance.torch') "
        "if m in sys.modules)\n"
        "assert not leaked, leaked\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, check=True)
