"""The error type of a request the engine refuses because of its input.

Front doors answer it as the client's fault (HTTP 400 BadRequestError, gRPC
INVALID_ARGUMENT) with its message; any other exception out of the engine is the
server's fault (HTTP 500 InternalServerError, gRPC INTERNAL) with a generic message,
the traceback in the server log, as vLLM maps its validation errors and the rest.
"""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request's input is invalid; the message says what to change.

    A ValueError, so callers that catch ValueError keep working.

    Args:
        message: the client-facing reason ("the prompt is empty; give at least one
            character or token").
        param: the request field it refuses (the HTTP error's `param`), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTypeError(RequestValidationError, TypeError):
    """A request value of the wrong type ("token-id prompts must be lists of int"); also
    a TypeError, as the engine raised for these before."""
