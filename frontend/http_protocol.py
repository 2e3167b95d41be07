"""uvicorn's h11 protocol with the limits a connection needs at the edge: a
deadline on request heads, one on a client that stops reading, the probes
answered past MAX_CONNECTIONS, and every error in the same shape.

- **Heads** (HEADER_TIMEOUT_S). uvicorn times out only a kept-alive connection
  that sits idle after a response (``timeout_keep_alive``), and any byte that
  arrives cancels that timer. A connection that opens and sends nothing, or half
  a request head, would otherwise stay open for ever, holding a file descriptor
  and a place under MAX_CONNECTIONS. Here a head must be complete within
  HEADER_TIMEOUT_S of the connection opening, or of the first byte of a later
  request on a kept-alive connection; else the connection is closed.
- **Readers** (BODY_TIMEOUT_S). A client that stops reading an answer fills the
  kernel's buffers, and the response then waits to write the rest with no time
  limit, its connection held. Once writing has waited BODY_TIMEOUT_S without
  the client taking a byte (what waits to be written has not shrunk), the
  connection is dropped; a client that reads slowly is not.
- **Head size** (h11's ``max_incomplete_event_size``, 16 KiB). h11 holds to it
  only a head that is still incomplete after a read, so one that came whole in a
  single read passed at any size (a 120 KB head of 20,000 fields was served).
  Every head is measured here, and a larger one gets 431, as h11's own refusal
  of a head in pieces now does too (uvicorn answered it 400 "not valid HTTP");
  so do the trailer fields after a chunked body (6,000 of them, 59 KB, were
  read).
- **Chunks** (FREE_CHUNKS, MIN_MEAN_CHUNK_BYTES). h11 parses each chunk of a
  chunked body as an event of its own, ~13 us of the event loop each (Zen 4
  EPYC): a 1 MB body sent a byte a chunk held every other request and probe for
  13 s, and 60 clients sending 4,000 one-byte chunks a request (a bound of 4,096
  chunks a body) kept /health 3 s slow (2-core Xeon, loaded). A body may come in FREE_CHUNKS chunks
  of any size, and one more for every MIN_MEAN_CHUNK_BYTES it holds; past that
  it is refused (400, the connection closed): the event loop's cost stays in
  proportion to the bytes a client sends.
- **Absolute-form targets** (``GET http://host/health``, as clients send to a
  proxy) are served as their path, as RFC 9112 asks; uvicorn routed the whole
  URL as a path, a 404.
- **Probes.** uvicorn answered every request 503 while MAX_CONNECTIONS
  connections (or requests under way) were open (its ``limit_concurrency``),
  idle ones included, so a client holding that many would blind the
  orchestrator's probes too, and have the instance taken out of service. Here a
  request past the limit gets that 503, in the shape of every error, and the
  probes (`OPEN_PATHS`) are answered past it.
- **Open files.** uvicorn accepts every connection, and each is a file: at the
  open-file limit, asyncio's accept logged 180 MB in 30 s (2-core Zen 5 EPYC) and took the CPU
  (Python 3.11 logs and retries every accept of its backlog), the probes
  unanswered. A frontend holds as many connections as its open-file limit
  leaves beside its own files (`connection_cap`); past that, a new connection
  closes the one kept alive longest after an answer, else the oldest that has
  waited `MIN_IDLE_S` or more for its first request head, else itself. Not
  sooner for those: a probe's connection, accepted in the same
  turn of the event loop as many others, has not been read yet, and a cap at
  MAX_CONNECTIONS closed the probes of a flood of a few hundred connections.
  (Those accepted in one turn pass the cap until each is seen.)

Every refusal made here is counted in ``minibatch_requests_total`` as the app's
are: one past MAX_CONNECTIONS by `frontend.refusal` (uvicorn's own answer was
plain text, and uncounted), one of a body as it came by the app's read of that
body, or here where the app had not begun (it counted a 499, a client that hung
up, or its own answer, which went nowhere), any other (no request to run) under
the ``other`` endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import struct
import termios
from typing import Any, ClassVar

import h11
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend.auth import OPEN_PATHS
from frontend.body import DRAIN_FACTOR, DRAIN_TIMEOUT_S, REFUSED_AS_IT_CAME
from frontend.config import FrontendConfig
from frontend.errors import ApiError, error_body
from frontend.metrics import NO_FINISH_REASON, UNROUTED, Metrics
from frontend.refusal import record_refusal, refuse

_HEAD_TOO_LARGE = ApiError(
    431,
    "the request head (its request line and header fields) is larger than this server "
    "takes; send fewer or shorter header fields",
    "head_too_large",
)
_INVALID_HTTP = ApiError(
    400,
    "the request is not valid HTTP/1.1 (its request line, a header or its Content-Length "
    "is malformed); send a well-formed request",
    "invalid_http",
)


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}

# The chunks a request body may come in: FREE_CHUNKS, and one more for every
# MIN_MEAN_CHUNK_BYTES of it. Clients that stream a body send kilobytes a chunk.
FREE_CHUNKS = 64
MIN_MEAN_CHUNK_BYTES = 256

_TOO_MANY_CHUNKS = ApiError(
    400,
    f"the request body came in more than {FREE_CHUNKS} chunks of under "
    f"{MIN_MEAN_CHUNK_BYTES} bytes on average; send it with a Content-Length, or in "
    "larger chunks",
    "too_many_chunks",
)


class EdgeConnection(h11.Connection):
    """h11's server side, refusing a request head larger than its
    ``max_incomplete_event_size`` however it arrived (431), and a request body of
    more chunks than its size allows (400), as protocol errors."""

    num_chunks = 0  # of the request being received
    num_body_bytes = 0
    is_head_too_large = False
    has_too_many_chunks = False

    def __init__(
        self, our_role: type[h11.SERVER], max_incomplete_event_size: int = 16 * 1024
    ) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_incomplete_event_size)
        self.max_head_bytes = max_incomplete_event_size

    def next_event(self) -> type[h11.NEED_DATA] | type[h11.PAUSED] | h11.Event:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.is_head_too_large = exc.error_status_hint == 431  # a head in pieces
            raise
        if isinstance(event, h11.Request):
            self.num_chunks = self.num_body_bytes = 0
            if _head_bytes(event) > self.max_head_bytes:
                self.is_head_too_large = True
                raise h11.RemoteProtocolError(_HEAD_TOO_LARGE.message, error_status_hint=431)
            event = _in_origin_form(event)
        elif (
            isinstance(event, h11.EndOfMessage)
            and _fields_bytes(event.headers) > self.max_head_bytes
        ):
            # A chunked body's trailer fields: a head of their own, bounded alike.
            self.is_head_too_large = True
            raise h11.RemoteProtocolError(_HEAD_TOO_LARGE.message, error_status_hint=431)
        elif isinstance(event, h11.Data):
            self.num_body_bytes += len(event.data)
            # chunk_end: a chunk whose size line ends one read starts the next
            # without chunk_start, but every chunk ends once.
            self.num_chunks += event.chunk_end
            if self.num_chunks > FREE_CHUNKS + self.num_body_bytes // MIN_MEAN_CHUNK_BYTES:
                self.has_too_many_chunks = True
                raise h11.RemoteProtocolError(_TOO_MANY_CHUNKS.message, error_status_hint=400)
        return event


def _in_origin_form(request: h11.Request) -> h11.Request:
    """``request`` with an absolute-form target (``GET http://host/health``, as
    sent to a proxy) in origin form (``/health``): RFC 9112 asks a server to take
    both, and uvicorn would route the whole URL as a path (404)."""
    scheme, _, rest = request.target.partition(b"://")
    if not rest or scheme.lower() not in (b"http", b"https"):
        return request
    path_start = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    target = rest[path_start:]
    if not target.startswith(b"/"):
        target = b"/" + target
    return h11.Request(
        method=request.method,
        target=target,
        headers=request.headers,
        http_version=request.http_version,
    )


def _head_bytes(request: h11.Request) -> int:
    """The size of ``request``'s head as sent, give or take its whitespace."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + _fields_bytes(request.headers) + 2


