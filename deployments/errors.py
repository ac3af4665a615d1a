"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client should see as it is. Raised by the engine replica and the ingress alike; it crosses Ray's
    process boundary intact (see __reduce__)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds: a retriable error (429, 503) says when to try again

    def __reduce__(self):
        return (APIError, (self.status, self.message, self.type, self.param, self.code, self.retry_after))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def prompt_too_long(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def body_too_large(message: str) -> APIError:
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist; this server serves {served!r}.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def queue_full(message: str) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "engine_queue_full", retry_after=1)


def queue_timeout(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "queue_timeout", retry_after=5)


def engine_not_ready(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_not_ready", retry_after=5)


def engine_unavailable(message: str) -> APIError:
    """The engine replica failed (a worker died and could not be replaced): the request may be sent again, and
    Serve's new replica, or another one, answers it."""
    return APIError(503, message, "server_error", None, "engine_unavailable", retry_after=5)


def not_found(path: str) -> APIError:
    return APIError(404, f"No route {path}.", "invalid_request_error", None, "not_found")


def internal_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, None)


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError keeps it as `.cause`)."""
    seen = 0
    while seen < 8 and not isinstance(exc, APIError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
        seen += 1
    return exc
