"""The Starlette application: routes, and the worker link's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend import chat_api, native_api, openai_api
from frontend.auth import ApiKeyMiddleware
from frontend.chat_api import chat_completions
from frontend.config import FrontendConfig
from frontend.errors import SHOULD_RETRY_HEADER, ApiError, error_response, handle_api_error
from frontend.field_errors import nearest_name
from frontend.framing import AmbiguousFramingMiddleware
from frontend.health import health, ready
from frontend.json_response import JSONResponse
from frontend.metrics import (
    CONTENT_TYPE,
    NO_FINISH_REASON,
    TOKENIZER_ENDPOINTS,
    UNROUTED,
    Metrics,
)
from frontend.native_api import generate
from frontend.openai_api import completions, models, retrieve_model
from frontend.openai_common import with_ignored_fields
from frontend.openapi import openapi_schema
from frontend.parse import IGNORED_FIELDS_HEADER
from frontend.refusal import log_refusal
from frontend.tokenize_api import detokenize, tokenize, version
from frontend.worker_client import WorkerClient
from protocol import ErrorCode

Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(config: FrontendConfig) -> Starlette:
    client = WorkerClient(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = Starlette(
        routes=routes(),
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
        middleware=_middleware(config),
        lifespan=lifespan,
    )
    # Starlette would answer "/generate/" with a redirect built from the client's
    # Host header; a 404 that names the route meant says the same without echoing it.
    app.router.redirect_slashes = False
    app.state.config = config
    app.state.client = client
    app.state.large_body_turn = asyncio.Lock()  # see frontend.parse.LARGE_BODY_BYTES
    app.state.metrics = Metrics(client)
    app.state.started_at = int(time.time())
    app.state.count_connections = lambda: 0  # open HTTP connections: set by the server
    # Connections the server's open-file limit leaves room for, beside the
    # probes': set by the server.
    app.state.connection_room = sys.maxsize
    return app


def routes() -> list[Route]:
    """Every endpoint this frontend serves. Those that generate are at the paths
    their modules count their answers under in /metrics (refusals count under
    the route's path)."""
    tokenize_path, detokenize_path = TOKENIZER_ENDPOINTS
    return [
        Route(native_api.ENDPOINT, generate, methods=["POST"]),
        Route(openai_api.ENDPOINT, completions, methods=["POST"]),
        Route(chat_api.ENDPOINT, chat_completions, methods=["POST"]),
        Route("/v1/models", _counted(models), methods=["GET"]),
        # A hub id holds a slash: "openai-community/gpt2".
        Route("/v1/models/{model:path}", _counted(retrieve_model), methods=["GET"]),
        Route(tokenize_path, tokenize, methods=["POST"]),
        Route(detokenize_path, detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


def _middleware(config: FrontendConfig) -> list[Middleware]:
    """Framing first: a request it refuses reaches nothing else. CORS outside the
    API key: a browser's preflight carries no key, and a 401 must reach the page."""
    middleware = [Middleware(AmbiguousFramingMiddleware)]
    if config.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=config.allowed_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
                expose_headers=[IGNORED_FIELDS_HEADER, "Retry-After", SHOULD_RETRY_HEADER],
            )
        )
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    return middleware


def _client(request: Request) -> WorkerClient:
    client: WorkerClient = request.app.state.client
    return client


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    # Every error that reaches here is the request's one answer: count it once.
    request_metrics: Metrics = request.app.state.metrics
    request_metrics.count_request(_route_path(request), exc.status, NO_FINISH_REASON)
    log_refusal(request.method, request.url.path, exc)
    return await handle_api_error(request, with_ignored_fields(request, exc))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug: the frontend raised where it should have answered. The client still
    gets the usual error shape, /metrics counts it, and Starlette logs the
    traceback once this answer is sent."""
    request_metrics: Metrics = request.app.state.metrics
    request_metrics.count_request(_route_path(request), 500, NO_FINISH_REASON)
    message = (
        f"the frontend failed on this request ({type(exc).__name__}, logged with its "
        "traceback); a bug: report it with that log"
    )
    return error_response(ApiError(500, message, ErrorCode.INTERNAL))


def _counted(endpoint: Endpoint) -> Endpoint:
    """An API route whose answers no generation metric counts: its successes count
    in minibatch_requests_total as its refusals do (`_api_error`). Probes' and
    scrapers' routes (/health, /metrics...) count only when refused."""

    async def counted(request: Request) -> Response:
        response = await endpoint(request)
        request_metrics: Metrics = request.app.state.metrics
        request_metrics.count_request(_route_path(request), response.status_code, NO_FINISH_REASON)
        return response

    return counted


def _route_path(request: Request) -> str:
    """The route's path as declared ("/v1/models/{model:path}"), not as requested:
    a label per requested path would let any client grow /metrics without bound."""
    route = request.scope.get("route")
    return route.path if isinstance(route, Route) else UNROUTED


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods, in the same error shape as everything else,
    and counted as every refusal is."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    message = f"{request.method} {path}: {exc.detail}; see GET /openapi.json"
    if exc.status_code == 404 and (meant := _meant_path(request, path)) is not None:
        message = f"{request.method} {path}: {exc.detail}; did you mean {meant}?"
    # A 405's Allow header names the methods the path takes.
    headers = dict(exc.headers or {})
    code = _CODE_BY_HTTP_STATUS.get(exc.status_code)
    return await _api_error(request, ApiError(exc.status_code, message, code, headers=headers))


def _meant_path(request: Request, path: str) -> str | None:
    """The route an unknown ``path`` likely meant: itself without a slash too many,
    or with the /v1 a client's base URL left out (/completions); else a route's
    path it is a typo of (/v1/chat/completion)."""
    for meant in (path.rstrip("/"), "/v1" + path.rstrip("/")):
        if meant != path and _is_route(request, meant):
            return meant
    routes = request.app.router.routes
    literal = [route.path for route in routes if isinstance(route, Route) and "{" not in route.path]
    return nearest_name(path.rstrip("/"), literal)


def _is_route(request: Request, path: str) -> bool:
    routes = request.app.router.routes
    return any(isinstance(route, Route) and route.path_regex.match(path) for route in routes)


_CODE_BY_HTTP_STATUS = {404: "not_found", 405: "method_not_allowed"}


async def metrics(request: Request) -> Response:
    """Prometheus text format: request counts, token counts, latencies, worker load."""
    app_metrics: Metrics = request.app.state.metrics
    return Response(app_metrics.render(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    """The OpenAPI 3.1 description of every endpoint."""
    config = _client(request).config
    return JSONResponse(openapi_schema(config.strict_request_fields, config.max_new_tokens_limit))
