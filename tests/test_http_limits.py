"""Limits at the HTTP edge, tried as an attacker would, on real processes: body
size, media type, slow bodies and heads, and bodies built to make work.

Time bounds are generous (a loaded 2-core machine); each test also fails without
its limit for a reason other than time: a hang, a status, or a size.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator

import h11
import httpx
import psutil
import pytest

from frontend.http_protocol import (
    FREE_CHUNKS,
    MIN_IDLE_S,
    MIN_MEAN_CHUNK_BYTES,
    EdgeConnection,
    EdgeProtocol,
    connection_cap,
)
from tests.stack import Stack, running_stack

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # room for 200,000 short keys, which is ~2 MB
TIMEOUT_S = 1.0  # HEADER_TIMEOUT_S and BODY_TIMEOUT_S
GIVE_UP_S = 15.0  # no answer by then is a hang
JSON = "application/json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {
        "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
        "HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "BODY_TIMEOUT_S": str(TIMEOUT_S),
        "FAKE_STEP_DELAY_S": "0.005",
    }
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


def connect(stack: Stack) -> socket.socket:
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
    return sock


def head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", *headers, "", ""]
    return "\r\n".join(lines).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response off a connection the server closes after it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    header_block, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = header_block.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def request_counts(stack: Stack, endpoint: str = "/generate") -> dict[str, float]:
    """minibatch_requests_total for ``endpoint`` by its labels."""
    counts = {}
    for line in httpx.get(f"{stack.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'minibatch_requests_total{{endpoint="{endpoint}"'):
            labels, value = line.rsplit(" ", 1)
            counts[labels] = float(value)
    return counts


def test_a_declared_100_mb_body_is_refused_at_once_without_reaching_the_worker(
    stack: Stack,
) -> None:
    before = request_counts(stack)
    with connect(stack) as sock:
        started = time.monotonic()
        # The head and the body's first bytes in one write: sent apart, the bytes
        # could arrive after the answer, unread, and the kernel would then reset
        # the connection (as the module docstring of frontend.body says).
        sock.sendall(
            head("/generate", f"Content-Type: {JSON}", "Content-Length: 100000000")
            + b'{"prompt": "'
        )
        status, headers, body = read_response(sock)
        elapsed_s = time.monotonic() - started
    assert status == 413
    assert headers["connection"] == "close"
    assert "MAX_REQUEST_BYTES=4,194,304" in json.loads(body)["error"]["message"]
    assert elapsed_s < 2.0, elapsed_s  # it waits for no byte of the body
    # A request the worker saw would end with a finish reason; this one ended as
    # one HTTP error with none, and the worker holds nothing.
    after = request_counts(stack)
    refused = 'minibatch_requests_total{endpoint="/generate",finish_reason="none",status="413"}'
    assert after.get(refused, 0) == before.get(refused, 0) + 1
    assert {k: v for k, v in after.items() if "413" not in k} == {
        k: v for k, v in before.items() if "413" not in k
    }
    # On a busy machine a heartbeat can come late (the tests' timeout is 1 s), and
    # /health then knows no worker's counts for a moment: wait for a live one's.
    health = stack.wait_for_health("a worker's counts", lambda body: body["active"] is not None)
    assert (health["inflight"], health["active"], health["queued"]) == (0, 0, 0)


def test_a_client_waiting_to_send_a_body_over_the_limit_gets_413_and_no_go_ahead(
    stack: Stack,
) -> None:
    # Within the size that a client still sending would have drained: one that
    # waits for "100 Continue" must be told no at once, not invited to upload.
    declared = 2 * MAX_REQUEST_BYTES
    with connect(stack) as sock:
        started = time.monotonic()
        sock.sendall(
            head(
                "/generate",
                f"Content-Type: {JSON}",
                f"Content-Length: {declared}",
                "Expect: 100-continue",
            )
        )
        status, _, answer = read_response(sock)
        elapsed_s = time.monotonic() - started
    assert status == 413, answer
    assert json.loads(answer)["error"]["code"] == "request_too_large"
    assert elapsed_s < TIMEOUT_S, elapsed_s  # not after waiting out the drain


@pytest.mark.parametrize("framing", ["Content-Length", "chunked"])
def test_a_client_still_sending_a_body_somewhat_over_the_limit_reads_its_413(
    stack: Stack, framing: str
) -> None:
    # The whole body is sent, slowly enough that the answer comes first. A server
    # that closed with the rest unread would make the kernel reset the connection,
    # and the client would read the reset, not the 413.
    body = b'{"prompt": "' + b"a" * (2 * MAX_REQUEST_BYTES) + b'"}'
    pieces = [body[i : i + 256 * 1024] for i in range(0, len(body), 256 * 1024)]
    with connect(stack) as sock:
        if framing == "chunked":
            sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
            pieces = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces] + [b"0\r\n\r\n"]
        else:
            sock.sendall(head("/generate", f"Content-Type: {JSON}", f"Content-Length: {len(body)}"))
        for data in pieces:
            sock.sendall(data)
            time.sleep(0.005)
        status, _, answer = read_response(sock)
    assert status == 413
    assert json.loads(answer)["error"]["code"] == "request_too_large"


def test_a_chunked_body_is_refused_once_it_passes_the_limit(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        chunk = b"x" * 65536
        for _ in range(MAX_REQUEST_BYTES // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # One byte more, and no end: a server that reads to the end waits for ever.
        sock.sendall(b"1\r\nx\r\n")
        status, headers, body = read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_body_refused_as_it_came_while_drained_counts_as_that_refusal(stack: Stack) -> None:
    """Over the limit, the app drains the rest of the body, and the connection
    refused its many tiny chunks: the client got that 400, and /metrics counted
    the 413 that went nowhere."""
    before = request_counts(stack)
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        chunk = b"x" * 65536
        for _ in range(MAX_REQUEST_BYTES // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        time.sleep(0.2)  # the app drains
        with contextlib.suppress(ConnectionResetError):
            sock.sendall(b"1\r\nx\r\n" * (2 * MAX_REQUEST_BYTES // MIN_MEAN_CHUNK_BYTES))
        status, _, body = read_response(sock)
    assert (status, json.loads(body)["error"]["code"]) == (400, "too_many_chunks")
    after = request_counts(stack)
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        _status_count(400): 1
    }


def _chunked(body: bytes, chunk_bytes: int) -> bytes:
    pieces = [body[i : i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def _status_count(status: int) -> str:
    """The label set of /generate's refusals of ``status``, as `request_counts` keys it."""
    labels = f'endpoint="/generate",finish_reason="none",status="{status}"'
    return f"minibatch_requests_total{{{labels}}}"


