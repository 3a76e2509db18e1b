"""OpenAI's request and response shapes as ``kvrag serve`` reads and writes them, with kvrag's extensions.

Requests: the fields of OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` that a text-only
engine can honour, plus kvrag's extension fields (:data:`EXTENSION_FIELDS`): ``documents`` (texts of
the prompt that are chunks: registered with the engine before the request is planned, and kept
in its bounded registry of chunk boundaries as ``/v1/documents`` keeps them; boundaries only, the
KV stays in the tenant's namespace), ``mode``, ``recompute_ratio``, ``selection``, ``quality``,
``conversation_id``, ``dedup``, ``speculate`` (a key: prefill this request ahead instead of
answering it; :mod:`kvrag.server.app`). Other OpenAI fields are ignored when they ask for nothing
(``user``, ``metadata``, a zero penalty, ``n=1``) and rejected when they ask for what kvrag
does not do (tools, log-probabilities, ``n > 1``), so a client never silently gets less than it asked.

Responses carry OpenAI's fields (``usage.prompt_tokens_details.cached_tokens`` included) and one
extension field, ``kvrag``: the figures of :func:`kvrag.calls.call_metadata` (the
keys LangChain's ``response_metadata`` and LlamaIndex's ``additional_kwargs`` hold) plus ``stats``,
the engine's whole :class:`~kvrag.engine.GenerationStats`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrag.calls import call_metadata, template_role
from kvrag.calls import usage as token_counts
from kvrag.calls.fields import ReuseFields
from kvrag.engine import Generation
from kvrag.engine.options import OPTION_DOCS, REUSE_OPTIONS, RequestOptions
from kvrag.errors import InvalidRequestError

__all__ = [
    "EXTENSION_FIELDS",
    "ChatRequest",
    "CompletionRequest",
    "DocumentsRequest",
    "figures",
    "usage",
    "chat_response",
    "completion_response",
    "StreamShape",
    "error_body",
]

#: kvrag's fields on an OpenAI request (all optional; ``None`` = the server engine's default): the
#: documents, the engine's reuse options (:data:`kvrag.engine.options.REUSE_OPTIONS`), a speculation key.
EXTENSION_FIELDS = ("documents", *REUSE_OPTIONS, "speculate")


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _GenerationRequest(ReuseFields):
    """The fields both completion endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # kvrag's extensions: the engine's reuse options (ReuseFields), a conversation, documents, a speculation key
    conversation_id: str | None = Field(default=None, description=OPTION_DOCS["conversation_id"])
    documents: list[str] | None = None
    speculate: str | None = Field(default=None, min_length=1, max_length=256)

    def check_supported(self) -> None:
        """Reject what kvrag cannot do rather than ignore it."""
        if self.n != 1:
            raise InvalidRequestError(f"n={self.n}: kvrag serve returns one choice per request (n=1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported by kvrag serve (leave it unset or 0)")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported by kvrag serve")

    def engine_options(self, namespace: str | None = None) -> RequestOptions:
        """The request's :class:`~kvrag.RequestOptions` for tenant ``namespace``; unset = the engine's default."""
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise InvalidRequestError("max_tokens and max_completion_tokens are one setting; give one of them")
        return RequestOptions(
            max_new_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop or None,
            seed=self.seed,
            namespace=namespace,
            **{name: getattr(self, name) for name in REUSE_OPTIONS},
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[_ContentPart] | None = None


class ChatRequest(_GenerationRequest):
    """A ``/v1/chat/completions`` request (text messages)."""

    messages: list[_Message]
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.functions:
            raise InvalidRequestError("tools and functions are not supported by kvrag serve")
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported by kvrag serve")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format: kvrag serve answers with plain text only")

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as ``[{"role", "content"}]`` for the model's chat template."""
        if not self.messages:
            raise InvalidRequestError("messages is empty: give at least one message")
        out = []
        for i, m in enumerate(self.messages):
            role = template_role(m.role)
            if role is None:
                raise InvalidRequestError(f"messages[{i}].role {m.role!r} is not a chat role")
            out.append({"role": role, "content": _text(m.content, i)})
        return out


