"""The opt-in API key (API_KEY): ``Authorization: Bearer <key>`` on every path
except the probes, which orchestrators and Prometheus call without credentials.

It runs before routing and before the body is read, so a client without the key
costs one header comparison. The comparison takes the same time however much of
the key a guess gets right.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import ApiError
from frontend.refusal import refuse

# The probes, answered from memory: open to orchestrators and Prometheus without
# the key, and past MAX_CONNECTIONS (`frontend.http_protocol`).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
SEND_KEY = "send the header 'Authorization: Bearer <key>' (the openai client sends its api_key so)"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        problem = self._problem(Headers(scope=scope).getlist("authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        error = ApiError(
            401,
            f"{problem}; {SEND_KEY}",
            "invalid_api_key",
            # Close: the body, which nobody will read, need not be sent.
            headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
        )
        await refuse(error, scope, receive, send)

    def _problem(self, fields: list[str]) -> str | None:
        """What is wrong with the credentials, or None when they are right."""
        if not fields:
            return "this server needs an API key"
        # Two fields could be read apart by a proxy in front that checks the other.
        if len(fields) > 1:
            return f"send one Authorization header, not {len(fields)}"
        scheme, _, token = fields[0].partition(" ")
        if scheme.lower() != "bearer":
            return f"the Authorization header must use the Bearer scheme, not {scheme[:20]!r}"
        # Header values are latin-1 on the wire; compare bytes so that any value works.
        if not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            return "the API key is not valid"
        return None