def test_a_body_of_too_many_chunks_is_refused(stack: Stack) -> None:
    """Each chunk costs the event loop an h11 event: a body a byte a chunk held
    every other client for seconds. It is counted as the 400 it got, not as a
    client that hung up (499)."""
    padded = json.dumps({"prompt": "chunks", "max_new_tokens": 2}).encode() + b" " * 9000
    before = request_counts(stack)
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        sock.sendall(_chunked(padded, 1))
        status, headers, body = read_response(sock)
    assert status == 400
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "too_many_chunks"
    after = request_counts(stack)
    assert after.get(_status_count(400), 0) == before.get(_status_count(400), 0) + 1
    assert after.get(_status_count(499), 0) == before.get(_status_count(499), 0)
    # The same body in chunks a client streaming it would send is read.
    with connect(stack) as sock:
        sock.sendall(
            head(
                "/generate",
                f"Content-Type: {JSON}",
                "Transfer-Encoding: chunked",
                "Connection: close",
            )
        )
        sock.sendall(_chunked(padded, 512))
        status, _, body = read_response(sock)
    assert status == 200, body


@pytest.mark.parametrize(
    ("request_line", "endpoint", "fields"),
    [
        ("POST /generate", "/generate", ["Content-Type: text/plain"]),  # a 415 before the read
        ("GET /v1/models", "/v1/models", []),  # a route that reads no body
    ],
)
def test_a_body_refused_before_its_app_began_counts_as_that_refusal(
    stack: Stack, request_line: str, endpoint: str, fields: list[str]
) -> None:
    """Head and body in one read: the body is refused before the app runs, and
    the app counted its own answer (415, 200), which went nowhere."""
    padded = json.dumps({"prompt": "chunks", "max_new_tokens": 2}).encode() + b" " * 9000
    lines = [f"{request_line} HTTP/1.1", "Host: test", *fields, "Transfer-Encoding: chunked"]
    before = request_counts(stack, endpoint)
    with connect(stack) as sock:
        sock.sendall("\r\n".join([*lines, "", ""]).encode() + _chunked(padded, 1))
        status, _, body = read_response(sock)
    assert (status, json.loads(body)["error"]["code"]) == (400, "too_many_chunks")
    after = request_counts(stack, endpoint)
    counted = f'minibatch_requests_total{{endpoint="{endpoint}",finish_reason="none",status="400"}}'
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        counted: 1
    }


def test_every_chunk_counts_however_the_reads_cut_the_body() -> None:
    """A chunk whose size line ends a read comes back without chunk_start: a body
    sent a segment a chunk passed uncounted."""
    conn = EdgeConnection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    for _ in range(FREE_CHUNKS):
        for piece in (b"1\r\n", b"x\r\n"):
            conn.receive_data(piece)
            while conn.next_event() is not h11.NEED_DATA:
                pass
    conn.receive_data(b"1\r\nx\r\n")
    with pytest.raises(h11.RemoteProtocolError, match=f"more than {FREE_CHUNKS} chunks"):
        conn.next_event()


