"""The worker's table of peers when it is full: newcomers that squat places are
forgotten for the next newcomer, and the frontends that were there first keep
theirs, whatever newcomers send."""

from __future__ import annotations

import msgpack
import pytest

from protocol import (
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    Heartbeat,
    Ping,
    decode_to_frontend,
    encode,
)
from protocol.request_checks import RequestLimits
from tests.fake_clock import FakeClock
from tests.stand_in_worker import stand_in_hello
from worker.serve.outputs import send_outputs
from worker.serve.peers import MAX_ERROR_CHARS, MIN_PING_ANSWER_S, SETTLED_S, Peers, route_for


class _Router:
    """Stands in for the ROUTER socket: records what each peer was sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames[0])


def _table(max_peers: int) -> Peers:
    hello = stand_in_hello(instance_id="worker")
    limits = RequestLimits(vocab_size=1000, context_window=64, max_token_chars=4)
    return Peers(_Router(), hello, limits, timeout_s=60, max_peers=max_peers)  # type: ignore[arg-type]


def _ping(peers: Peers, peer: bytes) -> None:
    peers.receive([peer, encode(Ping(peer.decode()))])


def _request(peers: Peers, peer: bytes) -> None:
    assert peers.receive([peer, encode(GenerateRequest("r", "hi", 4))])


def test_a_flood_of_newcomers_with_requests_does_not_push_out_an_idle_frontend(
    clock: FakeClock,
) -> None:
    # The frontend waits between requests while a flood's requests, each from a
    # peer of its own, have not yet been refused by the engine.
    peers = _table(max_peers=3)
    _ping(peers, b"frontend")
    clock.now += SETTLED_S + 1
    for attacker in (b"a1", b"a2"):
        _ping(peers, attacker)
        _request(peers, attacker)
    _ping(peers, b"a3")
    assert list(peers.last_seen) == [b"frontend", b"a1", b"a2"]  # a3 waits for a place


def test_the_newest_newcomer_squatting_a_place_is_forgotten_for_the_next(clock: FakeClock) -> None:
    peers = _table(max_peers=3)
    _ping(peers, b"frontend")
    clock.now += SETTLED_S + 1
    _ping(peers, b"probe-1")
    _ping(peers, b"probe-2")
    _ping(peers, b"restarted-frontend")
    assert list(peers.last_seen) == [b"frontend", b"probe-1", b"restarted-frontend"]


def test_a_flood_of_peers_leaving_with_requests_is_logged_once_a_second(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    peers = _table(max_peers=2000)
    flood = [f"peer-{i}".encode() for i in range(1000)]
    for peer in flood:
        _ping(peers, peer)
        _request(peers, peer)
    clock.now += 61  # past timeout_s: every one of them is forgotten
    peers.expire()
    assert len(peers.take_orphans()) == 1000
    assert caplog.text.count("aborting its 1 requests") == 1


def test_a_peer_of_another_protocol_version_is_greeted_and_never_seen() -> None:
    """Its hello tells it this worker's version, so that it can name the mismatch;
    before, it heard nothing, and its requests waited for a hello until they timed
    out. It is no peer of this worker: no heartbeats, no requests taken."""
    peers = _table(max_peers=4)
    router: _Router = peers.router  # type: ignore[assignment]
    old_ping = msgpack.packb({"v": 1, "type": "ping", "frontend_id": "f"})
    assert peers.receive([b"old", old_ping]) == []
    assert router.sent == [b"old"]
    assert not peers.last_seen
    old_request = msgpack.packb({"v": 1, "type": "generate", "request_id": "r", "prompt": "hi"})
    assert peers.receive([b"old", old_request]) == []
    assert not peers.routes


def test_a_flood_of_pings_is_answered_once_in_a_while_and_none_is_left_unanswered(
    clock: FakeClock,
) -> None:
    """Each ping is answered with a heartbeat (a frontend's sign of life after a
    death): 3,000 pings a second got 2,200 heartbeats a second back, and doubled
    the worker's CPU."""
    peers = _table(max_peers=4)
    beat = Heartbeat("worker", num_steps=0, num_queued=0, num_active=0)
    answered = 0
    for _ in range(100):  # 100 pings in 10 ms
        _ping(peers, b"flood")
        if due := peers.pings_due():
            peers.answer_pings(due, beat)
            answered += 1
        clock.now += 0.0001
    assert answered == 1
    assert peers.pings_due() == []  # the last ones wait their turn
    clock.now += MIN_PING_ANSWER_S
    assert peers.pings_due() == [b"flood"]


class _Push:
    """Stands in for the engine thread's PUSH socket: records each message's frames."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(frames)


def test_an_error_from_the_engine_thread_is_cut_as_the_io_threads_own_are() -> None:
    """An exception's text (a failed admission, a chat template's error) went out
    as built: 6,133 characters where every other refusal is cut at 512."""
    push = _Push()
    route = route_for(b"peer", "r1")
    send_outputs(push, [ErrorResult(route, ErrorCode.INTERNAL, "x" * 6000)])  # type: ignore[arg-type]
    [(_, _, payload)] = push.sent
    sent = decode_to_frontend(payload)
    assert isinstance(sent, ErrorResult) and sent.request_id == "r1"
    assert len(sent.message) == MAX_ERROR_CHARS and sent.message.endswith("...")
