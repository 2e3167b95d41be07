"""API_KEY: with it set, every endpoint but the probes needs the key as a bearer
token, from raw HTTP and from the `openai` client alike."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

from frontend.config import FrontendConfig
from frontend.main import log_access
from protocol.settings import load
from tests.stack import Stack, running_stack
from worker.engine.fake_engine import expected_text

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"API_KEY": KEY}
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


def generate(stack: Stack, headers: dict[str, str] | list[tuple[str, str]]) -> httpx.Response:
    body = {"prompt": "key", "max_new_tokens": 3}
    return httpx.post(f"{stack.url}/generate", json=body, headers=headers, timeout=10)


def test_the_right_key_is_served(stack: Stack) -> None:
    response = generate(stack, {"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected_text("key", 3)


def test_the_frontend_says_at_start_that_the_api_needs_the_key(stack: Stack) -> None:
    log = stack.log("frontend")
    assert "API_KEY is set: every path but /health, /metrics, /ready needs" in log
    assert KEY not in log


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("127.0.0.1", "no API_KEY: anyone who reaches 127.0.0.1:18000 may use the API"),
        # Not "0.0.0.0:18000", an address no client uses.
        (
            "0.0.0.0",
            "no API_KEY: anyone who reaches port 18000 on any address here (HOST=0.0.0.0; in a "
            "container, wherever its published port leads) may use the API",
        ),
        (
            "::0",
            "no API_KEY: anyone who reaches port 18000 on any address here (HOST=::0; in a "
            "container, wherever its published port leads) may use the API",
        ),
        (
            "0",
            "no API_KEY: anyone who reaches port 18000 on any address here (HOST=0; in a "
            "container, wherever its published port leads) may use the API",
        ),
        ("::1", "no API_KEY: anyone who reaches [::1]:18000 may use the API"),
    ],
)
def test_without_a_key_the_frontend_says_who_may_use_the_api(
    host: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = load(FrontendConfig, [], {"HOST": host, "PORT": "18000"})
    with caplog.at_level(logging.INFO):
        log_access(config)
    assert said in caplog.text
    assert "CURVE" not in caplog.text


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "this server needs an API key"),
        ({"Authorization": f"Bearer {KEY}x"}, "the API key is not valid"),
        ({"Authorization": f"Bearer {KEY[:-1]}"}, "the API key is not valid"),
        ({"Authorization": f"Basic {KEY}"}, "the Authorization header must use the Bearer scheme"),
        # The first field was read: right then wrong was served, wrong then right not.
        (
            [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer x")],
            "send one Authorization header, not 2",
        ),
        (
            [("Authorization", "Bearer x"), ("Authorization", f"Bearer {KEY}")],
            "send one Authorization header, not 2",
        ),
    ],
)
def test_a_missing_or_wrong_key_gets_401_saying_what_to_send(
    stack: Stack, headers: dict[str, str] | list[tuple[str, str]], message: str
) -> None:
    response = generate(stack, headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["message"].startswith(message)
    assert "Authorization: Bearer <key>" in error["message"]
    assert error["code"] == "invalid_api_key"
    assert KEY not in response.text


@pytest.mark.parametrize(
    ("path", "route"),
    [("/v1/models", "/v1/models"), ("/openapi.json", "/openapi.json"), ("/no-such-path", "other")],
)
def test_every_other_path_needs_the_key_and_its_refusal_counts(
    stack: Stack, path: str, route: str
) -> None:
    counted = f'minibatch_requests_total{{endpoint="{route}",finish_reason="none",status="401"}}'

    def count() -> float:
        for line in httpx.get(f"{stack.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(counted + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    assert httpx.get(f"{stack.url}{path}", timeout=10).status_code == 401
    assert count() == before + 1


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
def test_the_probes_need_no_key(stack: Stack, path: str) -> None:
    assert httpx.get(f"{stack.url}{path}", timeout=10).status_code == 200


def test_the_openai_client_with_the_key_is_served(stack: Stack) -> None:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as client:
        completion = client.completions.create(model="fake", prompt="sdk", max_tokens=3)
    assert completion.choices[0].text == expected_text("sdk", 3)


def test_the_openai_client_without_the_key_gets_an_authentication_error(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0)
    with client, pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model="fake", prompt="sdk", max_tokens=3)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