@pytest.mark.parametrize(("chunk_bytes", "is_read"), [(1024, True), (256, True), (128, False)])
def test_a_long_body_may_come_in_as_many_chunks_as_its_size_allows(
    chunk_bytes: int, is_read: bool
) -> None:
    """A bound of 4,096 chunks a body still let 60 clients, each sending 4,000
    one-byte chunks a request, keep /health 3 s slow (loaded Xeon): the event
    loop's cost now stays in proportion to the bytes sent."""
    conn = EdgeConnection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    conn.receive_data(b"%x\r\n%s\r\n" % (chunk_bytes, b"x" * chunk_bytes) * 1000)
    try:
        while conn.next_event() is not h11.NEED_DATA:
            pass
    except h11.RemoteProtocolError:
        assert not is_read and conn.num_chunks == 2 * FREE_CHUNKS + 1
    else:
        assert is_read and conn.num_chunks == 1000


def test_a_400_to_a_client_already_gone_drops_its_connection_quietly() -> None:
    """A request, then bytes that are not HTTP, then a hang-up: answered 400 once
    the first answer was sent, the client was gone, and the end of the answer
    raised OSError into the app, a 500 logged with its traceback."""

    class GoneTransport:
        is_aborted = False

        def can_write_eof(self) -> bool:
            return True

        def write_eof(self) -> None:
            raise OSError(107, "Transport endpoint is not connected")

        def abort(self) -> None:
            self.is_aborted = True

    protocol = EdgeProtocol.__new__(EdgeProtocol)
    protocol.transport = GoneTransport()  # type: ignore[assignment]
    protocol._close_after_drain()
    assert protocol.transport.is_aborted  # type: ignore[attr-defined]


@pytest.mark.parametrize("in_pieces", [False, True], ids=["one-read", "in-pieces"])
def test_a_request_head_past_16_kib_gets_431_however_it_arrives(
    stack: Stack, in_pieces: bool
) -> None:
    """Whole in one read, a 120 KB head was served; in pieces, it got a 400
    that called it malformed."""
    fields = [f"X-Field-{i}: {'v' * 20}" for i in range(1000)]  # ~30 KB
    request = head("/generate", f"Content-Type: {JSON}", "Content-Length: 2", *fields) + b"{}"
    with connect(stack) as sock:
        if in_pieces:
            for start in range(0, len(request), 10_000):
                sock.sendall(request[start : start + 10_000])
                time.sleep(0.05)
        else:
            sock.sendall(request)
        status, _, body = read_response(sock)
    assert status == 431, body
    assert json.loads(body)["error"]["code"] == "head_too_large"


def test_a_head_just_under_16_kib_is_served(stack: Stack) -> None:
    fields = [f"X-Field-{i}: {'v' * 20}" for i in range(400)]  # ~12 KB
    request = head(
        "/generate", f"Content-Type: {JSON}", "Connection: close", "Content-Length: 2", *fields
    )
    with connect(stack) as sock:
        sock.sendall(request + b"{}")
        status, _, body = read_response(sock)
    assert status == 422, body  # read and judged: "{}" has no prompt


def test_a_client_still_sending_a_refused_body_reads_its_400(stack: Stack) -> None:
    """Closed with the rest of the body unread, the connection was reset, and
    the reset could reach the client before the answer."""
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        body = _chunked(b"x" * 100 * 15000, 100)

        def send_body() -> None:
            with contextlib.suppress(OSError):  # the server closes once it has answered
                sock.sendall(body)

        sender = threading.Thread(target=send_body)
        sender.start()
        status, _, body = read_response(sock)
        sender.join(timeout=GIVE_UP_S)
    assert status == 400
    assert json.loads(body)["error"]["code"] == "too_many_chunks"


def test_what_follows_a_400_is_dropped_only_up_to_the_body_limit(stack: Stack) -> None:
    """Bounded in bytes as well as in time: a client that kept writing after its
    400 had the frontend read and drop a quarter of a gigabyte a second."""
    piece = b"x" * 65536
    with connect(stack) as sock:
        sock.sendall(b"BAD\r\n\r\n")
        with pytest.raises(OSError):  # reset once the limit is passed
            for _ in range(8 * MAX_REQUEST_BYTES // len(piece)):
                sock.sendall(piece)


def test_a_body_refused_400_is_not_answered_again_when_its_time_runs_out(stack: Stack) -> None:
    """The 400 ends the request: the body's timeout, passing while the client
    still reads it, tried to answer 408 on the same connection, and the frontend
    logged an exception with its traceback."""
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        time.sleep(TIMEOUT_S * 0.6)
        sock.sendall(b"1\r\nx\r\n" * (FREE_CHUNKS + 1))
        time.sleep(TIMEOUT_S * 0.6)  # past the body's timeout, the connection still open
        status, _, body = read_response(sock)
    assert status == 400 and json.loads(body)["error"]["code"] == "too_many_chunks"
    assert "Exception in ASGI application" not in stack.log("frontend")


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=UTF-16"],
)
def test_a_body_that_is_not_json_gets_415_saying_what_to_send(
    stack: Stack, content_type: str
) -> None:
    response = httpx.post(
        f"{stack.url}/generate",
        content=b'{"prompt": "hi", "max_new_tokens": 2}',
        headers={"Content-Type": content_type},
        timeout=GIVE_UP_S,
    )
    assert response.status_code == 415
    error = response.json()["error"]
    assert "-H 'Content-Type: application/json'" in error["message"]
    assert content_type in error["message"]


