"""Tool-call formats (:mod:`kvrag.engine.tools`): the family table, parsing, streaming, forcing grammars."""

from __future__ import annotations

import json

import pytest

from kvrag.config import Constraint
from kvrag.engine.tools import (
    TOOL_FORMATS,
    ToolCall,
    ToolStream,
    check_tools,
    engine_tool_format,
    forced_call,
    parse_tool_calls,
    tool_format,
)
from kvrag.errors import InvalidRequestError, UnsupportedModelError
from tests.helpers import QWEN_TOOLS_TEMPLATE, make_tool_engine

FMT = {f.name: f for f in TOOL_FORMATS}
QWEN, LLAMA, MISTRAL = FMT["qwen"], FMT["llama3"], FMT["mistral"]
TOOLS = check_tools(
    [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}}}}},
        {"type": "function", "function": {"name": "search", "description": "find passages"}},
    ]
)
# per format: a model's answer with two calls, and the calls it holds
ANSWERS = {
    "qwen": 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "search", "parameters": {"q": "x"}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "search", "arguments": {"q": "x"}}]',
}
CALLS = [("add", {"a": 1}), ("search", {"q": "x"})]


def _pairs(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_format_parses_its_calls_and_keeps_the_text_around_them(name):
    content, calls = parse_tool_calls(ANSWERS[name], FMT[name])
    assert _pairs(calls) == CALLS and len({c.id for c in calls}) == 2
    assert content == ("Let me check." if name == "qwen" else "")


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_text_that_is_not_a_well_formed_call_stays_text(name):
    for text in ("The answer is 42.", "<tool_call>\n{not json}\n</tool_call>", '{"no_name": 1}', "[TOOL_CALLS] oops"):
        assert parse_tool_calls(text, FMT[name]) == (text, [])


def test_arguments_written_as_json_text_are_decoded():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2}"}\n</tool_call>', QWEN)
    assert _pairs(calls) == [("add", {"a": 2})]


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_in_any_pieces_the_calls_and_text_are_those_of_the_whole(name, size):
    text = ANSWERS[name] + ("" if name != "qwen" else "\nDone.")
    stream, shown, calls = ToolStream(FMT[name]), "", []
    for i in range(0, len(text), size):
        piece, found = stream.feed(text[i : i + size])
        assert "<tool_call" not in piece and "TOOL_CALLS" not in piece  # a call's text is never shown
        shown, calls = shown + piece, calls + found
    piece, found = stream.finish()
    shown, calls = shown + piece, calls + found
    assert _pairs(calls) == CALLS
    assert shown == parse_tool_calls(text, FMT[name])[0] == ("Let me check.\n\n\nDone." if name == "qwen" else "")


def test_plain_text_streams_through_and_a_held_back_mark_prefix_comes_out_at_the_end():
    stream = ToolStream(QWEN)
    assert stream.feed("Hello <tool") == ("Hello", [])  # the space waits: a call may come next
    assert stream.finish() == (" <tool", [])
    bare = ToolStream(LLAMA)
    assert bare.feed("The ") == ("The ", []) and bare.feed("{x}") == ("{x}", [])


def test_the_family_table_names_a_format_only_where_the_template_renders_tools():
    assert tool_format("qwen2", QWEN_TOOLS_TEMPLATE) is QWEN
    assert tool_format("llama", "... Given the following functions, please respond with a JSON ...") is LLAMA
    assert tool_format("mistral", "[AVAILABLE_TOOLS] ... [TOOL_CALLS]") is MISTRAL
    smol = "{% for message in messages %}<|im_start|>{{ message['role'] }}...{% endfor %}"  # SmolLM2's kind
    with pytest.raises(UnsupportedModelError, match=r"SmolLM \(llama family\) has a chat template that does not"):
        tool_format("llama", smol, model_name="SmolLM")
    with pytest.raises(UnsupportedModelError, match="gemma3 family"):
        tool_format("gemma3", QWEN_TOOLS_TEMPLATE)
    with pytest.raises(UnsupportedModelError, match="has no chat template"):
        tool_format("qwen2", None)


def test_tool_choice_forces_a_call_with_a_grammar_constraint():
    assert forced_call(QWEN, TOOLS, "auto") is None and forced_call(QWEN, TOOLS, None) is None
    for choice in ("any", "required", True):
        c = forced_call(QWEN, TOOLS, choice)
        assert c.kind == "lark" and c.spec.startswith('start: "<tool_call>\\n" %json {"anyOf"')
    named = forced_call(LLAMA, TOOLS, {"type": "function", "function": {"name": "search"}})
    schema = json.loads(named.spec.removeprefix("start: %json "))
    assert schema["properties"]["name"] == {"const": "search"} and schema["required"] == ["name", "parameters"]
    assert schema["properties"]["parameters"] == {"type": "object", "properties": {}, "additionalProperties": False}
    with pytest.raises(InvalidRequestError, match="'nope', which is not among the tools"):
        forced_call(QWEN, TOOLS, "nope")
    with pytest.raises(InvalidRequestError, match="tool_choice must be"):
        forced_call(QWEN, TOOLS, 3)


def test_marks_that_are_added_tokens_are_matched_as_tokens():
    # Qwen2.5's tokenizer has <tool_call> as one added token: the model emits it whole, so the grammar
    # names the token, not the text (llguidance refuses an added token where text is expected)
    tokens = {"<tool_call>": 151657, "</tool_call>": 151658, "<|im_end|>": 151645}
    spec = forced_call(QWEN, TOOLS, "add", tokens).spec
    assert spec.startswith('start: <[151657]> "\\n" %json {') and spec.endswith('} "\\n" <[151658]>')


@pytest.mark.parametrize("fmt", TOOL_FORMATS, ids=lambda f: f.name)
def test_forcing_grammars_compile_in_llguidance(fmt):
    llguidance = pytest.importorskip("llguidance")
    for choice, tokens in (("any", None), ("add", {fmt.open.strip(): 7})):
        grammar = forced_call(fmt, TOOLS, choice, tokens)
        assert isinstance(grammar, Constraint)
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar.spec)) == ""


def test_bad_tools_are_one_clear_error():
    with pytest.raises(InvalidRequestError, match="tools must be a list"):
        check_tools({"type": "function"})
    with pytest.raises(InvalidRequestError, match="a tool is"):
        check_tools([{"name": "add"}])
    with pytest.raises(InvalidRequestError, match="parameters must be a JSON object schema"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])


def test_the_engine_renders_tools_calls_and_results_with_the_models_template(one_thread):
    engine = make_tool_engine()
    try:
        assert engine_tool_format(engine) is QWEN
        call = ToolCall("add", {"a": 1}, "c1")
        messages = [
            {"role": "user", "content": "add one"},
            {"role": "assistant", "content": "", "tool_calls": [call.to_template()]},
            {"role": "tool", "content": "2", "tool_call_id": "c1"},
        ]
        prompt = engine.apply_chat_template(messages, tools=TOOLS)
        assert json.dumps(TOOLS[1]) in prompt  # the schemas as the template writes them
        assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in prompt
        assert "<tool_response>\n2\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
        assert "<tools>" not in engine.apply_chat_template(messages[:1])  # no tools, none rendered
    finally:
        engine.close()
