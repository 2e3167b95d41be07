"""CORS_ALLOW_ORIGINS: a web page of an allowed origin may call the API from a
browser (its preflight answered without the API key, every answer marked for
it, a 401 included); any other origin, and every origin when it is unset, gets
no CORS headers, so the browser keeps the answer from the page."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from frontend.config import FrontendConfig
from protocol.settings import ConfigError, load
from tests.stack import Stack, running_stack

KEY = "sk-test-cors"
ALLOWED = "https://app.example.com"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"API_KEY": KEY, "CORS_ALLOW_ORIGINS": f"{ALLOWED}, http://localhost:3000"}
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


def _preflight(stack: Stack, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(f"{stack.url}/v1/completions", headers=headers, timeout=10)


def test_an_allowed_origins_preflight_is_answered_without_the_key(stack: Stack) -> None:
    response = _preflight(stack, ALLOWED)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


def test_another_origins_preflight_is_refused(stack: Stack) -> None:
    response = _preflight(stack, "https://evil.example.com")
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


def test_an_allowed_origin_reads_answers_and_refusals_alike(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "unknown_field": 1}
    headers = {"Origin": ALLOWED, "Authorization": f"Bearer {KEY}"}
    served = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert served.status_code == 200, served.text
    assert served.headers["access-control-allow-origin"] == ALLOWED
    assert "x-ignored-fields" in served.headers["access-control-expose-headers"].lower()
    refused = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Origin": ALLOWED})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ALLOWED


def test_without_the_setting_no_origin_gets_cors_headers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with running_stack(tmp_path_factory.mktemp("plain"), supervised=False) as stack:
        stack.wait_live()
        assert _preflight(stack, ALLOWED).status_code == 405
        answer = httpx.get(f"{stack.url}/health", headers={"Origin": ALLOWED}, timeout=10)
        assert "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize(
    "origin", ["https://app.example.com/", "app.example.com", "https://app.example.com/path"]
)
def test_an_origin_no_browser_sends_is_refused_at_start(origin: str) -> None:
    with pytest.raises(ConfigError, match="is no origin a browser sends"):
        load(FrontendConfig, [], {"CORS_ALLOW_ORIGINS": origin})
