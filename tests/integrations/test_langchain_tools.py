"""LangChain tool calling and structured output of ``KVCachedLLM``.

The answers are scripted (an engine stand-in replays a model's text, rendering prompts with a real
tokenizer and a Qwen2.5-style template), so what is checked is the translation: tools rendered,
calls parsed, the constraint each method sends. One test runs a real tiny Qwen2-family engine.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kvrag.config import Constraint  # noqa: E402
from kvrag.errors import InvalidRequestError, UnsupportedModelError  # noqa: E402
from kvrag.integrations.langchain import KVCachedLLM  # noqa: E402
from kvrag.integrations.langchain.structured import closed  # noqa: E402
from tests.helpers import make_tool_engine, scripted_engine  # noqa: E402


class Answer(BaseModel):
    """An answer and the passages it used."""

    answer: str = Field(description="the answer")
    passages: list[int] = Field(description="numbers of the passages used")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_bound_tools_are_rendered_and_the_models_calls_parsed():
    engine = scripted_engine("I will add.\n" + CALL)
    msg = KVCachedLLM(engine=engine).bind_tools([add]).invoke("what is 2 + 3?")
    assert msg.content == "I will add."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert msg.tool_calls[0]["id"].startswith("call_") and msg.usage_metadata["input_tokens"] == 100
    prompt = engine.calls[0]["prompt"]
    assert '"name": "add", "description": "Add two integers."' in prompt and "what is 2 + 3?" in prompt
    assert engine.calls[0]["constraint"] is None  # tool_choice auto: free text


def test_streaming_yields_tool_call_chunks_and_aggregates_to_the_same_calls():
    engine = scripted_engine("Sure. " + CALL + CALL.replace('"a": 2', '"a": 7'), size=3)
    chunks = list(KVCachedLLM(engine=engine).bind_tools([add]).stream("add"))
    assert "".join(c.content for c in chunks) == "Sure."
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert [c.tool_call_chunks[0]["index"] for c in with_calls] == [0, 1]
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert [c["args"] for c in full.tool_calls] == [{"a": 2, "b": 3}, {"a": 7, "b": 3}]


def test_tool_choice_any_or_a_name_forces_a_call_by_grammar():
    engine = scripted_engine(CALL)
    llm = KVCachedLLM(engine=engine)
    llm.bind_tools([add], tool_choice="any").invoke("add")
    llm.bind_tools([add, Answer], tool_choice="Answer").invoke("add")
    any_, named = engine.calls[0]["constraint"], engine.calls[1]["constraint"]
    assert any_.kind == named.kind == "lark" and any_.spec.startswith('start: "<tool_call>\\n" %json')
    assert '"const": "Answer"' in named.spec and '"const": "add"' not in named.spec
    with pytest.raises(InvalidRequestError, match="'mul', which is not among the tools"):
        llm.bind_tools([add], tool_choice="mul")
    llm.bind_tools([add], tool_choice="none").invoke("add")
    assert "<tools>" not in engine.calls[2]["prompt"] and engine.calls[2]["constraint"] is None


def test_a_conversation_with_calls_and_tool_results_renders_as_the_template_expects():
    engine = scripted_engine("5")
    history = [
        SystemMessage("be brief"),
        HumanMessage("2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
        ToolMessage("5", tool_call_id="c1", name="add"),
    ]
    assert KVCachedLLM(engine=engine).bind_tools([add]).invoke(history).content == "5"
    prompt = engine.calls[0]["prompt"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt and "be brief" in prompt


def test_a_model_whose_template_renders_no_tools_says_so_at_bind_time():
    smol = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    llm = KVCachedLLM(engine=scripted_engine("x", template=smol, model_type="llama"))
    with pytest.raises(UnsupportedModelError, match="does not render tools"):
        llm.bind_tools([add])
    assert llm.profile["tool_calling"] is False and llm.profile["structured_output"] is True


def test_profile_is_filled_from_the_engine():
    profile = KVCachedLLM(engine=scripted_engine("x")).profile
    assert profile["max_input_tokens"] == 4096 and profile["tool_calling"] and profile["tool_choice"]


def test_structured_output_json_schema_constrains_decoding_and_validates():
    engine = scripted_engine('{"answer": "Paris", "passages": [1, 3]}')
    llm = KVCachedLLM(engine=engine)
    assert llm.with_structured_output(Answer).invoke("where?") == Answer(answer="Paris", passages=[1, 3])
    closed = {**Answer.model_json_schema(), "additionalProperties": False}  # strict: the object may end
    assert engine.calls[0]["constraint"] == Constraint.json_schema(closed)
    as_dict = llm.with_structured_output(Answer.model_json_schema()).invoke("where?")
    assert as_dict == {"answer": "Paris", "passages": [1, 3]}
    assert llm.with_structured_output(None, method="json_mode").invoke("json please")["answer"] == "Paris"
    assert engine.calls[2]["constraint"] == Constraint.json_object()


def test_structured_output_function_calling_forces_the_schema_as_a_tool():
    engine = scripted_engine('<tool_call>\n{"name": "Answer", "arguments": {"answer": "Rome", "passages": [2]}}')
    result = KVCachedLLM(engine=engine).with_structured_output(Answer, method="function_calling").invoke("q")
    assert result == Answer(answer="Rome", passages=[2])  # the closing mark may be cut: the call is whole
    assert '"const": "Answer"' in engine.calls[0]["constraint"].spec


def test_include_raw_reports_a_parse_failure_instead_of_raising():
    engine = scripted_engine('{"answer": "Paris"}')  # passages missing
    out = KVCachedLLM(engine=engine).with_structured_output(Answer, include_raw=True).invoke("q")
    assert out["parsed"] is None and out["parsing_error"] is not None and out["raw"].content == '{"answer": "Paris"}'
    with pytest.raises(InvalidRequestError, match="method must be one of"):
        KVCachedLLM(engine=engine).with_structured_output(Answer, method="xml")


def test_a_real_engine_answers_a_tool_prompt_as_its_own_template_renders_it(one_thread):
    engine = make_tool_engine()
    try:
        llm = KVCachedLLM(engine=engine, max_tokens=6)
        tools = llm.bind_tools([add]).kwargs["tools"]
        messages = [{"role": "user", "content": "what is 2 + 3?"}]
        expected = engine.generate(prompt=engine.apply_chat_template(messages, tools=tools), max_new_tokens=6)
        msg = llm.bind_tools([add]).invoke("what is 2 + 3?")
        assert msg.content == expected.text.strip() or msg.tool_calls  # random weights: text, parsed as such
        assert msg.usage_metadata["input_tokens"] == expected.stats.prompt_tokens
        assert json.dumps(tools[0]) in engine.apply_chat_template(messages, tools=tools)
    finally:
        engine.close()


def test_a_constraint_a_server_cannot_take_is_refused_before_any_request():
    llm = KVCachedLLM(base_url="http://127.0.0.1:9")  # nothing listens there: no request may be made
    with pytest.raises(InvalidRequestError, match="a regex constraint cannot be sent to kvrag serve"):
        llm.invoke("2 + 3?", constraint=Constraint.regex("[0-9]+"))


def test_strict_closes_every_object_schema_that_does_not_say():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "$defs": {"Inner": {"type": "object", "properties": {}, "additionalProperties": True}},
        "anyOf": [{"type": "object"}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # a property named "properties" stays a property
    assert out["$defs"]["Inner"]["additionalProperties"] is True and out["anyOf"][0]["additionalProperties"] is False
    engine = scripted_engine('{"answer": "x", "passages": []}')
    KVCachedLLM(engine=engine).with_structured_output(Answer, strict=False).invoke("q")
    assert engine.calls[0]["constraint"] == Constraint.json_schema(Answer.model_json_schema())
