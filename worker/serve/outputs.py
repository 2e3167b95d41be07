"""What the engine thread sends its peers, through the I/O thread, which alone
owns the ROUTER: each message goes over an inproc PUSH/PULL pair as three frames,
the route of its request (`peers.route_for`), whether it is the request's last,
and the message as its sender will read it (under the id it gave)."""

from __future__ import annotations

import dataclasses

import zmq

from protocol import ErrorCode, ErrorResult, GenerateResult, RequestNews, encode
from protocol.wire import shorten
from worker.serve.peers import MAX_ERROR_CHARS, Peers, sender_request_id

# How long a stopping worker's last messages (its hand-backs) may wait to be
# delivered before its sockets close.
LAST_MESSAGES_MS = 1000

_FINAL = b"1"
_PARTIAL = b"0"
_HANDED_BACK = "the worker is stopping; the frontend sends the request to another"


def send_outputs(push: zmq.Socket[bytes], messages: list[RequestNews]) -> None:
    """The engine thread's side: each message under the id its sender gave it."""
    for message in messages:
        route = message.request_id
        final = isinstance(message, (GenerateResult, ErrorResult))
        reply = dataclasses.replace(message, request_id=sender_request_id(route))
        if isinstance(reply, ErrorResult):  # a template's or an exception's, of any size
            reply = dataclasses.replace(reply, message=shorten(reply.message, MAX_ERROR_CHARS))
        push.send_multipart([route.encode(), _FINAL if final else _PARTIAL, encode(reply)])


def forward_outputs(pull: zmq.Socket[bytes], peers: Peers) -> None:
    """The I/O thread's side: send each output the engine thread has written to
    its peer."""
    while pull.poll(0):
        route_bytes, final, payload = pull.recv_multipart()
        peers.send(route_bytes.decode(), final == _FINAL, payload)


def handed_back(request_id: str) -> ErrorResult:
    """A stopping worker's answer to a request it will not run: the frontend sends
    it to another worker, and counts no death."""
    return ErrorResult(request_id, ErrorCode.SHUTTING_DOWN, _HANDED_BACK)
