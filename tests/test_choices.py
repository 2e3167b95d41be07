"""OpenAI's n and best_of (`frontend/choices.py`): one request fans out into a
worker request per choice, through real processes. Streams of several choices
are `tests/test_choice_stream.py`'s."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from frontend.choices import choice_requests, choice_seed
from protocol import GenerateRequest
from protocol.limits import MAX_CHOICES, MAX_SEED
from tests.metrics_scrape import scrape, total, value
from tests.sse import sse_events
from tests.stack import Stack, free_port, live_stack, openai_client, running_stack
from worker.engine.fake_engine import expected_text
from worker.model.loader import gpt2_tokenizer, synthetic_config, synthetic_model

CHAT_PROMPT = "User: Hi\n\nAssistant:"  # the default template's
LONG = 400  # tokens: far longer than any test here waits


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with live_stack(tmp_path_factory.mktemp("stack"), {"FAKE_STEP_DELAY_S": "0.005"}) as stack:
        yield stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai_client(stack) as client:
        yield client


def _complete(stack: Stack, **fields: Any) -> httpx.Response:
    body = {"model": "fake", "prompt": "hello", "max_tokens": 5, **fields}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)


# --- the fan-out itself -----------------------------------------------------------


def test_a_lone_choice_is_the_request_itself() -> None:
    request = GenerateRequest("r", "prompt", 8, temperature=1.0, seed=5)
    assert choice_requests(request, 1) == [request]


def test_choices_have_ids_of_their_own_and_seeds_derived_from_the_requests() -> None:
    request = GenerateRequest("r", "prompt", 8, temperature=1.0, seed=5)
    choices = choice_requests(request, 4)
    assert [choice.request_id for choice in choices] == ["r-0", "r-1", "r-2", "r-3"]
    assert choices[0].seed == 5  # as with n=1: a seeded request samples as it did
    seeds = [choice.seed for choice in choices]
    assert len(set(seeds)) == 4
    assert all(seed is not None and 0 <= seed <= MAX_SEED for seed in seeds)
    # Derived from (seed, index) alone, and unlike a nearby seed's.
    assert seeds == [choice.seed for choice in choice_requests(request, 4)]
    assert choice_seed(5, 1) != choice_seed(6, 0)
    assert choice_seed(MAX_SEED, 7) is not None
    unseeded = choice_requests(GenerateRequest("u", "prompt", 8, temperature=1.0), 3)
    assert [choice.seed for choice in unseeded] == [None, None, None]


# --- answers ----------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, MAX_CHOICES + 1))
def test_n_choices_are_indexed_in_order_and_usage_sums_them(stack: Stack, n: int) -> None:
    response = _complete(stack, n=n, max_tokens=4)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [choice["index"] for choice in answer["choices"]] == list(range(n))
    for choice in answer["choices"]:
        assert (choice["text"], choice["finish_reason"]) == (expected_text("hello", 4), "length")
    # The prompt once, every choice's tokens.
    assert answer["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4 * n,
        "total_tokens": 5 + 4 * n,
        "prompt_tokens_details": {"cached_tokens": 0},  # the fake engine has no prefix cache
    }


def test_chat_answers_n_choices(stack: Stack) -> None:
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "n": 3,
        "logprobs": True,
    }
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    for choice in answer["choices"]:
        assert choice["message"] == {"role": "assistant", "content": expected_text(CHAT_PROMPT, 3)}
        assert len(choice["logprobs"]["content"]) == 3
    assert answer["usage"]["completion_tokens"] == 9
    assert answer["usage"]["prompt_tokens"] == len(CHAT_PROMPT)


def test_echo_and_logprobs_come_with_every_choice(stack: Stack) -> None:
    response = _complete(stack, n=2, echo=True, logprobs=1, max_tokens=3)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["text"] == "hello" + expected_text("hello", 3)
        # The prompt's 5 tokens (the first unscored) and the 3 generated.
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert len(choice["logprobs"]["tokens"]) == 8


def test_the_openai_client_gets_n_choices(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=4, n=3)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert {choice.text for choice in completion.choices} == {expected_text("hello", 4)}
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=2
    )
    assert [choice.message.content for choice in chat.choices] == [
        expected_text(CHAT_PROMPT, 2)
    ] * 2
    texts = ["", "", "", ""]
    for chunk in client.completions.create(
        model="fake", prompt="hello", max_tokens=5, n=4, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [expected_text("hello", 5)] * 4


# --- what is refused ----------------------------------------------------------------


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1, 2**31])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_out_of_range_is_a_422_naming_n(stack: Stack, n: int, path: str) -> None:
    body = {
        "model": "fake",
        "prompt": "hello",
        "messages": [{"role": "user", "content": "Hi"}],
        "n": n,
    }
    body.pop("prompt" if path.endswith("chat/completions") else "messages")
    response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "n"


def test_best_of_generates_more_and_answers_the_n_likeliest(stack: Stack) -> None:
    response = _complete(stack, n=2, best_of=3, max_tokens=4)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
    # Logprobs were asked of the worker to rank the choices, not by the client.
    assert [choice["logprobs"] for choice in answer["choices"]] == [None, None]
    assert answer["usage"]["completion_tokens"] == 3 * 4  # OpenAI counts all best_of


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"n": 3, "best_of": 2}, 422),
        ({"best_of": MAX_CHOICES + 1}, 422),
        ({"best_of": 0}, 422),
        ({"n": 1, "best_of": 2, "stream": True}, 400),
    ],
)
def test_best_of_out_of_range_is_refused_naming_it(
    stack: Stack, fields: dict[str, Any], status: int
) -> None:
    response = _complete(stack, **fields)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "best_of"


def test_best_of_equal_to_n_may_stream(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert list(sse_events(response))[-1] == (None, "[DONE]")


def test_the_choices_error_is_the_whole_requests(stack: Stack) -> None:
    # Past the fake model's context window: the worker refuses every choice, and
    # the first refusal is the answer, streamed or not.
    for stream in (False, True):
        response = _complete(stack, prompt="x" * 1100, n=4, stream=stream)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == "prompt"
    assert stack.wait_for_health("all answered", lambda h: h["inflight"] == 0)


def test_metrics_count_the_request_once_and_the_tokens_of_every_choice(stack: Stack) -> None:
    def counts() -> tuple[float, float, float]:
        samples = scrape(stack.url)
        return (
            total(samples, "minibatch_requests_total", endpoint="/v1/completions", status="200"),
            value(samples, "minibatch_prompt_tokens_total"),
            value(samples, "minibatch_generation_tokens_total"),
        )

    before = counts()
    assert _complete(stack, n=5, max_tokens=3).status_code == 200
    after = counts()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 5, 15)


# --- room, hang-ups, placement and replay -----------------------------------------


def test_choices_take_their_room_in_flight_all_or_none(tmp_path: Path) -> None:
    overrides = {"MAX_INFLIGHT_REQUESTS": "4", "FAKE_STEP_DELAY_S": "0.05"}
    with live_stack(tmp_path, overrides) as stack:
        body = {"model": "fake", "prompt": "hold", "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as held:
            events = sse_events(held)  # held: a dropped reader would close the stream
            next(events)  # one of the four places is taken
            refused = _complete(stack, n=4)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["message"] == (
                "1 request is already in flight (MAX_INFLIGHT_REQUESTS=4); this one needs 4, "
                "one per choice; retry later"
            )
            assert refused.headers["Retry-After"]
            assert stack.health().json()["inflight"] == 1  # none of the four went in
            assert _complete(stack, n=3, max_tokens=2).status_code == 200


def test_more_choices_than_ever_fit_in_flight_are_refused_not_told_to_retry(
    tmp_path: Path,
) -> None:
    """A 503 would have a client retry for ever: an idle server refuses it too."""
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    asks = [
        ("/v1/completions", {"model": "fake", "prompt": "hi", "n": 5}, "n"),
        ("/v1/completions", {"model": "fake", "prompt": "hi", "n": 2, "best_of": 5}, "best_of"),
        ("/v1/chat/completions", {**chat, "n": 5}, "n"),
    ]
    with live_stack(tmp_path, {"MAX_INFLIGHT_REQUESTS": "4"}) as stack:
        for path, body, param in asks:
            refused = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["param"] == param and "Retry-After" not in refused.headers
            assert "MAX_INFLIGHT_REQUESTS=4); ask for at most 4" in error["message"]
        fitting = {**chat, "n": 4, "max_tokens": 2}
        assert httpx.post(f"{stack.url}/v1/chat/completions", json=fitting).status_code == 200


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"FAKE_STEP_DELAY_S": "0.05", "MAX_BATCH_SIZE": "4"}
    with live_stack(tmp_path_factory.mktemp("slow"), overrides) as stack:
        yield stack


def test_a_streaming_client_hanging_up_aborts_every_choice(slow_stack: Stack) -> None:
    body = {"model": "fake", "prompt": "bye", "max_tokens": LONG, "n": 4, "stream": True}
    url = f"{slow_stack.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        events = sse_events(response)  # held: a dropped reader would close the stream
        next(events)
        slow_stack.wait_for_health("all running", lambda h: h["active"] == 4)
    freed = slow_stack.wait_for_health(
        "all aborted", lambda h: h["active"] == 0 and h["inflight"] == 0, 2.0
    )
    assert freed["queued"] == 0


def test_a_client_hanging_up_before_the_answer_aborts_every_choice(slow_stack: Stack) -> None:
    body = {"model": "fake", "prompt": "bye", "max_tokens": LONG, "n": 4}

    def post_and_hang_up() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{slow_stack.url}/v1/completions", json=body, timeout=1.0)

    thread = threading.Thread(target=post_and_hang_up)
    thread.start()
    slow_stack.wait_for_health("all running", lambda h: h["active"] == 4)
    thread.join()
    slow_stack.wait_for_health(
        "all aborted", lambda h: h["active"] == 0 and h["inflight"] == 0, 2.0
    )


def test_every_choice_goes_to_one_worker_even_past_its_free_slots(tmp_path: Path) -> None:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    overrides = {
        "MAX_BATCH_SIZE": "2",
        "FAKE_STEP_DELAY_S": "0.05",
        "WORKER_ENDPOINTS": ",".join(endpoints),
    }
    with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
        for i, endpoint in enumerate(endpoints):
            env = {**stack.env, "WORKER_ENDPOINT": endpoint}
            stack.start_command(f"worker-{i}", [sys.executable, "-m", "worker.serve.main"], env)
        stack.wait_for_health("both live", lambda h: h["workers_live"] == 2, 30)
        with ThreadPoolExecutor(2) as pool:
            for prompt in ("first", "second"):
                future = pool.submit(_complete, stack, prompt=prompt, n=4, max_tokens=40)
                stack.wait_until(
                    lambda: sorted(w["held"] for w in stack.workers().values()) == [0, 4],
                    "all four choices on one worker",
                )
                answer = future.result(timeout=60).json()
                assert [c["text"] for c in answer["choices"]] == [expected_text(prompt, 40)] * 4


def test_choices_past_the_workers_queue_room_wait_in_the_frontend(tmp_path: Path) -> None:
    # 2 slots and room for 1 more in the queue: of 4 choices, 3 go at once and
    # the last waits here for a slot, rather than being refused by the worker.
    overrides = {"MAX_BATCH_SIZE": "2", "MAX_QUEUE_DEPTH": "1", "FAKE_STEP_DELAY_S": "0.01"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        with ThreadPoolExecutor(3) as pool:
            prompts = ["one", "two", "three"]
            futures = [pool.submit(_complete, stack, prompt=p, n=4, max_tokens=8) for p in prompts]
            for prompt, future in zip(prompts, futures, strict=True):
                response = future.result(timeout=60)
                assert response.status_code == 200, response.text
                texts = [c["text"] for c in response.json()["choices"]]
                assert texts == [expected_text(prompt, 8)] * 4


def test_choices_on_a_killed_worker_are_replayed_and_resume_exactly(tmp_path: Path) -> None:
    overrides = {"MAX_BATCH_SIZE": "4", "FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        body = {"model": "fake", "prompt": "survive", "max_tokens": 60, "n": 3, "stream": True}
        texts = ["", "", ""]
        finished: list[str] = []
        url = f"{stack.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            events = sse_events(response)
            for num_chunks, (_, data) in enumerate(events):
                if data == "[DONE]":
                    break
                (choice,) = json.loads(data)["choices"]
                texts[choice["index"]] += choice["text"]
                if choice["finish_reason"]:
                    finished.append(choice["finish_reason"])
                if num_chunks == 15:
                    stack.signal_worker(signal.SIGKILL)
        assert texts == [expected_text("survive", 60)] * 3
        assert finished == ["length"] * 3
        health = stack.wait_live(instance_not=str(first["instance_id"]))
        assert health["worker_restarts"] == 1 and health["inflight"] == 0


# --- seeds, on a torch worker --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GPT-2 with random weights and the real tokenizer: nearly flat
    logits, so that differently seeded choices soon differ."""
    directory = tmp_path_factory.mktemp("choices-gpt2")
    config = synthetic_config(n_layer=2, n_embd=64, n_head=4, n_positions=128)
    synthetic_model(config).model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(directory)
    return directory