def test_a_compressed_body_gets_415_asking_for_it_uncompressed(stack: Stack) -> None:
    headers = {"Content-Type": JSON, "Content-Encoding": "gzip"}
    content = gzip.compress(b'{"prompt": "hi"}')
    response = httpx.post(f"{stack.url}/generate", content=content, headers=headers, timeout=10)
    assert response.status_code == 415
    assert response.headers["accept-encoding"] == "identity"
    assert response.json()["error"]["message"] == (
        "got Content-Encoding 'gzip'; this server reads bodies as they are sent: send it "
        "uncompressed, without a Content-Encoding"
    )
    identity = {"Content-Type": JSON, "Content-Encoding": "identity"}
    plain = httpx.post(f"{stack.url}/generate", json={"prompt": "hi"}, headers=identity, timeout=10)
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("codings", [["identity", "gzip"], ["identity, gzip"], ["", "br"]])
def test_every_content_encoding_is_read_not_only_the_first(
    stack: Stack, codings: list[str]
) -> None:
    """Two fields are one list: a proxy that read the second would take the body
    for compressed, and the two would not be answering the same request."""
    headers = [("Content-Type", JSON)] + [("Content-Encoding", coding) for coding in codings]
    response = httpx.post(
        f"{stack.url}/generate", content=b'{"prompt": "hi"}', headers=headers, timeout=10
    )
    assert response.status_code == 415
    assert f"got Content-Encoding {', '.join(codings)!r}" in response.json()["error"]["message"]


def test_two_content_type_headers_get_415(stack: Stack) -> None:
    """The first one is JSON, but a proxy in front might have read the second."""
    response = httpx.post(
        f"{stack.url}/generate",
        content=b'{"prompt": "hi", "max_new_tokens": 2}',
        headers=[("Content-Type", JSON), ("Content-Type", "text/plain")],
        timeout=GIVE_UP_S,
    )
    assert response.status_code == 415
    assert response.json()["error"]["message"].startswith("got 2 Content-Type headers; send one")


def test_no_content_type_gets_415(stack: Stack) -> None:
    response = httpx.post(
        f"{stack.url}/v1/completions", content=b'{"model": "fake"}', timeout=GIVE_UP_S
    )
    assert response.status_code == 415
    assert "no Content-Type" in response.json()["error"]["message"]


def test_json_with_a_charset_is_json(stack: Stack) -> None:
    response = httpx.post(
        f"{stack.url}/generate",
        content=b'{"prompt": "hi", "max_new_tokens": 2}',
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
        timeout=GIVE_UP_S,
    )
    assert response.status_code == 200, response.text


def test_200k_unknown_keys_get_a_short_422_quickly_while_others_are_served(
    stack: Stack,
) -> None:
    keys = {f"k{i}": 0 for i in range(200_000)}
    content = json.dumps({"prompt": "hi", **keys}, separators=(",", ":")).encode()
    assert len(content) < MAX_REQUEST_BYTES
    answers: list[tuple[httpx.Response, float]] = []

    def attack() -> None:
        started = time.monotonic()
        response = httpx.post(
            f"{stack.url}/generate",
            content=content,
            headers={"Content-Type": JSON},
            timeout=GIVE_UP_S,
        )
        answers.append((response, time.monotonic() - started))

    attackers = [threading.Thread(target=attack) for _ in range(3)]
    for attacker in attackers:
        attacker.start()
    bystander_s = []
    while any(attacker.is_alive() for attacker in attackers):
        started = time.monotonic()
        response = httpx.post(
            f"{stack.url}/generate", json={"prompt": "by", "max_new_tokens": 2}, timeout=GIVE_UP_S
        )
        assert response.status_code == 200, response.text
        bystander_s.append(time.monotonic() - started)
    for attacker in attackers:
        attacker.join()
    for response, elapsed_s in answers:
        assert response.status_code == 422
        assert len(response.content) < 2000, len(response.content)
        message = response.json()["error"]["message"]
        assert "200,000 unknown fields ('k0', 'k1', 'k2', 'k3', 'k4' and 199,995 more)" in message
        assert elapsed_s < 5.0, elapsed_s
    assert max(bystander_s) < 2.0, bystander_s


