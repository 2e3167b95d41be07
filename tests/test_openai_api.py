"""/v1/completions, /v1/models and /v1/models/{model} through the official `openai`
client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.parse import IGNORED_FIELDS_HEADER
from protocol.settings import load
from tests.sse import sse_events
from tests.stack import Stack, free_port, live_stack, openai_client, running_stack
from worker.engine.fake_engine import FAKE_VOCAB_SIZE, expected_text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with live_stack(tmp_path_factory.mktemp("stack"), {"FAKE_STEP_DELAY_S": "0.005"}) as stack:
        yield stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai_client(stack) as client:
        yield client


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == ["fake"]


def test_models_retrieve_gives_the_served_model_and_404_for_another(
    client: openai.OpenAI,
) -> None:
    listed = client.models.list().data[0]
    assert client.models.retrieve("fake") == listed
    for name in ("gpt-4o", "openai-community/gpt2"):  # a hub id holds a slash
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve(name)
        assert isinstance(raised.value.body, dict)
        assert raised.value.body["code"] == "model_not_found"
        assert raised.value.body["message"] == (
            f"model {name!r} is not served here; this server serves 'fake'"
        )


def test_a_long_model_name_is_quoted_back_cut_short(stack: Stack) -> None:
    body = {"model": "B" * 500_000, "prompt": "hi"}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == (
        f"model {'B' * 197 + '...'!r} is not served here; this server serves 'fake'"
    )


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=7)
    assert completion.object == "text_completion"
    assert completion.model == "fake"
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.text == expected_text("hello", 7)
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 7)
    assert completion.usage.total_tokens == 12


def test_prompt_as_token_ids(client: openai.OpenAI) -> None:
    token_ids = [ord(c) for c in "hello"]
    completion = client.completions.create(model="fake", prompt=token_ids, max_tokens=5)
    assert completion.choices[0].text == expected_text("hello", 5)
    assert completion.usage is not None and completion.usage.prompt_tokens == 5


def test_sampling_parameters_are_accepted(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model="fake",
        prompt="hi",
        max_tokens=3,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 40},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_stop_string(client: openai.OpenAI) -> None:
    full = expected_text("stop", 16)
    stop = full[5:7]
    completion = client.completions.create(
        model="fake", prompt="stop", max_tokens=16, stop=[stop, "never"]
    )
    assert completion.choices[0].text == full[: full.index(stop)]
    assert completion.choices[0].finish_reason == "stop"


def test_streaming(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="fake",
            prompt="stream me",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == expected_text("stream me", 10)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) == 10
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_stream_ends_with_done(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        events = list(sse_events(r))
    assert events[-1] == (None, "[DONE]")


def test_unsupported_value_is_a_400_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="fake", prompt="hi", suffix="!")
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == "suffix"
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        'suffix: text after the completion is not supported; send null or ""'
    )
    # An empty suffix appends nothing, as no suffix.
    reply = client.completions.create(model="fake", prompt="hi", suffix="", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[0-9]+"),
        ("guided_choice", ["yes", "no"]),
        ("guided_grammar", 'start: "a"'),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllms_older_guided_fields_are_refused_not_ignored(
    client: openai.OpenAI, field: str, value: object, endpoint: str
) -> None:
    """Ignored as unknown fields, they answered free text to a client that asked
    for a constraint; the refusal says what to send instead."""
    error = _refusal(client, endpoint, field, value)
    kind = field.removeprefix("guided_")
    assert f'send structured_outputs {{"{kind}": ...}} instead' in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "instead"),
    [
        ("allowed_token_ids", [1000, 2000], "constrain the text with structured_outputs"),
        ("allowed_token_ids", [], "(only null)"),
        ("bad_words", ["Snow"], "logit_bias of -100"),
        ("include_stop_str_in_output", True, "add it back yourself"),
        ("use_beam_search", True, "sampling and best_of"),
        ("truncate_prompt_tokens", 5, "fits the context window"),
        ("prompt_logprobs", 1, "echo with logprobs"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllms_fields_that_change_the_output_are_refused_not_ignored(
    client: openai.OpenAI, field: str, value: object, instead: str, endpoint: str
) -> None:
    """Ignored as unknown fields, they answered with a banned word, tokens outside
    the allowed ones, or without the stop string asked for."""
    error = _refusal(client, endpoint, field, value)
    assert error["message"].startswith(f"{field}: vLLM's, not followed here")
    assert instead in error["message"]


def test_vllms_fields_asking_for_what_is_done_anyway_are_taken(client: openai.OpenAI) -> None:
    """As a client that sends vLLM's defaults does."""
    defaults = {
        "allowed_token_ids": None,  # [] allows no token: refused
        "bad_words": [],
        "include_stop_str_in_output": False,
        "use_beam_search": False,
        "truncate_prompt_tokens": None,
        "prompt_logprobs": None,
    }
    completion = client.completions.create(
        model="fake", prompt="hi", max_tokens=2, extra_body=defaults
    )
    assert completion.choices[0].finish_reason == "length"