@pytest.mark.model
def test_seeded_choices_differ_and_repeat_whatever_the_batch(
    tmp_path: Path, model_dir: Path
) -> None:
    overrides = {"MODEL_ID": str(model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1"}
    with live_stack(tmp_path, overrides) as stack:
        stack.wait_live(timeout_s=120)
        model = stack.health().json()["model"]
        seeded = {
            "model": model,
            "prompt": "the quiet river",
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": 1234,
            "ignore_eos": True,
        }

        def texts(**fields: Any) -> list[str]:
            response = httpx.post(
                f"{stack.url}/v1/completions", json={**seeded, **fields}, timeout=120
            )
            assert response.status_code == 200, response.text
            return [choice["text"] for choice in response.json()["choices"]]

        alone = texts(n=4)
        assert len(set(alone)) == 4  # each choice its own seed
        # The prompt (3 tokens) was prefilled once: the other 3 choices took it whole.
        metrics = httpx.get(f"{stack.url}/metrics").text
        assert "minibatch_prefix_cache_hits_total 9.0" in metrics
        assert texts(n=1) == alone[:1]  # choice 0 samples as n=1 always did
        assert texts(n=4) == alone
        # Beside other sampled requests, in batches made up differently.
        others = [{"prompt": f"a letter {i}", "seed": i, "n": 2} for i in range(3)]
        with ThreadPoolExecutor(len(others) + 1) as pool:
            beside = [pool.submit(texts, **fields) for fields in others]
            assert texts(n=4) == alone
            for future in beside:
                assert len(future.result(timeout=120)) == 2
        # best_of picks the likeliest of the same four choices.
        scored = httpx.post(
            f"{stack.url}/v1/completions", json={**seeded, "n": 4, "logprobs": 0}, timeout=120
        ).json()["choices"]
        likeliest = max(scored, key=lambda choice: sum(choice["logprobs"]["token_logprobs"]))
        assert texts(n=1, best_of=4) == [likeliest["text"]]
        unseeded = {"seed": None, "n": 3}
        assert len(set(texts(**unseeded))) == 3  # each samples on its own
        # -1 is no seed, as vLLM reads it: every call and choice draws anew.
        minus_one = texts(seed=-1, n=3) + texts(seed=-1, n=3)
        assert len(set(minus_one)) == 6
        assert texts(seed=-2, n=2) == texts(seed=-2, n=2)  # another negative is a seed
