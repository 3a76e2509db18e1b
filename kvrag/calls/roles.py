"""Chat roles as chat templates know them, from the names frameworks and clients give them."""

from __future__ import annotations

__all__ = ["template_role"]

# Message roles and types of LangChain, LlamaIndex and OpenAI's API, as the roles chat templates know.
_TEMPLATE_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "chatbot": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
}


def template_role(role: str) -> str | None:
    """The chat-template role of a framework's message role or type (``human`` -> ``user``); None if unknown."""
    return _TEMPLATE_ROLES.get(role)