def test_a_long_list_of_bad_token_ids_gets_one_error(stack: Stack) -> None:
    body = {"prompt": "hi", "stop_token_ids": [-1] * 200_000}
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=GIVE_UP_S)
    assert response.status_code == 422
    assert response.json()["error"]["message"] == ("stop_token_ids.0: must be at least 0, got -1")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"[" * 10_000 + b"]" * 10_000,
            "body: JSON nested too deeply (the parser stops at about 200 levels); nothing "
            "nested that deep can be sent",
        ),
        (
            b'{"prompt": [' + b"[1]," * 40_000 + b"[1]]}",
            "body: 40,003 JSON arrays and objects, more than this server's 32,768; no "
            "request it takes needs that many",
        ),
        (b'["prompt"]', "body: must be a JSON object, got an array"),
        (b"", "body: empty; send a JSON object"),
        (b" \r\n", "body: empty; send a JSON object"),
        (
            b'{"prompt": "hi"',
            "body: invalid JSON (EOF while parsing an object at line 1 column 15)",
        ),
        # What Python's json.dumps writes for float("nan") and float("inf").
        (
            b'{"prompt": "hi", "temperature": NaN}',
            "body: invalid JSON: NaN and Infinity are not JSON numbers; send finite numbers",
        ),
        (
            b'{"prompt": "hi", "temperature": -Infinity}',
            "body: invalid JSON: NaN and Infinity are not JSON numbers; send finite numbers",
        ),
        (
            b'{"prompt": "hi", "max_new_tokens": 1' + b"0" * 4_300 + b"}",
            "body: invalid JSON (number out of range at line 1 column 4337): a number of more "
            "than 4,300 digits before any decimal point, more than the parser reads and than "
            "any field takes",
        ),
        # The hint about lone surrogates only where one is the fault.
        (
            b'{"prompt": "\\udc00"}',
            "body: invalid JSON (lone leading surrogate in hex escape at line 1 column 18): "
            "an escape \\ud800 to \\udfff is half of a character, sent with its other half "
            "or not at all",
        ),
    ],
)
def test_a_body_that_is_not_one_json_object_gets_a_short_422_that_says_why(
    stack: Stack, content: bytes, message: str
) -> None:
    response = httpx.post(
        f"{stack.url}/generate", content=content, headers={"Content-Type": JSON}, timeout=GIVE_UP_S
    )
    assert response.status_code == 422
    assert response.json()["error"]["message"] == message
    assert len(response.content) < 1000


def test_a_body_framed_two_ways_is_refused_and_its_connection_closed(stack: Stack) -> None:
    """Content-Length and Transfer-Encoding at once: request smuggling's start."""
    body = b'{"prompt": "hi"}'
    before = request_counts(stack)
    with connect(stack) as sock:
        sock.sendall(
            head(
                "/generate",
                f"Content-Type: {JSON}",
                "Content-Length: 5",
                "Transfer-Encoding: chunked",
            )
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        status, headers, answer = read_response(sock)  # returns once the server closes
    assert status == 400
    assert headers["connection"] == "close"
    error = json.loads(answer)["error"]
    assert error["message"].startswith(
        "the request has both Content-Length and Transfer-Encoding; send one"
    )
    assert error["code"] == "invalid_http"  # as for other HTTP that cannot be read
    # Refused before routing, and counted under the route all the same.
    refused = 'minibatch_requests_total{endpoint="/generate",finish_reason="none",status="400"}'
    assert request_counts(stack).get(refused, 0) == before.get(refused, 0) + 1


@pytest.mark.parametrize("length", ["-1", "99999999999999999999999", "ten"])
def test_a_malformed_content_length_gets_400_in_the_usual_error_shape(
    stack: Stack, length: str
) -> None:
    counted = 'minibatch_requests_total{endpoint="other",finish_reason="none",status="400"}'
    before = request_counts(stack, "other").get(counted, 0)
    with connect(stack) as sock:
        sock.sendall(head("/generate", f"Content-Type: {JSON}", f"Content-Length: {length}"))
        status, headers, answer = read_response(sock)
    assert (status, headers["content-type"], headers["connection"]) == (400, JSON, "close")
    error = json.loads(answer)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http")
    assert error["message"].startswith("the request is not valid HTTP/1.1")
    # Unread, it has no route: counted under "other", as an unknown path is.
    assert request_counts(stack, "other").get(counted, 0) == before + 1


def test_a_flood_of_malformed_requests_writes_a_line_a_second_not_one_each(
    stack: Stack,
) -> None:
    warning = "Invalid HTTP request received."  # uvicorn's own, for each
    lines_before = stack.log("frontend").count(warning)
    started = time.monotonic()
    for i in range(41):
        with connect(stack) as sock:
            sock.sendall(head("/generate", f"Content-Type: {JSON}", "Content-Length: -1"))
            assert read_response(sock)[0] == 400
        if i == 39:
            time.sleep(1.1)  # the next one is logged, with a count of those left out
    elapsed_s = time.monotonic() - started
    log = stack.log("frontend")
    assert log.count(warning) - lines_before <= elapsed_s + 2
    assert f"{warning} (" in log and "more not logged)" in log


def test_a_flood_of_hang_ups_writes_a_line_a_second_not_one_each(stack: Stack) -> None:
    line = "client disconnected; aborted"
    lines_before = stack.log("frontend").count(line)
    body = json.dumps({"prompt": "hang up", "max_new_tokens": 400}).encode()
    started = time.monotonic()
    for _ in range(30):
        with connect(stack) as sock:
            sock.sendall(head("/generate", f"Content-Type: {JSON}", f"Content-Length: {len(body)}"))
            sock.sendall(body)
            time.sleep(0.05)  # the request runs; the client goes
    time.sleep(1.1)
    with connect(stack) as sock:  # the next one is logged, with a count of those left out
        sock.sendall(head("/generate", f"Content-Type: {JSON}", f"Content-Length: {len(body)}"))
        sock.sendall(body)
        time.sleep(0.05)
    deadline = time.monotonic() + GIVE_UP_S
    while "more client disconnects not logged" not in (log := stack.log("frontend")):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.05)
    assert log.count(line) - lines_before <= time.monotonic() - started + 2


