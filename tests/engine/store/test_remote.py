"""The remote tier on a real Valkey/Redis server (started per test on a free port): layout, tenants,
damaged and foreign entries, a server killed mid-stream and restarted, a hung server, a server
down at start, and two fresh processes sharing one server."""

from __future__ import annotations

import json
import logging
import pickle
import random
import threading

import pytest
import torch

from kvrag import Engine, SamplingParams
from kvrag.engine.store import serial
from kvrag.engine.store.remote import KEY_PREFIX, RemoteStore, RemoteUnavailableError
from tests.engine.store.helpers import Payload, engine_job, key, record, run_engine_job, same, token_ids
from tests.helpers import make_docs

PREFIX = "<|im_start|>system\nanswer from the documents<|im_end|>\n<|im_start|>user\n"
SUFFIX = "question: where was the king born?<|im_end|>\n<|im_start|>assistant\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def engine(model, tok, url, **kw) -> Engine:
    """An engine over memory + the remote tier (no disk). Loading controller off: the answers of
    these tests must not depend on how fast the server was. KV at rest in float32 and plain (not the
    remote default int8), so that reused blocks are exact and an engine that computes every chunk
    answers as the reference."""
    kw.setdefault("loading_controller", False)
    kw.setdefault("disk_dtype", "float32")
    kw.setdefault("kv_codec", "plain")
    return Engine.from_model(model, tok, remote_url=url, sampling=SamplingParams(max_new_tokens=4), **kw)


def ask(eng: Engine, docs, requests):
    """(token ids, chunk tiers) per request, write-back flushed after each (deterministic runs)."""
    out = []
    for req in requests:
        g = eng.generate([docs[i] for i in req], PREFIX, SUFFIX)
        eng.flush()
        out.append((g.token_ids, [c.tier for c in g.stats.chunks]))
    return out


def computed_answers(model, tok, docs, requests):
    """What a memory-only engine answers when it computes every chunk (the reference)."""
    eng = Engine.from_model(
        model, tok, sampling=SamplingParams(max_new_tokens=4), loading_controller=False, write_back=False
    )
    out = [eng.generate([docs[i] for i in req], PREFIX, SUFFIX).token_ids for req in requests]
    eng.close()
    return out


def test_round_trip_parts_ttl_and_key_layout(remote_server):
    store = RemoteStore(remote_server.url, part_bytes=4096, ttl=60)
    rec = record(1, tokens=100, stats=True)
    assert store.put(key(1, tokens=100), rec)
    client = remote_server.client()
    keys = sorted(k.decode() for k in client.keys("*"))
    head = store.rkey(key(1, tokens=100))
    assert head in keys and head.startswith(f"{KEY_PREFIX}:f16:test:") and len(keys) > 2  # split into parts
    assert all(0 < client.pttl(k) <= 60_000 for k in keys)
    got = store.get(key(1, tokens=100), token_ids(1, 100))
    assert got.tier == "remote" and same(got, rec)
    torch.testing.assert_close(got.stats["inter"], rec.stats["inter"])
    assert store.get(key(1, tokens=100), token_ids(2, 100)) is None  # tokens verify every hit
    assert store.put(key(1, tokens=100), record(3, tokens=100))  # the key exists: never overwritten
    assert same(store.get(key(1, tokens=100)), rec)
    hits = store.stats()["hits"]
    assert store.meta(key(1, tokens=100)) == {"i": 1} and store.meta(key(9, tokens=100)) is None
    assert same(store.peek(key(1, tokens=100), token_ids(1, 100)), rec) and store.peek(key(9, tokens=100)) is None
    assert store.stats()["hits"] == hits and store.stats()["misses"] == 1  # looks are not uses
    # the layers are byte ranges of the value: a streamed read asks for one layer at a time
    entry = store.open(key(1, tokens=100))
    assert entry.tier == "remote"
    k, v = torch.empty(2, 100, 8, dtype=torch.float16), torch.empty(2, 100, 8, dtype=torch.float16)
    entry.read_layer_parts(3, [k, v])
    assert torch.equal(k.float(), rec.k[3]) and torch.equal(v.float(), rec.v[3])
    store.close()