def _refusal(client: openai.OpenAI, endpoint: str, field: str, value: object) -> dict[str, Any]:
    """The 400 that ``endpoint`` answers a body with ``field`` set to ``value``,
    which it names as the param at fault."""
    with pytest.raises(openai.BadRequestError) as raised:
        if endpoint == "chat":
            client.chat.completions.create(
                model="fake",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={field: value},
            )
        else:
            client.completions.create(model="fake", prompt="hi", extra_body={field: value})
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == field
    return error


def test_invalid_value_is_a_422_naming_the_parameter(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.completions.create(model="fake", prompt="hi", temperature=2.5)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "temperature"


def test_a_refusal_gets_a_log_line_with_what_the_client_sent_escaped(stack: Stack) -> None:
    time.sleep(1.1)  # refusals are logged at most once a second
    body = {"model": "fake", "prompt": "hi", "temperature": 2.5}
    refused = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 422
    time.sleep(1.1)
    missing = httpx.get(f"{stack.url}/v2/caf%C3%A9", timeout=10)
    assert missing.status_code == 404
    log = stack.log("frontend")
    assert "POST /v1/completions: 422 invalid_request: temperature: must be at most 2" in log
    assert "GET /v2/caf\\xe9: 404 not_found: GET /v2/caf\\xe9: Not Found" in log


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="serves 'fake'"):
        client.completions.create(model="gpt-4", prompt="hi")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_without_a_model_is_told_the_served_one(stack: Stack, path: str) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": []}
    refused = httpx.post(f"{stack.url}{path}", json=body, timeout=10)
    assert refused.status_code == 422
    assert (
        "model: required; send it (this server serves 'fake')"
        in (refused.json()["error"]["message"])
    )


def test_a_request_before_any_worker_is_checked_against_the_model_it_names(
    tmp_path: Path,
) -> None:
    """A request that comes before any worker's hello waits for one: then an
    unknown model is a 404, and the served one is answered under its own name."""
    with running_stack(tmp_path, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        with ThreadPoolExecutor(2) as pool:
            answers = [
                pool.submit(
                    httpx.post,
                    f"{stack.url}/v1/completions",
                    json={"model": model, "prompt": "early", "max_tokens": 3},
                    timeout=30,
                )
                for model in ("bogus", "fake")
            ]
            time.sleep(0.5)  # both wait, no worker known
            assert not any(answer.done() for answer in answers)
            stack.start("worker", "worker.serve.main")
            bogus, served = (answer.result() for answer in answers)
    assert bogus.status_code == 404, bogus.text
    assert bogus.json()["error"]["code"] == "model_not_found"
    assert served.status_code == 200, served.text
    assert served.json()["model"] == "fake"


def test_a_request_is_a_504_when_no_worker_names_its_model_in_time(tmp_path: Path) -> None:
    """It never reached a worker: sending it again runs it once, so the openai
    client (which reads x-should-retry) may; it was told not to."""
    overrides = {"REQUEST_TIMEOUT_S": "0.5"}
    with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        body = {"model": "bogus", "prompt": "alone", "max_tokens": 3}
        response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
        native = {"prompt": "alone", "max_new_tokens": 3}
        waited = httpx.post(f"{stack.url}/generate", json=native, timeout=30)
    assert response.status_code == 504
    assert response.json()["error"]["message"].startswith(
        "no worker named its model within REQUEST_TIMEOUT_S=0.5 s"
    )
    assert response.headers["x-should-retry"] == "true"
    assert waited.status_code == 504, waited.text
    assert waited.headers["x-should-retry"] == "true"


def test_a_504_for_a_request_a_worker_held_says_not_to_retry_it(tmp_path: Path) -> None:
    """Sent to a worker, which holds it (here until a step of 4 s that began
    before it ends) when its time runs out, with no token yet: sent again, it
    would run twice more."""
    overrides = {"REQUEST_TIMEOUT_S": "2", "FAKE_STEP_DELAY_S": "4", "MAX_BATCH_SIZE": "2"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        with ThreadPoolExecutor(1) as pool:
            first = {"model": "fake", "prompt": "first", "max_tokens": 100}
            pool.submit(httpx.post, f"{stack.url}/v1/completions", json=first, timeout=30)
            time.sleep(0.5)  # its first token out, a step of 4 s under way
            body = {"model": "fake", "prompt": "held", "max_tokens": 2}
            response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 504, response.text
    assert response.headers["x-should-retry"] == "false"


def test_the_wait_for_a_first_worker_counts_toward_the_request_timeout(tmp_path: Path) -> None:
    overrides = {"REQUEST_TIMEOUT_S": "4", "FAKE_STEP_DELAY_S": "0.5"}
    with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        body = {"model": "fake", "prompt": "slow", "max_tokens": 100}  # 50 s of steps
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{stack.url}/v1/completions", json=body, timeout=30)
            time.sleep(2)
            stack.start("worker", "worker.serve.main")
            response = answer.result()
        elapsed_s = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert elapsed_s < 5.5, f"504 after {elapsed_s:.1f} s; REQUEST_TIMEOUT_S=4"


def test_batch_of_prompts_is_refused_with_a_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model="fake", prompt=["a", "b"])


def test_max_tokens_over_the_limit_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError, match="MAX_NEW_TOKENS_LIMIT"):
        client.completions.create(model="fake", prompt="hi", max_tokens=100_000)


