"""Tool calls in chat templates, one table entry per format: how a model family's chat template
renders tools and marks a call, how the model's text becomes calls, and the grammar that forces one.

========== ============ ============================================== =====================================
format     families     a call in the model's text                     the template renders tools if it
========== ============ ============================================== =====================================
qwen       qwen2, qwen3 ``<tool_call>\\n{"name", "arguments"}\\n``       holds ``<tool_call>`` (Qwen2.5,
                        ``</tool_call>``, one or several               Qwen2.5-Coder, Qwen3)
llama3     llama        ``{"name", "parameters"}`` (after an optional  holds "Given the following functions"
                        ``<|python_tag|>``), ``;`` between calls       (Llama 3.1 / 3.2 / 3.3)
mistral    mistral      ``[TOOL_CALLS][{"name", "arguments"}, ...]``   holds ``[TOOL_CALLS]``
========== ============ ============================================== =====================================

Gemma 3 has no entry (its template has no tool role), and a template without the format's marker
(SmolLM2, a Llama-family model whose template ignores ``tools``) does not render tools:
:func:`tool_format` says so rather than letting a model answer without ever seeing the tools.

Messages for :func:`render_chat` are transformers' chat messages: an assistant turn may carry
``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": {...}}}]``), a ``tool``
turn its ``tool_call_id`` and ``name``; ``tools`` are OpenAI function schemas
(``{"type": "function", "function": {"name", "description", "parameters"}}``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrag.config import Constraint
from kvrag.engine.model.families import family_of
from kvrag.engine.model.grammar import JSON_LAYOUT
from kvrag.errors import InvalidRequestError, UnsupportedModelError

__all__ = [
    "ToolCall",
    "ToolFormat",
    "TOOL_FORMATS",
    "ToolStream",
    "tool_format",
    "render_chat",
    "parse_tool_calls",
    "forced_call",
    "check_tools",
    "added_tokens",
    "engine_tool_format",
    "tool_request",
    "closed",
]

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments, an id that the tool's answer refers to."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates read an assistant message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one family of chat templates marks tool calls.

    Attributes:
        name: the format's name in messages.
        families: kvrag model families (:mod:`kvrag.engine.model.families`) whose templates may use it.
        marker: text a chat template holds when it renders tools in this format.
        open: text before a call's JSON (``""``: the JSON stands alone, the whole answer).
        close: text after a call's JSON (``""``: none).
        args_key: the key of the arguments in a call's JSON (``arguments`` or ``parameters``).
        optional_open: text the model may put before the calls, dropped (Llama's ``<|python_tag|>``).
        array: the calls come as one JSON array after ``open`` (Mistral) rather than one object each.
        separator: text between two calls in the forcing grammar (and accepted between them when parsing).
    """

    name: str
    families: tuple[str, ...]
    marker: str
    open: str
    close: str
    args_key: str
    optional_open: str = ""
    array: bool = False
    separator: str = "\n"

    def call_schema(self, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> dict[str, Any]:
        """The JSON schema of one call to one of ``tools`` (to ``name`` only, if given); the arguments'
        objects :func:`closed` (no key the tool does not name)."""
        options = []
        for tool in tools:
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            params = closed(fn.get("parameters") or {"type": "object", "properties": {}})
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.args_key: params},
                    "required": ["name", self.args_key],
                    "additionalProperties": False,
                }
            )
        if not options:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools given")
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(
        self, tools: Sequence[Mapping[str, Any]], name: str | None = None, tokens: Mapping[str, int] | None = None
    ) -> str:
        """A Lark grammar (llguidance's dialect) whose language is one call in this format, nothing else.

        ``tokens``: the tokenizer's added tokens (text -> id). A mark that is one of them (Qwen2.5's
        ``<tool_call>``) is written as that token (``<[id]>``): the model emits it as one token, which a
        grammar matching the mark's text would refuse.
        """
        schema = self.call_schema(tools, name)
        if self.array:
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
        parts = [
            *_lark_text(self.open, tokens or {}),
            f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}",
            *_lark_text(self.close, tokens or {}),
        ]
        return "start: " + " ".join(parts)


