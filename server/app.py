"""The FastAPI application: engine client lifecycle, guards (Host, API key), errors, routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import EngineConfig
from server import VERSION
from server.config import ServerConfig, is_loopback_host
from server.errors import APIError, install_error_handlers
from server.metrics import ServerMetrics, status_of
from server.origins import OriginPolicy, refused_origin
from server.responses import ResponseStore
from server.serving import Serving

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat",
                    "/api/generate", "/infill", "/completion", "/completions")
OPEN_PATHS = ("/health",)  # answered without an API key
EXPOSED_HEADERS = ("X-Moe-Serve-Warning", "Retry-After")  # what a browser page may read of an answer

SYSTEM_FINGERPRINT = f"fp_moe-serve-{VERSION}"


class GuardMiddleware:
    """Refuses foreign Host headers while bound to loopback (DNS rebinding) and web pages of origins
    that `--allowed-origins` does not allow, and checks the API key."""

    def __init__(self, app: ASGIApp, api_key: str | None, local_only: bool, origins: OriginPolicy) -> None:
        self.app, self.api_key, self.local_only, self.origins = app, api_key, local_only, origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.check(scope)
            if error is not None:
                return await error.response(scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.local_only and host is not None and not is_loopback_host(_host_name(host)):
            return APIError(403, f"Host {host!r} is not allowed: the server is bound to loopback and answers "
                            "only local names (DNS rebinding protection)", "permission_error",
                            code="host_not_allowed")
        # a browser reads no answer without CORS headers, but it still sends a simple POST: refuse it
        # before it runs, so that no web site the user visits can drive the model
        origin = refused_origin(headers, self.origins)
        if origin is not None:
            return APIError(403, f"Origin {origin!r} is not allowed to call this server; start it with "
                            f"--allowed-origins {origin} (or *) to allow that page", "permission_error",
                            code="origin_not_allowed")
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return None
        keys = presented_keys(headers)
        if not keys:
            return APIError(401, "Missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                            "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        # every key compared (constant time each): which one was right must not show in the timing
        matches = [hmac.compare_digest(key.encode(), self.api_key.encode()) for key in keys]
        if not any(matches):
            return APIError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


def presented_keys(headers: Headers) -> list[str]:
    """The API keys a request presents: OpenAI's clients send `Authorization: Bearer`, Anthropic's `x-api-key`."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    keys = [token.strip()] if scheme.lower() == "bearer" else []
    keys.append(headers.get("x-api-key", "").strip())
    return [key for key in keys if key]


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413 before reading it whole: at once by its
    Content-Length, and by counting the bytes of a chunked upload as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.too_large().response(scope["path"])(scope, receive, send)
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.too_large().message)  # FastAPI's body reader lets it through
            return message

        await self.app(scope, counted_receive, send)

    def too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than the server's limit of {self.max_bytes} bytes "
                        "(--max-request-bytes).", code="request_too_large")


def _host_name(host: str) -> str:
    """`[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    if host.startswith("["):
        return host[1: host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _load_engine(config: EngineConfig):
    from engine.engine import Engine  # torch and transformers load here, not at `--help`

    return Engine.load(config)


def create_app(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    load_engine: Callable[[], object] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """`on_load_failure(reason)` runs on the event loop when the model cannot be loaded (the CLI
    exits); without it the server stays up and answers 503 with the reason."""
    from engine.client import EngineClient
    from server import anthropic_routes, llamacpp_routes, ollama_routes, responses_routes, routes
    from server.embeddings import EmbeddingGroups

    load = load_engine or (lambda: _load_engine(engine_config))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(load, max_queue=server_config.max_queue)
        app.state.client = client
        app.state.serving = Serving(client, metrics, server_config.drain_timeout)
        app.state.embedding_groups = EmbeddingGroups(app.state.serving)
        watcher = asyncio.ensure_future(_report_load_failure(client, on_load_failure))
        yield
        watcher.cancel()
        log.info("shutting down the engine (saving its state)")
        await asyncio.to_thread(client.shutdown)
        log.info("engine shut down")

    app = FastAPI(title="moe-serve", version=VERSION, lifespan=lifespan)
    app.state.fingerprint = SYSTEM_FINGERPRINT
    app.state.tool_call_parser = server_config.tool_call_parser
    app.state.reasoning_parser = server_config.reasoning_parser
    app.state.pooling = server_config.pooling
    budget = server_config.reasoning_budget
    app.state.reasoning_budget = None if budget < 0 else budget  # None: unlimited
    app.state.started = int(time.time())
    app.state.responses = ResponseStore()  # stored responses, for previous_response_id (in memory)
    metrics = ServerMetrics(
        queue_depth=lambda: app.state.serving.scheduler.depth,
        cache_counters=lambda: app.state.client.engine.cache_counters() if app.state.client.ready else None,
    )
    app.state.metrics = metrics
    install_error_handlers(app, on_error=lambda request, error: _count_error(metrics, request, error))
    for api in (routes, responses_routes, anthropic_routes, ollama_routes, llamacpp_routes):
        app.include_router(api.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_request_bytes)
    origins = OriginPolicy.from_setting(server_config.allowed_origins)
    app.add_middleware(GuardMiddleware, api_key=server_config.api_key, local_only=server_config.is_loopback,
                       origins=origins)
    # outermost: a preflight is answered before the API key is asked for (browsers send none with it)
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if origins.allows_any else [],
                       allow_origin_regex=None if origins.allows_any else origins.regex,
                       allow_methods=["*"], allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600)
    return app


async def _report_load_failure(client, on_load_failure: Callable[[str], None] | None) -> None:
    if on_load_failure is not None and not await asyncio.to_thread(client.wait_ready):
        on_load_failure(client.error or "the engine worker stopped")


def _count_error(metrics: ServerMetrics, request, error: APIError) -> None:
    """Generation requests answered with an error (400 validation, 503 queue full, ...) count too."""
    if request.url.path in GENERATION_PATHS:
        metrics.requests.labels(status_of(error.status)).inc()
