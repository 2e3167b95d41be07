"""Refusals: each answered, counted and logged alike, wherever it is raised.

A middleware's refusal (ambiguous framing, a missing API key), or the
connection's past MAX_CONNECTIONS (`frontend.http_protocol`), runs before
routing and before the app's exception handlers, which count every other
refusal in ``minibatch_requests_total``; here the request's route is looked up
from its path and method, so the count carries the same ``endpoint`` label the
router would have given it (``other`` for no route).

The frontend writes no access log; a refused (4xx) or failed (5xx) answer gets a
line of its own, at most one a second of each kind, with a count of those left
out, so that an operator sees them and a client's flood of bad requests does not
flood the log.
"""

from __future__ import annotations

import logging

from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from frontend.errors import ApiError, error_response
from frontend.field_errors import printable
from frontend.metrics import NO_FINISH_REASON, UNROUTED, Metrics
from protocol.throttled import Throttled

log = logging.getLogger(__name__)
_REFUSED = Throttled(log, "refused requests", logging.INFO)
_FAILED = Throttled(log, "failed requests", logging.WARNING)
_MAX_LOGGED_PATH_CHARS = 200


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    record_refusal(error, scope)
    await error_response(error)(scope, receive, send)


def record_refusal(error: ApiError, scope: Scope) -> None:
    """Count and log ``error``, the answer to the request of ``scope``."""
    metrics: Metrics = scope["app"].state.metrics
    metrics.count_request(declared_route(scope), error.status, NO_FINISH_REASON)
    log_refusal(scope["method"], scope["path"], error)


def log_refusal(method: str, path: str, error: ApiError) -> None:
    """A line for ``error``, the answer to ``method`` ``path`` (throttled)."""
    line = (
        f"{printable(method)} {printable(path[:_MAX_LOGGED_PATH_CHARS])}: {error.status} "
        f"{error.code or '-'}: {printable(error.message)}"
    )
    (_FAILED if error.status >= 500 else _REFUSED).warn(line)


def declared_route(scope: Scope) -> str:
    """The path of the route this request is for, as declared, or UNROUTED: a
    route whose path matches but not its method counts, as the router's 405 does."""
    for route in scope["app"].routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return str(route.path)
    return UNROUTED
