"""``kvrag serve``'s ``response_format``, ``tools`` and ``tool_choice`` on a tiny random Qwen-style model
whose chat template renders tools: answers validate, calls parse (whole and streamed), tool turns are
rendered, bad inputs are one 400 naming the field; the OpenAI Python client parses all of it.

Random weights sample valid output only under a constraint, so the checks sample (temperature 1, seeded)
with room for the grammar to end the answer.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import jsonschema  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kvrag.engine import Generation, GenerationStats, GenerationStream  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from tests.helpers import make_tool_engine, running_server  # noqa: E402

ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 10},
        "passages": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
    },
    "required": ["answer", "passages"],
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "The forecast.", "parameters": CITY}},
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "maxLength": 8}},
                "required": ["q"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "what is the weather in paris?"}]
SAMPLE = {"temperature": 1.0, "max_tokens": 300}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def served():
    engine = make_tool_engine()
    try:
        with running_server(create_app(engine)) as url:
            yield engine, url
    finally:
        engine.close()


def chat(url, **body):
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **SAMPLE, **body}, timeout=60)


def events(response) -> list[dict]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def assembled(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """A stream's content, its tool calls reassembled from the deltas (as OpenAI's clients do), finish reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or ():
                call = calls.setdefault(
                    d["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}}
                )
                call["id"] = d.get("id") or call["id"]
                call["type"] = d.get("type") or call["type"]
                call["function"]["name"] += d.get("function", {}).get("name") or ""
                call["function"]["arguments"] += d.get("function", {}).get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def scripted(text: str, size: int = 5):
    """A stand-in for ``Engine.stream`` replaying ``text`` (a model's answer) in pieces of ``size`` characters."""

    def stream(*args, **kwargs):
        def pieces():
            for i in range(0, len(text), size):
                yield text[i : i + size]
            stats = GenerationStats(mode="full", recompute_ratio=0.0, prompt_tokens=50, completion_tokens=9)
            return Generation(text, [1], "stop", 0.01, 0.02, stats)

        return GenerationStream(pieces())

    return stream


def test_json_schema_output_validates_on_both_endpoints(served):
    _, url = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for seed in range(3):
        data = chat(url, response_format=fmt, seed=seed).json()
        (choice,) = data["choices"]
        answer = json.loads(choice["message"]["content"])
        jsonschema.validate(answer, {**ANSWER, "additionalProperties": False})  # strict: no other key
        assert choice["finish_reason"] == "stop"
    text = httpx.post(
        f"{url}/v1/completions", json={"prompt": "answer:", "response_format": fmt, "seed": 4, **SAMPLE}, timeout=60
    ).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), ANSWER)


def test_json_object_output_parses_and_text_asks_for_nothing(served):
    _, url = served
    # a random model ends an object only now and then (it may write one string to the limit): every object
    # that ends parses, and some do
    ended = 0
    for seed in range(8):
        out = chat(url, response_format={"type": "json_object"}, seed=seed).json()["choices"][0]
        if out["finish_reason"] == "stop":
            assert isinstance(json.loads(out["message"]["content"]), dict)
            ended += 1
        else:
            assert out["finish_reason"] == "length" and out["message"]["content"].startswith("{")
    assert ended >= 2
    plain = chat(url, response_format={"type": "text"}, seed=1, max_tokens=6).json()["choices"][0]
    assert plain["message"]["content"] == chat(url, seed=1, max_tokens=6).json()["choices"][0]["message"]["content"]


def test_required_and_named_tool_choice_yield_a_call_whose_arguments_validate(served):
    _, url = served
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "weather"}}] * 2):
        data = chat(url, tools=TOOLS, tool_choice=choice, seed=seed).json()
        (out,) = data["choices"]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
        (call,) = out["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        if isinstance(choice, dict):
            assert call["function"]["name"] == "weather"
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, {**schemas[call["function"]["name"]], "additionalProperties": False})


def test_streamed_deltas_reassemble_to_the_whole_answers_call(served):
    _, url = served
    body = {"tools": TOOLS, "tool_choice": "required", "seed": 3}
    whole = chat(url, **body).json()["choices"][0]["message"]["tool_calls"][0]
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={"messages": ASK, **SAMPLE, **body, "stream": True}
    ) as r:
        chunks = events(r)
    content, (call,), reason = assembled(chunks)
    assert content == "" and reason == "tool_calls"
    assert call["function"] == whole["function"] and call["type"] == "function" and call["id"].startswith("call_")
    heads = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or ()]
    assert heads[0]["function"] == {"name": call["function"]["name"], "arguments": ""} and "id" in heads[0]


def test_auto_parses_the_models_calls_and_keeps_its_text(served, monkeypatch):
    engine, url = served
    monkeypatch.setattr(engine, "stream", scripted(CALL_TEXT))
    out = chat(url, tools=TOOLS).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Let me look."
    (call,) = out["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": json.dumps({"city": "rome", "days": 2})}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "stream": True}
    ) as r:
        content, calls, reason = assembled(events(r))
    assert (content, reason) == ("Let me look.", "tool_calls") and calls[0]["function"] == call["function"]
    # without tools (or with tool_choice "none") the same text is the content, unparsed
    assert chat(url, tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]["content"] == CALL_TEXT


