"""The worker's side of its peers (frontends, supervisors, probes): which are
connected, which sent each request in flight, and what each may send.
Used by the I/O thread alone."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import zmq

from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    Heartbeat,
    Hello,
    Ping,
    ProtocolError,
    ToWorker,
    VersionMismatch,
    decode_to_worker,
    encode,
)
from protocol.request_checks import RequestLimits, is_valid_abort, request_problem
from protocol.throttled import Throttled
from protocol.wire import shorten

log = logging.getLogger(__name__)

# Messages the worker holds for a peer that does not read. Past this the peer is
# forgotten and its requests aborted (a frontend that only stalled is greeted again
# on its next ping, and replays them): with every reply bounded (ids, error text),
# a peer that never reads costs at most about a megabyte.
MAX_QUEUED_PER_PEER = 2048
# A peer connected this long keeps its place in a full table (see `Peers._make_room`).
SETTLED_S = 5.0
# A peer's pings are answered with a heartbeat at most this often (`pings_due`).
MIN_PING_ANSWER_S = 0.05
# Of an error message sent to a peer, from this thread or the engine's.
MAX_ERROR_CHARS = 512


def route_for(peer: bytes, request_id: str) -> str:
    """The worker's own key for a peer's request: ids are unique per peer only."""
    return f"{peer.hex()}/{request_id}"


def sender_request_id(route: str) -> str:
    """The request id as its sender gave it."""
    return route.partition("/")[2]


class Peers:
    """Which peers are connected, and which peer sent each request in flight.
    Used by the I/O thread alone. A request is known by its route (`route_for`),
    so a peer can neither receive nor abort another peer's requests. A peer that
    leaves, stops pinging or stops reading is forgotten, and the routes of its
    requests wait in `take_orphans` for the engine to abort them."""

    def __init__(
        self,
        router: zmq.Socket[bytes],
        hello: Hello,
        limits: RequestLimits,
        timeout_s: float,
        max_peers: int,
    ) -> None:
        self.router = router
        self.max_peers = max_peers
        self.hello = encode(hello)
        self.limits = limits
        self.timeout_s = timeout_s
        # peer -> when it last sent a valid message; in order of first contact
        self.last_seen: dict[bytes, float] = {}
        self.first_seen: dict[bytes, float] = {}
        self.routes: dict[str, bytes] = {}  # route -> peer, for requests in flight
        self._pinged_by: set[bytes] = set()  # peers that pinged since the last heartbeat
        self._answered_at: dict[bytes, float] = {}  # peer -> when its last ping was answered
        self._orphans: list[str] = []
        self._malformed = Throttled(log, "malformed frames")
        self._refused = Throttled(log, "refused requests")
        self._stalled = Throttled(log, "peers that stopped reading")
        self._departed = Throttled(log, "peers gone with requests")

    def receive(self, frames: list[bytes]) -> list[ToWorker]:
        """Check one multipart message; return what the engine thread must act on."""
        if len(frames) != 2:
            # ROUTER prefixes the peer's identity; a protocol message is one frame.
            sender = frames[0].hex() if frames else "?"
            self._malformed.warn(f"{len(frames) - 1} frames from peer {sender}; expected 1")
            return []
        peer, frame = frames
        try:
            message = decode_to_worker(frame)
        except VersionMismatch as exc:
            self._malformed.warn(f"peer {peer.hex()}: {exc}")
            # Unread, and not seen: the hello tells the peer this worker's version
            # (it names the mismatch), and no request of the peer is ever taken.
            if exc.request_id is None:
                self._deliver(peer, self.hello)
            else:
                self._answer(peer, exc.request_id, ErrorCode.INVALID_REQUEST, str(exc))
            return []
        except ProtocolError as exc:
            self._malformed.warn(f"peer {peer.hex()}: {exc}")
            if exc.request_id is not None:
                self._answer(peer, exc.request_id, ErrorCode.INVALID_REQUEST, str(exc))
            return []
        if not self._see(peer):
            return []
        if isinstance(message, GenerateRequest):
            problem = request_problem(message, self.limits)
            if problem is not None:
                self._answer(peer, message.request_id, *problem)
                return []
            route = route_for(peer, message.request_id)
            if route in self.routes:
                self._refused.warn(
                    f"peer {peer.hex()} sent request {route} again before its final answer "
                    "(an abort's included); ignored: a request id is reused only once answered"
                )
                return []
            self.routes[route] = peer
            return [dataclasses.replace(message, request_id=route)]
        if isinstance(message, AbortRequest) and is_valid_abort(message):
            return [AbortRequest(route_for(peer, message.request_id))]
        if isinstance(message, Ping):
            self._pinged_by.add(peer)  # `answer_pings`
        return []

    def send(self, route: str, final: bool, payload: bytes) -> None:
        peer = self.routes.pop(route, None) if final else self.routes.get(route)
        if peer is not None:
            self._deliver(peer, payload)

    def heartbeat(self, heartbeat: Heartbeat) -> None:
        frame = encode(heartbeat)
        for peer in list(self.last_seen):
            self._deliver(peer, frame)
        self._pinged_by.clear()

    def pings_due(self) -> list[bytes]:
        """The peers whose pings since the last heartbeat are to be answered now:
        at most one answer every MIN_PING_ANSWER_S a peer, so that a flood of pings
        costs a heartbeat now and then, not one each; the others wait their turn."""
        now = time.monotonic()
        self._pinged_by &= self.last_seen.keys()
        return [
            peer
            for peer in self._pinged_by
            if now - self._answered_at.get(peer, -math.inf) >= MIN_PING_ANSWER_S
        ]

    def answer_pings(self, peers: list[bytes], heartbeat: Heartbeat) -> None:
        """Send ``heartbeat`` to ``peers`` (`pings_due`): a frontend that saw another
        worker die learns within a round trip, not a heartbeat interval, that this
        one lives (`frontend.worker_link`)."""
        frame = encode(heartbeat)
        now = time.monotonic()
        for peer in peers:
            if self._deliver(peer, frame):
                self._answered_at[peer] = now
            self._pinged_by.discard(peer)

    def expire(self) -> None:
        """Forget peers whose pings stopped."""
        cutoff = time.monotonic() - self.timeout_s
        gone = {peer for peer, seen in self.last_seen.items() if seen < cutoff}
        self._forget(gone, f"sent nothing for {self.timeout_s:.0f} s")

    def take_orphans(self) -> list[str]:
        """The routes of requests whose peers were forgotten since the last call."""
        orphans, self._orphans = self._orphans, []
        return orphans

    def _deliver(self, peer: bytes, frame: bytes) -> bool:
        """Queue ``frame`` for ``peer``. If the peer left, or its queue is full
        because it does not read, nothing is queued: the peer is forgotten, and
        False returned."""
        try:
            self.router.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.Again:
            # Throttled: such a peer may go on sending, and be greeted in vain each time.
            self._stalled.warn(f"peer {peer.hex()} stopped reading ({MAX_QUEUED_PER_PEER} unread)")
            self._forget({peer}, "stopped reading")
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget({peer}, "left")
            return False
        return True

    def _see(self, peer: bytes) -> bool:
        """Note a valid message from ``peer``, greeting it on first contact; False
        if there is no room for another peer."""
        if peer not in self.last_seen:
            if len(self.last_seen) >= self.max_peers and not self._make_room():
                self._refused.warn(f"{self.max_peers} peers connected; ignoring {peer.hex()}")
                return False
            # Debug level: health probes connect as short-lived frontends.
            log.debug("peer %s connected", peer.hex())
            if not self._deliver(peer, self.hello):
                return False
            self.first_seen[peer] = time.monotonic()
        self.last_seen[peer] = time.monotonic()
        return True

    def _make_room(self) -> bool:
        """Forget the newest peer that has no request in flight and arrived less
        than SETTLED_S ago, if there is one. A newcomer that squats a place only
        delays other newcomers, and the frontends that were here first keep theirs
        however many newcomers ping or send requests: one that waits between
        requests is idle, and may be the only idle peer while a flood's requests
        wait to be refused."""
        busy = set(self.routes.values())
        settled_before = time.monotonic() - SETTLED_S
        idle = [p for p in self.last_seen if p not in busy and self.first_seen[p] > settled_before]
        if not idle:
            return False
        self._forget({idle[-1]}, "too many peers")
        return True

    def _forget(self, gone: set[bytes], why: str) -> None:
        if not gone:
            return
        orphans = [route for route, peer in self.routes.items() if peer in gone]
        for peer in gone:
            num_orphans = sum(1 for route in orphans if self.routes[route] == peer)
            # Probes come and go all the time; a peer that takes work with it does not,
            # unless a flood of them left at once.
            message = f"peer {peer.hex()} {why}; aborting its {num_orphans} requests"
            if num_orphans:
                self._departed.warn(message)
            else:
                log.debug("%s", message)
            self.last_seen.pop(peer, None)
            self.first_seen.pop(peer, None)
            self._answered_at.pop(peer, None)
        for route in orphans:
            del self.routes[route]
        self._orphans.extend(orphans)

    def _answer(self, peer: bytes, request_id: str, code: str, message: str) -> None:
        message = shorten(message, MAX_ERROR_CHARS)
        self._refused.warn(f"request {request_id:.64} from peer {peer.hex()} refused: {message}")
        self._deliver(peer, encode(ErrorResult(request_id, code, message)))
