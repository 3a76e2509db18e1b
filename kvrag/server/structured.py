"""Structured output and tool calls on ``kvrag serve``, in OpenAI's shapes (as vLLM's server reads them).

- ``response_format`` (chat and text completions): ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` constrains decoding to the schema (:meth:`~kvrag.Constraint.json_schema`; ``strict``
  also closes its objects, :func:`~kvrag.engine.tools.closed`), ``{"type": "json_object"}`` to one JSON
  object, ``{"type": "text"}`` to nothing.
- ``tools`` and ``tool_choice`` (chat): the tools are rendered by the model's own chat template, the
  answer is parsed in its family's format (:mod:`kvrag.engine.tools`) into ``message.tool_calls``
  (``delta.tool_calls`` when streamed), and ``"required"`` or a named function forces one call with
  the family's grammar. ``"none"`` renders no tools.

A request's constraint is compiled before any work: a bad schema is one 400 naming ``response_format``
(:class:`FieldError`), a model whose template renders no tools a 400 naming ``tools``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrag.config import Constraint
from kvrag.engine.tools import (
    ToolCall,
    ToolFormat,
    ToolStream,
    closed,
    engine_tool_format,
    parse_tool_calls,
    tool_request,
)
from kvrag.errors import InvalidRequestError, UnsupportedModelError

__all__ = [
    "FieldError",
    "ResponseFormat",
    "Tool",
    "ToolChoice",
    "ToolCallIn",
    "ToolPlan",
    "ToolDeltas",
    "response_constraint",
    "tool_plan",
    "check_constraint",
    "template_tool_calls",
    "tool_calls_out",
    "parsed_message",
    "one_constraint",
    "renders_tools",
]


class FieldError(InvalidRequestError):
    """A request field the server cannot honour as given (HTTP 400 with ``param`` the field)."""

    def __init__(self, message: str, *, param: str) -> None:
        self.param = param
        super().__init__(message)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _TextFormat(_Closed):
    type: Literal["text"]


class _JsonObjectFormat(_Closed):
    type: Literal["json_object"]


class _JsonSchema(_Closed):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON schema the answer must match.")
    strict: bool | None = Field(default=None, description="Also close the schema's objects (no extra keys).")


class _JsonSchemaFormat(_Closed):
    type: Literal["json_schema"]
    json_schema: _JsonSchema


#: OpenAI's ``response_format``, one of three shapes told apart by ``type``.
ResponseFormat = Annotated[_TextFormat | _JsonObjectFormat | _JsonSchemaFormat, Field(discriminator="type")]


class _Function(_Closed):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Closed):
    """An OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: _Function


class _ChoiceFunction(_Closed):
    name: str = Field(min_length=1, max_length=64)


class _NamedChoice(_Closed):
    type: Literal["function"]
    function: _ChoiceFunction


#: ``tool_choice``: ``"none"`` (no tools rendered), ``"auto"`` (the model decides), ``"required"`` (one
#: call to any tool, forced), or ``{"type": "function", "function": {"name"}}`` (a call to that tool, forced).
ToolChoice = Literal["none", "auto", "required"] | _NamedChoice


class _CallFunction(_Closed):
    name: str = Field(min_length=1)
    arguments: str = Field(description="The arguments as a JSON object's text, as OpenAI writes them.")


class ToolCallIn(_Closed):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: _CallFunction


def template_tool_calls(calls: list[ToolCallIn], where: str) -> list[dict[str, Any]]:
    """Earlier calls as chat templates read them: the arguments a dict, not JSON text (as vLLM renders them)."""
    out = []
    for j, call in enumerate(calls):
        try:
            args = json.loads(call.function.arguments)
        except ValueError as e:
            raise FieldError(f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}", param="messages") from None
        if not isinstance(args, dict):
            raise FieldError(f"{where}.tool_calls[{j}].function.arguments is not a JSON object", param="messages")
        out.append(ToolCall(call.function.name, args, call.id).to_template())
    return out


