"""``kvrag serve`` over HTTP on the tiny random Llama: OpenAI shapes, SSE, errors, tenants, disconnects, metrics.

Requests are plain httpx calls (what any OpenAI client sends); answers are checked against the
same engine called directly.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvrag.client import Client  # noqa: E402
from kvrag.engine import GenerationStream  # noqa: E402
from kvrag.errors import ServerError  # noqa: E402
from kvrag.server import ServerSettings, TenantMap  # noqa: E402
from tests.helpers import failing_stream, hold_engine_thread, make_docs, stored_contexts  # noqa: E402


def rag_messages(docs, question="where was the king born?"):
    return [
        {"role": "system", "content": "Answer from the documents.\n\n" + "\n".join(docs)},
        {"role": "user", "content": question},
    ]


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE answer, ``[DONE]`` kept as the string (SSE parsed by hand on purpose)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_chat_completion_shape_usage_and_figures(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3)
    body = {"model": "default", "messages": rag_messages(docs), "max_tokens": 6, "documents": docs, "mode": "full"}
    data = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    expected = engine.generate(prompt=engine.apply_chat_template(rag_messages(docs)), max_new_tokens=6, mode="full")
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == engine.model_name
    (choice,) = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == expected.finish_reason
    assert data["usage"]["prompt_tokens"] == expected.stats.prompt_tokens
    assert data["usage"]["completion_tokens"] == expected.stats.completion_tokens
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    ext = data["kvrag"]
    assert ext["mode"] == "full" and ext["chunk_misses"] == 3 and ext["stats"]["computed_tokens"] > 0


def test_documents_make_chunk_hits_and_cached_tokens(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3)
    body = {"messages": rag_messages(docs), "max_tokens": 4, "documents": docs}
    first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    engine.flush()  # write-back of the chunks the first request computed
    second = httpx.post(f"{url}/v1/chat/completions", json={**body, "mode": "reuse"}, timeout=60).json()
    assert first["kvrag"]["chunk_misses"] == 3 and first["kvrag"]["chunk_hits"] == 0
    assert second["kvrag"]["chunk_hits"] == 3
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == second["kvrag"]["cache_read"] == second["kvrag"]["stats"]["cached_tokens"] >= 3 * 40


def test_documents_endpoint_lets_plain_openai_requests_hit(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3, seed=4)
    answer = httpx.post(f"{url}/v1/documents", json={"documents": docs, "warm": True}, timeout=60).json()
    assert answer["warm"]["computed"] == 3 and answer["warm"]["variants"] == 0 and len(answer["ids"]) == 3
    plain = {"model": engine.model_name, "messages": rag_messages(docs), "max_tokens": 4}  # no kvrag field at all
    data = httpx.post(f"{url}/v1/chat/completions", json=plain, timeout=60).json()
    assert data["kvrag"]["chunk_hits"] == 3 and data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_client_warms_a_corpus_in_similar_order(serve_tiny, tiny_model, tiny_tokenizer):
    from kvrag import Engine

    engine, url = serve_tiny()
    docs = make_docs(5, seed=6)
    assert Client(url).warm(docs, order="similar").computed == 5
    with Engine.from_model(tiny_model, tiny_tokenizer) as ref:
        ref.warm(docs, order="similar")
        assert stored_contexts(engine, docs) == stored_contexts(ref, docs)
    bad = httpx.post(f"{url}/v1/documents", json={"documents": docs, "warm": True, "order": "random"}, timeout=60)
    assert bad.status_code == 400 and "order" in bad.text


def test_completions_endpoint_matches_the_engine(serve_tiny):
    engine, url = serve_tiny()
    prompt = "the king of the river city was born in"
    data = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 5}, timeout=60).json()
    expected = engine.generate(prompt=prompt, max_new_tokens=5)
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == expected.text and data["usage"]["completion_tokens"] == 5


def test_chat_stream_is_openai_sse(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(2)
    body = {"messages": rag_messages(docs), "max_tokens": 8, "stream": True, "mode": "full"}
    whole = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finish, usage_chunk = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert finish["kvrag"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])  # as OpenAI: usage only in the last chunk


def test_text_stream_without_usage(serve_tiny):
    _, url = serve_tiny()
    body = {"prompt": "the king of", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)
    chunks = events[:-1]
    assert events[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["kvrag"]["completion_tokens"] == 4


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "needle"),
    [
        (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model_not_found", "gpt-4o"),
        (TEXT, {"prompt": ""}, 400, None, "empty"),
        (TEXT, {"prompt": "the king " * 600}, 400, "context_length_exceeded", "context window"),
        (CHAT, {"messages": [{"role": "user", "content": "the king " * 600}]}, 400, "context_length_exceeded", "1024"),
        (CHAT, {"messages": []}, 400, None, "messages"),
        (CHAT, {"messages": HI, "n": 2}, 400, None, "n=2"),
        (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400, None, "tools"),
        (CHAT, {"messages": HI, "mode": "turbo"}, 400, None, "mode"),
        (CHAT, {"messages": HI, "recompute_ratio": 2}, 400, None, "recompute_ratio"),
        (CHAT, {"messages": HI, "quality": "best"}, 400, None, "quality must be one of"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "wizard"),
        (CHAT, {"messages": "hello"}, 400, None, "messages"),  # a malformed body: 400 as OpenAI, not FastAPI's 422
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, "text"),
        (TEXT, {"prompt": ["a", "b"]}, 400, None, "one string"),
    ],
)
def test_errors_in_openai_shape(serve_tiny, path, body, status, code, needle):
    _, url = serve_tiny()
    for stream in (False, True):  # a request that fails validation fails before any event is sent
        response = httpx.post(f"{url}{path}", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == code
        assert needle in error["message"]


def test_unknown_route_and_model_lookup(serve_tiny):
    engine, url = serve_tiny()
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [engine.model_name]
    assert models["data"][0]["max_model_len"] == engine.context_window
    assert httpx.get(f"{url}/v1/models/default").json()["id"] == engine.model_name
    assert httpx.get(f"{url}/v1/models/other").json()["error"]["code"] == "model_not_found"
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["queue"]["waiting"] == 0 and health["queue"]["running"] == 0


def test_served_model_name(serve_tiny):
    _, url = serve_tiny(ServerSettings(model_name="kvrag-tiny"))
    body = {"model": "kvrag-tiny", "prompt": "the king", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["model"] == "kvrag-tiny"


def test_tenants_by_api_key_never_share_kv(serve_tiny):
    settings = ServerSettings(tenants=TenantMap(api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}))
    engine, url = serve_tiny(settings)
    docs = make_docs(3, seed=7)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    httpx.post(f"{url}/v1/documents", json={"documents": docs, "warm": True}, headers=a, timeout=60)
    body = {"messages": rag_messages(docs), "max_tokens": 2}
    as_b = httpx.post(f"{url}/v1/chat/completions", json=body, headers=b, timeout=60).json()
    engine.flush()
    as_a = httpx.post(f"{url}/v1/chat/completions", json=body, headers=a, timeout=60).json()
    assert as_b["kvrag"]["chunk_hits"] == 0 and as_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert as_a["kvrag"]["chunk_hits"] == 3
    for headers in ({}, {"Authorization": "Bearer key-c"}, {"Authorization": "key-a"}):
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_tenants_by_header_never_share_kv(serve_tiny):
    engine, url = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))
    docs = make_docs(2, seed=8)
    body = {"messages": rag_messages(docs), "max_tokens": 2, "documents": docs}
    httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Kvrag-Tenant": "a"}, timeout=60)
    engine.flush()
    hits = {
        tenant: httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()["kvrag"][
            "chunk_hits"
        ]
        for tenant, headers in (("b", {"X-Kvrag-Tenant": "b"}), ("default", {}), ("a", {"X-Kvrag-Tenant": "a"}))
    }
    assert hits == {"b": 0, "default": 0, "a": 2}


class _ClosedFromAnyThread:
    """A generator over an engine stream whose ``close`` is the engine stream's (safe from any thread, as
    the server's loop closes it while a worker thread iterates); the generator then ends on its own."""

    def __init__(self, gen, inner) -> None:
        self.gen, self.inner = gen, inner

    def __next__(self):
        return next(self.gen)

    def close(self) -> None:
        self.inner.close()