def test_tool_turns_are_rendered_as_the_template_expects(served):
    engine, url = served
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "oslo", "days": 1}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    data = chat(url, messages=messages, tools=TOOLS, max_tokens=4, temperature=None).json()
    template = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "weather", "arguments": {"city": "oslo", "days": 1}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    prompt = engine.apply_chat_template(template, tools=TOOLS)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and '"city": "oslo"' in prompt
    assert data["usage"]["prompt_tokens"] == engine.count_tokens(prompt)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}},
            "response_format",
            "does not compile",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.json_schema.schema",
            "Field required",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "does not compile",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "give one",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", ""),
        ({"logprobs": True}, None, "log-probabilities"),
        ({"functions": [{"name": "f"}]}, None, "give tools"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages",
            "not JSON",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, None, "only a tool message"),
    ],
)
def test_bad_inputs_are_one_400_naming_the_field(served, monkeypatch, body, param, words):
    engine, url = served
    monkeypatch.setattr(engine, "stream", lambda **kw: pytest.fail("a refused request reached the engine"))
    r = chat(url, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error


def test_a_model_without_tool_support_is_a_400_naming_tools(serve_tiny):
    engine, url = serve_tiny()  # the tiny Llama: its template renders no tools
    r = chat(url, tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not render tools" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["kvrag"]["tool_calling"] is False


# -- the OpenAI Python client ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_parses_structured_output(client):
    class Answer(BaseModel):
        answer: str = Field(max_length=10)
        passages: list[int] = Field(max_length=3)

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    done = client.chat.completions.create(model="default", messages=ASK, response_format=fmt, seed=0, **SAMPLE)
    jsonschema.validate(json.loads(done.choices[0].message.content), ANSWER)
    parsed = client.beta.chat.completions.parse(model="default", messages=ASK, response_format=Answer, seed=2, **SAMPLE)
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Answer) and message.parsed == Answer.model_validate_json(message.content)


def test_the_openai_client_parses_tool_calls_whole_and_streamed(client):
    args = {"model": "default", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 5, **SAMPLE}
    done = client.chat.completions.create(**args)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None
    json.loads(call.function.arguments)
    with client.beta.chat.completions.stream(**{k: v for k, v in args.items() if k != "stream"}) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # the answer's call and the tool's reply, sent back as the next request's messages
    follow = [
        *ASK,
        done.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
    ]
    again = client.chat.completions.create(model="default", messages=follow, tools=TOOLS, max_tokens=4)
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")


# -- kvrag's client and LangChain's KVCachedLLM with base_url= ------------------------------------------


def test_kvrag_client_sends_constraints_and_tools_and_reads_the_calls(served):
    from kvrag import Constraint
    from kvrag.client import Client

    _, url = served
    with Client(url) as client:
        g = client.chat(ASK, constraint=Constraint.json_schema(ANSWER), temperature=1.0, seed=0, max_tokens=300)
        jsonschema.validate(json.loads(g.text), ANSWER)
        whole = client.chat(ASK, tools=TOOLS, tool_choice="weather", temperature=1.0, seed=1, max_tokens=300)
        stream = client.stream_chat(ASK, tools=TOOLS, tool_choice="weather", temperature=1.0, seed=1, max_tokens=300)
        assert "".join(stream) == "" and whole.text == ""
    (call,) = whole.tool_calls
    assert whole.finish_reason == "tool_calls" and call.name == "weather"
    jsonschema.validate(call.arguments, CITY)
    (streamed,) = stream.generation.tool_calls
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def test_langchain_bind_tools_and_structured_output_against_the_server(served):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import ToolMessage

    from kvrag.integrations.langchain import KVCachedLLM

    class Answer(BaseModel):
        """An answer and the passages it used."""

        answer: str = Field(max_length=10)
        passages: list[int] = Field(max_length=3)

    _, url = served
    llm = KVCachedLLM(base_url=url, max_tokens=300, temperature=1.0, seed=2)
    bound = llm.bind_tools(TOOLS, tool_choice="any")
    msg = bound.invoke("what is the weather in paris?")
    (call,) = msg.tool_calls
    assert call["name"] in ("weather", "search") and msg.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(bound.stream("what is the weather in paris?"))
    folded = chunks[0]
    for c in chunks[1:]:
        folded += c
    assert [(c["name"], c["args"]) for c in folded.tool_calls] == [(call["name"], call["args"])]
    # the call and its answer, sent back: the server renders the tool turn
    reply = llm.bind_tools(TOOLS).invoke(
        ["what is the weather in paris?", msg, ToolMessage("21 C", tool_call_id=call["id"])]
    )
    assert reply.usage_metadata["input_tokens"] > msg.usage_metadata["input_tokens"]
    assert isinstance(llm.with_structured_output(Answer).invoke("answer in JSON"), Answer)
    named = llm.with_structured_output(Answer, method="function_calling").invoke("answer in JSON")
    assert isinstance(named, Answer)


class WeatherArgs(BaseModel):
    city: Literal["paris", "rome", "oslo"]
    days: Literal[1, 2, 3]


def weather(city: str, days: int) -> str:
    """The forecast (a LlamaIndex function tool)."""
    return "sunny"


def test_llama_index_function_agent_tools_against_the_server(served):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    from kvrag.integrations.llama_index import KVCachedLLM

    _, url = served
    llm = KVCachedLLM(base_url=url, max_new_tokens=300, temperature=1.0, seed=4)
    assert llm.metadata.is_function_calling_model  # the served model's template renders tools
    tool = FunctionTool.from_defaults(fn=weather, fn_schema=WeatherArgs)
    response = llm.chat_with_tools(
        [tool], chat_history=[ChatMessage(role="user", content="paris?")], tool_required=True
    )
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "weather" and set(selection.tool_kwargs) == {"city", "days"}
