"""Poison requests for the fault drill: bodies built to crash, wedge or fool a
server, each with the answer a sound server gives it.

Most must be refused with a 4xx. A few are legitimately fine and must be served:
a temperature of 1e-30 is greedy, and top_p 1e-300 keeps only the top token, so
both must answer exactly what the fault-free greedy run answered for that prompt.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from protocol.limits import MAX_CHOICES, MAX_GRAMMAR_CHARS
from worker.engine.fake_engine import FAKE_VOCAB_SIZE

GPT2_VOCAB_SIZE = 50257  # the synthetic model's and distilgpt2's
JSON = "application/json"
REFUSED = "4xx"
SERVED = "200"
GREEDY = "200, the greedy text"
NO_ANSWER = "none"
DEEP_NESTING = 100_000  # far past the JSON parser's ~200 levels
NESTING_PAST_THE_SCHEMA = 150  # under the parser's limit: the schema must refuse it
# A JSON schema that llguidance accepts without a tokenizer, but whose first key
# needs more parser items than a step may take: the worker ends it, naming it.
COSTLY_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


@dataclass(frozen=True)
class Probe:
    kind: str
    path: str
    content: bytes
    content_type: str | None = JSON
    expect: str = REFUSED
    expected_text: str | None = None  # GREEDY: the fault-free answer for its prompt
    declared_bytes: int | None = None  # a Content-Length far beyond what is sent


@dataclass
class KindTally:
    expect: str
    statuses: Counter[str] = field(default_factory=Counter)
    num_unexpected: int = 0
    num_sent_under_load: int = 0  # sent while innocent requests were still running

    def summary(self) -> dict[str, object]:
        return {
            "expect": self.expect,
            "statuses": dict(self.statuses),
            "unexpected": self.num_unexpected,
            "sent_while_innocents_ran": self.num_sent_under_load,
        }


def vocab_size_of(model: str | None) -> int:
    return FAKE_VOCAB_SIZE if model == "fake" else GPT2_VOCAB_SIZE


def make_probes(
    innocents: list[dict[str, Any]],
    reference_texts: Mapping[str, str],
    model: str,
    vocab_size: int,
    max_request_bytes: int,
) -> list[Probe]:
    """One of each poison request. ``innocents`` lend their prompts (and their
    reference answers) to the probes that must be served."""
    first, second = innocents[0], innocents[1 % len(innocents)]

    def greedy(kind: str, path: str, body: dict[str, Any], innocent: dict[str, Any]) -> Probe:
        text = reference_texts[str(innocent["request_id"])]
        return Probe(kind, path, _json(body), expect=GREEDY, expected_text=text)

    def generate(kind: str, **fields: Any) -> Probe:
        return Probe(kind, "/generate", _json({"prompt": first["prompt"], **fields}))

    def completion(kind: str, **fields: Any) -> Probe:
        return Probe(kind, "/v1/completions", _json({"model": model, **fields}))

    text_budget = max_request_bytes - len(_json({"prompt": ""})) - 1
    id_budget = (max_request_bytes - len(_json({"model": model, "prompt": []}))) // 2 - 1
    nested = "[" * NESTING_PAST_THE_SCHEMA + "1" + "]" * NESTING_PAST_THE_SCHEMA
    return [
        # The largest bodies the frontend reads: a prompt far past the context window.
        Probe("largest_body", "/generate", _json({"prompt": "a" * text_budget})),
        completion("largest_body", prompt=[1] * id_budget),
        Probe("over_limit_body", "/generate", _json({"prompt": "a" * 2 * max_request_bytes})),
        Probe("over_limit_body", "/generate", b'{"prompt": "', declared_bytes=100_000_000),
        completion("out_of_vocab", prompt=[vocab_size]),
        completion("out_of_vocab", prompt=[2**31 - 1]),
        completion("logit_bias", prompt="hello", logit_bias={str(vocab_size): 100}),
        completion("logit_bias", prompt="hello", logit_bias={str(i): 1 for i in range(301)}),
        greedy(
            "tiny_temperature",
            "/generate",
            {**_prompt_of(first), "temperature": 1e-30},
            first,
        ),
        greedy(
            "tiny_temperature",
            "/v1/completions",
            {
                "model": model,
                "prompt": second["prompt"],
                "max_tokens": second["max_new_tokens"],
                "temperature": 1e-30,
            },
            second,
        ),
        greedy(
            "tiny_top_p",
            "/generate",
            {**_prompt_of(second), "temperature": 1.0, "top_p": 1e-300},
            second,
        ),
        Probe(
            "odd_sampling",
            "/generate",
            _json({**_prompt_of(first), "temperature": 1.0, "top_k": 2**31 - 1}),
            expect=SERVED,
        ),
        Probe(
            "odd_sampling",
            "/generate",
            _json({**_prompt_of(first), "temperature": 1.0, "seed": 2**63 - 1}),
            expect=SERVED,
        ),
        # n and best_of past the limit; the most choices, greedy, all the greedy text.
        completion("choices", prompt="hello", n=MAX_CHOICES + 1),
        completion("choices", prompt="hello", n=2**63),
        completion("choices", prompt="hello", n=2, best_of=MAX_CHOICES + 1),
        completion("choices", prompt="hello", n=1, best_of=2, stream=True),
        greedy(
            "most_choices",
            "/v1/completions",
            {
                "model": model,
                "prompt": first["prompt"],
                "max_tokens": first["max_new_tokens"],
                "temperature": 0,
                "n": MAX_CHOICES,
            },
            first,
        ),
        generate("long_stop", stop="x" * 300),
        generate("many_stops", stop=[f"stop{i}" for i in range(100)]),
        generate("max_new_tokens", max_new_tokens=0),
        generate("max_new_tokens", max_new_tokens=2**64),
        completion("max_new_tokens", prompt="hello", max_tokens=0),
        Probe("not_json", "/generate", b"prompt=hello", "application/x-www-form-urlencoded"),
        Probe("not_json", "/generate", _json({"prompt": "hello"}), "text/plain"),
        Probe("not_json", "/generate", _json({"prompt": "hello"}), None),
        Probe(
            "deep_nesting",
            "/generate",
            b'{"prompt": ' + b"[" * DEEP_NESTING + b"]" * DEEP_NESTING + b"}",
        ),
        completion("deep_nesting", prompt=json.loads(nested)),
        completion("grammar", prompt="hello", response_format=_json_schema({"type": "strin"})),
        completion("grammar", prompt="hello", response_format=_json_schema(COSTLY_SCHEMA)),
        completion(
            "grammar",
            prompt="hello",
            response_format=_json_schema(_nested_schema(NESTING_PAST_THE_SCHEMA)),
        ),
        completion("grammar", prompt="hello", structured_outputs={"regex": "(" * 50}),
        completion(
            "grammar", prompt="hello", structured_outputs={"regex": "a" * MAX_GRAMMAR_CHARS * 2}
        ),
        Probe(
            "grammar_served",
            "/v1/completions",
            _json(
                {
                    "model": model,
                    "prompt": first["prompt"],
                    "max_tokens": 16,
                    "structured_outputs": {"choice": ["yes", "no"]},
                }
            ),
            expect=SERVED,
        ),
    ]


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "poison", "schema": schema}}


def _nested_schema(depth: int) -> dict[str, Any]:
    """An array of arrays ``depth`` deep (llguidance refuses past ~128 levels)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _prompt_of(innocent: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": innocent["prompt"], "max_new_tokens": innocent["max_new_tokens"]}


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


async def send_mixed_in(
    url: str,
    probes: list[Probe],
    timeout_s: float,
    wait_turn: Callable[[int], Awaitable[bool]],
) -> dict[str, KindTally]:
    """Send ``probes`` one at a time, probe ``i`` once ``wait_turn(i)`` returns (True
    while the innocent workload is still running), and tally the answers by kind."""
    tallies: dict[str, KindTally] = {}
    # Its own connections: a refused body closes the connection it came on.
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        for i, probe in enumerate(probes):
            tally = tallies.setdefault(probe.kind, KindTally(probe.expect))
            tally.num_sent_under_load += await wait_turn(i)
            status, text = await _send(client, probe, timeout_s)
            tally.statuses[status] += 1
            tally.num_unexpected += not _is_expected(probe, status, text)
    return tallies


async def _send(client: httpx.AsyncClient, probe: Probe, timeout_s: float) -> tuple[str, str]:
    """The status (NO_ANSWER for none) and the generated text of a 200."""
    if probe.declared_bytes is not None:
        return await _send_declared(str(client.base_url), probe, timeout_s), ""
    headers = {"Content-Type": probe.content_type} if probe.content_type else {}
    try:
        response = await client.post(probe.path, content=probe.content, headers=headers)
    except httpx.TransportError:
        return NO_ANSWER, ""
    if response.status_code != 200:
        return str(response.status_code), ""
    answer = response.json()
    if "text" in answer:
        return "200", str(answer["text"])
    # Every choice must hold the text: a greedy request's choices are all alike.
    texts = {str(choice["text"]) for choice in answer["choices"]}
    return "200", texts.pop() if len(texts) == 1 else f"{len(texts)} different choices"


async def _send_declared(url: str, probe: Probe, timeout_s: float) -> str:
    """Declare ``probe.declared_bytes`` and send only the start: a sound server
    answers 413 at once instead of waiting for the rest."""
    parsed = httpx.URL(url)
    reader, writer = await asyncio.open_connection(parsed.host, parsed.port or 80)
    head = (
        f"POST {probe.path} HTTP/1.1\r\nHost: {parsed.host}\r\n"
        f"Content-Type: {JSON}\r\nContent-Length: {probe.declared_bytes}\r\n\r\n"
    )
    try:
        writer.write(head.encode() + probe.content)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            status_line = await reader.readline()
        return status_line.split()[1].decode() if status_line else NO_ANSWER
    except (TimeoutError, ConnectionError):
        return NO_ANSWER
    finally:
        writer.close()
        await writer.wait_closed()


def _is_expected(probe: Probe, status: str, text: str) -> bool:
    if probe.expect == REFUSED:
        return status.startswith("4")
    if probe.expect == GREEDY:
        return status == "200" and text == probe.expected_text
    return status == "200"


def print_tallies(tallies: Mapping[str, KindTally]) -> None:
    print(f"\n  {'poison kind':<17} {'expected':<21} {'statuses seen':<22} unexpected")
    for kind, tally in tallies.items():
        statuses = ", ".join(f"{n}x {status}" for status, n in sorted(tally.statuses.items()))
        print(f"  {kind:<17} {tally.expect:<21} {statuses:<22} {tally.num_unexpected:>10}")
