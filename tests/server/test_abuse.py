"""``kvrag serve`` read as an attacker and as an OpenAI client would (issue 59): limits before any
work, the key before the body, one OpenAI-shaped error for every failure, a disconnect that stops
a queued request, OpenAI's defaults. Each test fails on the server before that issue.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from kvrag.server import ServerSettings, TenantMap  # noqa: E402
from kvrag.server.cli import parser  # noqa: E402
from kvrag.server.settings import Limits  # noqa: E402
from tests.helpers import hold_engine_thread, make_docs  # noqa: E402
from tests.server.test_app import metric, rag_messages  # noqa: E402

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
KEYS = ServerSettings(tenants=TenantMap(api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}))
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_five_thousand_stop_strings_are_a_400_at_once(serve_tiny):
    _, url = serve_tiny()
    t0 = time.perf_counter()
    many = httpx.post(f"{url}{TEXT}", json={"prompt": "the king", "stop": ["x" * 40] * 5000}, timeout=60)
    assert time.perf_counter() - t0 < 10  # refused before the engine sees it (the bound is loose: a shared CPU)
    error = openai_error(many, 400)
    assert "max_stop_strings" in error["message"] and error["param"] == "stop" and error["code"] == "limit_exceeded"
    long = httpx.post(f"{url}{CHAT}", json={"messages": HI, "stop": "y" * 300}, timeout=60)
    assert "max_stop_chars" in openai_error(long, 400)["message"]


def test_body_size_is_refused_announced_or_streamed(serve_tiny):
    engine, url = serve_tiny(ServerSettings(limits=Limits(max_body_bytes=2000)))
    body = json.dumps({"prompt": "the king " * 400}).encode()  # 3.6 KB
    announced = httpx.post(f"{url}{TEXT}", content=body, headers={"content-type": "application/json"}, timeout=60)
    error = openai_error(announced, 413)
    assert "max_body_bytes" in error["message"] and error["code"] == "request_too_large"
    assert announced.headers["connection"] == "close"  # the rest of the body is never read

    def chunked():  # no Content-Length: refused while it is read
        for i in range(0, len(body), 500):
            yield body[i : i + 500]

    streamed = httpx.post(f"{url}{TEXT}", content=chunked(), headers={"content-type": "application/json"}, timeout=60)
    assert "max_body_bytes" in openai_error(streamed, 413)["message"]
    assert streamed.headers["connection"] == "close"
    small = httpx.post(f"{url}{TEXT}", json={"prompt": "the king", "max_tokens": 2}, timeout=60)
    assert small.status_code == 200 and "connection" not in small.headers  # kept alive


def test_the_key_is_checked_before_the_body_is_read(serve_tiny):
    _, url = serve_tiny(ServerSettings(tenants=KEYS.tenants, limits=Limits(max_body_bytes=1 << 20)))
    headers = {"content-type": "application/json"}
    for content in (b"{not json", json.dumps({"prompt": "x" * (2 << 20)}).encode()):  # bad JSON; past the body limit
        refused = httpx.post(f"{url}{TEXT}", content=content, headers=headers, timeout=60)
        assert openai_error(refused, 401)["code"] == "invalid_api_key" and refused.headers["connection"] == "close"
    for path in ("/v1/models", "/metrics", "/v1/models/default"):  # behind the key too
        assert openai_error(httpx.get(f"{url}{path}", timeout=60), 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{url}{path}", headers=A, timeout=60).status_code == 200
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # a load balancer's check needs no key


def test_the_tenant_header_needs_an_explicit_flag(serve_tiny):
    engine, url = serve_tiny()  # the default: no header-chosen tenants
    error = openai_error(httpx.post(f"{url}{CHAT}", json={"messages": HI}, headers={"X-Kvrag-Tenant": "a"}), 400)
    assert "--trust-tenant-header" in error["message"]
    _, trusting = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))
    bad = httpx.post(f"{trusting}{CHAT}", json={"messages": HI}, headers={"X-Kvrag-Tenant": "a\tb"}, timeout=60)
    assert "printable" in openai_error(bad, 400)["message"]
    args = parser().parse_args(["--trust-tenant-header", "--max-stop-strings", "4"])
    assert args.trust_tenant_header and args.max_stop_strings == 4 and not parser().parse_args([]).trust_tenant_header


@pytest.mark.parametrize(
    ("path", "body", "limit"),
    [
        (CHAT, {"messages": HI, "documents": ["a document of some length"] * 5}, "max_documents"),
        (CHAT, {"messages": HI, "documents": ["d" * 300]}, "max_document_bytes"),
        (CHAT, {"messages": HI * 5}, "max_messages"),
        (CHAT, {"messages": [{"role": "user", "content": "é" * 200}]}, "max_message_bytes"),  # 400 bytes
        (TEXT, {"prompt": "p" * 600}, "max_prompt_bytes"),
        ("/v1/documents", {"documents": ["a document of some length"] * 5}, "max_documents"),
    ],
)
def test_each_limit_is_a_400_naming_it(serve_tiny, path, body, limit):
    limits = Limits(
        max_documents=4, max_document_bytes=256, max_messages=4, max_message_bytes=256, max_prompt_bytes=512
    )
    engine, url = serve_tiny(ServerSettings(limits=limits))
    error = openai_error(httpx.post(f"{url}{path}", json=body, timeout=60), 400)
    assert limit in error["message"] and f"--{limit.replace('_', '-')}" in error["message"]
    assert engine.queue_stats()["decode_steps"] == 0  # nothing ran


def test_unexpected_failures_are_openai_errors_with_a_request_id(serve_tiny, monkeypatch, caplog):
    engine, url = serve_tiny()
    surrogate = b'{"messages": [{"role": "user", "content": "hi"}], "documents": ["a lone \\ud800 surrogate in a doc"]}'
    bad = httpx.post(f"{url}{CHAT}", content=surrogate, headers={"content-type": "application/json"}, timeout=60)
    assert "not valid Unicode" in openai_error(bad, 400)["message"]
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    refused = httpx.post(f"{url}{CHAT}", json={"messages": HI}, timeout=60)
    assert "roles must alternate" in openai_error(refused, 400)["message"]

    def broken(*args, **kwargs):
        raise RuntimeError("a torch kernel failed at /secret/path.py")

    monkeypatch.setattr(engine, "stream", broken)
    with caplog.at_level(logging.ERROR, logger="kvrag.server"):
        fault = httpx.post(f"{url}{TEXT}", json={"prompt": "the king"}, timeout=60)
    error = openai_error(fault, 500)
    request_id = fault.headers["x-request-id"]
    assert request_id in error["message"] and "secret" not in fault.text and "Traceback" not in fault.text
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert httpx.get(f"{url}/health").headers["x-request-id"] != request_id  # every answer has its own


def test_unknown_and_unsupported_fields_are_refused_by_name(serve_tiny):
    _, url = serve_tiny()
    extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "guided_json": {}}
    error = openai_error(httpx.post(f"{url}{CHAT}", json={"messages": HI, **extra}, timeout=60), 400)
    assert error["code"] == "unknown_field" and all(name in error["message"] for name in extra)
    nested = httpx.post(f"{url}{CHAT}", json={"messages": [{"role": "user", "content": "hi", "foo": 1}]}, timeout=60)
    assert "messages.0.foo" in openai_error(nested, 400)["message"]
    for field, value in (("functions", [{"name": "f"}]), ("tool_choice", "auto"), ("logprobs", True)):
        refused = httpx.post(f"{url}{CHAT}", json={"messages": HI, field: value}, timeout=60)
        assert field in openai_error(refused, 400)["message"]
    fine = {
        "messages": HI,
        "max_tokens": 1,
        "user": "u1",
        "n": 1,
        "presence_penalty": 0,
        "response_format": {"type": "text"},
    }
    assert httpx.post(f"{url}{CHAT}", json=fine, timeout=60).status_code == 200


def test_max_tokens_defaults_to_the_rest_of_the_window_and_past_it_is_a_400(serve_tiny):
    engine, url = serve_tiny(max_context=48)
    prompt = "the king of the river city was born in"
    n = engine.count_tokens(prompt)
    data = httpx.post(f"{url}{TEXT}", json={"prompt": prompt}, timeout=60).json()
    usage = data["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 48 or data["choices"][0]["finish_reason"] == "stop"
    assert usage["completion_tokens"] > 8  # not the engine's default of 8 here (64 by default)
    over = httpx.post(f"{url}{TEXT}", json={"prompt": prompt, "max_tokens": 48 - n + 1}, timeout=60)
    error = openai_error(over, 400)
    assert error["code"] == "context_length_exceeded" and "max_tokens" in error["message"]
    fits = httpx.post(f"{url}{TEXT}", json={"prompt": prompt, "max_tokens": 48 - n - 1}, timeout=60)
    assert fits.status_code == 200


def test_documents_in_vllms_shape_and_under_kvrags_own_name(serve_tiny, monkeypatch):
    engine, url = serve_tiny()
    docs = make_docs(2, seed=21)
    question = [{"role": "user", "content": "where was the king born?"}]
    objects = [{"title": f"doc {i}", "text": d} for i, d in enumerate(docs)]
    unplaced = httpx.post(f"{url}{CHAT}", json={"messages": question, "documents": objects, "max_tokens": 1})
    assert "documents[0]" in openai_error(unplaced, 400)["message"]  # this template ignores documents
    template = (
        "{% if documents %}{% for d in documents %}<|im_start|>system\n{{ d['title'] }}: {{ d['text'] }}"
        "<|im_end|>\n{% endfor %}{% endif %}" + engine.tokenizer.chat_template
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    first = httpx.post(f"{url}{CHAT}", json={"messages": question, "documents": objects, "max_tokens": 1}).json()
    assert first["kvrag"]["chunk_misses"] == 2  # placed by the template, registered as chunks
    others = make_docs(2, seed=23)
    own = {"messages": rag_messages(others), "kvrag_documents": others, "max_tokens": 1}
    assert httpx.post(f"{url}{CHAT}", json=own, timeout=60).json()["kvrag"]["chunk_misses"] == 2
    both = httpx.post(f"{url}{CHAT}", json={**own, "documents": others}, timeout=60)
    assert "not both" in openai_error(both, 400)["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_is_cancelled_there(serve_tiny, stream):
    engine, url = serve_tiny()
    gate = hold_engine_thread(engine)  # the engine is busy: the request waits in its queue
    try:
        body = {"prompt": "the king of the river city", "max_tokens": 50, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", f"{url}{TEXT}", json=body, timeout=httpx.Timeout(60, read=1.0)) as response:
                response.read()
        for _ in range(500):  # the server notices the disconnect and takes the request out of the queue
            if engine.queue_stats()["waiting"] == 0:
                break
            time.sleep(0.02)
        assert engine.queue_stats()["waiting"] == 0
    finally:
        gate.set()
    engine.flush()
    for _ in range(500):
        if metric(url, "kvrag_requests_total", outcome="cancelled") == 1:
            break
        time.sleep(0.02)
    assert metric(url, "kvrag_requests_total", outcome="cancelled") == 1
    assert engine.queue_stats()["decode_steps"] == 0  # its prefill never ran


def test_metrics_report_the_store_per_tier(serve_tiny):
    engine, url = serve_tiny(memory_budget_bytes=4 << 20)
    httpx.post(f"{url}/v1/documents", json={"documents": make_docs(3, seed=22), "warm": True}, timeout=60)
    stats = engine.store.stats()
    memory = stats.get("memory", stats)  # a tiered store per tier; a memory store alone its own figures
    assert memory["bytes"] > 0
    assert metric(url, "kvrag_store_bytes", tier="memory") == memory["bytes"]
    assert metric(url, "kvrag_store_tokens", tier="memory") == memory["tokens"]
    assert metric(url, "kvrag_store_budget_bytes", tier="memory") == memory["budget_bytes"]
    assert metric(url, "kvrag_store_evictions_total", tier="memory") == memory["evictions"]
    engine.flush()
    writeback = engine.writeback.stats()
    assert metric(url, "kvrag_writeback_queued") == writeback["queued"] == 0
    assert metric(url, "kvrag_writeback_dropped_total") == writeback["dropped"]


def test_ids_with_control_characters_are_refused(serve_tiny):
    engine, url = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))
    tenant_a = {"X-Kvrag-Tenant": "a"}
    body = {"messages": HI, "max_tokens": 1, "conversation_id": "c1"}
    assert httpx.post(f"{url}{CHAT}", json=body, headers=tenant_a, timeout=60).status_code == 200
    forged = {**body, "conversation_id": "a\u0000c1"}  # the key the engine kept for tenant a's c1
    assert "conversation_id" in openai_error(httpx.post(f"{url}{CHAT}", json=forged, timeout=60), 400)["message"]
    assert openai_error(httpx.delete(f"{url}/v1/conversations/a%00c1", timeout=60), 400)
    assert httpx.delete(f"{url}/v1/conversations/c1", headers=tenant_a, timeout=60).json()["deleted"] is True
