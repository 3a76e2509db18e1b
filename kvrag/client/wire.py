"""The wire format of kvrag's client: request bodies, answers and stream events, errors.

Transport-free (what both clients share): OpenAI-shaped request bodies with kvrag's extension
fields, the :class:`~kvrag.engine.Generation` of an answer or of a stream's events (:class:`Fold`),
and the :mod:`kvrag.errors` exception of an error body.

A call's ``constraint`` (a :class:`~kvrag.Constraint`) is sent as OpenAI's ``response_format`` (a JSON
schema or any JSON object; a regex or a grammar has no OpenAI field and is refused before any request).
Chat calls take ``tools`` (OpenAI function schemas) and ``tool_choice``: the server renders the tools,
forces a call as asked and parses the answer's calls, which come back as :attr:`ServedGeneration.tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrag.config import Constraint
from kvrag.engine.options import RequestOptions
from kvrag.engine.tools import ToolCall
from kvrag.engine.types import Generation, GenerationStats
from kvrag.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, ServerError

__all__ = [
    "REQUEST_OPTIONS",
    "Fold",
    "ServedGeneration",
    "response_format_of",
    "wire_tool_choice",
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


@dataclass(slots=True)
class ServedGeneration(Generation):
    """A :class:`~kvrag.engine.Generation` answered by ``kvrag serve``, with the tool calls it parsed from
    the answer (``text`` is then the content left)."""

    tool_calls: list[ToolCall] = field(default_factory=list)


def response_format_of(constraint: Any) -> dict[str, Any]:
    """A :class:`~kvrag.Constraint` as OpenAI's ``response_format``."""
    if not isinstance(constraint, Constraint):
        raise InvalidRequestError(f"a constraint must be a kvrag.Constraint, got {type(constraint).__name__}")
    if constraint.kind == "json_object":
        return {"type": "json_object"}
    if constraint.kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(constraint.spec)}}
    raise InvalidRequestError(
        f"a {constraint.kind} constraint cannot be sent to kvrag serve: it takes a JSON schema or any JSON "
        "object (response_format), or tools with tool_choice for a forced call"
    )


def wire_tool_choice(choice: Any) -> Any:
    """A ``tool_choice`` as OpenAI's: ``"any"``/``True`` -> ``"required"``, a tool's name -> the named form."""
    if choice in ("any", True):
        return "required"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as OpenAI's: an assistant turn's call arguments as JSON text (templates take objects)."""
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _json_text(c["function"].get("arguments", {}))}}
            for c in out["tool_calls"]
        ]
    return out


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


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
        if name == "constraint":
            body["response_format"] = response_format_of(value)
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
    options = dict(options)
    tools, choice = options.pop("tools", None), options.pop("tool_choice", None)
    body = request_body(options, model=model, documents=documents, stream=stream)
    if tools:
        body["tools"] = list(tools)
    if choice is not None:
        if body.get("response_format") is not None and wire_tool_choice(choice) not in ("auto", "none"):
            raise InvalidRequestError("a forced tool call is a constraint: give tool_choice or constraint")
        body["tool_choice"] = wire_tool_choice(choice)
    return "/v1/chat/completions", {**body, "messages": [_wire_message(m) for m in messages]}


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


def generation_of(text: str, finish_reason: str, extension: Any, calls: Sequence[Any] = ()) -> ServedGeneration:
    if not isinstance(extension, dict) or "stats" not in extension:
        raise ServerError("the server's answer has no kvrag figures: is it a kvrag server?")
    stats = GenerationStats.from_dict(extension["stats"])
    tool_calls = [_call_of(c) for c in calls]
    return ServedGeneration(text, [], finish_reason, extension["ttft_s"], extension["total_s"], stats, tool_calls)


def _call_of(call: Mapping[str, Any]) -> ToolCall:
    """An answer's OpenAI-shaped call as a :class:`~kvrag.engine.tools.ToolCall`."""
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        raise ServerError(f"the server answered a tool call whose arguments are not JSON: {call!r:.300}") from None
    if not isinstance(args, dict):
        raise ServerError(f"the server answered a tool call whose arguments are not an object: {call!r:.300}")
    given = {"id": str(call["id"])} if call.get("id") else {}
    return ToolCall(str(fn.get("name", "")), args, **given)


def whole(data: dict[str, Any]) -> Generation:
    """The :class:`Generation` of a whole chat or text completion (a chat's tool calls included)."""
    choice = data["choices"][0]
    message = choice.get("message")
    text = message["content"] if message is not None else choice["text"]
    calls = (message or {}).get("tool_calls") or ()
    return generation_of(text or "", choice["finish_reason"], data.get("kvrag"), calls)


class Fold:
    """Reads a stream's events one by one: their text pieces, then the :class:`Generation`."""

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.extension: Any = None
        self.finished = False  # the ``[DONE]`` event came
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls, by index, as their deltas add up

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
            for delta in (choice.get("delta") or {}).get("tool_calls") or ():
                self._add_call(delta)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text += piece
        return [piece] if piece else []

    def _add_call(self, delta: Mapping[str, Any]) -> None:
        call = self.calls.setdefault(
            int(delta.get("index", 0)), {"id": None, "function": {"name": "", "arguments": ""}}
        )
        call["id"] = delta.get("id") or call["id"]
        fn = delta.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""

    def generation(self) -> Generation:
        if self.finish_reason is None:
            raise ServerError("the server's stream ended before the answer did")
        calls = [self.calls[i] for i in sorted(self.calls)]
        return generation_of(self.text, self.finish_reason, self.extension, calls)
