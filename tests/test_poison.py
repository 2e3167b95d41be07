"""Poison requests over HTTP: each gets its own 4xx (or its right answer), while
innocent requests beside them are answered as usual and no worker restarts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.poison import COSTLY_SCHEMA
from protocol.limits import MAX_GRAMMAR_CHARS
from tests.stack import Stack, running_stack
from worker.engine.fake_engine import FAKE_VOCAB_SIZE, expected_text

MAX_REQUEST_BYTES = 1024 * 1024

# (what, path, body or raw bytes, expected status)
POISON: list[tuple[str, str, object, int]] = [
    ("the largest prompt a body may hold", "/generate", {"prompt": "x" * 1_040_000}, 422),
    ("a body over the limit", "/generate", {"prompt": "x" * (2 * MAX_REQUEST_BYTES)}, 413),
    ("an id outside the vocabulary", "/v1/completions", {"prompt": [FAKE_VOCAB_SIZE]}, 422),
    ("the largest id", "/v1/completions", {"prompt": [2**31 - 1]}, 422),
    ("a stop string over 256 characters", "/generate", {"stop": ["s" * 300]}, 422),
    ("a temperature of 1e-30", "/generate", {"temperature": 1e-30}, 200),
    ("a top_p of 1e-300", "/generate", {"temperature": 1.0, "top_p": 1e-300, "seed": 1}, 200),
    ("a top_k of 2**31 - 1", "/generate", {"temperature": 1.0, "top_k": 2**31 - 1}, 200),
    ("max_new_tokens 0", "/generate", {"max_new_tokens": 0}, 422),
    (
        "a logit_bias id outside the vocabulary",
        "/v1/completions",
        {"prompt": "poison", "logit_bias": {str(FAKE_VOCAB_SIZE): 100}},
        422,
    ),
    (
        "301 logit_bias entries",
        "/v1/completions",
        {"prompt": "poison", "logit_bias": {str(i): 1 for i in range(301)}},
        422,
    ),
    ("a logit_bias of 1e308", "/v1/completions", {"prompt": "p", "logit_bias": {"0": 1e308}}, 422),
    ("n past the limit", "/v1/completions", {"prompt": "poison", "n": 9}, 422),
    ("n of 2**63", "/v1/chat/completions", {"n": 2**63}, 422),
    ("the most choices", "/v1/completions", {"prompt": "poison", "n": 8, "best_of": 8}, 200),
    (
        "the largest logit_bias, at the largest id",
        "/v1/completions",
        {"prompt": "poison", "logit_bias": {str(FAKE_VOCAB_SIZE - 1 - i): 100 for i in range(300)}},
        200,
    ),
    (
        "a grammar twice MAX_GRAMMAR_CHARS long",
        "/v1/completions",
        {"prompt": "p", "structured_outputs": {"regex": "a" * 2 * MAX_GRAMMAR_CHARS}},
        422,
    ),
    (
        "a schema too costly for one step",
        "/v1/completions",
        {
            "prompt": "p",
            "response_format": {"type": "json_schema", "json_schema": {"schema": COSTLY_SCHEMA}},
        },
        422,
    ),
    (
        "a regex that never closes",
        "/v1/completions",
        {"structured_outputs": {"regex": "(" * 50}},
        422,
    ),
    ("a choice", "/v1/completions", {"prompt": "p", "structured_outputs": {"choice": ["a"]}}, 200),
    (
        "deeply nested JSON",
        "/generate",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        422,
    ),
]


def _send(stack: Stack, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{stack.url}{path}", content=body, headers=headers, timeout=30)
    payload = dict(body)  # type: ignore[call-overload]
    if path == "/v1/chat/completions":
        payload.setdefault("model", "fake")
        payload.setdefault("messages", [{"role": "user", "content": "poison"}])
    elif path == "/v1/completions":
        payload.setdefault("model", "fake")
    else:
        payload.setdefault("prompt", "poison")
    return httpx.post(f"{stack.url}{path}", json=payload, timeout=30)


def _innocent(stack: Stack, i: int) -> str:
    body = {"prompt": f"innocent {i}", "max_new_tokens": 20}
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


def test_poison_requests_fail_alone_and_restart_nothing(tmp_path: Path) -> None:
    overrides = {"FAKE_STEP_DELAY_S": "0.01", "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        with ThreadPoolExecutor(max_workers=8) as pool:
            innocents = [pool.submit(_innocent, stack, i) for i in range(16)]
            poisons = [pool.submit(_send, stack, path, body) for _, path, body, _ in POISON]
            for (what, _, _, status), future in zip(POISON, poisons, strict=True):
                response = future.result(timeout=60)
                assert response.status_code == status, f"{what}: {response.text[:300]}"
                assert len(response.content) < 2000, what
            for i, future in enumerate(innocents):
                assert future.result(timeout=60) == expected_text(f"innocent {i}", 20)
        greedy = _send(stack, "/generate", {"temperature": 1e-30})
        assert greedy.json()["text"] == expected_text("poison", 16)
        health = stack.wait_live()
        assert (health["instance_id"], health["worker_restarts"]) == (first["instance_id"], 0)


def test_a_refusal_by_the_worker_names_the_request_field(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False) as stack:
        stack.wait_live()
        cases = [
            ("/v1/completions", {"prompt": [FAKE_VOCAB_SIZE]}, "prompt"),
            ("/generate", {"stop_token_ids": [FAKE_VOCAB_SIZE]}, "stop_token_ids"),
            (
                "/v1/completions",
                {"prompt": "p", "logit_bias": {str(FAKE_VOCAB_SIZE): 1}},
                "logit_bias",
            ),
            ("/generate", {"prompt": "x" * 2000}, "prompt"),
            (
                "/v1/completions",
                {
                    "prompt": "p",
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": COSTLY_SCHEMA},
                    },
                },
                "response_format.json_schema.schema",
            ),
            (
                "/v1/completions",
                {"prompt": "p", "structured_outputs": {"grammar": "start: start"}},
                "structured_outputs.grammar",
            ),
        ]
        for path, body, param in cases:
            response = _send(stack, path, body)
            assert response.status_code == 422, response.text
            assert response.json()["error"]["param"] == param, response.text