def _fields_bytes(headers: h11._headers.Headers) -> int:
    return sum(len(name) + len(value) + 4 for name, value in headers.raw_items())


# Connections past MAX_CONNECTIONS that the open-file limit should leave room
# for, where the probes are answered.
PROBE_ROOM = 32
# Files a frontend holds besides its clients' connections: its workers' sockets
# (libzmq's take several each), its logs, its event loop's.
_OWN_FILES = 256
# How long a connection may wait for its first request head before a new one
# may close it, at the cap.
MIN_IDLE_S = 1.0


def connection_cap(open_file_limit: int) -> int:
    """The connections a frontend holds at most: what its open-file limit leaves
    beside its own files (a quarter of a limit too small for them)."""
    return max(1, open_file_limit - min(_OWN_FILES, open_file_limit // 4))


def edge_protocol(config: FrontendConfig, api: Starlette, cap: int) -> type[EdgeProtocol]:
    """The class to give uvicorn as ``http=`` for ``api``, the frontend's app,
    holding ``cap`` connections at most (`connection_cap`); uvicorn builds one
    protocol per connection from a class, so the settings travel as class
    attributes."""
    settings = {
        "header_timeout_s": config.header_timeout_s,
        "reader_timeout_s": config.body_timeout_s,
        "drain_bytes": DRAIN_FACTOR * config.max_request_bytes,
        "api": api,
        "connection_cap": cap,
        "fresh_since": {},
        "kept_alive_since": {},
    }
    return type(EdgeProtocol.__name__, (EdgeProtocol,), settings)


class EdgeProtocol(H11Protocol):
    header_timeout_s: ClassVar[float]
    reader_timeout_s: ClassVar[float]
    api: ClassVar[Starlette]  # whose metrics count the refusals made here
    connection_cap: ClassVar[int]
    # The connections with no request under way, each with the event-loop time
    # it became idle, oldest first: those whose first request head has not come
    # whole yet, and those kept alive after an answer.
    fresh_since: ClassVar[dict[EdgeProtocol, float]]
    kept_alive_since: ClassVar[dict[EdgeProtocol, float]]
    is_fresh = True  # no request head of it has come whole yet
    head_timer: asyncio.TimerHandle | None = None
    reader_timer: asyncio.TimerHandle | None = None
    _max_connections: int | None = None
    is_draining = False  # answered 400: what the client still sends is dropped
    num_drained = 0  # bytes dropped so far
    drain_bytes: ClassVar[int]
    conn: EdgeConnection  # uvicorn's h11 connection, with the limits above

    def __init__(self, config: Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        max_event = config.h11_max_incomplete_event_size  # None: h11's default
        sizes = {} if max_event is None else {"max_incomplete_event_size": max_event}
        self.conn = EdgeConnection(h11.SERVER, **sizes)

    @property
    def limit_concurrency(self) -> None:
        """None, as uvicorn reads it for each request: past MAX_CONNECTIONS, `app`
        answers instead of uvicorn."""
        return None

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._max_connections = value

    @property
    def app(self) -> Any:
        """The app that answers the request whose scope uvicorn has just made: past
        MAX_CONNECTIONS (more connections open, or as many requests under way), a
        503 in the shape of every error, but for a probe."""
        scope = getattr(self, "scope", None)
        limit = self._max_connections
        if (
            limit is not None
            and scope is not None
            and scope.get("path") not in OPEN_PATHS
            # Its own connection among them (uvicorn's >= held one fewer), its
            # task not yet among them.
            and (len(self.connections) > limit or len(self.tasks) >= limit)
        ):
            return self._refuse_past_limit
        return self._run_app

    @app.setter
    def app(self, value: Any) -> None:
        self._app = value

    async def _run_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._was_refused_before(scope):
            await self._app(scope, receive, send)

    def _was_refused_before(self, scope: Scope) -> bool:
        """Whether the body of this request was refused before its app began (the
        head and a body of too many chunks in one read): that refusal, answered
        already, is counted and logged here, where the app would have counted
        its own answer, which goes nowhere."""
        refused: ApiError | None = scope.get(REFUSED_AS_IT_CAME)
        if refused is None:
            return False
        scope["app"] = self.api  # as Starlette sets it: counted by its route
        record_refusal(refused, scope)
        return True

    async def _refuse_past_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._was_refused_before(scope):
            return
        scope["app"] = self.api  # as Starlette sets it: `refuse` counts it by its route
        error = ApiError(
            503,
            f"more than MAX_CONNECTIONS={self._max_connections} connections, or as many "
            "requests, are open here; retry later, and close connections you do not use",
            "too_many_connections",
            headers={"Connection": "close"},
        )
        await refuse(error, scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.connection_cap and not self._close_oldest_idle():
            self.logger.warning(
                "%d connections open, as many as the open-file limit leaves room for, "
                "none idle for long: a new one is closed at once",
                len(self.connections) - 1,
            )
            transport.abort()
            return
        self._start_head_timer()

    def _close_oldest_idle(self) -> bool:
        """Close a connection with no request under way, to make room for a new
        one: the one kept alive longest after an answer, else the oldest that
        has waited `MIN_IDLE_S` for its first head (a probe's comes at once, a
        flood's never, and one just accepted has not been read yet); False if
        none may be closed."""
        oldest = next(iter(self.kept_alive_since), None)
        if oldest is None:
            oldest = next(iter(self.fresh_since), None)
            if oldest is None or self.loop.time() - self.fresh_since[oldest] < MIN_IDLE_S:
                return False
        self.logger.warning(
            "%d connections open, as many as the open-file limit leaves room for: one "
            "with no request under way is closed to make room",
            len(self.connections) - 1,
        )
        oldest._cancel_head_timer()
        oldest.transport.abort()
        return True

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn's own advised installing a websocket library: this server has
        # no websockets, by design, and answers the request as plain HTTP.
        self.logger.warning("Unsupported upgrade request: answered as plain HTTP")

    def data_received(self, data: bytes) -> None:
        if self.is_draining:  # after a 400: dropped unread (see `_close_after_drain`)
            self.num_drained += len(data)
            if self.num_drained > self.drain_bytes:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE:
            self._start_head_timer()  # the first bytes of a request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # the head is complete (or the connection failed)
            self.is_fresh = False

    def pause_writing(self) -> None:
        """The transport's buffer is full: the client reads slower than the answer
        is written, or not at all."""
        super().pause_writing()
        if self.reader_timer is None:
            self._watch_reader(self._num_untaken())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_reader_timer()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, as JSON in the shape of every
        other error rather than its plain text, and 431 for a head too large; the
        connection closes after it (`_close_after_drain`)."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # answered already
            self.transport.close()
            return
        if self.conn.has_too_many_chunks:
            error = _TOO_MANY_CHUNKS
        elif self.conn.is_head_too_large:
            error = _HEAD_TOO_LARGE
        else:
            error = _INVALID_HTTP
        body = json.dumps(error_body(error)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=error.status, headers=headers, reason=_REASONS[error.status]),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            # The app reads this body: its read ends now, and counts the refusal.
            cycle.scope[REFUSED_AS_IT_CAME] = error
        else:
            metrics: Metrics = self.api.state.metrics
            metrics.count_request(UNROUTED, error.status, NO_FINISH_REASON)
        self._close_after_drain()

    def _close_after_drain(self) -> None:
        """Close the connection once its client has had time to read the answer.
        Closed at once, with the rest of a body unread in its buffer, the kernel
        resets the connection, and the reset can reach the client before the
        answer does: it saw no answer at all. What still comes is dropped unread,
        for at most `DRAIN_TIMEOUT_S` and `DRAIN_FACTOR` times MAX_REQUEST_BYTES, as
        `frontend.body` drains a body it refuses."""
        self.is_draining = True
        # The request under way, if any, is over: its app's reads end, and what it
        # would still answer (a 408 as the body stalls) goes nowhere.
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if self.transport.can_write_eof():
            # The answer is whole: the client reads to the end. (A client gone
            # already makes this raise: there is no one left to drain for.)
            try:
                self.transport.write_eof()
            except OSError:
                self.transport.abort()
                return
        self.loop.call_later(DRAIN_TIMEOUT_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_reader_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._mark_idle()  # kept alive, until its next request comes

    def _mark_idle(self) -> None:
        """Idle from now: last of its kind, which stays in time order."""
        self._forget_idle()
        idle_since = self.fresh_since if self.is_fresh else self.kept_alive_since
        idle_since[self] = self.loop.time()

    def _forget_idle(self) -> None:
        self.fresh_since.pop(self, None)
        self.kept_alive_since.pop(self, None)

    def _start_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.header_timeout_s, self._on_head_timeout)
            self._mark_idle()

    def _cancel_head_timer(self) -> None:
        self._forget_idle()
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _cancel_reader_timer(self) -> None:
        if self.reader_timer is not None:
            self.reader_timer.cancel()
            self.reader_timer = None

    def _on_head_timeout(self) -> None:
        self.head_timer = None
        self._forget_idle()
        if not self.transport.is_closing():
            self.logger.debug(
                "%s: no whole request head within HEADER_TIMEOUT_S=%g s; closed",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()

    def _watch_reader(self, num_waiting: int) -> None:
        """In BODY_TIMEOUT_S, check that fewer than ``num_waiting`` bytes wait."""
        self.reader_timer = self.loop.call_later(
            self.reader_timeout_s, self._check_reader, num_waiting
        )

    def _num_untaken(self) -> int:
        """The bytes of the answer the client has not taken: those in the
        transport's buffer and those in the kernel's send queue. The transport's
        buffer alone shrinks only once the kernel's queue (megabytes) has drained
        by about a third: a client reading 500 KB/s was dropped as not reading."""
        num_untaken = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # Linux's SIOCOUTQ: bytes sent that the client has not acknowledged.
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                num_untaken += struct.unpack("i", queued)[0]
        return num_untaken

    def _check_reader(self, num_waiting_before: int) -> None:
        num_waiting = self._num_untaken()
        if num_waiting < num_waiting_before:
            self._watch_reader(num_waiting)  # slow, but reading
            return
        self.reader_timer = None
        self.logger.info(
            "%s: took no byte of its answer for BODY_TIMEOUT_S=%g s; connection dropped",
            self.client,
            self.reader_timeout_s,
        )
        # Not close(): that would wait to send what the client does not read.
        self.transport.abort()
