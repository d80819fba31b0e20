"""The errors the engine raises for a request it refuses, raised before anything is queued.

    InvalidRequestError (ValueError)          a bad sampling parameter, prompt, id or adapter
    └── InvalidRequestTypeError (TypeError)   a request field of the wrong type

Each names the field and the offending value in its message, and carries both as data: `parameter`
(the field as the engine's API names it: "stop", "prompt", "pooling.dimensions", ...) and `value`, so
a caller maps the error to its own field without reading the message (vLLM's VLLMValidationError).
"""

from __future__ import annotations

from typing import Any


class InvalidRequestError(ValueError):
    """The engine refuses a request. `parameter`: the offending field (None when the request as a whole is
    wrong, e.g. a count of prompts and params that differ); `value`: what it held (None when not kept)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """A request field of the wrong type. Also a ValueError, so one `except ValueError` catches every
    refused request."""


def show_value(value: Any, with_type: bool = True) -> str:
    """A bad value for an error message: its repr (cut at 80 characters) and its type."""
    try:
        text = repr(value)
    except Exception:  # an int past Python's 4300-digit str limit, or a __repr__ that fails
        text = "<unprintable>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})" if with_type else text