def test_a_body_that_stalls_gets_408(stack: Stack) -> None:
    with connect(stack) as sock:
        started = time.monotonic()
        sock.sendall(head("/generate", f"Content-Type: {JSON}", "Content-Length: 100"))
        sock.sendall(b'{"prompt": ')
        status, headers, body = read_response(sock)
        elapsed_s = time.monotonic() - started
    assert status == 408
    assert headers["connection"] == "close"
    assert "BODY_TIMEOUT_S=1 s" in json.loads(body)["error"]["message"]
    assert TIMEOUT_S * 0.9 < elapsed_s < GIVE_UP_S


@pytest.mark.parametrize("sent", [b"", b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-"])
def test_a_connection_without_a_whole_request_head_is_closed(stack: Stack, sent: bytes) -> None:
    with connect(stack) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        assert sock.recv(65536) == b""  # closed, with nothing to say
        elapsed_s = time.monotonic() - started
    assert TIMEOUT_S * 0.9 < elapsed_s < GIVE_UP_S


def test_a_kept_alive_connection_may_idle_longer_than_the_head_timeout(stack: Stack) -> None:
    """The head timer runs from a request's first byte, not from the last response:
    idling between requests is KEEP_ALIVE_TIMEOUT_S's business (5 s here)."""
    request = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
    with connect(stack) as sock:
        sock.sendall(request)
        assert read_kept_alive_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S * 1.5)
        sock.sendall(request)
        assert read_kept_alive_response(sock).startswith(b"HTTP/1.1 200")


def read_kept_alive_response(sock: socket.socket) -> bytes:
    """One whole response (head and body may arrive apart) off an open connection."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    return data


def _length(data: bytes) -> int:
    header_block = data.partition(b"\r\n\r\n")[0].lower()
    return int(header_block.split(b"content-length:")[1].split(b"\r\n")[0])


def test_an_unknown_path_or_method_gets_the_usual_error_shape(stack: Stack) -> None:
    missing = httpx.get(f"{stack.url}/nowhere", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "GET /nowhere: Not Found; see GET /openapi.json"
    assert missing.json()["error"]["code"] == "not_found"
    for typo, meant in (("/v1/chat/completion", "/v1/chat/completions"), ("/helth", "/health")):
        message = httpx.post(f"{stack.url}{typo}", timeout=10).json()["error"]["message"]
        assert message == f"POST {typo}: Not Found; did you mean {meant}?"
    wrong_method = httpx.get(f"{stack.url}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"  # as RFC 9110 asks of a 405
    error = wrong_method.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "method_not_allowed")


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("http://example.com/health", 200),
        ("HTTPS://example.com:8443/health?x=1", 200),
        ("http://example.com", 404),
        ("http://example.com/nowhere", 404),
    ],
)
def test_an_absolute_form_target_is_routed_by_its_path(
    stack: Stack, target: str, status: int
) -> None:
    with connect(stack) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert read_response(sock)[0] == status


def test_a_websocket_upgrade_is_answered_as_plain_http_and_logged_without_advice(
    stack: Stack,
) -> None:
    """uvicorn's warning told the operator to install a websocket library."""
    with connect(stack) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        sock.shutdown(socket.SHUT_WR)  # no second request: the server closes after this one
        assert read_response(sock)[0] == 200
    log = stack.log("frontend")
    assert "Unsupported upgrade request: answered as plain HTTP" in log
    assert "pip install" not in log


def test_a_trailing_slash_gets_a_404_naming_the_route_not_a_redirect(stack: Stack) -> None:
    # Starlette's redirect would send the client to whatever its Host header named.
    headers = {"Host": "elsewhere.example"}
    response = httpx.post(f"{stack.url}/generate/", json={"prompt": "hi"}, headers=headers)
    assert response.status_code == 404
    assert "location" not in response.headers
    assert response.json()["error"]["message"] == (
        "POST /generate/: Not Found; did you mean /generate?"
    )


@pytest.mark.parametrize(
    ("path", "meant"),
    [("/completions", "/v1/completions"), ("/chat/completions/", "/v1/chat/completions")],
)
def test_a_path_without_v1_gets_a_404_naming_the_route(stack: Stack, path: str, meant: str) -> None:
    """An openai client's base_url without /v1 was told only to see /openapi.json."""
    response = httpx.post(f"{stack.url}{path}", json={})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == f"POST {path}: Not Found; did you mean {meant}?"


def test_a_body_after_a_utf8_byte_order_mark_is_read(stack: Stack) -> None:
    content = b'\xef\xbb\xbf{"prompt": "hi", "max_new_tokens": 2}'
    headers = {"Content-Type": JSON}
    response = httpx.post(f"{stack.url}/generate", content=content, headers=headers, timeout=10)
    assert response.status_code == 200, response.text


def test_past_max_connections_only_the_probes_are_answered(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A client holding MAX_CONNECTIONS idle connections blinds no orchestrator:
    /health, /ready and /metrics answer, everything else gets 503, and /ready
    says so (503 "full") until connections are free again."""
    tmp_path = tmp_path_factory.mktemp("connections")
    overrides = {"MAX_CONNECTIONS": "4", "HEADER_TIMEOUT_S": "30"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        port = int(stack.url.rsplit(":", 1)[1])
        body = {"prompt": "hi", "max_new_tokens": 2}
        frontend = psutil.Process(stack.processes["frontend"].pid)
        files_before = frontend.num_fds()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:  # with its own, MAX_CONNECTIONS: served (uvicorn's check refused it)
            deadline = time.monotonic() + GIVE_UP_S
            while frontend.num_fds() < files_before + 3 and time.monotonic() < deadline:
                time.sleep(0.05)  # until the server holds them
            answered = httpx.post(f"{stack.url}/generate", json=body, timeout=GIVE_UP_S)
            assert answered.status_code == 200, answered.text
        finally:
            for connection in idle:
                connection.close()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        try:
            time.sleep(0.2)  # the server has taken them
            for path in ("/health", "/metrics"):
                probe = httpx.get(f"{stack.url}{path}", timeout=GIVE_UP_S)
                assert probe.status_code == 200, (path, probe.text)
            full = httpx.get(f"{stack.url}/ready", timeout=GIVE_UP_S)
            assert full.status_code == 503
            assert (full.json()["status"], full.json()["reason"]) == (
                "full",
                "more than MAX_CONNECTIONS=4 connections open",
            )
            before = request_counts(stack).get(_status_count(503), 0)
            refused = httpx.post(f"{stack.url}/generate", json=body, timeout=GIVE_UP_S)
            assert refused.status_code == 503
            # In the shape of every error (uvicorn's was plain text), and counted.
            assert refused.json()["error"]["code"] == "too_many_connections"
            assert refused.headers["retry-after"]
            assert request_counts(stack).get(_status_count(503), 0) == before + 1
        finally:
            for connection in idle:
                connection.close()
        time.sleep(0.2)
        assert httpx.get(f"{stack.url}/ready", timeout=GIVE_UP_S).status_code == 200
        answered = httpx.post(f"{stack.url}/generate", json=body, timeout=GIVE_UP_S)
        assert answered.status_code == 200, answered.text


# A frontend whose open-file limit (soft and hard) is this.
_FEW_FILES = 1024
_WITH_FEW_FILES = (
    "import resource, runpy; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({_FEW_FILES}, {_FEW_FILES})); "
    "runpy.run_module('frontend.main', run_name='__main__')"
)


def _read_one_answer(sock: socket.socket) -> None:
    """One answer off a kept-alive connection, to its last byte."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head_block, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head_block, re.IGNORECASE)[1])  # type: ignore[index]
    while len(body) < length:
        body += sock.recv(65536)


@pytest.mark.parametrize(
    ("kept_alive", "asks_again"),
    [(False, False), (True, False), (True, True)],
    ids=["half-head", "kept-alive", "kept-alive-asking-again"],
)
def test_at_the_open_file_limit_a_connection_closes_the_one_idle_longest(
    tmp_path_factory: pytest.TempPathFactory, kept_alive: bool, asks_again: bool
) -> None:
    """uvicorn accepted every connection: at the open-file limit the accept loop
    filled the log and the CPU, and the probes went unanswered. A frontend
    holds what its limit leaves; the probes still answer, once the flood's
    connections have been idle MIN_IDLE_S: a head begun and never ended, or
    kept alive after an answer."""
    tmp_path = tmp_path_factory.mktemp("cap")
    overrides = {"HEADER_TIMEOUT_S": "30"}
    with running_stack(tmp_path, overrides, supervised=False, start=("worker",)) as stack:
        command = [sys.executable, "-c", _WITH_FEW_FILES]
        frontend = psutil.Process(stack.start_command("frontend", command, stack.env).pid)
        stack.wait_live()
        cap = connection_cap(_FEW_FILES)
        port = int(stack.url.rsplit(":", 1)[1])
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap + 100)]
        try:
            for connection in flood:
                with contextlib.suppress(ConnectionResetError):  # closed already
                    if not kept_alive:
                        connection.sendall(b"G")  # a head begun, never ended
                    else:  # a whole request, answered, and nothing more
                        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            if kept_alive:
                for connection in flood[:cap]:
                    _read_one_answer(connection)
            time.sleep(MIN_IDLE_S + 0.5)
            if asks_again:  # each idle for less than MIN_IDLE_S when the probes come
                for connection in flood[:cap]:
                    connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    _read_one_answer(connection)
            assert frontend.num_fds() < _FEW_FILES
            for _ in range(3):
                assert httpx.get(f"{stack.url}/health", timeout=GIVE_UP_S).status_code == 200
            # A load balancer is told to send new clients elsewhere.
            ready = httpx.get(f"{stack.url}/ready", timeout=GIVE_UP_S)
            assert (ready.status_code, ready.json()["status"]) == (503, "full")
            assert "that the open-file limit (ulimit -n) leaves room for" in ready.json()["reason"]
            # The oldest were closed: reset, nothing said to them (the reset may
            # have come to the sendall already).
            flood[0].settimeout(GIVE_UP_S)
            with contextlib.suppress(ConnectionResetError):
                assert flood[0].recv(1) == b""
        finally:
            for connection in flood:
                connection.close()
        log = stack.log("frontend")
    assert "the open-file limit (ulimit -n) lets this frontend hold" in log
    assert 1 <= log.count("is closed to make room") <= 3, log  # a line a second
    assert "out of system resource" not in log


