"""The frontend's links to its workers: a background task that dies ends the frontend;
a slot that the step under way frees (its request's max_new_tokens, or the context
window, reached) is refilled before that step ends; a worker's death while a request
only waited in its queue is not held against the request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from frontend import worker_link
from frontend.config import FrontendConfig
from frontend.worker_client import WorkerClient
from frontend.worker_link import HEARD_AFTER_DEATH_S
from protocol import (
    Admitted,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    Heartbeat,
    Ping,
    ToFrontend,
    TokenDelta,
    ToWorker,
    Waiting,
    decode_to_worker,
    encode,
)
from protocol.lifeline import SUPERVISOR_PID_ENV
from protocol.settings import load
from tests.stack import free_port
from tests.stand_in_worker import StandInWorker, stand_in_hello


@pytest.mark.parametrize(
    ("cls", "loop"),
    [
        ("worker_pool.WorkerPool", "_tick_loop"),
        ("worker_pool.WorkerPool", "_discovery_loop"),
        ("worker_link.WorkerLink", "_receive_loop"),
        ("worker_link.WorkerLink", "_monitor_loop"),
    ],
)
def test_a_background_task_that_raises_ends_the_frontend_loudly(cls: str, loop: str) -> None:
    module = cls.partition(".")[0]
    script = (
        f"import frontend.main, frontend.{module}\n"
        "async def broken(self):\n"
        "    raise RuntimeError('injected')\n"
        f"setattr(frontend.{cls}, {loop!r}, broken)\n"
        "frontend.main.main([])\n"
    )
    env = {
        **os.environ,
        "PORT": str(free_port()),
        # A host name, so that the frontend looks it up again and again.
        "WORKER_ENDPOINT": f"tcp://localhost:{free_port()}",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 4
    assert "background task worker-" in done.stderr
    assert "RuntimeError: injected" in done.stderr


class ScriptedWorker:
    """A ROUTER that speaks the worker's side of the protocol frame by frame, as
    the test's event loop says (`tests.stand_in_worker` answers on its own thread)."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""

    async def greet(self, capacity: int, heartbeat_interval_s: float = 0.0) -> None:
        """Answer the frontend's first ping with a hello and a heartbeat."""
        self.peer, frame = await self.socket.recv_multipart()
        assert isinstance(decode_to_worker(frame), Ping)
        await self.say_hello("stand-in", capacity, heartbeat_interval_s)

    async def say_hello(
        self, instance_id: str, capacity: int, heartbeat_interval_s: float = 0.0
    ) -> None:
        """Greet as ``instance_id``: a new one is a replacement, as if the worker
        the frontend knew had died."""
        hello = stand_in_hello(instance_id=instance_id, capacity=capacity)
        await self.send(dataclasses.replace(hello, heartbeat_interval_s=heartbeat_interval_s))
        await self.heartbeat(instance_id)

    async def heartbeat(self, instance_id: str = "stand-in") -> None:
        await self.send(Heartbeat(instance_id, num_steps=1, num_queued=0, num_active=0))

    async def send(self, message: ToFrontend) -> None:
        await self.socket.send_multipart([self.peer, encode(message)])

    async def next_message(self, timeout_s: float) -> ToWorker | None:
        """The next message the frontend sends, or None in time."""
        if not await self.socket.poll(timeout_s * 1000):
            return None
        _, frame = await self.socket.recv_multipart()
        return decode_to_worker(frame)

    async def next_request(self, timeout_s: float) -> GenerateRequest | None:
        """The next request the frontend sends (pings skipped), or None in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            if not await self.socket.poll(remaining * 1000):
                break
            _, frame = await self.socket.recv_multipart()
            message = decode_to_worker(frame)
            if isinstance(message, GenerateRequest):
                return message
        return None


@contextlib.asynccontextmanager
async def _client_of_one_slot() -> AsyncIterator[tuple[WorkerClient, ScriptedWorker]]:
    """A frontend's client of workers, live with a stand-in worker of one slot."""
    context = zmq.asyncio.Context()
    worker = ScriptedWorker(context)
    client = WorkerClient(load(FrontendConfig, [], {"WORKER_ENDPOINT": worker.endpoint}))
    await client.start()
    try:
        await worker.greet(capacity=1)
        while not client.verdict().is_live:
            await asyncio.sleep(0.01)
        yield client, worker
    finally:
        await client.close()
        worker.socket.close()
        context.term()


def test_the_next_request_goes_out_while_the_running_one_takes_its_last_step() -> None:
    """One slot: the second request is sent as soon as the first is one token short
    of its max_new_tokens (the step under way ends it), not after the first's
    result, so the worker can start it right after that step."""

    async def drill() -> None:
        async with _client_of_one_slot() as (client, worker):
            deadline = asyncio.get_running_loop().time() + 30
            for request_id in ("first", "second"):
                client.submit([GenerateRequest(request_id, "a prompt", max_new_tokens=3)], deadline)
            first = await worker.next_request(timeout_s=5)
            assert first is not None and first.request_id == "first.1"
            await worker.send(TokenDelta(first.request_id, [1], "x"))
            assert await worker.next_request(timeout_s=0.3) is None  # two more steps to go
            await worker.send(TokenDelta(first.request_id, [2], "y"))
            second = await worker.next_request(timeout_s=5)
            assert second is not None and second.request_id == "second.1"

    asyncio.run(drill())