def paced(engine, monkeypatch, gate: threading.Event):
    """Make ``engine.stream`` hold after its first piece until ``gate`` is set; returns what it saw."""
    seen = {"streams": [], "pieces": 0, "closed": threading.Event()}
    real = engine.stream

    def stream(*args, **kwargs):
        inner = real(*args, **kwargs)
        seen["streams"].append(inner)

        def pieces():
            try:
                for piece in inner:
                    seen["pieces"] += 1
                    yield piece
                    gate.wait(30)
                return inner.generation
            finally:
                inner.close()
                seen["closed"].set()

        return GenerationStream(_ClosedFromAnyThread(pieces(), inner))

    monkeypatch.setattr(engine, "stream", stream)
    return seen


def test_client_disconnect_mid_stream_closes_the_engine_stream(serve_tiny, monkeypatch):
    engine, url = serve_tiny()
    gate = threading.Event()
    seen = paced(engine, monkeypatch, gate)
    body = {"prompt": "the king of the river city", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one token, then the client goes away
    for _ in range(1500):  # the server notices the disconnect (bounded wait: 30 s on a loaded machine)
        if metric(url, "kvrag_requests_total", outcome="cancelled") == 1:
            break
        time.sleep(0.02)
    assert metric(url, "kvrag_requests_total", outcome="cancelled") == 1
    gate.set()  # the worker finishes the token it holds, sees the stop, and closes the engine stream
    assert seen["closed"].wait(30)
    (inner,) = seen["streams"]
    assert inner.generation is None and seen["pieces"] < 10  # stopped, not run to its 200 tokens
    assert metric(url, "kvrag_requests_running") == 0 and metric(url, "kvrag_requests_waiting") == 0


def test_error_after_the_stream_started_is_an_sse_error_event(serve_tiny, monkeypatch):
    engine, url = serve_tiny()
    monkeypatch.setattr(engine, "stream", failing_stream)
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["text"] == "partial"
    assert events[-1]["error"]["message"] == "the engine gave up" and "[DONE]" not in events
    assert metric(url, "kvrag_requests_total", outcome="error") == 1


def test_concurrent_requests_match_requests_run_alone(serve_tiny):
    engine, url = serve_tiny()
    prompts = [f"the {w} of the river city was born in" for w in ("king", "queen", "poet", "mayor", "bishop")]
    expected = {p: engine.generate(prompt=p, max_new_tokens=8, mode="full").text for p in prompts}
    results: dict[str, str] = {}

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 8, "mode": "full", "stream": prompt.endswith("n")}
        with httpx.Client(timeout=120) as http:
            if body["stream"]:
                with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    results[prompt] = "".join(e["choices"][0]["text"] for e in sse_events(response)[:-1])
            else:
                results[prompt] = http.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected
    assert metric(url, "kvrag_requests_total", outcome="ok") == len(threads)