def test_logprobs_per_token_with_the_chosen_one_among_the_top(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=3, logprobs=2)
    logprobs = completion.choices[0].logprobs
    text = expected_text("hello", 3)
    assert logprobs is not None
    assert logprobs.tokens == list(text)
    assert logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] == {text[0]: -0.25, chr(ord(text[0]) + 1): -0.5}
    assert logprobs.text_offset == [0, 1, 2]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model="fake", prompt="abc", max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = completion.choices
    assert choice.text == "abc"
    assert choice.logprobs is not None and choice.logprobs.tokens == ["a", "b", "c"]
    assert choice.logprobs.token_logprobs == [None, -0.25, -0.25]
    assert choice.logprobs.top_logprobs is not None and choice.logprobs.top_logprobs[0] is None
    assert completion.usage is not None and completion.usage.completion_tokens == 0


def test_lm_eval_loglikelihood_request_shape(stack: Stack) -> None:
    """lm-eval's local-completions model: a batch of one id prompt, echo, logprobs 1,
    max_tokens 1; it sums token_logprobs[ctxlen:-1] and checks greediness."""
    context, continuation = [ord(c) for c in "Q: "], [ord(c) for c in "ab"]
    body = {
        "model": "fake",
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10).json()
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(context) + len(continuation) + 1
    scored = logprobs["token_logprobs"][len(context) : -1]
    assert scored == [-0.25, -0.25]
    assert all(top is not None for top in logprobs["top_logprobs"][1:])