def test_a_chat_that_fills_the_context_window_sends_its_successor_in_its_last_step() -> None:
    """A request fitted to the context window (a chat that asked for no max_tokens)
    ends where the window is full, long before its max_new_tokens: the next request
    goes out during that last step too."""

    async def drill() -> None:
        async with _client_of_one_slot() as (client, worker):
            deadline = asyncio.get_running_loop().time() + 30
            fitted = GenerateRequest("first", "a prompt", max_new_tokens=512, fit_context=True)
            client.submit([fitted], deadline)
            client.submit([GenerateRequest("second", "a prompt", max_new_tokens=3)], deadline)
            first = await worker.next_request(timeout_s=5)
            assert first is not None and first.request_id == "first.1"
            window = 1024  # the stand-in's hello: the prompt leaves room for 3 tokens
            await worker.send(TokenDelta(first.request_id, [1], "x", prompt_tokens=window - 3))
            assert await worker.next_request(timeout_s=0.3) is None  # two more steps to go
            await worker.send(TokenDelta(first.request_id, [2], "y", prompt_tokens=window - 3))
            second = await worker.next_request(timeout_s=5)
            assert second is not None and second.request_id == "second.1"

    asyncio.run(drill())


async def _next_attempt_of(
    worker: ScriptedWorker, request_id: str, timeout_s: float
) -> GenerateRequest | None:
    """The next attempt of ``request_id`` the frontend sends; any other request
    sent before it makes progress at once (a token)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (remaining := deadline - loop.time()) > 0:
        request = await worker.next_request(remaining)
        if request is None:
            break
        if request.request_id.startswith(f"{request_id}."):
            return request
        await worker.send(TokenDelta(request.request_id, [1], "x"))
    return None


@pytest.mark.parametrize(
    ("notices", "grammar", "is_replayed"),
    [
        ([Waiting], "", True),
        ([Waiting, Admitted], "", False),  # its prefill may be what killed them
        ([], "", False),  # the worker never said it waits
        ([Waiting], "x+", False),  # its grammar compiles while it waits
    ],
)
def test_two_deaths_while_a_request_only_waited_in_the_queue_do_not_fail_it(
    notices: list[type[Waiting] | type[Admitted]], grammar: str, is_replayed: bool
) -> None:
    """Two choices and one slot: the second waits in the worker's queue while the
    first runs (it makes progress), and the worker is replaced twice. Deaths
    without progress, with no other request there that may have caused them,
    fail a request after two, but not those in which it only waited, which
    nothing of it ran."""

    async def drill() -> None:
        async with _client_of_one_slot() as (client, worker):
            running = GenerateRequest("running", "a prompt", max_new_tokens=50)
            queued = GenerateRequest(
                "queued", "a prompt", 50, grammar_kind="regex" if grammar else "", grammar=grammar
            )
            _, entry = client.submit([running, queued], asyncio.get_running_loop().time() + 30)
            for death in (1, 2):
                attempt = await _next_attempt_of(worker, "queued", timeout_s=5)
                assert attempt is not None, f"not replayed after {death - 1} deaths"
                for notice in notices:
                    await worker.send(notice(attempt.request_id))
                if death == 2:  # the running one's replay, sent after it, makes progress
                    await _next_attempt_of(worker, "none", timeout_s=0.3)
                await worker.say_hello(f"replacement-{death}", capacity=1)
            replayed = await _next_attempt_of(worker, "queued", timeout_s=2)
            assert (replayed is not None) == is_replayed
            if not is_replayed:
                _, final = entry.events.get_nowait()
                assert isinstance(final, ErrorResult)
                assert final.code == ErrorCode.WORKERS_DIED

    asyncio.run(drill())


@contextlib.asynccontextmanager
async def _one_of_two_killed_holding_a_suspect(
    heartbeat_interval_s: float, **settings: str
) -> AsyncIterator[ScriptedWorker]:
    """Two stand-in workers of one slot; a request goes to one, which is killed
    before it made progress (its connection closes) and found dead: the request
    is a suspect. Yields the other."""
    context = zmq.asyncio.Context()
    first, second = ScriptedWorker(context), ScriptedWorker(context)
    settings["WORKER_ENDPOINTS"] = f"{first.endpoint},{second.endpoint}"
    client = WorkerClient(load(FrontendConfig, [], settings))
    await client.start()
    try:
        await asyncio.gather(*(w.greet(1, heartbeat_interval_s) for w in (first, second)))
        while sum(link.verdict().is_live for link in client.workers()) < 2:
            await asyncio.sleep(0.01)
        client.submit([GenerateRequest("r", "a prompt", 4)], asyncio.get_running_loop().time() + 30)
        receiving = {asyncio.ensure_future(w.next_request(5)): w for w in (first, second)}
        done, pending = await asyncio.wait(receiving, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        holder = receiving[done.pop()]
        (holder_link,) = [link for link in client.workers() if link.endpoint == holder.endpoint]
        holder.socket.close()
        while holder_link.verdict().is_live:
            await asyncio.sleep(0.01)
        yield second if holder is first else first
    finally:
        await client.close()
        for worker in (first, second):
            worker.socket.close()
        context.term()


def test_a_suspect_waits_for_a_sign_of_life_from_the_worker_it_is_tried_on() -> None:
    """Two workers killed together: the first found dead left a suspect, which
    went at once to the second, dead too but not yet found so. It died with it,
    its second death without progress, and was failed: an innocent request. A
    heartbeat read right after the death may have been sent before it: only one
    read HEARD_AFTER_DEATH_S later lets the trial go (this stand-in answers no
    ping)."""

    async def drill() -> None:
        async with _one_of_two_killed_holding_a_suspect(heartbeat_interval_s=1.0) as other:
            await other.heartbeat()  # may have been sent before the death
            assert await other.next_request(timeout_s=0.3) is None
            await asyncio.sleep(HEARD_AFTER_DEATH_S)
            await other.heartbeat()
            trial = await other.next_request(timeout_s=2)
            assert trial is not None and trial.request_id == "r.2"

    asyncio.run(drill())


def test_after_a_death_the_others_are_pinged_for_a_sign_of_life() -> None:
    """The suspect need not wait for the survivor's timer (here 10 s): 0.1 s after
    the death the frontend pings it, and the heartbeat that answers lets the
    trial go."""

    async def drill() -> None:
        async with _one_of_two_killed_holding_a_suspect(10.0, PING_INTERVAL_S="30") as other:
            found_dead_at = asyncio.get_running_loop().time()
            assert isinstance(await other.next_message(timeout_s=1), Ping)
            await other.heartbeat()  # the answer
            trial = await other.next_request(timeout_s=1)
            assert trial is not None and trial.request_id == "r.2"
            assert asyncio.get_running_loop().time() - found_dead_at < 0.6

    asyncio.run(drill())


def test_a_busy_event_loop_does_not_take_unread_heartbeats_for_silence() -> None:
    """The loop blocked past HEARTBEAT_TIMEOUT_S (a burst of large bodies to
    validate) while the worker kept sending heartbeats: they wait unread, and the
    worker is still live when the loop looks again, before it reads them."""

    async def drill(endpoint: str) -> None:
        env = {"WORKER_ENDPOINT": endpoint, "HEARTBEAT_TIMEOUT_S": "0.5"}
        client = WorkerClient(load(FrontendConfig, [], env))
        await client.start()
        try:
            while not client.verdict().is_live:
                await asyncio.sleep(0.01)
            time.sleep(1.0)  # the loop blocked: nothing is read meanwhile
            assert client.verdict().is_live
            (link,) = client.workers()
            assert link.was_live
        finally:
            await client.close()

    # Its heartbeats go on, every 0.1 s, from a thread of its own.
    with StandInWorker(lambda request: [], capacity=1) as worker:
        asyncio.run(drill(worker.endpoint))


@pytest.mark.parametrize("is_supervised", [False, True])
def test_a_frontend_with_no_worker_at_its_address_asks_whether_one_runs_there(
    is_supervised: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It said only "no worker has said hello yet", in /health and in every
    request's timeout, however long nothing answered at a mistyped address.
    Under minibatch-serve, whose worker is there, loading, the log line is only
    a note, and does not ask whether a worker runs there: a first start's warning
    alarmed its user, and so did the question, asked before the model loaded."""
    monkeypatch.setattr(worker_link, "SILENT_WORKER_HINT_S", 0.3)
    monkeypatch.delenv(SUPERVISOR_PID_ENV, raising=False)
    if is_supervised:
        monkeypatch.setenv(SUPERVISOR_PID_ENV, str(os.getpid()))
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    async def drill() -> None:
        client = WorkerClient(load(FrontendConfig, [], {"WORKER_ENDPOINT": endpoint}))
        await client.start()
        try:
            assert client.verdict().reason == "no worker has said hello yet"
            await asyncio.sleep(0.5)
            client.on_tick()
            client.on_tick()
            reason = client.verdict().reason
            if is_supervised:  # the worker is there, or will be once the model loads
                said = "minibatch-serve's worker says hello once its model is loaded"
                assert re.match(rf"no hello from {endpoint} in \d s: {said}", reason)
            else:
                assert re.match(rf"no hello from {endpoint} in \d s: is a worker running", reason)
                assert "WORKER_ENDPOINT" in reason
        finally:
            await client.close()

    with caplog.at_level(logging.INFO, logger="frontend.worker_link"):
        asyncio.run(drill())
    (logged,) = caplog.records  # once, for two ticks
    assert logged.getMessage().startswith(f"no hello from {endpoint}")
    assert logged.levelno == (logging.INFO if is_supervised else logging.WARNING)
