"""Requests whose body length is told two ways are refused, and their connection
closed.

A request with both ``Content-Length`` and ``Transfer-Encoding`` is how request
smuggling starts: a proxy in front may frame the body by one header while this
server frames it by the other (h11 takes ``Transfer-Encoding``), and the bytes
in between become a request nobody sent. RFC 9112 (section 6.3) lets a server
refuse such a request, and requires it to close the connection after answering.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import ApiError
from frontend.refusal import refuse


class AmbiguousFramingMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            if "content-length" in headers and "transfer-encoding" in headers:
                error = ApiError(
                    400,
                    "the request has both Content-Length and Transfer-Encoding; send one: "
                    "Content-Length for a body of known length, else chunked",
                    "invalid_http",  # as for other HTTP that cannot be read
                    headers={"Connection": "close"},  # what follows cannot be trusted
                )
                await refuse(error, scope, receive, send)
                return
        await self.app(scope, receive, send)
