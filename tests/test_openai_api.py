"""/v1/completions and /v1/models through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.sse import sse_events
from tests.stack import Stack, running_stack
from worker.fake_engine import expected_text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"FAKE_STEP_DELAY_S": "0.005"}
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == ["fake"]


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
        client.completions.create(model="fake", prompt="hi", n=2)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == "n"
    assert error["type"] == "invalid_request_error"
    assert "n=1" in error["message"]


def test_invalid_value_is_a_422_naming_the_parameter(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.completions.create(model="fake", prompt="hi", temperature=2.5)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "temperature"


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="serves 'fake'"):
        client.completions.create(model="gpt-4", prompt="hi")


def test_batch_of_prompts_is_refused_with_a_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model="fake", prompt=["a", "b"])


def test_max_tokens_over_the_limit_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError, match="MAX_NEW_TOKENS_LIMIT"):
        client.completions.create(model="fake", prompt="hi", max_tokens=100_000)