def test_the_connections_held_leave_the_frontend_files_of_its_own() -> None:
    assert connection_cap(1024) == 1024 - 256
    assert connection_cap(256) == 192  # macOS's default: not one connection


def _read_a_large_answer(stack: Stack, wait_s: float, bytes_per_s: float) -> tuple[int, int]:
    """Ask for a 5 MB answer (more than the kernel holds for a client with a small
    receive buffer), wait ``wait_s`` before reading, then read at ``bytes_per_s``
    until the server is done: the bytes of the answer received, and its length."""
    chat = {"model": "fake", "messages": [{"role": "user", "content": "😀"}], "n": 8}
    chat |= {"max_tokens": 512, "logprobs": True, "top_logprobs": 20}
    chat["logit_bias"] = {str(ord("😀")): 100}  # 4-byte characters, 20 alternatives each
    body = json.dumps(chat).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: {JSON}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(head + body)
        client.settimeout(GIVE_UP_S)
        if wait_s:
            # From the answer's first byte: generating it takes seconds of its own
            # (512 steps of 8 choices), more on a busy machine.
            client.recv(1, socket.MSG_PEEK)
            time.sleep(wait_s)
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(1 << 16):
                received += chunk
                time.sleep(len(chunk) / bytes_per_s)
    answer_head, _, answer = bytes(received).partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.1 200")
    return len(answer), _length(bytes(received))