#: The tool-call formats kvrag parses, one per template family.
TOOL_FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("qwen", ("qwen2", "qwen3"), "<tool_call>", "<tool_call>\n", "\n</tool_call>", "arguments"),
    ToolFormat(
        "llama3",
        ("llama",),
        "Given the following functions",
        "",
        "",
        "parameters",
        optional_open="<|python_tag|>",
        separator="; ",
    ),
    ToolFormat("mistral", ("mistral",), "[TOOL_CALLS]", "[TOOL_CALLS]", "", "arguments", array=True),
)


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say (OpenAI's
    strict mode): a constrained model may then end the object once its properties are written, where an
    open schema lets it add keys until ``max_tokens`` runs out."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):  # maps of schemas
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):  # lists of schemas
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not"):  # one schema
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_format(family: str, chat_template: str | None, *, model_name: str = "the model") -> ToolFormat:
    """The tool-call format of a model family whose chat template is ``chat_template``.

    Raises:
        UnsupportedModelError: the family has no tool format, or its template does not render tools.
    """
    template = chat_template or ""
    for fmt in TOOL_FORMATS:
        if family in fmt.families and fmt.marker in template:
            return fmt
    known = ", ".join(f"{f.name} ({'/'.join(f.families)})" for f in TOOL_FORMATS)
    why = "has no chat template" if not template else "has a chat template that does not render tools"
    raise UnsupportedModelError(
        f"{model_name} ({family} family) {why}: tool calling needs a template of a known tool format: {known}"
    )


def engine_tool_format(engine) -> ToolFormat:
    """:func:`tool_format` of an engine's model."""
    hf_model = getattr(engine, "hf_model", None)
    if hf_model is None:  # a stand-in engine without a transformers model
        raise UnsupportedModelError(f"{engine.model_name} has no model config: its tool format is not known")
    family = family_of(hf_model.config).name
    return tool_format(family, getattr(engine.tokenizer, "chat_template", None), model_name=engine.model_name)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as OpenAI function schemas, each checked (a name, parameters an object schema)."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of function schemas, got {type(tools).__name__}")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f'a tool is {{"type": "function", "function": {{"name", ...}}}}, got {tool!r}')
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
            raise InvalidRequestError(f"tool {fn['name']!r}: parameters must be a JSON object schema")
        out.append({"type": "function", "function": dict(fn)})
    return out


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
    """Render chat messages (and ``tools``, OpenAI function schemas) with the tokenizer's own chat template."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def _lark_text(text: str, tokens: Mapping[str, int]) -> list[str]:
    """``text`` as Lark items: quoted strings, and ``<[id]>`` for the added tokens in it."""
    items, rest = [], text
    while rest:
        hits = [(rest.find(t), t) for t in tokens if t and t in rest]
        if not hits:
            items.append(json.dumps(rest))
            break
        at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at:
            items.append(json.dumps(rest[:at]))
        items.append(f"<[{tokens[token]}]>")
        rest = rest[at + len(token) :]
    return items


def added_tokens(tokenizer) -> dict[str, int]:
    """A tokenizer's added tokens (special or not), text -> id: llguidance matches them as tokens, not text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: int(i) for i, t in decoder.items() if getattr(t, "content", "")}


def forced_call(
    fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], choice: Any, tokens: Mapping[str, int] | None = None
) -> Constraint | None:
    """The constraint a ``tool_choice`` asks for: ``None`` for ``"auto"``/``"none"``/``None`` (free text);
    one call to any tool for ``"any"``/``"required"``/``True``; to one tool for its name or
    ``{"type": "function", "function": {"name": ...}}``. ``tokens``: as for :meth:`ToolFormat.grammar`."""
    if choice in (None, "auto", "none", False):
        return None
    if choice in ("any", "required", True):
        return Constraint.grammar(fmt.grammar(tools, tokens=tokens))
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    else:
        name = choice if isinstance(choice, str) else None
    if not name:
        raise InvalidRequestError(
            f"tool_choice must be 'auto', 'none', 'any', 'required', a tool's name or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
        )
    return Constraint.grammar(fmt.grammar(tools, name, tokens))


def tool_request(engine, tools: Any, choice: Any) -> tuple[ToolFormat, list[dict[str, Any]], Constraint | None]:
    """What a request with ``tools`` needs from an engine: its model's tool format, the tools checked,
    and the constraint ``choice`` asks for (None: free text)."""
    fmt = engine_tool_format(engine)
    tools = check_tools(tools)
    return fmt, tools, forced_call(fmt, tools, choice, added_tokens(engine.tokenizer))