@pytest.mark.parametrize("size", [1, 8, 15, 16, 40, 200])
def test_a_value_truncated_inside_its_header_is_damage_not_eviction(remote_server, size):
    store = RemoteStore(remote_server.url)
    assert store.put(key(2), record(2))
    client = remote_server.client()
    head = store.rkey(key(2))
    client.set(head, client.get(head)[:size])
    assert store.get(key(2), token_ids(2, 40)) is None
    st = store.stats()
    assert (st["damaged"], st["vanished"]) == (1, 0) and not client.exists(head)  # dropped, to be rewritten
    store.close()


def test_tenants_on_one_server_never_share_an_entry(tiny_model, tiny_tokenizer, remote_server):
    docs = make_docs(3, seed=13)
    alice = engine(tiny_model, tiny_tokenizer, remote_server.url, namespace="alice")
    alice.warm(docs)
    alice.close()
    bob = engine(tiny_model, tiny_tokenizer, remote_server.url, namespace="bob")
    assert bob.generate(docs, PREFIX, SUFFIX).stats.chunk_hits == 0
    bob.flush()
    bob.close()
    names = {k.decode().split(":")[3] for k in remote_server.client().keys("*")}
    assert names == {"alice", "bob"}  # bob computed and wrote his own entries
    alice = engine(tiny_model, tiny_tokenizer, remote_server.url, namespace="alice")
    assert [c.tier for c in alice.generate(docs, PREFIX, SUFFIX).stats.chunks] == ["remote"] * 3
    alice.close()


