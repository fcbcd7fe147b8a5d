"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`; on Anthropic's paths
(`/v1/messages`) in Anthropic's, around the same keys: `{"type": "error", "error": {...}}`; on
Ollama's (`/api/...`) in Ollama's: `{"error": "<message>"}`. `error_dialect(path)` picks one.

Every failure the server reports goes through `APIError`: engine errors are mapped onto
it, FastAPI's 422 validation errors become 400, unknown routes 404, crashes 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api import (
    ContextLengthError,
    DeviceMemoryError,
    EngineUnavailableError,
    InvalidRequestError,
    QueueFullError,
)
from server.ollama_protocol import ErrorResponse as OllamaErrorResponse
from server.protocol import AnthropicErrorResponse, ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

QUEUE_RETRY_AFTER_S = 1
LOADING_RETRY_AFTER_S = 5
ANTHROPIC_PATH = "/v1/messages"  # and the paths under it
OLLAMA_PREFIX = "/api/"
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_dialect(path: str) -> str:
    """The API whose error shape errors on `path` take ("openai", "anthropic" or "ollama"): each
    API's clients read only their own."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return "anthropic"
    if path.startswith(OLLAMA_PREFIX):
        return "ollama"
    return "openai"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def anthropic_body(self) -> AnthropicErrorResponse:
        """Anthropic's shape, with its type names (`not_found_error`, ...) where they differ from OpenAI's."""
        info = ErrorInfo(message=self.message, type=ANTHROPIC_TYPES.get(self.status, self.type), param=self.param,
                         code=self.code)
        return AnthropicErrorResponse(error=info)

    def ollama_body(self) -> OllamaErrorResponse:
        return OllamaErrorResponse(error=self.message)

    def response(self, path: str = "") -> JSONResponse:
        """`path`: the request's; it picks the API whose shape the error takes."""
        body = {"anthropic": self.anthropic_body, "ollama": self.ollama_body, "openai": self.body}[
            error_dialect(path)]()
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def to_api_error(exc: BaseException) -> APIError:
    """The API error for any exception: engine errors keep their meaning, the rest is a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "server_error", code="queue_full",
                        headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
    if isinstance(exc, DeviceMemoryError):  # no Retry-After: the same request would fail again
        return APIError(503, str(exc), "server_error", code="device_out_of_memory")
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), "server_error", code="engine_unavailable",
                        headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")


def validation_error(exc: RequestValidationError) -> APIError:
    first = _most_specific(exc.errors())
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {reason}".rstrip(": "))
    param = _param(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _most_specific(errors) -> dict:
    """The error to report: for a union (`str | list[...]`) pydantic reports one per member; the one
    that is not a wrong type (a list too long), else the one deepest into the value, says most."""
    if not errors:
        return {}
    not_a_type = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    candidates = not_a_type or errors
    return max(candidates, key=lambda e: len(e.get("loc", ())))  # the first of the deepest


_UNION_TAGS = {"str", "int", "float", "bool", "none", "json_invalid"}


def _param(loc) -> str | None:
    """pydantic's ('body', 'messages', 0, 'content', 'str') -> OpenAI's 'messages[0].content'."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part:  # skip the union member pydantic names
            param += f".{part}" if param else part
    return param or None


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """`on_error(request, api_error)` sees every error answered (for metrics)."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error)
        return error.response(request.url.path)

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, to_api_error(exc))

    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return answer(request, APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InvalidRequestError, api_error)
    app.add_exception_handler(QueueFullError, api_error)
    app.add_exception_handler(EngineUnavailableError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # not add_exception_handler(Exception): Starlette re-raises after answering, so each crash was logged twice
    app.add_middleware(CrashMiddleware, on_error=on_error)


class CrashMiddleware:
    """Answers an unhandled exception with a 500 in OpenAI's shape, and logs it once."""

    def __init__(self, app: ASGIApp, on_error=None) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if started:  # too late for a status: the response just ends
                return
            error = to_api_error(exc)
            if self.on_error is not None:
                self.on_error(Request(scope), error)
            await error.response(scope["path"])(scope, receive, send)
