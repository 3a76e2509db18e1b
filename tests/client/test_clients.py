"""kvrag's client against ``kvrag serve`` (tiny random Llama): the engine's results and errors over HTTP."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from kvrag import ContextLengthError, InvalidRequestError, ModelNotFoundError  # noqa: E402
from kvrag.client import AsyncClient, Client  # noqa: E402
from kvrag.errors import ServerError  # noqa: E402
from kvrag.server import ServerSettings, TenantMap  # noqa: E402
from tests.helpers import failing_stream, make_docs  # noqa: E402

QUESTION = "where was the king born?"


def messages(docs):
    return [{"role": "system", "content": "Documents:\n" + "".join(docs)}, {"role": "user", "content": QUESTION}]


def test_chat_and_stream_give_the_engines_generation(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3)
    with Client(url) as client:
        whole = client.chat(messages(docs), documents=docs, max_new_tokens=6, mode="full")
        stream = client.stream_chat(messages(docs), documents=docs, max_tokens=6, mode="full")
        pieces = list(stream)
    # the same request on the engine itself (the documents are registered by now)
    expected = engine.generate(prompt=engine.apply_chat_template(messages(docs)), max_new_tokens=6, mode="full")
    for gen in (whole, stream.generation):
        assert gen.text == expected.text and gen.finish_reason == expected.finish_reason
        assert gen.stats.prompt_tokens == expected.stats.prompt_tokens
        assert gen.stats.chunk_misses == 3 and [c.tokens for c in gen.stats.chunks] == [
            c.tokens for c in expected.stats.chunks
        ]
        assert gen.ttft_s > 0 and gen.total_s >= gen.ttft_s
    assert "".join(pieces) == expected.text


def test_complete_matches_the_engine(serve_tiny):
    engine, url = serve_tiny()
    prompt = "the queen of the harbor city was born in"
    expected = engine.generate(prompt=prompt, max_new_tokens=5, stop=["zz"])
    with Client(url + "/v1") as client:  # an OpenAI-style base URL is accepted too
        assert client.complete(prompt, max_new_tokens=5, stop=["zz"]).text == expected.text
        assert "".join(client.stream_complete(prompt, max_new_tokens=5)) == expected.text


def test_documents_registered_once_are_found_in_later_prompts(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3, seed=3)
    with Client(url) as client:
        warmed = client.warm(docs)
        assert warmed.computed == 3 and warmed.cached == 0
        gen = client.chat(messages(docs), max_new_tokens=2)  # no documents= : the server knows them
        assert gen.stats.chunk_hits == 3 and gen.stats.cached_tokens > 0
        assert len(client.register(make_docs(2, seed=4))) == 2
        assert client.model_card()["id"] == engine.model_name and client.health()


def test_errors_are_kvrag_errors(serve_tiny):
    engine, url = serve_tiny()
    with Client(url) as client:
        with pytest.raises(ContextLengthError) as info:
            client.complete("the king " * 600)
        assert info.value.limit == engine.context_window and info.value.prompt_tokens > info.value.limit
        with pytest.raises(InvalidRequestError, match="empty"):
            client.stream_complete("")
        with pytest.raises(InvalidRequestError, match="mode"):
            client.chat(QUESTION, mode="turbo")
        with pytest.raises(ModelNotFoundError, match="gpt-4o"):
            client.chat(QUESTION, model="gpt-4o")
        with pytest.raises(InvalidRequestError, match="unknown argument"):
            client.chat(QUESTION, top_k=3)
        with pytest.raises(InvalidRequestError, match="one argument"):
            client.chat(QUESTION, max_tokens=3, max_new_tokens=4)
        with pytest.raises(InvalidRequestError, match="documents"):
            client.chat(QUESTION, documents="one string")


def test_api_keys_and_unreachable_servers(serve_tiny):
    _, url = serve_tiny(ServerSettings(tenants=TenantMap(api_keys={"secret": "t1"})))
    with Client(url, api_key="secret") as client:
        assert client.complete("the king", max_new_tokens=1).finish_reason == "length"
    with Client(url, api_key="wrong") as client, pytest.raises(ServerError) as info:
        client.complete("the king")
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}") as client:
        assert not client.health()
        with pytest.raises(ServerError, match="cannot reach") as info:
            client.complete("the king")
        assert info.value.status_code is None


def test_tenant_header(serve_tiny):
    engine, url = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))
    docs = make_docs(2, seed=5)
    with Client(url, tenant="a") as a, Client(url, tenant="b") as b:
        a.warm(docs)
        assert b.chat(messages(docs), max_new_tokens=1).stats.chunk_hits == 0
        assert a.chat(messages(docs), max_new_tokens=1).stats.chunk_hits == 2


def test_an_error_event_mid_stream_is_raised(serve_tiny, monkeypatch):
    engine, url = serve_tiny()
    monkeypatch.setattr(engine, "stream", failing_stream)
    with Client(url) as client:
        stream = client.stream_complete("x")
        assert next(stream) == "partial"
        with pytest.raises(InvalidRequestError, match="gave up"):
            next(stream)


def cancelled(url: str) -> bool:
    return 'outcome="cancelled"} 1.0' in httpx.get(f"{url}/metrics").text


def test_closing_a_stream_stops_the_request(serve_tiny):
    _, url = serve_tiny()
    with Client(url) as client:
        stream = client.stream_complete("the king of the river city", max_new_tokens=900)
        next(stream)
        stream.close()
        for _ in range(1500):  # the server notices the closed connection (bounded wait: 30 s)
            if cancelled(url):
                break
            time.sleep(0.02)
        assert cancelled(url) and stream.generation is None


def test_async_client(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(2, seed=6)
    engine.register(docs)  # as the requests below will: the same chunk boundaries for the reference
    prompt = engine.apply_chat_template(messages(docs))
    expected = engine.generate(prompt=prompt, max_new_tokens=4, mode="full")

    async def run():
        async with AsyncClient(url) as client:
            whole = await client.chat(messages(docs), documents=docs, max_new_tokens=4, mode="full")
            stream = await client.stream_chat(messages(docs), documents=docs, max_new_tokens=4, mode="full")
            pieces = [p async for p in stream]
            text = (await client.complete("the king", max_new_tokens=2)).text
            streams = await asyncio.gather(*(client.stream_complete("the king", max_new_tokens=2) for _ in range(3)))
            texts = []
            for s in streams:
                texts.append([p async for p in s])
            early = await client.stream_complete("the king", max_new_tokens=500)
            await anext(early)
            await early.aclose()
            with pytest.raises(ContextLengthError):
                await client.complete("the king " * 600)
            return whole, stream.generation, pieces, text, texts, await client.model_card()

    whole, streamed, pieces, text, texts, card = asyncio.run(run())
    assert whole.text == streamed.text == "".join(pieces) == expected.text
    assert streamed.stats.chunk_misses == 2
    assert ["".join(t) for t in texts] == [text] * 3
    assert card["max_model_len"] == engine.context_window