def response_constraint(response_format: Any) -> Constraint | None:
    """The constraint ``response_format`` asks for (None: plain text)."""
    if response_format is None or isinstance(response_format, _TextFormat):
        return None
    if isinstance(response_format, _JsonObjectFormat):
        return Constraint.json_object()
    spec = response_format.json_schema
    schema = closed(spec.json_schema) if spec.strict else spec.json_schema
    try:
        return Constraint.json_schema(schema)
    except InvalidRequestError as e:
        raise FieldError(f"response_format: {e}", param="response_format") from None


def check_constraint(engine, constraint: Constraint | None, param: str) -> None:
    """Compile ``constraint`` for the engine's tokenizer now (before any work): a 400 naming ``param`` if
    it does not compile (a schema that is not one, a feature the grammar library lacks)."""
    if constraint is None:
        return
    try:
        engine.requests.grammars.check(constraint)
    except InvalidRequestError as e:
        raise FieldError(f"{param}: {e}", param=param) from None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools as the engine takes them: the model's format, the tools (OpenAI function
    schemas, for the template) and the constraint of a forced call (None: the model decides)."""

    fmt: ToolFormat
    tools: list[dict[str, Any]]
    constraint: Constraint | None


def tool_plan(engine, tools: list[Tool] | None, choice: Any) -> ToolPlan | None:
    """What ``tools`` and ``tool_choice`` ask of ``engine``; None when no tool is to be rendered."""
    if choice is not None and not tools:
        raise FieldError("tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    raw_choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
    try:
        fmt, checked, forced = tool_request(engine, [t.model_dump(exclude_none=True) for t in tools], raw_choice)
    except UnsupportedModelError as e:
        raise FieldError(f"tools: {e}", param="tools") from None
    except InvalidRequestError as e:  # a named tool that is not among them
        raise FieldError(f"tool_choice: {e}", param="tool_choice") from None
    return ToolPlan(fmt, checked, forced)


def one_constraint(asked: Constraint | None, plan: ToolPlan | None) -> Constraint | None:
    """A request's one constraint: ``response_format``'s (``asked``) or a forced tool call's, not both."""
    if plan is None or plan.constraint is None:
        return asked
    if asked is not None:
        raise FieldError(
            "response_format and a forced tool call (tool_choice) both constrain the answer: give one",
            param="response_format",
        )
    return plan.constraint


def renders_tools(engine) -> bool:
    """Whether the model's chat template renders tools (the model card says it; ``tools`` are refused otherwise)."""
    try:
        engine_tool_format(engine)
    except UnsupportedModelError:
        return False
    return True


def tool_calls_out(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in OpenAI's answer shape (``arguments`` as JSON text)."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ]


def parsed_message(text: str, fmt: ToolFormat | None) -> tuple[dict[str, Any], bool]:
    """An answer's ``message`` (content left, ``tool_calls``) and whether it made calls."""
    if fmt is None:
        return {"role": "assistant", "content": text}, False
    content, calls = parse_tool_calls(text, fmt)
    if not calls:
        return {"role": "assistant", "content": content}, False
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls_out(calls)}, True


class ToolDeltas:
    """A streamed answer's text split into content and ``delta.tool_calls`` (OpenAI's streaming shape:
    per call, a delta with its ``index``, ``id``, ``type`` and ``function.name``, then one with its
    ``function.arguments``), with :class:`~kvrag.engine.tools.ToolStream` holding back text that may start a call.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self._stream = ToolStream(fmt)
        self.calls = 0

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas a piece of the answer makes (none while text is held back)."""
        return self._deltas(*self._stream.feed(piece))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back when the answer ended."""
        return self._deltas(*self._stream.finish())

    def _deltas(self, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": text}] if text else []
        for call in calls:
            head = {
                "index": self.calls,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            args = {"index": self.calls, "function": {"arguments": json.dumps(call.arguments)}}
            out += [{"tool_calls": [head]}, {"tool_calls": [args]}]
            self.calls += 1
        return out
