"""One benchmark request over HTTP: our ``/generate`` or any OpenAI-compatible
``/v1/completions``, streamed by default so that first-token and inter-token
times are seen as the client sees them.

Both APIs get the same greedy request. ``ignore_eos`` forces exactly max tokens
where a server supports it (ours and vLLM do; a server that refuses unknown
fields needs ``--no-ignore-eos``, and may then stop early at EOS).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from httpx_sse import EventSource

from bench.report import OK, RequestRecord
from protocol import GenerateRequest

NATIVE = "native"
OPENAI = "openai"


class HttpTarget:
    def __init__(
        self,
        client: httpx.AsyncClient,
        api: str,
        model: str | None = None,
        stream: bool = True,
        ignore_eos: bool = True,
    ) -> None:
        if api not in (NATIVE, OPENAI):
            raise ValueError(f"api must be {NATIVE!r} or {OPENAI!r}, got {api!r}")
        self.client = client
        self.api = api
        self.model = model
        self.stream = stream
        self.ignore_eos = ignore_eos

    async def resolve_model(self) -> str:
        """The model an OpenAI request must name: the first one /v1/models lists."""
        if self.model is None:
            response = await self.client.get("/v1/models")
            response.raise_for_status()
            self.model = str(response.json()["data"][0]["id"])
        return self.model

    def body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        extra: dict[str, Any] = {"ignore_eos": True} if self.ignore_eos else {}
        if self.api == NATIVE:
            return "/generate", {
                "prompt": request.prompt,
                "max_new_tokens": request.max_new_tokens,
                "stream": self.stream,
                **extra,
            }
        stream: dict[str, Any] = (
            {"stream": True, "stream_options": {"include_usage": True}} if self.stream else {}
        )
        return "/v1/completions", {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_new_tokens,
            "temperature": 0.0,
            **stream,
            **extra,
        }

    async def send(self, request: GenerateRequest) -> RequestRecord:
        path, body = self.body(request)
        record = RequestRecord(request.request_id, time.perf_counter())
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    record.status = str(response.status_code)
                elif self.stream:
                    await self._read_events(response, record)
                else:
                    answer = json.loads(await response.aread())
                    _read_usage(record, answer["usage"])
                    record.server_s = _server_s(answer)
        except httpx.TimeoutException:
            record.status = "timeout"
        except httpx.TransportError as exc:
            record.status = type(exc).__name__
        record.ended_at = time.perf_counter()
        return record

    async def _read_events(self, response: httpx.Response, record: RequestRecord) -> None:
        """Count tokens as the events arrive; a stream that ends in an error event
        or without a final event fails."""
        num_streamed = 0
        usage: dict[str, Any] | None = None
        record.status = "incomplete_stream"
        async for sse in EventSource(response).aiter_sse():
            event = sse.event
            if sse.data == "[DONE]":
                record.status = OK
                break
            payload = json.loads(sse.data)
            if event == "error" or "error" in payload:
                record.status = "stream_error"
                break
            if self.api == NATIVE:
                if event == "token" and payload["token_ids"]:
                    record.chunk_times.append(time.perf_counter())
                    num_streamed += len(payload["token_ids"])
                elif event == "done":
                    usage = payload["usage"]
                    record.server_s = _server_s(payload)
                    record.status = OK
                    break
            else:
                if payload.get("choices") and payload["choices"][0].get("text"):
                    record.chunk_times.append(time.perf_counter())
                    num_streamed += 1
                if payload.get("usage"):
                    usage = payload["usage"]
        # A server that reports usage is exact; else each text chunk counts as one token.
        if usage is None:
            record.num_tokens = num_streamed
        else:
            _read_usage(record, usage)


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.num_tokens = int(usage["completion_tokens"])
    if "prompt_tokens" in usage:
        record.num_prompt_tokens = int(usage["prompt_tokens"])


def _server_s(answer: dict[str, Any]) -> float | None:
    """The server's time for a native answer (its wait for a slot and its
    generation); OpenAI answers do not say."""
    metrics = answer.get("metrics")
    if not metrics:
        return None
    return (float(metrics["queue_wait_ms"]) + float(metrics["generate_ms"])) / 1000