def test_metrics_count_hits_and_tokens(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(2, seed=9)
    httpx.post(f"{url}/v1/documents", json={"documents": docs, "warm": True}, timeout=60)
    data = httpx.post(f"{url}/v1/chat/completions", json={"messages": rag_messages(docs)}, timeout=60).json()
    assert metric(url, "kvrag_chunk_hits_total") == 2
    assert metric(url, "kvrag_prompt_tokens_total") == data["usage"]["prompt_tokens"]
    assert metric(url, "kvrag_cached_tokens_total") == data["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert metric(url, "kvrag_time_to_first_token_seconds_count") == 1
    assert metric(url, "kvrag_requests_total", endpoint="/v1/chat/completions", outcome="ok") == 1


def test_end_conversation(serve_tiny):
    engine, url = serve_tiny()
    body = {"messages": [{"role": "user", "content": "where was the king born?"}], "conversation_id": "c1"}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert ("default", "c1") in engine.conversations
    assert httpx.delete(f"{url}/v1/conversations/c1").json()["deleted"] is True
    assert httpx.delete(f"{url}/v1/conversations/c1").json()["deleted"] is False


def test_an_overloaded_engine_is_a_503_with_retry_after(serve_tiny):
    engine, url = serve_tiny(ServerSettings(retry_after_s=3), max_queued=1)
    gate = hold_engine_thread(engine)  # the engine thread is busy: requests wait in its queue
    try:
        waiting = engine.stream(prefix="the king was born in", mode="full")  # the queue is full now
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "the king", "stream": stream}, timeout=60)
            assert response.status_code == 503 and response.headers["retry-after"] == "3"
            assert response.json()["error"]["code"] == "overloaded"
            assert "max_queued=1" in response.json()["error"]["message"]
        with Client(url) as client, pytest.raises(ServerError) as info:
            client.complete("the king")
        assert info.value.status_code == 503 and info.value.retry_after == 3.0 and info.value.code == "overloaded"
    finally:
        gate.set()
    assert "".join(waiting) == waiting.generation.text  # the queued request was not harmed
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "the king"}, timeout=60)
    assert response.status_code == 200  # and the server serves again


