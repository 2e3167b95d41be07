"""One benchmark request straight to the worker's ZMQ socket, bypassing HTTP.

The client speaks `protocol` exactly as the frontend does: a DEALER that pings
(the worker drops the requests of a frontend whose pings stop), sends
`GenerateRequest`s and reads `TokenDelta`s and the final answer. Run against the
same worker as the HTTP client, the difference between the two is the frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from types import TracebackType

import zmq
import zmq.asyncio

from bench.report import RequestRecord
from protocol import (
    AbortRequest,
    ErrorResult,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Hello,
    Ping,
    TokenDelta,
    decode_to_frontend,
    encode,
)
from protocol.curve import ClientKeys
from protocol.liveness import Liveness, WorkerState
from protocol.peer import worker_socket

PING_INTERVAL_S = 1.0
# The status of a request the worker no longer holds: it greeted this client again,
# which it does only on first contact (it was replaced, or it timed this client
# out). Unlike the frontend, this client does not replay it elsewhere.
LOST = "lost_by_worker"
# A worker silent this long is dead, one whose steps stand still this long with
# work pending is hung, and this client's requests there end with that status
# ("dead", "hung"): without it, a load run waited for ever on a worker killed and
# not replaced. Longer than the frontend's defaults: a benchmark loads the machine.
WORKER_SILENT_S = 10.0
STEP_TIMEOUT_S = 60.0


class ZmqTarget:
    def __init__(
        self,
        endpoint: str,
        stream: bool = True,
        hello_timeout_s: float = 60.0,
        curve: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.stream = stream
        self.hello_timeout_s = hello_timeout_s
        self.frontend_id = f"bench-{uuid.uuid4().hex[:12]}"
        self.hello: Hello | None = None
        self._context = zmq.asyncio.Context()
        self._waiting: dict[str, tuple[RequestRecord, asyncio.Future[None]]] = {}
        self._liveness = Liveness(WORKER_SILENT_S, STEP_TIMEOUT_S)
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> ZmqTarget:
        self._socket = worker_socket(self._context, self.endpoint, self.curve)
        self._socket.connect(self.endpoint)
        hello_seen = asyncio.get_running_loop().create_future()
        self._tasks = [
            asyncio.create_task(self._receive_loop(hello_seen)),
            asyncio.create_task(self._ping_loop()),
        ]
        try:
            await asyncio.wait_for(hello_seen, self.hello_timeout_s)
        except TimeoutError:
            await self.__aexit__(None, None, None)
            raise RuntimeError(
                f"no Hello from a worker at {self.endpoint} within {self.hello_timeout_s:g} s"
            ) from None
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._socket.close(linger=0)
        self._context.term()

    async def send(self, request: GenerateRequest) -> RequestRecord:
        record = RequestRecord(request.request_id, time.perf_counter())
        done = asyncio.get_running_loop().create_future()
        self._waiting[request.request_id] = (record, done)
        await self._socket.send(encode(dataclasses.replace(request, stream=self.stream)))
        await done
        return record

    async def _ping_loop(self) -> None:
        frame = encode(Ping(self.frontend_id))
        while True:
            await self._socket.send(frame)
            await asyncio.sleep(PING_INTERVAL_S)
            state = self._liveness.verdict().state
            if self._waiting and state in (WorkerState.DEAD, WorkerState.HUNG):
                print(
                    f"the worker is {state.value} (nothing from it for {WORKER_SILENT_S:g} s, "
                    f"or no step for {STEP_TIMEOUT_S:g} s with work pending): its "
                    f"{len(self._waiting)} requests fail"
                )
                # Should it wake, it stops running them: they would hold its slots.
                for request_id in self._waiting:
                    with contextlib.suppress(zmq.Again):  # nowhere to queue it: gone
                        await self._socket.send(encode(AbortRequest(request_id)), zmq.NOBLOCK)
                self._end_waiting(state.value, time.perf_counter())

    async def _receive_loop(self, hello_seen: asyncio.Future[None]) -> None:
        while True:
            message = decode_to_frontend(await self._socket.recv())
            now = time.perf_counter()
            if isinstance(message, Hello):
                if self.hello is not None:
                    self._end_waiting(LOST, now)
                self.hello = message
                self._liveness.on_hello(message)
                if not hello_seen.done():
                    hello_seen.set_result(None)
                continue
            if isinstance(message, Heartbeat):
                self._liveness.on_heartbeat(message)
            # Any message says it is there, as frames waiting unread do.
            self._liveness.on_frames_waiting()
            if not isinstance(message, (TokenDelta, GenerateResult, ErrorResult)):
                continue  # heartbeats, and which requests wait in the queue
            waiting = self._waiting.get(message.request_id)
            if waiting is None:
                continue
            record, done = waiting
            if isinstance(message, TokenDelta):
                if message.token_ids:
                    record.chunk_times.append(now)
                continue
            if isinstance(message, GenerateResult):
                record.num_tokens = message.completion_tokens
                record.server_s = (message.queue_wait_ms + message.generate_ms) / 1000
                if message.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    record.status = message.finish_reason
            else:
                record.status = message.code
            record.ended_at = now
            del self._waiting[message.request_id]
            done.set_result(None)

    def _end_waiting(self, status: str, now: float) -> None:
        for record, done in self._waiting.values():
            record.status = status
            record.ended_at = now
            done.set_result(None)
        self._waiting.clear()
