"""APIError: every error the router answers with, in OpenAI's JSON shape.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

Anything that turns into an HTTP error (validation, auth, routing, an upstream
gRPC status) is raised as APIError and rendered by `error_response`; streaming
responses that fail after their first token send `error_event` instead. The
constructors below fix the (status, type, code) triple per kind, so handlers
never spell them out.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from pipeserve.errors import InvalidRequestError

# A refusal of load (429, 503) says when to try again (RFC 9110 Retry-After, seconds), so a client
# that honours it (the OpenAI SDKs do) backs off instead of spinning on refusals: a busy group frees
# a seat within a few steps, and a group that is not ready is polled every second or so.
RETRY_AFTER_S = 1


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
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, None)


def from_invalid_request(e: InvalidRequestError) -> APIError:
    return invalid(e.param, e.message)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found"
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
        "invalid_request_error",
        None,
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def too_large(message: str) -> APIError:
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


def too_many_requests(message: str) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", _retry_after())


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "service_unavailable", _retry_after())


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def internal(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def http_error(status: int, detail: object) -> APIError:
    """Starlette/FastAPI's own HTTPException (404 unknown path, 405 method) in the same shape."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, str(detail), kind, None, codes.get(status))


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def error_event(err: APIError) -> str:
    """The SSE event a stream ends with when it fails after its first chunk (then `[DONE]`)."""
    return f"data: {json.dumps(err.body())}\n\n"