def _text(content: str | list[_ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(f"messages[{i}]: kvrag serve takes text content only, got a {part.type!r} part")
        parts.append(part.text)
    return "".join(parts)


class CompletionRequest(_GenerationRequest):
    """A ``/v1/completions`` request (one prompt string)."""

    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo or self.suffix or (self.best_of or 1) != 1 or self.logprobs:
            raise InvalidRequestError("echo, suffix, best_of and logprobs are not supported by kvrag serve")

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidRequestError("prompt: give one string (kvrag serve answers one prompt per request)")
        return self.prompt[0]


class DocumentsRequest(BaseModel):
    """A ``/v1/documents`` request: register a corpus (chunk boundaries) and optionally warm its KV."""

    model_config = ConfigDict(extra="forbid")

    documents: list[str]
    warm: bool = False
    order: Literal["given", "similar"] = "given"  # warm's: "similar" for a corpus (each behind its likes)
    # a key: compute the documents' missing KV as speculative idle-time work (a staged search's
    # candidate list); a newer list of the same key cancels the older one
    speculate: str | None = Field(default=None, min_length=1, max_length=256)
    # CRAFT: the documents are one retrieval's results, in rank order: counted once in the tenant's
    # chunk-access table, and answered with the order to put them in ("retrieval" or "frequency";
    # checked by the engine: an unknown name is one 400 listing the valid ones). None: a corpus.
    chunk_order: str | None = None


def figures(generation: Generation, *, model_name: str, conversation_id: str | None) -> dict[str, Any]:
    """The ``kvrag`` extension field: the integrations' metadata keys plus the engine's whole stats."""
    info = call_metadata(generation, model_name=model_name, conversation_id=conversation_id)
    return {**info, "stats": generation.stats.to_dict()}


def usage(generation: Generation) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: chunk hits, exact prefix, conversation."""
    counts = token_counts(generation)
    cached = counts.pop("cache_read")
    return {**counts, "prompt_tokens_details": {"cached_tokens": cached}}


def _head(kind: str, model: str) -> dict[str, Any]:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def chat_response(generation: Generation, *, model: str, extension: dict[str, Any]) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": generation.text},
        "finish_reason": generation.finish_reason,
        "logprobs": None,
    }
    return {**_head("chat.completion", model), "choices": [choice], "usage": usage(generation), "kvrag": extension}


def completion_response(generation: Generation, *, model: str, extension: dict[str, Any]) -> dict[str, Any]:
    """A whole ``text_completion``."""
    choice = {"index": 0, "text": generation.text, "finish_reason": generation.finish_reason, "logprobs": None}
    return {**_head("text_completion", model), "choices": [choice], "usage": usage(generation), "kvrag": extension}


class StreamShape:
    """The chunks of one streamed response, chat (``chat.completion.chunk``) or text (``text_completion``).

    Every chunk shares the response's id, creation time and model. With ``include_usage`` every
    chunk has ``usage: null`` and a last chunk with no choices carries the usage, as OpenAI does.
    """

    def __init__(self, kind: Literal["chat", "text"], *, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self._head = _head("chat.completion.chunk" if kind == "chat" else "text_completion", model)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {**self._head, "choices": choices, **extra}
        if self.include_usage:
            out.setdefault("usage", None)
        return out

    def _choice(self, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.kind == "text":
            return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role (and empty content), as OpenAI's do."""
        return [self._chunk([self._choice("", None, role=True)])] if self.kind == "chat" else []

    def piece(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)])

    def closing(self, generation: Generation, extension: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunk with the finish reason (and kvrag's figures), then the usage chunk if asked for."""
        out = [self._chunk([self._choice(None, generation.finish_reason)], kvrag=extension)]
        if self.include_usage:
            out.append(self._chunk([], usage=usage(generation)))
        return out


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
