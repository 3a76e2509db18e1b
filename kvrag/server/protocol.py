"""OpenAI's request and response shapes as ``kvrag serve`` reads and writes them, with kvrag's extensions.

Requests: the fields of OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` that a text-only
engine can honour, plus kvrag's extension fields (:data:`EXTENSION_FIELDS`): ``documents`` (the
chunks; below), ``mode``, ``recompute_ratio``, ``selection``, ``quality``, ``conversation_id``,
``dedup``, ``speculate`` (a key: prefill this request ahead instead of answering it;
:mod:`kvrag.server.app`). A field the server does not know is refused (400 naming it), and so is an
OpenAI field that asks for what kvrag does not do (:data:`NOT_SUPPORTED`: log-probabilities,
``n > 1``, legacy ``functions``, ...); fields that ask for nothing (``user``, ``metadata``, a zero penalty, ``n=1``) are
accepted. A client never silently gets less than it asked for.

``documents`` takes two shapes, mixed freely:

- a string: kvrag's extension (also accepted as ``kvrag_documents``, its own name): a text of the
  prompt that is a chunk, registered with the engine before the request is planned (and kept in
  its bounded registry of chunk boundaries as ``/v1/documents`` keeps them; boundaries only, the
  KV stays in the tenant's namespace);
- ``{"title", "text"}``: vLLM's shape, handed to the model's chat template (which places it in the
  prompt) and registered as a chunk too; a template that does not place it is refused (400).

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
from kvrag.config import Constraint
from kvrag.engine import Generation
from kvrag.engine.options import OPTION_DOCS, REUSE_OPTIONS, RequestOptions
from kvrag.engine.tools import ToolFormat
from kvrag.errors import InvalidRequestError
from kvrag.server.structured import (
    ResponseFormat,
    Tool,
    ToolCallIn,
    ToolChoice,
    ToolDeltas,
    parsed_message,
    response_constraint,
    template_tool_calls,
)

__all__ = [
    "EXTENSION_FIELDS",
    "NOT_SUPPORTED",
    "ChatRequest",
    "CompletionRequest",
    "DocumentsRequest",
    "figures",
    "usage",
    "chat_response",
    "completion_response",
    "StreamShape",
    "Document",
    "check_supported",
]

#: kvrag's fields on an OpenAI request (all optional; ``None`` = the server engine's default): the
#: documents, the engine's reuse options (:data:`kvrag.engine.options.REUSE_OPTIONS`), a speculation key.
EXTENSION_FIELDS = ("documents", "kvrag_documents", *REUSE_OPTIONS, "speculate")

#: OpenAI fields kvrag serve parses but does not do: field -> (the values that ask for nothing, what it
#: would ask for). A request giving another value is refused naming the field. ``response_format``,
#: ``tools`` and ``tool_choice`` are done (:mod:`kvrag.server.structured`); log-probabilities are not: the
#: sampler keeps none (it samples from masked, tempered logits and keeps only the token).
NOT_SUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "one choice per request (n=1)"),
    "presence_penalty": ((None, 0, 0.0), "penalties (leave it unset or 0)"),
    "frequency_penalty": ((None, 0, 0.0), "penalties (leave it unset or 0)"),
    "logit_bias": ((None, {}), "logit biases"),
    "logprobs": ((None, False, 0), "log-probabilities"),
    "top_logprobs": ((None, 0), "log-probabilities"),
    "functions": ((None, []), "legacy functions (give tools)"),
    "function_call": ((None, "none"), "legacy functions (give tools and tool_choice)"),
    "echo": ((None, False), "echo"),
    "suffix": ((None, ""), "suffix"),
    "best_of": ((None, 1), "best_of"),
}


def check_supported(body: BaseModel) -> None:
    """Refuse an OpenAI field set to something kvrag does not do (:data:`NOT_SUPPORTED`)."""
    for name, (neutral, what) in NOT_SUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise InvalidRequestError(f"{name}={value!r}: kvrag serve does not do {what}")


class Document(BaseModel):
    """vLLM's document shape: a text the chat template places in the prompt, with its title."""

    model_config = ConfigDict(extra="forbid")

    title: str | None = None
    text: str


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _GenerationRequest(ReuseFields):
    """The fields both completion endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    max_tokens: int | None = Field(default=None, ge=0, description="Default: the rest of the context window.")
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = Field(default=None, description=OPTION_DOCS["ignore_eos"])  # vLLM's too
    stream: bool = False
    stream_options: _StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = Field(
        default=None, description="json_schema or json_object: decoding is constrained to it (kvrag.server.structured)."
    )
    # kvrag's extensions: the engine's reuse options (ReuseFields), a conversation, documents, a speculation key
    conversation_id: str | None = Field(default=None, description=OPTION_DOCS["conversation_id"])
    documents: list[str | Document] | None = Field(
        default=None,
        description="Chunks of the prompt: texts in it (kvrag), or {title, text} objects the chat template "
        "places (vLLM); their KV is reused when cached.",
    )
    kvrag_documents: list[str] | None = Field(
        default=None, description="kvrag's name for string documents: texts of the prompt that are chunks."
    )
    speculate: str | None = Field(default=None, min_length=1, max_length=256)

    def check_supported(self) -> None:
        """Reject what kvrag cannot do rather than ignore it."""
        check_supported(self)

    def chunk_texts(self) -> list[str]:
        """Every document's text (both fields, both shapes), in the order given."""
        given = [*(self.kvrag_documents or ()), *(self.documents or ())]
        return [d.text if isinstance(d, Document) else d for d in given]

    def template_documents(self) -> list[dict[str, str]]:
        """vLLM-shaped documents, for the chat template."""
        return [d.model_dump(exclude_none=True) for d in self.documents or () if isinstance(d, Document)]

    @property
    def max_new_tokens(self) -> int | None:
        """``max_tokens`` (or ``max_completion_tokens``, its newer name); ``None`` when not given."""
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise InvalidRequestError("max_tokens and max_completion_tokens are one setting; give one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def constraint(self) -> Constraint | None:
        """The constraint ``response_format`` asks for (None: plain text)."""
        return response_constraint(self.response_format)

    def engine_options(
        self, namespace: str | None = None, max_new_tokens: int | None = None, constraint: Constraint | None = None
    ) -> RequestOptions:
        """The request's :class:`~kvrag.RequestOptions` for tenant ``namespace``; unset = the engine's
        default (``max_new_tokens``: what the server resolved the request's ``max_tokens`` to;
        ``constraint``: the one the server resolved from ``response_format`` or a forced tool call)."""
        return RequestOptions(
            constraint=constraint,
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop or None,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            namespace=namespace,
            **{name: getattr(self, name) for name in REUSE_OPTIONS},
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(default=None, description="A tool turn's answer: the call it answers.")


class ChatRequest(_GenerationRequest):
    """A ``/v1/chat/completions`` request (text messages, tools)."""

    messages: list[_Message]
    tools: list[Tool] | None = Field(default=None, description="Function tools, rendered by the model's template.")
    tool_choice: ToolChoice | None = Field(
        default=None, description='"auto" (the default with tools), "none", "required", or a named function.'
    )
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the model's chat template reads them: ``{"role", "content"}``, plus an assistant
        turn's ``tool_calls`` (arguments as dicts) and a tool turn's ``tool_call_id`` and ``name``."""
        if not self.messages:
            raise InvalidRequestError("messages is empty: give at least one message")
        out = []
        for i, m in enumerate(self.messages):
            role = template_role(m.role)
            if role is None:
                raise InvalidRequestError(f"messages[{i}].role {m.role!r} is not a chat role")
            entry: dict[str, Any] = {"role": role, "content": _text(m.content, i)}
            if m.tool_calls:
                if role != "assistant":
                    raise InvalidRequestError(f"messages[{i}]: only an assistant message carries tool_calls")
                entry["tool_calls"] = template_tool_calls(m.tool_calls, f"messages[{i}]")
            if m.tool_call_id is not None:
                if role != "tool":
                    raise InvalidRequestError(f"messages[{i}]: only a tool message carries tool_call_id")
                entry["tool_call_id"] = m.tool_call_id
            if role == "tool" and m.name is not None:
                entry["name"] = m.name
            out.append(entry)
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
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

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


def chat_response(
    generation: Generation, *, model: str, extension: dict[str, Any], tools: ToolFormat | None = None
) -> dict[str, Any]:
    """A whole ``chat.completion``; with ``tools`` (the model's format) the answer's calls are parsed into
    ``message.tool_calls`` (``content`` the text left, null when none; ``finish_reason`` ``tool_calls``)."""
    message, called = parsed_message(generation.text, tools)
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if called else generation.finish_reason,
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

    def __init__(
        self, kind: Literal["chat", "text"], *, model: str, include_usage: bool, tools: ToolFormat | None = None
    ) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self._tools = ToolDeltas(tools) if tools is not None else None
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
        return self._delta(delta, finish_reason)

    @staticmethod
    def _delta(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role (and empty content), as OpenAI's do."""
        return [self._chunk([self._choice("", None, role=True)])] if self.kind == "chat" else []

    def pieces(self, text: str) -> list[dict[str, Any]]:
        """The chunks of one piece of the answer: its text, or (with tools) the text shown and the calls
        completed (none while text that may start a call is held back)."""
        if self._tools is None:
            return [self._chunk([self._choice(text, None)])]
        return [self._chunk([self._delta(d)]) for d in self._tools.feed(text)]

    def closing(self, generation: Generation, extension: dict[str, Any]) -> list[dict[str, Any]]:
        """What was held back, the chunk with the finish reason (and kvrag's figures), then the usage
        chunk if asked for. An answer that made calls finishes with ``tool_calls``."""
        reason = generation.finish_reason
        out = []
        if self._tools is not None:
            out = [self._chunk([self._delta(d)]) for d in self._tools.finish()]
            reason = "tool_calls" if self._tools.calls else reason
        out.append(self._chunk([self._choice(None, reason)], kvrag=extension))
        if self.include_usage:
            out.append(self._chunk([], usage=usage(generation)))
        return out