def _damage(client, name: bytes, how: str, rng: random.Random, foreign: bytes) -> None:
    blob = client.get(name)
    if how == "flip":  # a flipped byte in the body (a layer or the token ids)
        pos = rng.randrange(len(blob) // 2, len(blob))
        client.setrange(name, pos, bytes([blob[pos] ^ 0x5A]))
    elif how == "truncate":
        client.set(name, blob[: rng.randrange(1, len(blob))])
    elif how == "foreign":  # a whole valid entry of another key
        client.set(name, foreign)
    elif how == "garbage":
        client.set(name, rng.randbytes(len(blob)))
    elif how == "list":  # not even a string value
        client.delete(name)
        client.rpush(name, b"not kvrag")
    elif how == "pickle":
        client.set(name, pickle.dumps(Payload("/nonexistent/kvrag-pwned")))
    else:  # everything past the first 64 bytes zeroed
        client.set(name, blob[:64] + b"\0" * (len(blob) - 64))


def test_100_damaged_or_foreign_entries_are_misses_served_by_recompute(
    tiny_model, tiny_tokenizer, remote_server, caplog
):
    docs = make_docs(100, words=30, seed=21)
    requests = [list(range(i, i + 4)) for i in range(0, 100, 4)]  # disjoint: every chunk is new
    ref = computed_answers(tiny_model, tiny_tokenizer, docs, requests)
    a = engine(tiny_model, tiny_tokenizer, remote_server.url)
    a.warm(docs)
    a.close()
    client = remote_server.client()
    chunk_keys = [k for k in client.keys("*") if serial.MAGIC in (client.getrange(k, 0, 7) or b"")]
    assert len(chunk_keys) >= 100
    rng = random.Random(0)
    foreign = client.get(chunk_keys[0])
    ways = ["flip", "truncate", "foreign", "garbage", "pickle", "list", "zeroed"]
    for i, name in enumerate(chunk_keys):
        _damage(client, name, ways[i % len(ways)], rng, foreign if i else client.get(chunk_keys[1]))
    b = engine(tiny_model, tiny_tokenizer, remote_server.url, write_back=False)
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        got = ask(b, docs, requests)
    assert [t for t, _ in got] == ref  # 0 wrong answers
    assert all(tiers == [""] * 4 for _, tiers in got)  # every chunk computed
    st = b.store.stats()["remote"]
    assert st["damaged"] >= 100  # each dropped (some only when a layer failed its checksum mid-stream)
    assert sum("unusable" in r.message for r in caplog.records) == 1  # warned once
    b.close()


def test_server_killed_mid_stream_then_restarted(tiny_model, tiny_tokenizer, remote_server, caplog, monkeypatch):
    docs = make_docs(8, seed=5)
    requests = [[0, 1, 2, 3], [4, 5, 6, 7], [3, 2, 1, 0]]
    ref = computed_answers(tiny_model, tiny_tokenizer, docs, requests)
    eng = engine(tiny_model, tiny_tokenizer, remote_server.url, write_back=False)
    eng.warm(docs)
    eng.store.memory.clear()
    read = serial.Entry.read_layer_parts
    calls = []

    def read_then_kill(self, layer, parts):
        calls.append(layer)
        if self.tier == "remote" and len(calls) == 3:
            remote_server.kill()  # mid-stream: some layers are in, the rest never come
        return read(self, layer, parts)

    monkeypatch.setattr(serial.Entry, "read_layer_parts", read_then_kill)
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        got = ask(eng, docs, requests)  # 0 failed requests
    monkeypatch.undo()
    assert [t for t, _ in got] == ref
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    assert not eng.store.remote.available
    # the server comes back (empty: no persistence); the tier reconnects after its backoff
    remote_server.start()
    assert eng.store.remote.retry_now()  # as if the backoff had passed
    eng.config = eng.config.replace(write_back=True)
    eng.writeback.config = eng.config
    eng.store.memory.clear()
    again = ask(eng, docs, requests[:2])  # misses: computed, written through
    assert [t for t, _ in again] == ref[:2] and eng.store.remote.available
    eng.store.memory.clear()
    hits = ask(eng, docs, requests[:2])
    assert all(tiers == ["remote"] * 4 for _, tiers in hits)  # hits resume
    eng.close()


def test_a_call_that_began_before_an_outage_does_not_end_it(remote_server, caplog):
    """A read in flight when another thread finds the server gone may still return what it had
    received; that says nothing of the server now: it stays down, and no recovery is logged."""
    store = RemoteStore(remote_server.url)
    started, release = threading.Event(), threading.Event()

    def in_flight():
        started.set()
        assert release.wait(10)
        return b"received before the outage"

    def refused():
        raise ConnectionError("connection refused")

    with caplog.at_level(logging.WARNING, logger="kvrag"):
        t = threading.Thread(target=store._call, args=(in_flight,))
        t.start()
        assert started.wait(10)
        with pytest.raises(RemoteUnavailableError):
            store._call(refused)
        release.set()
        t.join(10)
    assert not store.available
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    assert not any("reachable again" in r.message for r in caplog.records)
    assert store.retry_now() and store.available  # a call made after the outage does end it


def test_hung_server_times_out_and_requests_still_succeed(tiny_model, tiny_tokenizer, remote_server):
    docs = make_docs(4, seed=8)
    ref = computed_answers(tiny_model, tiny_tokenizer, docs, [[0, 1, 2, 3]])
    eng = engine(tiny_model, tiny_tokenizer, remote_server.url, remote_timeout_s=0.2, write_back=False)
    eng.warm(docs)
    eng.store.memory.clear()
    remote_server.pause()  # connections stay open, nothing answers
    try:
        got = ask(eng, docs, [[0, 1, 2, 3]])
    finally:
        remote_server.resume()
    assert [t for t, _ in got] == ref and got[0][1] == [""] * 4
    assert eng.store.stats()["remote"]["errors"] >= 1
    eng.close()


def test_server_down_at_start_serves_from_memory(tiny_model, tiny_tokenizer, remote_server, caplog):
    url = remote_server.url
    remote_server.kill()
    docs = make_docs(4, seed=2)
    with caplog.at_level(logging.WARNING, logger="kvrag"):
        eng = engine(tiny_model, tiny_tokenizer, url)
        first = eng.generate(docs, PREFIX, SUFFIX)
        eng.flush()
        second = eng.generate(docs, PREFIX, SUFFIX)
    assert first.stats.chunk_hits == 0 and [c.tier for c in second.stats.chunks] == ["memory"] * 4
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    assert eng.store.stats()["remote"]["puts"] == 0
    eng.close()


def test_two_fresh_processes_share_one_server(tiny_model, tiny_tokenizer, remote_server, tmp_path):
    """Process A warms 20 chunks into the server; process B (empty memory, no disk) gets all 20
    from the server and answers as A did."""
    model_dir, job = engine_job(tiny_model, tiny_tokenizer, tmp_path, PREFIX, SUFFIX)
    for name, mode in (("a", "warm"), ("b", "cold")):
        run_engine_job(model_dir, tmp_path / f"cache-{name}", job, tmp_path / f"{name}.json", mode, remote_server.url)
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert all(r["tiers"] == ["memory"] * 4 for r in a)
    assert all(r["tiers"] == ["remote"] * 4 and r["hits"] == 4 for r in b)  # all 20 chunks, from the server
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
