"""The per-request :class:`~kvrag.server.settings.Limits` checked on a parsed request, before the
engine sees it: stop strings, documents, messages, and the prompt's bytes before it is split at
documents. Each refusal is a :class:`~kvrag.server.settings.LimitError` naming the limit. Texts
that are not valid Unicode (a lone surrogate, which JSON can spell) are refused here too, so the
engine only ever hashes text it can encode.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvrag.errors import InvalidRequestError
from kvrag.server.settings import LimitError, Limits

__all__ = ["check_id", "utf8_size", "check_stop", "check_documents", "check_messages", "check_prompt"]


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Longest id a client may give (a conversation, a speculation key).
MAX_ID_CHARS = 256


def check_id(value: str | None, param: str) -> None:
    """A client's id (``conversation_id``, a speculation key): 1 to 256 printable characters, so that no
    id can spell another tenant's key."""
    if value is not None and (not value or len(value) > MAX_ID_CHARS or _CONTROL.search(value)):
        raise InvalidRequestError(f"{param}: an id is 1 to {MAX_ID_CHARS} characters, none of them a control character")
    if value is not None:
        utf8_size(value, param)


def utf8_size(text: str, where: str) -> int:
    """Bytes of ``text`` in UTF-8; a text that has none (a lone surrogate) is refused naming ``where``."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{where}: not valid Unicode text ({exc.reason} at {exc.start})") from None


def check_stop(stop: str | Sequence[str] | None, limits: Limits) -> None:
    """At most ``max_stop_strings`` stop strings of at most ``max_stop_chars`` characters each."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop_strings:
        raise LimitError(
            f"stop: {len(stops)} stop strings, more than {limits.max_stop_strings}",
            limit="max_stop_strings",
            param="stop",
        )
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            raise LimitError(
                f"stop[{i}]: {len(s)} characters, more than {limits.max_stop_chars}",
                limit="max_stop_chars",
                param="stop",
            )
        utf8_size(s, f"stop[{i}]")


def check_documents(texts: Sequence[str], limits: Limits, param: str = "documents") -> None:
    """At most ``max_documents`` documents of at most ``max_document_bytes`` each."""
    if len(texts) > limits.max_documents:
        raise LimitError(
            f"{param}: {len(texts)} documents, more than {limits.max_documents}", limit="max_documents", param=param
        )
    for i, text in enumerate(texts):
        size = utf8_size(text, f"{param}[{i}]")
        if size > limits.max_document_bytes:
            raise LimitError(
                f"{param}[{i}]: {size} bytes, more than {limits.max_document_bytes}",
                limit="max_document_bytes",
                param=param,
            )


def check_messages(messages: Sequence[dict[str, str]], limits: Limits) -> None:
    """At most ``max_messages`` messages of at most ``max_message_bytes`` each."""
    if len(messages) > limits.max_messages:
        raise LimitError(
            f"messages: {len(messages)} messages, more than {limits.max_messages}",
            limit="max_messages",
            param="messages",
        )
    for i, m in enumerate(messages):
        size = utf8_size(m["content"], f"messages[{i}].content")
        if size > limits.max_message_bytes:
            raise LimitError(
                f"messages[{i}]: {size} bytes, more than {limits.max_message_bytes}",
                limit="max_message_bytes",
                param="messages",
            )


def check_prompt(prompt: str, limits: Limits, param: str = "prompt") -> None:
    """The prompt (a chat's rendered by its template) holds at most ``max_prompt_bytes``."""
    size = utf8_size(prompt, param)
    if size > limits.max_prompt_bytes:
        raise LimitError(
            f"{param}: {size} bytes, more than {limits.max_prompt_bytes}", limit="max_prompt_bytes", param=param
        )