def test_streamed_logprobs_wait_for_the_text_they_belong_to(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 4, "logprobs": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        chunks = [json.loads(data) for _, data in sse_events(r) if data != "[DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks]
    tokens = [token for choice in choices for token in choice["logprobs"]["tokens"]]
    assert "".join(tokens) == expected_text("hi", 4)
    assert [c["logprobs"]["text_offset"] for c in choices if c["text"]] == [[0], [1], [2], [3]]


def test_streamed_echo_sends_the_prompt_first(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        texts = [json.loads(d)["choices"][0]["text"] for _, d in sse_events(r) if d != "[DONE]"]
    assert texts[0] == "hi" + expected_text("hi", 1)
    assert "".join(texts) == "hi" + expected_text("hi", 2)


def test_min_tokens_holds_off_a_stop_and_the_penalties_are_taken(client: openai.OpenAI) -> None:
    # The fake engine writes "tiuoew" after "hi": the stop string "u" ends it at
    # three tokens, unless min_tokens holds stops off. (The penalties' effect on
    # logits is tested against HF in tests/test_scoring.py.)
    def complete(**extra: object) -> openai.types.Completion:
        return client.completions.create(
            model="fake",
            prompt="hi",
            max_tokens=6,
            stop=["u"],
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body={"repetition_penalty": 1.2, **extra},
        )

    stopped = complete()
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("ti", "stop")
    held_off = complete(min_tokens=6)
    assert (held_off.choices[0].text, held_off.choices[0].finish_reason) == ("tiuoew", "length")


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "seeded"]
)
def test_a_logit_bias_of_100_forces_its_token(
    client: openai.OpenAI, sampling: dict[str, object]
) -> None:
    # The fake engine takes its own choice's logit as 0 and others' as -50 or
    # above; the torch sampler is held to this in tests/test_sampler.py.
    completion = client.completions.create(
        model="fake", prompt="hello", max_tokens=5, logit_bias={str(ord("Z")): 100}, **sampling
    )
    assert completion.choices[0].text == "ZZZZZ"


def test_a_logit_bias_of_minus_100_moves_greedy_off_its_token(client: openai.OpenAI) -> None:
    greedy = expected_text("hello", 5)
    banned = {str(ord(c)): -100 for c in set(greedy)}
    completion = client.completions.create(
        model="fake", prompt="hello", max_tokens=5, logit_bias=banned
    )
    text = completion.choices[0].text
    assert text != greedy and text[0] == chr(ord(greedy[0]) + 1)  # the runner-up


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        ({str(FAKE_VOCAB_SIZE): 1}, f"logit_bias: token id {FAKE_VOCAB_SIZE} is outside"),
        ({"65": 100.5}, "logit_bias.65: must be at most 100, got 100.5"),
        ({"65": -101}, "logit_bias.65: must be at least -100, got -101"),
        ({"A": 1}, "logit_bias: keys must be token ids, decimal integers"),
        ({"065": 1}, "logit_bias: keys must be token ids"),
        ({str(i): 1 for i in range(301)}, "logit_bias: at most 300 entries, got 301"),
    ],
    ids=["outside-vocabulary", "over-100", "under-minus-100", "not-an-id", "zero-padded", "301"],
)
def test_a_bad_logit_bias_is_a_422_naming_it(
    client: openai.OpenAI, logit_bias: dict[str, float], message: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.completions.create(model="fake", prompt="hi", max_tokens=2, logit_bias=logit_bias)
    error = raised.value.body
    assert isinstance(error, dict) and message in error["message"], error
    assert error["param"].startswith("logit_bias")


def test_300_logit_bias_entries_are_taken(client: openai.OpenAI) -> None:
    logit_bias = {str(ord("a") + i): 1 for i in range(300)}  # the fake's choice is among them
    completion = client.completions.create(
        model="fake", prompt="hi", max_tokens=4, logit_bias=logit_bias
    )
    assert completion.choices[0].text == expected_text("hi", 4)


def test_min_tokens_above_max_tokens_is_a_422(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.completions.create(
            model="fake", prompt="hi", max_tokens=2, extra_body={"min_tokens": 3}
        )
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "min_tokens"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/generate"])
def test_a_cache_salt_is_taken_and_an_empty_or_long_one_is_a_422(
    stack: Stack, endpoint: str
) -> None:
    body: dict[str, object] = {"prompt": "hi", "cache_salt": "tenant a"}
    body |= {"model": "fake", "max_tokens": 2} if endpoint != "/generate" else {}
    taken = httpx.post(f"{stack.url}{endpoint}", json=body, timeout=10)
    assert taken.status_code == 200, taken.text
    assert IGNORED_FIELDS_HEADER not in taken.headers
    for salt in ("", "x" * 257):
        refused = httpx.post(f"{stack.url}{endpoint}", json=body | {"cache_salt": salt})
        assert refused.status_code == 422
        assert refused.json()["error"]["param"] == "cache_salt"


def test_unknown_fields_are_ignored_and_named(stack: Stack) -> None:
    time.sleep(1.1)  # their log lines are one a second at most
    body = {
        "model": "fake",
        "prompt": "hi",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "nonsense": 1},
        "best_of_luck": True,
    }
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "stream_options.nonsense, best_of_luck"
    assert "ignored 2 unknown fields: stream_options.nonsense, best_of_luck" in stack.log(
        "frontend"
    )


@pytest.mark.parametrize(("name", "shown"), [("a ", "a\\x20"), (" ", "\\x20"), (" b", "\\x20b")])
def test_an_ignored_field_name_with_spaces_at_its_ends_is_answered(
    stack: Stack, name: str, shown: str
) -> None:
    """A header value cannot begin or end with a space: the response failed to send."""
    body = {"model": "fake", "prompt": "hi", "max_tokens": 1, name: 1}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == shown


@pytest.mark.parametrize(
    ("names", "shown"),
    [
        (["a,b", "c"], '"a,b", c'),
        (['say "hi"'], '"say ""hi"""'),
        (["a, b"], '"a, b"'),
        (["0", ""], '0, ""'),
    ],
)
def test_ignored_field_names_read_one_way_in_the_header(
    stack: Stack, names: list[str], shown: str
) -> None:
    """Names holding a comma are quoted: `a,b, c` read as three."""
    body = {"model": "fake", "prompt": "hi", "max_tokens": 1, **dict.fromkeys(names, 1)}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == shown


def test_an_ignored_field_name_is_escaped_in_the_header_and_the_log(stack: Stack) -> None:
    """A newline in a name would otherwise forge a log line; a NUL make the log binary."""
    time.sleep(1.1)  # their log lines are one a second at most
    forged = "zz\n2026-12-03 13:00:00,000 supervisor ERROR: forged\x00é"
    body = {"model": "fake", "prompt": "hi", "max_tokens": 1, forged: 1}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    escaped = '"zz\\n2026-12-03 13:00:00,000 supervisor..."'  # quoted: it holds a comma
    assert response.headers[IGNORED_FIELDS_HEADER] == escaped
    log = stack.log("frontend")
    assert f"ignored 1 unknown fields: {escaped}" in log
    assert "\n2026-12-03 13:00:00,000 supervisor ERROR: forged" not in log


def test_a_flood_of_ignored_fields_writes_a_line_a_second(stack: Stack) -> None:
    """A client sending unknown fields wrote a WARNING line per request, about
    400 a second."""
    lines_before = stack.log("frontend").count("unknown fields:")
    body = {"model": "fake", "prompt": "a", "zz": 1}
    started = time.monotonic()
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        for _ in range(100):
            assert client.post("/tokenize", json=body).status_code == 200
    elapsed_s = time.monotonic() - started
    assert stack.log("frontend").count("unknown fields:") - lines_before <= elapsed_s + 2


def test_a_known_field_of_the_wrong_type_is_still_a_422(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "hi", "min_tokens": "3", "whatever": 1}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "min_tokens"


GUIDELLM_BODIES = [
    (
        "/v1/completions",
        {
            "model": "fake",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 3,
            "stop": None,
            "ignore_eos": True,
            "prompt": "some words",
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "fake",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 3,
            "stop": None,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "some words"}]}],
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), GUIDELLM_BODIES, ids=["completions", "chat"])
def test_guidellm_request_bodies_are_served(
    stack: Stack, path: str, body: dict[str, object]
) -> None:
    """What guidellm 0.8 sends by default (bench/clients.py runs guidellm itself)."""
    with httpx.stream("POST", f"{stack.url}{path}", json=body, timeout=10) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(data) for _, data in sse_events(r) if data != "[DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(chunk["usage"] is not None for chunk in chunks)


