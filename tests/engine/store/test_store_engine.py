"""The tiered store under the engine (tiny random Llama): tiers in stats, disk hits answer like
memory hits, 200 damaged entries, a full disk, kill -9 mid-write, processes sharing a directory,
and a restart across processes."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvrag import Engine, SamplingParams
from kvrag.engine.store import serial
from kvrag.engine.store.disk import SafeDisk
from tests.engine.store.helpers import (
    ROOT,
    Payload,
    engine_job,
    entry_path,
    key,
    record,
    run_engine_job,
    run_helper,
    same,
    subprocess_env,
    token_ids,
)
from tests.helpers import make_docs

pytestmark = pytest.mark.usefixtures("one_thread")


PREFIX = "<|im_start|>system\nanswer from the documents<|im_end|>\n<|im_start|>user\n"
SUFFIX = "question: where was the king born?<|im_end|>\n<|im_start|>assistant\n"


def engine(model, tok, cache_dir, **kw) -> Engine:
    """An engine over a disk tier. The loading controller is off: with it, the ratio (and so the
    answer) depends on how fast the disk was, and these tests compare answers across stores."""
    kw.setdefault("loading_controller", False)
    return Engine.from_model(
        model, tok, cache_dir=str(cache_dir), disk_tier=True, sampling=SamplingParams(max_new_tokens=4), **kw
    )


def answers(eng: Engine, docs, requests) -> list[tuple[list[int], list[bool]]]:
    out = []
    for req in requests:
        g = eng.generate([docs[i] for i in req], PREFIX, SUFFIX)
        eng.flush()  # prefix blocks written before the next request: runs are deterministic
        out.append((g.token_ids, [c.hit for c in g.stats.chunks]))
    return out


def test_disk_hits_answer_like_memory_hits_and_report_their_tier(tiny_model, tiny_tokenizer, tmp_path):
    docs = make_docs(4, seed=3)
    for prefetch in (True, False):
        eng = engine(tiny_model, tiny_tokenizer, tmp_path / str(prefetch), prefetch=prefetch)
        eng.warm(docs)
        mem = eng.generate(docs, PREFIX, SUFFIX)
        assert [c.tier for c in mem.stats.chunks] == ["memory"] * 4
        eng.store.memory.clear()
        disk = eng.generate(docs, PREFIX, SUFFIX)
        assert [c.tier for c in disk.stats.chunks] == ["disk"] * 4
        assert disk.token_ids == mem.token_ids
        st = eng.store.stats()
        assert st["disk"]["hits"] >= 4 and st["load"]["bytes"] > 0
        eng.close()


def _damage(path: str, how: str, rng: random.Random, marker: str) -> None:
    blob = open(path, "rb").read()
    if how == "flip":  # flip a few bits in the header, the token ids or a layer (not the padding)
        fd = os.open(path, os.O_RDONLY)
        h = serial.read_header(fd, len(blob))
        os.close(fd)
        hlen = serial._PRELUDE.unpack_from(blob)[1]
        spans = [(0, serial._PRELUDE.size + hlen), (h.body_offset, len(blob))]
        a, b = rng.choice(spans)
        data = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(a, b)
            data[i] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(data))
    elif how == "truncate":
        open(path, "wb").write(blob[: rng.randrange(len(blob))])
    elif how == "delete":
        os.remove(path)
    else:  # "pickle-file": the file's content replaced by a pickle
        open(path, "wb").write(pickle.dumps(Payload(marker)))


def test_200_damaged_entries_are_misses_never_crashes_never_wrong(tiny_model, tiny_tokenizer, tmp_path, caplog):
    import diskcache

    rng = random.Random(0)
    docs = make_docs(240, words=25, seed=11)
    order = list(range(240))
    rng.shuffle(order)
    requests = [order[i : i + 12] for i in range(0, 240, 12)]
    eng = engine(tiny_model, tiny_tokenizer, tmp_path / "damaged")
    eng.warm(docs)
    keys = [eng.planner.chunk_key(eng.prompt_tokenizer.tokenize(d)) for d in docs]
    eng.close()
    for copy in ("clean", "clean2"):
        shutil.copytree(tmp_path / "damaged", tmp_path / copy)

    # damage 200 entries of the 240, 40 of each kind
    marker = str(tmp_path / "payload-ran")
    store = engine(tiny_model, tiny_tokenizer, tmp_path / "damaged").store
    kinds = ["flip", "truncate", "delete", "pickle-file", "pickle-row"]
    damaged = rng.sample(range(240), 200)
    for n, i in enumerate(damaged):
        how = kinds[n % 5]
        if how == "pickle-row":  # the index row replaced by diskcache's default (pickling) disk layer
            plain = diskcache.Cache(str(store.disk.directory))
            plain.set(store.disk._name(keys[i]), Payload(marker))  # the entry as named in this codec
            plain.close()
        else:
            _damage(entry_path(store.disk, keys[i]), how, rng, marker)
    store.close()

    # the same requests on the damaged store, and on a clean store where those entries are simply missing
    caplog.set_level(logging.WARNING, logger="kvrag")
    hurt = engine(tiny_model, tiny_tokenizer, tmp_path / "damaged", write_back=False)
    got = answers(hurt, docs, requests)
    ref_eng = engine(tiny_model, tiny_tokenizer, tmp_path / "clean", write_back=False)
    for i in damaged:
        ref_eng.store.disk.remove(keys[i])
    ref = answers(ref_eng, docs, requests)
    ref_eng.close()
    assert got == ref  # same tokens and the same hits and misses, request by request
    assert sum(not h for _, hits in got for h in hits) == 200
    st = hurt.store.stats()
    assert st["disk"]["damaged"] == 200
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert not os.path.exists(marker)  # the planted payload never ran

    # go on: warming recomputes what was lost, and answers are then the clean store's
    hurt.warm(docs)
    healed = answers(hurt, docs, requests)
    hurt.close()
    clean = engine(tiny_model, tiny_tokenizer, tmp_path / "clean2")
    assert healed == answers(clean, docs, requests)
    clean.close()


def test_full_disk_skips_writes_and_keeps_serving(tiny_model, tiny_tokenizer, tmp_path, monkeypatch, caplog):
    docs = make_docs(3, seed=5)
    ref = engine(tiny_model, tiny_tokenizer, tmp_path / "ok")
    ref.warm(docs)
    want = ref.generate(docs, PREFIX, SUFFIX).token_ids
    ref.close()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafeDisk, "_write", full)
    caplog.set_level(logging.WARNING, logger="kvrag")
    eng = engine(tiny_model, tiny_tokenizer, tmp_path / "full")
    eng.warm(docs)
    g = eng.generate(docs, PREFIX, SUFFIX)
    assert g.token_ids == want and g.stats.chunk_hits == 3
    assert eng.store.stats()["disk"]["write_errors"] >= 3  # chunks and prefix blocks
    assert sum("could not write" in r.getMessage() for r in caplog.records) == 1
    eng.close()


@pytest.mark.slow
def test_full_disk_in_a_process_with_a_file_size_limit(tmp_path):
    out = run_helper("full_disk", tmp_path / "kv", 90_000, timeout=120)
    res = json.loads(out.stdout)
    assert res == {"kept": 30, "served": 30, "disk_puts": 0, "write_errors": 30}
    assert out.stderr.count("could not write") == 1


@pytest.mark.slow
def test_kill_9_during_writes_leaves_nothing_that_reads_back_wrong(tmp_path):
    from kvrag.engine.store.disk import DiskStore

    directory = str(tmp_path / "kv")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.store.helpers", "writer", directory, "0", "400", "3000"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    stored = {int(proc.stdout.readline()) for _ in range(4)}
    time.sleep(0.02)  # somewhere in the middle of a 1.5 MB write
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stored.update(int(x) for x in proc.stdout.read().split())
    store = DiskStore(directory, 1 << 34)
    seen = 0
    for i in range(max(stored) + 5):  # everything the writer may have touched, and a little more
        rec = store.get(key(i, tokens=3000), token_ids(i, 3000))
        if i in stored:
            assert rec is not None  # acknowledged writes survive
        if rec is not None:
            seen += 1
            assert same(rec, record(i, tokens=3000))
    assert seen >= len(stored) and store.stats()["damaged"] == 0
    assert store.put(key(10_000), record(10_000)) and same(store.get(key(10_000)), record(10_000))
    store.close()


@pytest.mark.slow
def test_processes_share_one_directory(tmp_path):
    """Two child processes and this one put and get overlapping keys in one small directory."""
    from kvrag.engine.store.disk import DiskStore
    from tests.engine.store.helpers import _mixed

    directory = str(tmp_path / "kv")
    DiskStore(directory, 200_000).close()  # create it before the race
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engine.store.helpers", "mixed", directory, str(seed), "300"],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(2)
    ]
    time.sleep(1.0)  # let them start (importing torch) before this process joins in
    _mixed(directory, 99, 300)
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [r["wrong"] for r in results] == [0, 0] and sum(r["hits"] for r in results) > 0
    store = DiskStore(directory, 200_000)
    assert store.volume() <= 200_000
    store.close()


@pytest.mark.slow
def test_restart_a_fresh_process_gets_every_chunk_from_disk(tiny_model, tiny_tokenizer, tmp_path):
    """Process A (this one) warms 20 chunks into a disk tier; process B starts empty and gets all 20
    from disk, answering as A did."""
    model_dir, job = engine_job(tiny_model, tiny_tokenizer, tmp_path, PREFIX, SUFFIX)
    from tests.engine.store.helpers import _engine

    _engine(str(model_dir), str(tmp_path / "cache"), str(job), str(tmp_path / "a.json"), warm=True)
    run_engine_job(model_dir, tmp_path / "cache", job, tmp_path / "b.json", "cold")
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert all(r["tiers"] == ["memory"] * 4 for r in a)
    assert all(r["tiers"] == ["disk"] * 4 and r["hits"] == 4 for r in b)  # all 20 chunks hit, from disk
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]


def test_a_restarted_engine_finds_the_warms_second_variants(tiny_model, tiny_tokenizer, tmp_path):
    """A corpus warmed by similarity keeps two variants per chunk on disk; a new engine over the
    same directory warms it again computing nothing (it indexes the stored variants, reading them)
    and answers a reordered prompt as the first engine does."""
    docs = make_docs(4, seed=21)
    prompt = [docs[i] for i in (3, 1, 0, 2)]
    first = engine(tiny_model, tiny_tokenizer, tmp_path, write_back=False)
    assert first.warm(docs, order="similar").variants == 4
    want = first.generate(prompt, PREFIX, SUFFIX, mode="blend", recompute_ratio=0.15)
    first.close()
    again = engine(tiny_model, tiny_tokenizer, tmp_path, write_back=False)
    try:
        res = again.warm(docs, order="similar")
        assert (res.computed, res.variants) == (0, 0)
        assert again.store.stats()["hits"] == 0 and len(again.store.memory) == 0  # headers read, no KV
        keys = [again.planner.chunk_key(again.prompt_tokenizer.tokenize(d)) for d in docs]
        assert all(len(again.variants.index.keys(k)) == 2 for k in keys)
        got = again.generate(prompt, PREFIX, SUFFIX, mode="blend", recompute_ratio=0.15)
        assert got.token_ids == want.token_ids
        assert [c.fix for c in got.stats.chunks] == [c.fix for c in want.stats.chunks]
    finally:
        again.close()


def test_loading_controller_raises_the_ratio_only_when_loading_is_slow(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    docs = make_docs(4, seed=9)
    eng = engine(tiny_model, tiny_tokenizer, tmp_path, loading_controller=True)
    eng.warm(docs)
    eng.generate(docs, PREFIX, SUFFIX, mode="full")  # the profile learns what a full prefill costs
    eng.store.memory.clear()
    eng.store.meter.add(10**12, 1.0)  # a very fast tier: loading hides under any recompute
    fast = eng.generate(docs, PREFIX, SUFFIX, recompute_ratio=0.15)
    assert fast.stats.recompute_ratio == 0.15 and [c.tier for c in fast.stats.chunks] == ["disk"] * 4
    eng.store.memory.clear()
    eng.store.meter.add(1, 10**6)  # now a very slow one: recompute everything while waiting
    # and slow indeed: the tiny records would otherwise be read in whole before the prefill decides
    # (nothing left to load: nothing to hide under), as the planner's lookups take their time
    read = serial.Entry.read_layer_parts
    monkeypatch.setattr(serial.Entry, "read_layer_parts", lambda *a: (time.sleep(0.01), read(*a))[1])
    slow = eng.generate(docs, PREFIX, SUFFIX, recompute_ratio=0.15)
    assert slow.stats.recompute_ratio > 0.15 and eng.costs.loading.last["t_load"] > 0
    eng.close()


def test_tenants_sharing_a_directory_never_see_each_other(tiny_model, tiny_tokenizer, tmp_path):
    docs = make_docs(3, seed=13)
    a = engine(tiny_model, tiny_tokenizer, tmp_path, namespace="alice")
    a.warm(docs)
    a.close()
    bob = engine(tiny_model, tiny_tokenizer, tmp_path, namespace="bob", write_back=False)
    assert bob.generate(docs, PREFIX, SUFFIX).stats.chunk_hits == 0
    bob.close()
    alice = engine(tiny_model, tiny_tokenizer, tmp_path, namespace="alice")
    assert [c.tier for c in alice.generate(docs, PREFIX, SUFFIX).stats.chunks] == ["disk"] * 3
    alice.close()
