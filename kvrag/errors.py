"""Errors raised by kvrag. Every one derives from :class:`KvragError`."""

from __future__ import annotations

__all__ = [
    "KvragError",
    "InvalidRequestError",
    "ContextLengthError",
    "UnsupportedModelError",
    "ModelNotFoundError",
    "StoreError",
    "ServerError",
    "OverloadedError",
]


class KvragError(Exception):
    """Base class of every error kvrag raises on purpose."""


class InvalidRequestError(KvragError, ValueError):
    """A request argument is wrong (bad mode, ratio out of range, non-text chunk, empty prompt)."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context window.

    Attributes:
        prompt_tokens: tokens the prompt needs.
        limit: the context window, in tokens.
    """

    def __init__(self, prompt_tokens: int, limit: int, detail: str = "") -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        msg = (
            f"prompt has {prompt_tokens} tokens but the context window is {limit} tokens"
            + (f" ({detail})" if detail else "")
            + "; retrieve fewer or shorter documents"
        )
        super().__init__(msg)


class UnsupportedModelError(KvragError, ValueError):
    """The model's architecture or a feature of it is not implemented exactly by the engine."""


class ModelNotFoundError(KvragError, FileNotFoundError):
    """The model name is neither the bundled model nor a local directory or ``.gguf`` file."""


class StoreError(KvragError):
    """The KV store cannot be used at all (bad directory, closed store)."""


class ServerError(KvragError):
    """A kvrag server cannot be reached, or answered with an error that is not about the request.

    Request errors keep their own classes on the client (:class:`InvalidRequestError`,
    :class:`ContextLengthError`, :class:`ModelNotFoundError`); this one is for the rest: a refused
    API key (401), an overloaded server (429/503, ``retry_after`` seconds), a server fault (5xx),
    no connection (``status_code`` None).

    Attributes:
        status_code: the HTTP status, or ``None`` when no answer came.
        code: the error's ``code`` in OpenAI's error body (``invalid_api_key``, ``overloaded``, ...).
        retry_after: seconds the server asked the client to wait (``Retry-After``), if it did.
    """

    def __init__(
        self, message: str, *, status_code: int | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        self.status_code = status_code
        self.code = code
        self.retry_after = retry_after
        super().__init__(message)


class OverloadedError(KvragError):
    """The engine's queue is full (``EngineConfig.max_queued`` / ``max_queued_tokens``): try again later.

    Raised when a request is submitted, before any work is done for it; nothing is kept. A server
    answers it with HTTP 503 (or 429) and a retry hint.
    """