def test_request_options_reach_the_engine(serve_tiny):
    _, url = serve_tiny()
    docs = make_docs(2, seed=10)
    base = {"messages": rag_messages(docs), "max_tokens": 1, "documents": docs}
    for options, mode in (({"recompute_ratio": "auto"}, "blend"), ({"mode": "prefix"}, "prefix")):
        data = httpx.post(f"{url}/v1/chat/completions", json={**base, **options}, timeout=60).json()
        assert data["kvrag"]["mode"] == mode, data
    data = httpx.post(f"{url}/v1/chat/completions", json={**base, "recompute_ratio": 0.5}, timeout=60).json()
    assert data["kvrag"]["recompute_ratio"] == 0.5


def test_documents_as_a_retrieval_are_counted_per_tenant_and_ordered(serve_tiny):
    """``chunk_order`` on ``/v1/documents``: one retrieval, counted in the tenant's chunk-access table,
    answered with the prompt order; the client and an LLM's server link ask the same."""
    from kvrag.integrations._shared import ServerDocuments

    settings = ServerSettings(tenants=TenantMap(api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}))
    engine, url = serve_tiny(settings)
    docs = make_docs(3, seed=8)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    post = lambda body, headers: httpx.post(f"{url}/v1/documents", json=body, headers=headers, timeout=60)  # noqa: E731
    assert "order" not in post({"documents": docs}, a).json()  # a corpus: not a retrieval
    assert post({"documents": [docs[2]], "chunk_order": "retrieval"}, a).json()["order"] == [0]
    # tied counts: in the order their KV was computed, else in retrieval order
    assert post({"documents": docs, "chunk_order": "frequency"}, a).json()["order"] == [2, 0, 1]
    assert post({"documents": docs[::-1], "chunk_order": "frequency"}, b).json()["order"] == [0, 1, 2]
    assert engine.chunk_access("tenant-a").retrievals == 2 and engine.chunk_access("tenant-b").retrievals == 1
    bad = post({"documents": docs, "chunk_order": "popular"}, a)
    assert bad.status_code == 400 and "use one of 'retrieval', 'frequency'" in bad.json()["error"]["message"]
    link = ServerDocuments(Client(url, api_key="key-b"))
    assert link.record_retrieval(docs[::-1], order="retrieval") == [0, 1, 2]  # counted there too
    assert engine.chunk_access("tenant-b").retrievals == 2
    assert link.record_retrieval([docs[1], docs[0]], order="frequency") == [0, 1]
    assert engine.chunk_access("tenant-b").retrievals == 3
