"""LlamaIndex tool calling and structured output of ``KVCachedLLM`` (a ``FunctionCallingLLM``).

Answers are scripted (an engine stand-in replays a model's text over a real tokenizer and a
Qwen2.5-style template): what is checked is the translation and the agent loop, not the model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import FunctionAgent  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from kvrag.config import Constraint  # noqa: E402
from kvrag.integrations.llama_index import KVCachedLLM  # noqa: E402
from tests.helpers import scripted_engine  # noqa: E402


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOL = FunctionTool.from_defaults(fn=multiply)
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


class City(BaseModel):
    name: str
    country: str


def test_it_is_a_function_calling_model_where_the_template_renders_tools():
    assert KVCachedLLM(engine=scripted_engine("x")).metadata.is_function_calling_model
    smol = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not KVCachedLLM(
        engine=scripted_engine("x", template=smol, model_type="llama")
    ).metadata.is_function_calling_model


def test_chat_with_tools_renders_them_and_parses_the_call():
    engine = scripted_engine("Calling.\n" + CALL + CALL)
    llm = KVCachedLLM(engine=engine)
    response = llm.chat_with_tools([TOOL], user_msg="what is 6 times 7?")
    assert response.message.content == "Calling."
    (selection,) = llm.get_tool_calls_from_response(response)  # one: parallel calls not allowed
    assert (selection.tool_name, selection.tool_kwargs) == ("multiply", {"a": 6, "b": 7})
    assert (
        '{"type": "function", "function": {"name": "multiply", "description": "multiply(' in engine.calls[0]["prompt"]
    )
    assert engine.calls[0]["constraint"] is None
    llm.chat_with_tools([TOOL], user_msg="again", tool_required=True)
    assert engine.calls[1]["constraint"].kind == "lark" and '"const": "multiply"' in engine.calls[1]["constraint"].spec
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(KVCachedLLM(engine=scripted_engine("no call")).chat_with_tools([TOOL], "x"))


def test_streamed_chat_with_tools_carries_the_calls_so_far():
    llm = KVCachedLLM(engine=scripted_engine("Sure. " + CALL, size=3))
    responses = list(llm.stream_chat_with_tools([TOOL], user_msg="6 x 7?"))
    assert responses[-1].message.content == "Sure." and "tool_call" not in "".join(r.delta or "" for r in responses)
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(responses[-1])] == [{"a": 6, "b": 7}]


async def test_function_agent_calls_the_tool_and_answers_from_its_result():
    # first turn: the model calls the tool; second turn (the tool's result in the prompt): it answers
    engine = scripted_engine(CALL)
    llm = KVCachedLLM(engine=engine)
    agent = FunctionAgent(tools=[TOOL], llm=llm, system_prompt="Use the tools.")
    answers = iter([CALL, "The product is 42."])
    original = engine._run

    def run():
        text = next(answers)
        engine_answer = scripted_engine(text)
        return (yield from engine_answer._run())

    engine._run = run
    result = await agent.run(user_msg="What is 6 times 7?")
    assert str(result) == "The product is 42."
    assert [(c.tool_name, c.tool_kwargs, c.tool_output.content) for c in result.tool_calls] == [
        ("multiply", {"a": 6, "b": 7}, "42")
    ]
    second = engine.calls[1]["prompt"]  # the call and its result, as the template renders them
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>' in second
    assert "<tool_response>\n42\n</tool_response>" in second and "Use the tools." in second
    del original


def test_structured_predict_constrains_decoding_to_the_schema():
    engine = scripted_engine('{"name": "Lima", "country": "Peru"}')
    llm = KVCachedLLM(engine=engine)
    city = llm.structured_predict(City, PromptTemplate("Name the capital of {country}."), country="Peru")
    assert city == City(name="Lima", country="Peru")
    assert engine.calls[0]["constraint"] == Constraint.json_schema(City.model_json_schema())
    assert "Name the capital of Peru." in engine.calls[0]["prompt"]


async def test_astructured_predict_too():
    llm = KVCachedLLM(engine=scripted_engine('{"name": "Lima", "country": "Peru"}'))
    assert await llm.astructured_predict(City, PromptTemplate("capital of {c}?"), c="Peru") == City(
        name="Lima", country="Peru"
    )


def test_an_assistant_turn_with_calls_and_a_tool_turn_render_as_the_template_expects():
    engine = scripted_engine("42")
    history = [
        ChatMessage(role=MessageRole.USER, content="6 x 7?"),
        ChatMessage(
            role=MessageRole.ASSISTANT,
            content="",
            additional_kwargs={"tool_calls": [{"id": "c1", "name": "multiply", "arguments": {"a": 6, "b": 7}}]},
        ),
        ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"tool_call_id": "c1"}),
    ]
    KVCachedLLM(engine=engine).chat(history, tools=[TOOL.metadata.to_openai_tool()])
    assert "<tool_response>\n42\n</tool_response>" in engine.calls[0]["prompt"]
    assert '"arguments": {"a": 6, "b": 7}' in engine.calls[0]["prompt"]