def test_strict_request_fields_restores_the_422(tmp_path: Path) -> None:
    overrides = {"STRICT_REQUEST_FIELDS": "1"}
    with running_stack(tmp_path, overrides, supervised=False) as strict:
        strict.wait_live()
        body = {"model": "fake", "prompt": "hi", "best_of_luck": True}
        response = httpx.post(f"{strict.url}/v1/completions", json=body, timeout=10)
        nested = {"model": "fake", "prompt": "hi", "stream_options": {"nonsense": 1}}
        inside = httpx.post(f"{strict.url}/v1/completions", json=nested, timeout=10)
    assert response.status_code == 422
    assert "best_of_luck" in response.json()["error"]["message"]
    assert inside.status_code == 422
    assert inside.json()["error"]["message"] == (
        "stream_options.nonsense: not a field of stream_options, whose fields are "
        "include_usage, continuous_usage_stats"
    )


def _chat(content: str, **fields: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **fields}


@pytest.mark.parametrize(
    ("path", "body", "param", "start"),
    [
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1] * 1020, "max_tokens": 10},
            "prompt",
            "prompt: 1,020 tokens and 10 to generate, more than the context window of 1,024",
        ),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1, FAKE_VOCAB_SIZE]},
            "prompt",
            f"prompt: token id {FAKE_VOCAB_SIZE} is outside the vocabulary",
        ),
        (
            "/v1/chat/completions",
            _chat("x" * 1000, max_completion_tokens=40),
            "messages",
            "messages: 1,01",  # the conversation as its template renders it
        ),
        ("/v1/chat/completions", _chat("x" * 2000), "messages", "messages: 2,0"),
        ("/tokenize", _chat("x" * 1020), "messages", "messages: 1,03"),
        ("/detokenize", {"tokens": [1] * 1500}, "tokens", "tokens: 1,500 tokens, more than"),
    ],
)
def test_a_worker_refusal_names_the_field_as_the_endpoint_body_does(
    stack: Stack, path: str, body: dict[str, object], param: str, start: str
) -> None:
    """The worker checks what only it can (the vocabulary, the context window) and
    names its own fields; the client sees them as its body named them."""
    response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(start), error
    for worker_field in ("max_new_tokens", "prompt_token_ids", "chat_"):
        assert worker_field not in error["message"], error


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": [[]]}),
        ("/v1/completions", {"prompt": [""]}),
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/completions", {"prompt": [[1], [2]]}),
        ("/v1/completions", {"prompt": ["hi"]}),
        ("/v1/completions", {"prompt": [[104, 105]]}),
        ("/v1/completions", {"stop": ""}),
        ("/v1/completions", {"stop": ["a", ""]}),
        ("/v1/completions", {"max_tokens": 100_000}),
        ("/v1/completions", {"max_tokens": 512}),
        ("/v1/completions", {"response_format": {"type": "xml"}}),
        ("/v1/chat/completions", {"max_completion_tokens": 513}),
        ("/v1/chat/completions", {"stop": [""]}),
        ("/generate", {"max_new_tokens": 100_000}),
        ("/generate", {"stop": ""}),
    ],
)
def test_openapi_describes_as_valid_only_what_the_server_takes(
    stack: Stack, endpoint: str, fields: dict[str, object]
) -> None:
    """A client generated from /openapi.json sent bodies it called valid, and got
    422s: an empty prompt or stop string, more tokens than MAX_NEW_TOKENS_LIMIT."""
    base: dict[str, object] = {
        "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 1},
        "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
        "/generate": {"prompt": "hi", "max_new_tokens": 1},
    }[endpoint]
    body = base | fields
    document = httpx.get(f"{stack.url}/openapi.json", timeout=10).json()
    schema = document["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]
    validator = jsonschema.Draft202012Validator(
        schema["schema"] | {"components": document["components"]}
    )
    response = httpx.post(f"{stack.url}{endpoint}", json=body | {"stream": False}, timeout=30)
    assert response.status_code in (200, 400, 422), response.text
    assert validator.is_valid(body) == (response.status_code == 200), response.text


@pytest.mark.parametrize(
    ("path", "fields", "problem"),
    [
        ("/v1/completions", {"max_tokens": 2, "min_tokens": 5}, "0 to max_tokens (2), got 5"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens: must be at least 1"),
        ("/v1/completions", {"max_tokens": -1}, "max_tokens: must be at least 1 (0 with echo"),
        ("/v1/completions", {"max_tokens": -1, "echo": True}, "got -1"),
        ("/v1/completions", {"min_tokens": 20}, "must be 0 to max_tokens' default (16), got 20"),
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of: 1 is less than n (2)"),
        ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "regex"),
        ("/v1/chat/completions", {"max_tokens": 2, "min_tokens": 5}, "min_tokens: must be 0 to"),
        (  # no max_tokens sent: the budget is the server's, not max_tokens'
            "/v1/chat/completions",
            {"min_tokens": 100_000},
            "min_tokens: must be 0 to the server's MAX_NEW_TOKENS_LIMIT (",
        ),
    ],
)
def test_a_wrong_request_is_refused_at_once_while_no_worker_has_said_hello(
    path: str, fields: dict[str, object], problem: str
) -> None:
    """It waited REQUEST_TIMEOUT_S for the model's name, then got a 504 that said
    to retry once a worker is live: a retry that could never succeed."""
    config = load(
        FrontendConfig,
        [],
        {"WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}", "REQUEST_TIMEOUT_S": "20"},
    )
    body: dict[str, object] = {"model": "any", **fields}
    if path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    with TestClient(create_app(config)) as http:
        started = time.monotonic()
        refused = http.post(path, json=body)
        assert time.monotonic() - started < 5
    assert refused.status_code in (400, 422), refused.text
    assert problem in refused.json()["error"]["message"]
