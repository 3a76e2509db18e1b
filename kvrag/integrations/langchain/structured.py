"""Tool calls and structured output for :class:`~kvrag.integrations.langchain.KVCachedLLM`.

LangChain messages become the chat template's messages (tool calls and tool results included); a
streamed answer becomes text and ``tool_call_chunks`` (:class:`~kvrag.engine.tools.ToolStream`);
``with_structured_output`` binds a constraint (a JSON schema, any JSON object, or a forced tool call)
and parses what comes back. Formats per model family: :mod:`kvrag.engine.tools`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from kvrag.config import Constraint
from kvrag.engine.tools import ToolCall, ToolFormat, ToolStream, closed
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import template_role

__all__ = ["to_chat_messages", "tool_chunks", "structured_runnable", "closed", "STRUCTURED_METHODS"]

#: The methods of ``with_structured_output``.
STRUCTURED_METHODS = ("json_schema", "function_calling", "json_mode")
_CALL_BLOCKS = ("tool_use", "tool_call", "function_call")  # tool calls written as content blocks


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(message, AIMessage) and isinstance(block, dict) and block.get("type") in _CALL_BLOCKS:
            continue  # the same call is in message.tool_calls, rendered from there
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequestError(f"KVCachedLLM takes text messages only; got a {kind!r} content block")
    return "".join(parts)


def to_chat_messages(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the chat template's messages: ``{"role", "content"}``, plus ``tool_calls`` on
    an assistant turn that made calls and ``tool_call_id``/``name`` on a tool result."""
    out = []
    for m in messages:
        role = m.role if m.type == "chat" else template_role(m.type)  # type: ignore[attr-defined]
        if role is None:
            raise InvalidRequestError(f"unsupported message type {m.type!r}")
        entry: dict[str, Any] = {"role": role, "content": _text(m)}
        if isinstance(m, AIMessage) and m.tool_calls:
            entry["tool_calls"] = [
                ToolCall(c["name"], dict(c["args"]), c.get("id") or f"call_{i}").to_template()
                for i, c in enumerate(m.tool_calls)
            ]
        elif isinstance(m, ToolMessage):
            entry["tool_call_id"] = m.tool_call_id
            if m.name:
                entry["name"] = m.name
        out.append(entry)
    return out


def tool_chunks(pieces: Iterator[tuple[str, Any]], fmt: ToolFormat | None) -> Iterator[tuple[AIMessageChunk, Any]]:
    """Text pieces as message chunks, tool calls as ``tool_call_chunks`` (one chunk per call, its
    arguments whole); ``(chunk, info)`` pairs, ``info`` the last piece's metadata (else None). Calls a
    kvrag server parsed (``base_url=``) come in that metadata's ``tool_calls``."""
    stream = ToolStream(fmt) if fmt is not None else None
    index = 0

    def chunk(text: str, calls: list[ToolCall]) -> AIMessageChunk:
        nonlocal index
        tcc = []
        for call in calls:
            tcc.append({"name": call.name, "args": json.dumps(call.arguments), "id": call.id, "index": index})
            index += 1
        return AIMessageChunk(content=text, tool_call_chunks=tcc)

    for text, info in pieces:
        if info is not None:
            if stream is not None:
                rest, calls = stream.finish()
                if rest or calls:
                    yield chunk(rest, calls), None
            served = info.pop("tool_calls", None)
            if served:
                yield chunk("", served), None
            yield None, info
        elif stream is None:
            if text:
                yield AIMessageChunk(content=text), None
        else:
            shown, calls = stream.feed(text)
            if shown or calls:
                yield chunk(shown, calls), None


def _schema_parser(schema: Any) -> tuple[dict, Runnable]:
    """The JSON schema of ``schema`` (a pydantic class, v2 or v1, a TypedDict, a JSON schema dict) and its parser."""
    if is_basemodel_subclass(schema):
        json_schema = schema.model_json_schema() if hasattr(schema, "model_json_schema") else schema.schema()
        return json_schema, PydanticOutputParser(pydantic_object=schema)
    return convert_to_json_schema(schema), JsonOutputParser()


def structured_runnable(
    llm: Any,
    schema: Any,
    method: str,
    include_raw: bool,
    bind_tools: Callable[..., Runnable],
    strict: bool | None = None,
) -> Runnable:
    """The runnable of ``with_structured_output``: ``llm`` bound to a constraint, then the parser. Object
    schemas are :func:`closed` unless ``strict=False``."""
    if method not in STRUCTURED_METHODS:
        raise InvalidRequestError(f"method must be one of {', '.join(STRUCTURED_METHODS)}, got {method!r}")
    if schema is None and method != "json_mode":
        raise InvalidRequestError(f"with_structured_output(method={method!r}) needs a schema")
    trace = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
    if method == "function_calling":
        tool = convert_to_openai_tool(schema)
        if strict is not False:
            tool["function"]["parameters"] = closed(tool["function"].get("parameters") or {"type": "object"})
        name = tool["function"]["name"]
        bound = bind_tools([tool], tool_choice=name, **trace)
        if is_basemodel_subclass(schema):
            parser: Runnable = PydanticToolsParser(tools=[schema], first_tool_only=True)
        else:
            parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    elif method == "json_mode":
        parser = _schema_parser(schema)[1] if schema is not None else JsonOutputParser()
        if schema is None:
            trace = {}
        bound = llm.bind(constraint=Constraint.json_object(), **trace)
    else:
        json_schema, parser = _schema_parser(schema)
        json_schema = json_schema if strict is False else closed(json_schema)
        bound = llm.bind(constraint=Constraint.json_schema(json_schema), **trace)
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def tool_choice_of(tools: Sequence[dict], choice: Any) -> Any:
    """``tool_choice`` checked against the tools at bind time (a name must be one of them)."""
    names = [t["function"]["name"] for t in tools]
    if choice is True:
        if len(names) != 1:
            raise InvalidRequestError("tool_choice=True needs exactly one tool")
        return names[0]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
    elif isinstance(choice, str) and choice not in ("auto", "none", "any", "required"):
        name = choice
    else:
        return choice
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
    return choice
