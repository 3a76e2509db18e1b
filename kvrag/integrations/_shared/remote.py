"""What a call sends (:class:`Prompt`), and the server an LLM with ``base_url=`` calls instead of an engine.

An embedded LLM renders its prompt with the engine's chat template and finds registered documents
in the result. An LLM with ``base_url`` sends chat messages to the server (which renders them with
the same template) or a finished prompt string, and registers nothing up front: the documents
recorded for it (by retrievers, node postprocessors, ``register_documents``) are kept here and
sent with each request whose prompt holds them (the request's ``documents`` field). The server's
answer carries the engine's figures, so the call's metadata has the same keys either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrag.engine.reuse.access import check_chunk_order
from kvrag.engine.reuse.documents import DocumentFinder
from kvrag.engine.serving.requests import check_chunks
from kvrag.engine.types import GenerationStream, WarmResult

if TYPE_CHECKING:
    from kvrag.client import Client
    from kvrag.engine import Engine

__all__ = ["Prompt", "ServerDocuments"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A call's prompt: chat messages (rendered with the model's chat template) or a string used as is.

    Build it with :meth:`chat` or :meth:`plain`.
    """

    messages: tuple[Mapping[str, Any], ...] | None = None
    text: str | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None

    @classmethod
    def chat(
        cls,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> Prompt:
        """``[{"role", "content"}]`` messages, roles as chat templates know them (an assistant turn may
        carry ``tool_calls``, a ``tool`` turn its ``tool_call_id``), and the ``tools`` the template
        renders (OpenAI function schemas; :mod:`kvrag.engine.tools`). ``tool_choice`` is sent to a server
        with the tools (it forces the call there); an embedded engine gets it as a constraint instead."""
        return cls(messages=tuple(messages), tools=tuple(tools) if tools else None, tool_choice=tool_choice)

    @classmethod
    def plain(cls, text: str) -> Prompt:
        return cls(text=text)

    def render(self, engine: Engine) -> str:
        """The prompt string the engine reads."""
        if self.messages is None:
            return self.text or ""
        messages = [dict(m) for m in self.messages]
        if self.tools:
            return engine.apply_chat_template(messages, tools=[dict(t) for t in self.tools])
        return engine.apply_chat_template(messages)

    def texts(self) -> list[str]:
        """What the prompt is made of, where documents are looked for."""
        return [self.text or ""] if self.messages is None else [m["content"] for m in self.messages]


class ServerDocuments:
    """An LLM's link to a kvrag server: its client and the documents recorded for it.

    Has the registration calls of an :class:`~kvrag.Engine` (``register``, ``warm``), so that
    retrievers and node postprocessors record documents for either kind of LLM alike.

    Args:
        client: the server's client.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.documents = DocumentFinder()  # the engine's own matcher: the same texts count as documents

    def register(self, texts: Sequence[str]) -> list[str]:
        """Record texts, sent later with the requests whose prompt holds them; their content ids."""
        return self.documents.register(check_chunks(texts))

    def warm(self, texts: Sequence[str], *, order: str = "given", embeddings=None) -> WarmResult:
        """Record texts and have the server register them and compute their KV now (``order`` as
        :meth:`kvrag.Engine.warm`'s; the server orders by its own lexical similarity: ``embeddings``
        are not sent)."""
        self.register(texts)
        return self.client.warm(check_chunks(texts), order=order)

    def record_retrieval(self, documents: Sequence, *, order: str = "retrieval") -> list[int]:
        """Count one retrieval on the server and get its prompt order (:meth:`kvrag.Engine.record_retrieval`).

        One round trip per retrieval, whatever the order: the server counts it in this client's
        tenant's table, so promotion (``promotion_threshold``) gates the server's refresh as it
        gates an embedded engine's, and the two answer alike. A document given as several forms is
        sent as its first.
        """
        check_chunk_order(order)
        texts = [d if isinstance(d, str) else next(iter(d)) for d in documents]
        self.register(texts)
        return self.client.record_retrieval(texts, order=order)

    def found(self, prompt: Prompt) -> list[str]:
        """The recorded texts that occur in the prompt, once each, in order."""
        out: dict[str, None] = {}
        for text in prompt.texts():
            for start, end in self.documents.find(text):
                out.setdefault(text[start:end])
        return list(out)

    def stream(self, prompt: Prompt, *, model: str | None, options: Mapping[str, Any]) -> GenerationStream:
        """Start a streamed request on the server (validated there before this returns). A chat's tools
        are rendered, forced and parsed by the server: the calls come in the stream's final
        :class:`~kvrag.client.wire.ServedGeneration`."""
        documents = self.found(prompt) or None
        model = model if model is not None else self.client.model
        if prompt.messages is not None:
            messages = [dict(m) for m in prompt.messages]
            if prompt.tools:
                options = {**options, "tools": [dict(t) for t in prompt.tools], "tool_choice": prompt.tool_choice}
            return self.client.stream_chat(messages, documents=documents, model=model, **options)
        return self.client.stream_complete(prompt.text or "", documents=documents, model=model, **options)

    def model_name(self) -> str:
        """The served model's name (asked once)."""
        return self.client.model_card()["id"]
