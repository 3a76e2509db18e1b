"""Tool calls for LlamaIndex's :class:`~kvrag.integrations.llama_index.KVCachedLLM` (a ``FunctionCallingLLM``).

LlamaIndex chat messages become the chat template's messages (an assistant turn's calls, from
``additional_kwargs["tool_calls"]`` or ``ToolCallBlock``\\ s; a ``tool`` turn's ``tool_call_id``), and the
model's answer becomes text plus calls, kept in the response message's ``additional_kwargs["tool_calls"]``
(``[{"id", "name", "arguments"}]``) where :func:`tool_selections` reads them. Formats per model family:
:mod:`kvrag.engine.tools`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from kvrag.engine.tools import ToolCall
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import template_role

__all__ = ["template_message", "calls_metadata", "tool_selections", "openai_tools"]


def _calls_of(message: ChatMessage) -> list[ToolCall]:
    calls = []
    for c in message.additional_kwargs.get("tool_calls") or []:
        fn = c.get("function", c)  # ours, or OpenAI's shape
        calls.append(ToolCall(fn["name"], dict(fn.get("arguments") or {}), c.get("id") or f"call_{len(calls)}"))
    for block in message.blocks:
        if isinstance(block, ToolCallBlock) and isinstance(block.tool_kwargs, dict):
            calls.append(ToolCall(block.tool_name, dict(block.tool_kwargs), block.tool_call_id or f"call_{len(calls)}"))
    return calls


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex chat message as the chat template's message (tool calls and tool results included)."""
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    texts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, ToolCallBlock):
            raise InvalidRequestError(f"KVCachedLLM takes text messages only (got a {type(block).__name__})")
    entry: dict[str, Any] = {"role": template_role(role) or role, "content": "\n".join(texts)}
    calls = _calls_of(message)
    if calls:
        entry["tool_calls"] = [c.to_template() for c in calls]
    if entry["role"] == "tool" and message.additional_kwargs.get("tool_call_id"):
        entry["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return entry


def calls_metadata(calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The ``additional_kwargs`` of a response message that made ``calls`` (empty if none)."""
    return {"tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]} if calls else {}


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """The calls of a chat response as LlamaIndex's ``ToolSelection``\\ s."""
    calls = _calls_of(response.message)
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected at least one tool call, got none; the model answered {response.message.content!r}")
    return [ToolSelection(tool_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls]


def openai_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """LlamaIndex tools as OpenAI function schemas (what chat templates render)."""
    return [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
