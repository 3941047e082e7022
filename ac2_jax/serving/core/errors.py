"""API-shaped errors: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's `{"type": "error", "error": {"type", "message"}}` on the Anthropic
routes (`ANTHROPIC_PATHS`) and the Gemini API's `{"error": {"code", "message",
"status"}}` on its routes (`GEMINI_PATHS`).

Every failure the endpoint reports (bad JSON, auth, unknown model or route,
context overflow, validation) goes through `APIError`, so clients such as
the official `openai` and `anthropic` packages raise the matching exception
class (BadRequestError, AuthenticationError, PermissionDeniedError,
NotFoundError, ConflictError, ...) with our message. The status is the same
whichever shape the body takes.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# Anthropic's error types by status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# Routes whose errors take Anthropic's shape (the Messages API and its sub-routes).
ANTHROPIC_PATHS = ("/v1/messages",)
# Routes whose errors take the Gemini API's shape (google.rpc.Status by HTTP status).
GEMINI_PATHS = ("/v1beta/",)
_GEMINI_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "INVALID_ARGUMENT",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def error_style(path: str) -> str:
    """The error shape of `path`: "anthropic" on the Anthropic routes, "gemini" on the
    Gemini API's (/v1beta/..., and /v1/models/<model>:<method>), else "openai"."""
    if path.startswith(ANTHROPIC_PATHS):
        return "anthropic"
    gemini = path.startswith(GEMINI_PATHS) or (path.startswith("/v1/models/") and ":" in path)
    return "gemini" if gemini else "openai"


class APIError(Exception):
    """An error answered as OpenAI JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape: the type by status, our message (param named in it)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def gemini_body(self) -> dict[str, Any]:
        """The Gemini API's shape: {"error": {code, message, status}} (param named in
        the message)."""
        status = _GEMINI_STATUS.get(self.status, "UNKNOWN")
        return {"error": {"code": self.status, "message": self.message, "status": status}}

    def response(self, style: str = "openai") -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if style == "anthropic":
            body = self.anthropic_body()
        elif style == "gemini":
            body = self.gemini_body()
        else:
            body = self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install_error_handlers(
    app: FastAPI, on_crash: Callable[[Request, Exception], Awaitable[None] | None] | None = None
) -> None:
    """Makes every error of `app` (ours, routing, validation, crashes) OpenAI-shaped.

    on_crash(request, exc) (a function or coroutine function) runs first on an
    unexpected exception: a 500 whose body never carries the exception's text
    (it is logged instead).
    """

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(error_style(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        err = APIError(exc.status_code, msg, code=f"http_{exc.status_code}")
        return err.response(error_style(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return APIError(
            400,
            f"Invalid request: {loc or 'body'}: {first.get('msg', 'invalid')}",
            param=loc or None,
            code="invalid_request",
        ).response(error_style(request.url.path))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.error(
            "crash on %s %s",
            request.method,
            request.url.path,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        if on_crash is not None:
            result = on_crash(request, exc)
            if inspect.isawaitable(result):
                await result
        return APIError(
            500, "Internal server error (the server log has the cause)", code="internal_error"
        ).response(error_style(request.url.path))
