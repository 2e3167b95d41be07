"""A middleware's refusal (ambiguous framing, a missing API key), answered and
counted as the router's refusals are.

Middleware runs before routing and before the app's exception handlers, which
count every other refusal in ``minibatch_requests_total``; here the request's
route is looked up from its path and method, so the count carries the same
``endpoint`` label the router would have given it (``other`` for no route).
"""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from frontend.errors import ApiError, error_response
from frontend.metrics import NO_FINISH_REASON, UNROUTED, Metrics


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    metrics: Metrics = scope["app"].state.metrics
    metrics.count_request(declared_route(scope), error.status, NO_FINISH_REASON)
    await error_response(error)(scope, receive, send)


def declared_route(scope: Scope) -> str:
    """The path of the route this request is for, as declared, or UNROUTED: a
    route whose path matches but not its method counts, as the router's 405 does."""
    for route in scope["app"].routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return str(route.path)
    return UNROUTED
