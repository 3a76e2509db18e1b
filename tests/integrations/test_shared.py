"""The integration layer both drop-ins stand on: argument table, engine lookup, figures, async bridge.

Engine-free: a hand-made :class:`Generation` and a stand-in engine whose ``stream`` replays fixed
pieces, so what is checked is the translation, not the model.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import get_args

import pytest

pytest.importorskip("pydantic")  # the LLM fields are pydantic models (both integrations' extras bring it)

import kvrag.engine
from kvrag.config import MODES, EngineConfig
from kvrag.engine import Engine, Generation, GenerationStats, GenerationStream
from kvrag.engine.options import RequestOptions
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import (
    CALL_ARGUMENTS,
    METADATA_KEYS,
    EngineCall,
    Mode,
    call_metadata,
    call_options,
    check_target,
    engine_of,
    open_in_thread,
    usage,
)

STATS = GenerationStats(
    mode="blend",
    path="blend",
    path_reason="predicted 0.40 of a full prefill",
    recompute_ratio=0.25,
    prompt_tokens=100,
    cached_tokens=70,
    prefix_tokens=10,
    exact_tokens=40,
    recomputed_tokens=9,
    computed_tokens=39,
    compute_fraction=0.4,
    chunk_hits=3,
    chunk_misses=1,
    chunks_found=3,
    conversation_tokens=20,
    conversation_spans=[(0, 12), (30, 38)],
    deduplicated_chunks=2,
    completion_tokens=5,
)
GENERATION = Generation(
    text="Paris!", token_ids=[1, 2, 3, 4, 5], finish_reason="stop", ttft_s=0.5, total_s=0.75, stats=STATS
)


class FakeEngine(Engine):
    """An engine stand-in: ``stream`` replays ``pieces`` and ends with :data:`GENERATION`."""

    def __init__(self, pieces=("Par", "is!")) -> None:  # no model: Engine.__init__ is not called
        self.model_name = "fake-model"
        self.config = EngineConfig()  # LlamaIndex reads max_new_tokens and the window for its metadata
        self.context_window = 2048
        self.pieces = pieces
        self.calls: list[dict] = []
        self.closed = threading.Event()

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def stream(self, **kwargs) -> GenerationStream:
        self.calls.append(kwargs)
        return GenerationStream(self._run())

    def _run(self):
        try:
            yield from self.pieces
            return GENERATION
        finally:
            self.closed.set()


# -- the argument table ---------------------------------------------------------------------------


def test_every_argument_names_an_engine_keyword():
    # every request keyword but the prompt itself, the sampling object (its fields are here one by
    # one), the tenant (a server's business, not a per-call argument) and the chunk order (the
    # retriever wrappers' order=: documents are ordered before the prompt is rendered)
    request_keywords = set(RequestOptions.names()) - {"namespace", "chunk_order"}
    assert set(CALL_ARGUMENTS.values()) == request_keywords | {"model"}
    assert CALL_ARGUMENTS["max_tokens"] == CALL_ARGUMENTS["max_new_tokens"] == "max_new_tokens"


def test_call_options_override_defaults_and_resolve_aliases():
    options = call_options({"temperature": 0.5, "mode": "full"}, {"max_tokens": 7, "mode": None}, owner="X")
    assert options["max_new_tokens"] == 7 and options["temperature"] == 0.5
    assert options["mode"] == "full"  # None per call means "not given": the default stays
    assert set(options) == set(CALL_ARGUMENTS.values()) and options["stop"] is None
    assert call_options({}, {"max_tokens": 3, "max_new_tokens": 3}, owner="X")["max_new_tokens"] == 3
    with pytest.raises(InvalidRequestError, match="max_tokens and max_new_tokens are one argument"):
        call_options({}, {"max_tokens": 3, "max_new_tokens": 4}, owner="X")


def test_unknown_argument_is_one_error_naming_it_and_the_accepted_ones():
    with pytest.raises(InvalidRequestError) as err:
        call_options({}, {"temprature": 0.1, "frequency_penalty": 1.0, "seed": 1}, owner="SomeLLM")
    message = str(err.value)
    assert message.startswith("unknown argument(s) frequency_penalty, temprature; SomeLLM accepts ")
    assert all(name in message for name in CALL_ARGUMENTS)


def test_literals_and_descriptions_follow_kvrag_config():
    from kvrag.engine.reuse.selection import registered_selections
    from kvrag.integrations._shared import GenerationFields

    assert get_args(Mode) == MODES
    fields = GenerationFields.model_fields
    assert all(m in fields["mode"].description for m in MODES)
    assert fields["selection"].annotation == str | None  # the registry is the list, checked per call
    assert all(s in fields["selection"].description for s in ("probe", "recency"))
    assert set(registered_selections()) >= {"probe", "recency"}  # the benchmarks may have added theirs


# -- figures --------------------------------------------------------------------------------------


def test_metadata_maps_every_stat():
    meta = call_metadata(GENERATION, model_name="m", conversation_id="c-1")
    assert meta == {
        "model_name": "m",
        "finish_reason": "stop",
        "ttft_s": 0.5,
        "total_s": 0.75,
        "mode": "blend",
        "path": "blend",
        "path_reason": "predicted 0.40 of a full prefill",
        "recompute_ratio": 0.25,
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "cache_read": 70,
        "prefix_tokens": 10,
        "exact_tokens": 40,
        "recomputed_tokens": 9,
        "compute_fraction": 0.4,
        "chunk_hits": 3,
        "chunk_misses": 1,
        "chunks_found": 3,
        "conversation_id": "c-1",
        "conversation_tokens": 20,
        "conversation_spans": [[0, 12], [30, 38]],
        "deduplicated_chunks": 2,
    }
    assert set(meta) == METADATA_KEYS
    assert usage(GENERATION) == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105, "cache_read": 70}


def test_both_integrations_report_the_same_figures():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from kvrag.integrations.langchain import KVCachedLLM as LangChainLLM
    from kvrag.integrations.llama_index import KVCachedLLM as LlamaIndexLLM

    engine = FakeEngine()
    lc = LangChainLLM(engine=engine).invoke("hi", max_tokens=4, conversation_id="c-1")
    li = LlamaIndexLLM(engine=engine).complete("hi", max_tokens=4, conversation_id="c-1")
    expected = call_metadata(GENERATION, model_name="fake-model", conversation_id="c-1")
    assert lc.content == li.text == "Paris!"
    assert lc.response_metadata == {**expected, "model_provider": "kvrag"}
    assert li.additional_kwargs == expected
    assert lc.usage_metadata["input_token_details"]["cache_read"] == li.raw["usage"]["cache_read"] == 70
    # the same engine request from both: max_tokens became max_new_tokens, the rest the defaults
    assert (
        engine.calls[0]
        == engine.calls[1]
        == {
            "prompt": "user:hi",
            **{name: None for name in set(CALL_ARGUMENTS.values()) - {"model"}},
            "max_new_tokens": 4,
            "conversation_id": "c-1",
        }
    )


def test_both_integrations_reject_the_same_unknown_argument():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from kvrag.integrations.langchain import KVCachedTextLLM
    from kvrag.integrations.llama_index import KVCachedLLM as LlamaIndexLLM

    engine = FakeEngine()
    with pytest.raises(InvalidRequestError, match="unknown argument.*top_k; KVCachedTextLLM accepts"):
        KVCachedTextLLM(engine=engine).invoke("hi", top_k=3)
    with pytest.raises(InvalidRequestError, match="unknown argument.*top_k; KVCachedLLM accepts"):
        LlamaIndexLLM(engine=engine).complete("hi", top_k=3)
    assert engine.calls == []


# -- engine lookup --------------------------------------------------------------------------------


def test_engine_lookup_is_the_same_in_both_integrations(monkeypatch):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from kvrag.integrations.langchain import KVCachedLLM as LangChainLLM
    from kvrag.integrations.llama_index import KVCachedLLM as LlamaIndexLLM

    loaded = []
    shared = FakeEngine()
    monkeypatch.setattr(kvrag.engine, "get_engine", lambda model=None, **cfg: loaded.append((model, cfg)) or shared)
    given = FakeEngine()
    for cls in (LangChainLLM, LlamaIndexLLM):
        loaded.clear()
        assert cls(engine=given).get_engine() is given
        assert cls(engine=given).get_engine("other") is shared  # a per-call model: its shared engine
        llm = cls(model="/m", engine_config={"dtype": "bfloat16"})
        assert loaded == [("other", {})] and llm.get_engine() is shared
        assert loaded[-1] == ("/m", {"dtype": "bfloat16"})
        with pytest.raises(ValueError, match="either engine= or model="):
            cls(engine=given, model="/m")
        with pytest.raises(ValueError, match="either engine= or model="):
            cls(engine=given, engine_config={"dtype": "bfloat16"})
        with pytest.raises(ValueError, match="recompute_ratio"):
            cls(engine_config={"recompute_ratio": 0.3})  # a per-call setting, not a second engine
    assert engine_of(None) is shared and engine_of(given) is given
    assert engine_of(LlamaIndexLLM(engine=given)) is given and engine_of(LangChainLLM()) is shared
    with pytest.raises(InvalidRequestError, match="got str"):
        check_target("llm")


def test_registration_targets_are_checked_at_construction_in_both():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.runnables import RunnableLambda
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvrag.integrations.langchain import KVCachedRetriever, KVCachedVectorStore
    from kvrag.integrations.llama_index import KVCachedNodePostprocessor

    retriever = RunnableLambda(lambda query: [])
    for make in (
        lambda llm: KVCachedRetriever(retriever=retriever, llm=llm),
        lambda llm: KVCachedVectorStore(InMemoryVectorStore(embedding=None), llm=llm),
        lambda llm: KVCachedNodePostprocessor(llm=llm),
    ):
        assert make(None).llm is None and make(FakeEngine()).llm is not None  # None: the shared engine
        with pytest.raises(ValueError, match="expected a kvrag LLM, a kvrag Engine or None, got str"):
            make("llm")


# -- one engine call ------------------------------------------------------------------------------


def test_engine_call_yields_pieces_then_the_generation():
    engine = FakeEngine()
    call = EngineCall(engine.stream(prompt="p"), model_name="m", conversation_id=None)
    assert list(call) == [("Par", None), ("is!", None), ("", GENERATION)]
    assert engine.closed.is_set() and list(call) == []
    assert call.metadata(GENERATION)["model_name"] == "m"
    assert EngineCall(engine.stream(prompt="p"), model_name="m", conversation_id=None).finish() is GENERATION


def test_engine_call_close_frees_the_request_even_before_iteration():
    engine = FakeEngine()
    started = EngineCall(engine.stream(prompt="p"), model_name="m", conversation_id=None)
    assert next(started) == ("Par", None)
    started.close()
    assert engine.closed.is_set() and list(started) == []
    with pytest.raises(RuntimeError, match="closed before it finished"):
        started.finish()
    unstarted = FakeEngine()
    call = EngineCall(unstarted.stream(prompt="p"), model_name="m", conversation_id=None)
    call.close()
    assert list(call) == []


# -- the async bridge -----------------------------------------------------------------------------


async def test_bridge_runs_one_worker_thread_per_stream():
    threads = []
    var = contextvars.ContextVar("var", default="unset")
    var.set("caller")

    def numbers():
        for i in range(5):
            threads.append((threading.get_ident(), var.get()))
            yield i

    def make():
        threads.append((threading.get_ident(), var.get()))
        return numbers()

    assert [x async for x in await open_in_thread(make)] == [0, 1, 2, 3, 4]
    assert len(set(threads)) == 1  # make and every step: one thread, with the caller's context
    (worker, seen), loop_thread = threads[0], threading.get_ident()
    assert worker != loop_thread and seen == "caller"


async def test_bridge_raises_errors_where_they_belong():
    def bad_make():
        raise InvalidRequestError("rejected up front")

    with pytest.raises(InvalidRequestError, match="rejected up front"):
        await open_in_thread(bad_make)  # at the await, before any iteration

    def failing():
        yield 1
        raise ValueError("mid-stream")

    stream = await open_in_thread(failing)
    assert await anext(stream) == 1
    with pytest.raises(ValueError, match="mid-stream"):
        await anext(stream)


async def test_bridge_close_stops_the_worker_and_closes_the_iterator():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    stream = await open_in_thread(endless)
    assert [await anext(stream), await anext(stream)] == [0, 1]
    await stream.aclose()
    assert await asyncio.to_thread(closed.wait, 10)  # closed in the worker: nothing more is produced


async def test_cancelling_the_consumer_closes_the_engine_stream():
    release = threading.Event()
    reached_end = []

    def slow():
        yield "first"
        release.wait(10)  # a long decode step: the consumer is cancelled meanwhile
        yield "second"
        reached_end.append(True)

    engine = FakeEngine(pieces=slow())
    got = []

    async def consume():
        call = lambda: EngineCall(engine.stream(prompt="p"), model_name="m", conversation_id=None)  # noqa: E731
        async for item in await open_in_thread(call):
            got.append(item)

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(engine.closed.wait, 10)  # the request was freed, in the worker
    assert got == [("first", None)] and not reached_end