def _as_call(value: Any, fmt: ToolFormat) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(fmt.args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(value["name"], args) if isinstance(args, dict) else None


def _calls_of(value: Any, fmt: ToolFormat) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, fmt) for v in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at ``pos`` (leading whitespace skipped) and where it ends; None if there is none."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _parse_marked(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    content, calls, pos = [], [], 0
    opener = fmt.open.strip()
    closer = fmt.close.strip()
    while True:
        start = text.find(opener, pos)
        if start < 0:
            content.append(text[pos:])
            break
        decoded = _decode_at(text, start + len(opener))
        found = _calls_of(decoded[0], fmt) if decoded else None
        if found is None:  # not a call after all: keep it as text
            content.append(text[pos : start + len(opener)])
            pos = start + len(opener)
            continue
        end = decoded[1]
        rest = text[end:]
        if closer and rest.lstrip().startswith(closer):
            end += len(rest) - len(rest.lstrip()) + len(closer)
        content.append(text[pos:start])
        calls.extend(found)
        pos = end
    return "".join(content).strip() if calls else "".join(content), calls


def _parse_bare(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if fmt.optional_open and body.startswith(fmt.optional_open):
        body = body[len(fmt.optional_open) :]
    calls, pos = [], 0
    sep = fmt.separator.strip()
    while True:
        decoded = _decode_at(body, pos)
        found = _calls_of(decoded[0], fmt) if decoded else None
        if found is None:
            return text, []
        calls.extend(found)
        pos = decoded[1]
        rest = body[pos:].lstrip()
        if not rest:
            return "", calls
        if sep and rest.startswith(sep):
            rest = rest[len(sep) :]
        pos = len(body) - len(rest)


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """The model's text as (content left, tool calls). Text that is not a well-formed call stays content."""
    return _parse_marked(text, fmt) if fmt.open else _parse_bare(text, fmt)


class ToolStream:
    """Splits a streamed answer into text and tool calls as the pieces come.

    :meth:`feed` returns the text safe to show now and the calls completed; text that may begin a call
    is held back until it is known not to. A format without an opening mark (Llama 3's bare JSON) is
    decided by the answer's first character: ``{``/``[``/``<|python_tag|>`` holds the answer to the end.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""
        self._bare: bool | None = None  # bare formats: is the answer a call? (None: not known yet)
        self._space, self._calls = "", 0  # whitespace held back, calls found so far

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        """Add a piece; the text to emit now and the calls completed by it."""
        self._buf += piece
        if not self.fmt.open:
            return self._feed_bare()
        return self._spaced(*self._drain(final=False), final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The answer ended: whatever was held back, as text and calls."""
        if not self.fmt.open:
            text, self._buf = self._buf, ""
            return parse_tool_calls(text, self.fmt) if self._bare else (text, [])
        return self._spaced(*self._drain(final=True), final=True)

    def _spaced(self, text: str, calls: list[ToolCall], final: bool) -> tuple[str, list[ToolCall]]:
        """Whitespace at the end of the text shown is held until more text comes (dropped at the end of
        an answer with calls): the text shown is the content :func:`parse_tool_calls` leaves."""
        self._calls += len(calls)
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if final and not self._calls:
            body, self._space = body + self._space, ""
        return body, calls

    def _feed_bare(self) -> tuple[str, list[ToolCall]]:
        if self._bare is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            opens = ("{", "[", *((self.fmt.optional_open,) if self.fmt.optional_open else ()))
            if any(o.startswith(head) or head.startswith(o) for o in opens):
                if not any(head.startswith(o) for o in opens):
                    return "", []  # a prefix of <|python_tag|>: not known yet
                self._bare = True
            else:
                self._bare = False
        if self._bare:
            return "", []
        text, self._buf = self._buf, ""
        return text, []

    def _drain(self, final: bool) -> tuple[str, list[ToolCall]]:
        opener, closer = self.fmt.open.strip(), self.fmt.close.strip()
        out, calls = [], []
        while self._buf:
            start = self._buf.find(opener)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, opener)
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            out.append(self._buf[:start])
            self._buf = self._buf[start:]
            if closer:
                end = self._buf.find(closer)
                if end < 0 and not final:
                    break
                segment = self._buf if end < 0 else self._buf[: end + len(closer)]
            elif final:
                segment = self._buf
            else:
                break  # no closing mark (Mistral): the calls run to the end of the answer
            text, found = parse_tool_calls(segment, self.fmt)
            out.append(text)
            calls.extend(found)
            self._buf = self._buf[len(segment) :]
        return "".join(out), calls


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of ``text`` that begins ``mark`` (held back: a call may start there)."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0