def test_a_client_that_stops_reading_its_answer_is_dropped_after_the_body_timeout(
    stack: Stack,
) -> None:
    """A reader that takes nothing: the response would wait to write the rest for
    ever, holding its connection. It is dropped instead."""
    received, length = _read_a_large_answer(stack, 4 * TIMEOUT_S + 2, 1e9)
    assert received < length  # cut off, not the whole answer


def test_a_client_that_reads_slowly_gets_its_whole_answer(stack: Stack) -> None:
    """At 500 KB/s the server's buffers drain more slowly than BODY_TIMEOUT_S, but
    the client reads all along: it is not dropped. It was, while the transport's
    buffer alone was watched: that shrinks only once the kernel's send queue has
    drained by about a third, 750 KB here."""
    received, length = _read_a_large_answer(stack, 0, 5e5)
    assert received == length


def test_trailer_fields_past_16_kib_get_431(stack: Stack) -> None:
    """A chunked body's trailers are a head of their own: 6,000 fields (59 KB)
    after a 14-byte body were read, and served."""
    body = b'{"prompt":"a"}'
    trailers = "".join(f"X-Trailer-{i}: {'v' * 20}\r\n" for i in range(1000)).encode()
    counted = 'minibatch_requests_total{endpoint="/tokenize",finish_reason="none",status="431"}'
    before = request_counts(stack, "/tokenize")
    with connect(stack) as sock:
        sock.sendall(head("/tokenize", f"Content-Type: {JSON}", "Transfer-Encoding: chunked"))
        sock.sendall(b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers))
        status, _, answer = read_response(sock)
    assert status == 431, answer
    assert json.loads(answer)["error"]["code"] == "head_too_large"
    # Counted as the 431 it got, and as nothing else (it was a 499 too).
    after = request_counts(stack, "/tokenize")
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        counted: 1
    }
