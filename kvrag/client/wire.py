"""The wire format of kvrag's client: request bodies, answers and stream events, errors.

Transport-free (what both clients share): OpenAI-shaped request bodies with kvrag's extension
fields, the :class:`~kvrag.engine.Generation` of an answer or of a stream's events (:class:`Fold`),
and the :mod:`kvrag.errors` exception of an error body.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from kvrag.engine.options import RequestOptions
from kvrag.engine.types import Generation, GenerationStats
from kvrag.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, ServerError

__all__ = [
    "REQUEST_OPTIONS",
    "Fold",
    "chat_body",
    "check",
    "error_of",
    "generation_of",
    "root_url",
    "text_body",
    "whole",
]

#: Per-request keywords of the client's calls (the engine's, less what the server decides) and
#: their names on the wire. ``max_tokens`` is accepted for ``max_new_tokens``.
REQUEST_OPTIONS = {
    **{name: name for name in RequestOptions.names() if name != "namespace"},
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


def root_url(base_url: str) -> str:
    """The server's root URL (an OpenAI-style base URL ending in ``/v1`` is accepted too)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_body(
    options: dict[str, Any], *, model: str, documents: Sequence[str] | None, stream: bool
) -> dict[str, Any]:
    """The OpenAI request fields of a call's options (kvrag names) and documents."""
    options = dict(options)
    model = options.pop("model", None) or model
    unknown = sorted(set(options) - REQUEST_OPTIONS.keys())
    if unknown:
        raise InvalidRequestError(f"unknown argument(s) {', '.join(unknown)}; give model, {', '.join(REQUEST_OPTIONS)}")
    body: dict[str, Any] = {"model": model, "stream": stream}
    for name, value in options.items():
        if value is None:
            continue
        wire = REQUEST_OPTIONS[name]
        if body.get(wire, value) != value:
            raise InvalidRequestError("max_new_tokens and max_tokens are one argument; give one of them")
        body[wire] = list(value) if name == "stop" and not isinstance(value, str) else value
    if documents is not None:
        if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequestError("documents must be a list of strings")
        body["documents"] = list(documents)
    return body


def chat_body(messages, documents, options, model, stream) -> tuple[str, dict[str, Any]]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = request_body(options, model=model, documents=documents, stream=stream)
    return "/v1/chat/completions", {**body, "messages": list(messages)}


def text_body(prompt, documents, options, model, stream) -> tuple[str, dict[str, Any]]:
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
    return "/v1/completions", {
        **request_body(options, model=model, documents=documents, stream=stream),
        "prompt": prompt,
    }


def error_of(status: int | None, body: Any, retry_after: str | None = None) -> Exception:
    """The :mod:`kvrag.errors` exception of an OpenAI error body (answer or stream event)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ServerError(f"kvrag server answered {status}: {str(body)[:300]}", status_code=status)
    message, code = str(err.get("message", "")), err.get("code")
    if code == "context_length_exceeded" and "prompt_tokens" in err and "limit" in err:
        return ContextLengthError(int(err["prompt_tokens"]), int(err["limit"]))
    if code == "model_not_found":
        return ModelNotFoundError(message)
    if err.get("type") == "invalid_request_error" and status in (None, 400, 422):
        return InvalidRequestError(message)
    retry = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    return ServerError(message or f"kvrag server answered {status}", status_code=status, code=code, retry_after=retry)


def check(response: httpx.Response) -> None:
    """Raise the answer's error unless it is a success (the body must have been read)."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    raise error_of(response.status_code, body, response.headers.get("retry-after"))


def generation_of(text: str, finish_reason: str, extension: Any) -> Generation:
    if not isinstance(extension, dict) or "stats" not in extension:
        raise ServerError("the server's answer has no kvrag figures: is it a kvrag server?")
    stats = GenerationStats.from_dict(extension["stats"])
    return Generation(text, [], finish_reason, extension["ttft_s"], extension["total_s"], stats)


def whole(data: dict[str, Any]) -> Generation:
    """The :class:`Generation` of a whole chat or text completion."""
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return generation_of(text or "", choice["finish_reason"], data.get("kvrag"))


class Fold:
    """Reads a stream's events one by one: their text pieces, then the :class:`Generation`."""

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.extension: Any = None
        self.finished = False  # the ``[DONE]`` event came

    def take(self, data: str) -> list[str]:
        """The text piece an event's data carries (none or one); raises the error an event carries."""
        if data == "[DONE]":
            self.finished = True
            return []
        event = json.loads(data)
        if "error" in event:
            raise error_of(None, event)
        if "kvrag" in event:
            self.extension = event["kvrag"]
        piece = ""
        for choice in event.get("choices") or ():
            piece += (choice["delta"].get("content") if "delta" in choice else choice.get("text")) or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text += piece
        return [piece] if piece else []

    def generation(self) -> Generation:
        if self.finish_reason is None:
            raise ServerError("the server's stream ended before the answer did")
        return generation_of(self.text, self.finish_reason, self.extension)
