"""The chunk store without a model: format, safe disk layer, tiers, policies, prefetch, controller."""

from __future__ import annotations

import os
import pickle
import threading
import time

import diskcache
import pytest
import torch

from kvrag.engine.store import DamagedEntryError, DiskStore, MemoryStore, TieredStore, build_store, serial
from kvrag.engine.store.policy import LRUPolicy, PGDSFPolicy
from kvrag.engine.store.prefetch import LoadingController, ThroughputMeter
from kvrag.engine.store.profile import CostProfile
from tests.engine.store.helpers import Payload, entry_path, key, record, same, token_ids


def tiered(tmp_path, memory=1 << 20, disk=1 << 22, policy="lru", **kw) -> TieredStore:
    return TieredStore(MemoryStore(memory, policy), DiskStore(tmp_path / "kv", disk), **kw)


# -- format ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_format_round_trip_whole_and_by_layer(tmp_path, dtype):
    rec = record(1, stats=True)
    data = serial.encode(key(1), rec, dtype)
    path = tmp_path / "e"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        h = serial.read_header(fd, len(data))
        assert h.shape == tuple(rec.k.shape) and h.kind == "chunk" and h.meta == {"i": 1}
        ids = serial.read_tokens(fd, h)
        whole = serial.read_record(fd, h, ids)
        assert whole.k.dtype == dtype and whole.tier == "disk" and torch.equal(whole.token_ids, rec.token_ids)
        assert torch.equal(whole.k, rec.k.to(dtype)) and torch.equal(whole.v, rec.v.to(dtype))
        torch.testing.assert_close(whole.stats["inter"], rec.stats["inter"])
        k, v = torch.empty_like(whole.k[2]), torch.empty_like(whole.v[2])
        serial.read_layer_into(fd, h, 2, k, v)
        assert torch.equal(k, whole.k[2]) and torch.equal(v, whole.v[2])
    finally:
        os.close(fd)


def test_format_detects_every_kind_of_damage(tmp_path):
    data = serial.encode(key(2), record(2), torch.float16)
    h_end = 64  # inside the header

    def check(blob, where):
        path = tmp_path / "e"
        path.write_bytes(blob)
        fd = os.open(path, os.O_RDONLY)
        try:
            h = serial.read_header(fd, len(blob))
            serial.read_record(fd, h, serial.read_tokens(fd, h))
        finally:
            os.close(fd)
        raise AssertionError(f"damage {where} not detected")

    flip = lambda b, i: b[:i] + bytes([b[i] ^ 0x10]) + b[i + 1 :]  # noqa: E731
    cases = {
        "header": flip(data, h_end),
        "layer": flip(data, len(data) - 100),
        "magic": flip(data, 0),
        "truncated": data[:-5],
        "extended": data + b"\0",
        "pickle": pickle.dumps({"a": 1}),
    }
    for where, blob in cases.items():
        with pytest.raises(DamagedEntryError):
            check(blob, where)


# -- the disk layer never unpickles --------------------------------------------------------------


def test_disk_refuses_pickled_values_and_keys(tmp_path):
    store = DiskStore(tmp_path / "kv", 1 << 22)
    store.put(key(1), record(1))
    marker = str(tmp_path / "payload-ran")
    # another program writes pickles into the same directory with diskcache's default disk layer
    plain = diskcache.Cache(str(tmp_path / "kv"))
    plain.set(f"{key(2).namespace}/{key(2).digest}", Payload(marker))  # a pickled value under a real key
    plain.set(Payload(marker + "-key"), b"x")  # a pickled key
    plain.close()
    # a file's content replaced by a pickle
    with open(entry_path(store, key(1)), "wb") as f:
        f.write(pickle.dumps(Payload(marker + "-file")))
    assert store.get(key(2), token_ids(2)) is None
    assert store.get(key(1), token_ids(1)) is None
    store.put(key(3), record(3))
    store._make_room(1 << 22)  # evicts everything, the planted rows too (by row id, never unpickled)
    assert not any(os.path.exists(m) for m in (marker, marker + "-key", marker + "-file"))
    assert store.stats()["damaged"] == 2 and len(store) == 0
    store.close()


def test_disk_stays_within_budget_and_evicts_least_recently_used(tmp_path):
    size = len(serial.encode(key(0), record(0), torch.float16))
    store = DiskStore(tmp_path / "kv", 64 * 1024 + 4 * size)  # the index itself takes a few pages
    for i in range(12):
        store.put(key(i), record(i))
        if i == 6:
            assert store.get(key(0), token_ids(0)) is not None  # recently used: kept
        assert store.volume() <= store.budget_bytes
    assert store.contains(key(0)) and store.contains(key(11)) and not store.contains(key(5))
    assert store.stats()["evictions"] > 0
    assert not store.put(key(99, tokens=4000), record(99, tokens=4000))  # larger than the budget
    store.close()


# -- tiers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False])
def test_tiers_promote_on_hit_and_swap_out_only_once(tmp_path, prefetch):
    size = record(0).k.numel() * 2 * 2 + 40 * 8  # fp16 K and V plus token ids
    store = tiered(tmp_path, memory=3 * size, prefetch=prefetch)
    for i in range(6):
        assert store.put(key(i), record(i))
    assert len(store.memory) == 3 and store.disk.stats()["puts"] == 6
    for i in (3, 4, 5, 0, 1, 2):  # 0..2 were evicted from memory: served from disk, promoted
        rec = store.get(key(i), token_ids(i))
        assert rec.tier == ("memory" if i >= 3 else "disk") and same(rec, record(i))
    store._prefetcher.close()  # finish promotions
    st = store.stats()
    assert st["promotions"] == 3 and st["memory"]["bytes"] <= 3 * size
    assert store.get(key(0), token_ids(0)).tier == "memory"  # promoted copies are memory hits
    assert store.put(key(0), record(0))  # already on disk: not written again
    assert store.disk.stats()["puts"] == 6 and st["disk"]["hits"] == 3
    store.close()


def test_meta_reads_a_header_alone_and_counts_no_use(tmp_path):
    """``meta`` is a look, not a use: memory, disk and the tiers above them give a record's meta
    without counting a hit or promoting it into memory."""
    store = tiered(tmp_path, prefetch=False)
    assert store.put(key(1), record(1))
    store.memory.clear()
    assert store.meta(key(1)) == {"i": 1} and store.meta(key(2)) is None
    assert not store.memory.contains(key(1))
    st = store.stats()
    assert st["hits"] == 0 and st["disk"]["hits"] == 0
    assert store.memory.put(key(3), record(3)) and store.memory.meta(key(3)) == {"i": 3}
    assert store.memory.stats()["hits"] == 0
    store.close()


def test_peek_reads_a_record_and_counts_no_use(tmp_path):
    """``peek`` reads the whole record as a look: no hit counted on any tier, nothing promoted into
    memory, and a speculative entry stays "not used yet" (still the first to go)."""
    store = tiered(tmp_path, prefetch=False)
    assert store.put(key(1), record(1))
    store.memory.clear()
    got = store.peek(key(1), token_ids(1))
    assert same(got, record(1)) and got.tier == "disk"
    assert store.peek(key(1), token_ids(1) + 1) is None and store.peek(key(2)) is None
    assert not store.memory.contains(key(1))
    st = store.stats()
    assert (st["hits"], st["misses"], st["promotions"], st["disk"]["hits"], st["disk"]["misses"]) == (0, 0, 0, 0, 0)
    assert store.memory.put(key(3), record(3), speculative=True)
    assert same(store.memory.peek(key(3), token_ids(3)), record(3))
    assert store.memory.stats()["hits"] == 0 and key(3) in store.memory._speculative
    store.close()


def test_namespaces_never_see_each_other(tmp_path):
    a = tiered(tmp_path)
    a.put(key(1, "alice"), record(1))
    b = tiered(tmp_path)  # same directory, another process-like store
    assert b.get(key(1, "bob"), token_ids(1)) is None and not b.contains(key(1, "bob"))
    assert same(b.get(key(1, "alice"), token_ids(1)), record(1))
    a.close(), b.close()


def test_tokens_verify_every_hit(tmp_path):
    store = tiered(tmp_path)
    store.put(key(1), record(1))
    other = token_ids(1) + 1
    assert store.get(key(1), other) is None
    store.memory.clear()
    assert store.get(key(1), other) is None and store.disk.stats()["damaged"] == 0
    store.close()


def test_streamed_record_fails_on_a_damaged_layer_and_is_dropped(tmp_path):
    store = tiered(tmp_path)
    store.put(key(1), record(1))
    store.memory.clear()
    path = entry_path(store.disk, key(1))
    blob = bytearray(open(path, "rb").read())
    blob[-3] ^= 0x01  # last layer
    open(path, "wb").write(bytes(blob))
    rec = store.get(key(1), token_ids(1))  # header and tokens are fine: a streamed hit
    assert rec is not None and rec.tier == "disk"
    with pytest.raises(DamagedEntryError):
        for layer in range(rec.num_layers):
            rec.layer(layer)
    store._prefetcher.close()
    assert not store.contains(key(1)) and store.stats()["disk"]["damaged"] == 1
    store.close()


def test_threads_share_a_store(tmp_path):
    store = tiered(tmp_path, memory=6 * 1500)
    errors = []

    def work(seed):
        try:
            for n in range(40):
                i = (seed * 7 + n) % 10
                if n % 3 == 0:
                    store.put(key(i), record(i))
                else:
                    rec = store.get(key(i), token_ids(i))
                    if rec is not None and not same(rec, record(i)):
                        errors.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    store.close()


def test_build_store_from_config(tmp_path):
    from kvrag import EngineConfig

    assert isinstance(build_store(EngineConfig()), MemoryStore)
    st = build_store(EngineConfig(disk_tier=True, cache_dir=str(tmp_path), eviction_policy="pgdsf"))
    assert isinstance(st, TieredStore) and st.disk.directory == tmp_path / "kv" and st.policy.name == "pgdsf"
    st.close()


# -- policies and costs ------------------------------------------------------------------------


def test_lru_order():
    lru = LRUPolicy()
    for k in "abc":
        lru.insert(k, 1)
    lru.access("a", True)
    assert lru.victim() == "b"


def test_pgdsf_counts_reuses_by_their_fix_overhead():
    """Cache-Craft's frequency-reuse inside PGDSF: a reuse with fix overhead CFO counts 1/CFO accesses."""
    p = PGDSFPolicy()
    for k in "abc":
        p.insert(k, 1)
        p.record_cost(k, 1.0)
    for k, cfo in (("a", 0.5), ("b", 0.05), ("c", 1.0)):
        p.access(k, True)
        p.record_reuse(k, cfo)
    assert p.value_of("a")[0] == 2 and p.value_of("b")[0] == 10 and p.value_of("c")[0] == 1  # b floored at 0.1
    assert p.victim() == "c"
    p.record_reuse("c", 0.01)  # an exact reuse moves it up
    assert p.victim() == "a"


def test_pgdsf_priority_clock_and_cost():
    p = PGDSFPolicy()
    for k in "abc":
        p.access(k, False)
        p.insert(k, 1)
    p.record_cost("a", 2.0)  # expensive to recompute
    p.record_cost("b", 1.0)
    p.record_cost("c", 1.0)
    p.access("c", True)  # c: frequency 2, cost 1 -> 2; a: 1 x 2 = 2; b: 1
    assert p.victim() == "b"
    p.evicted("b")
    assert p.clock == pytest.approx(1.0)  # the clock rises to the victim's priority
    p.access("d", False)
    p.insert("d", 1)  # a newcomer starts at clock + its frequency x mean cost
    assert p.priority("d") == pytest.approx(1.0 + 1 * (4.0 / 3))
    # history survives eviction: b comes back with its frequency
    p.access("b", False)
    assert p._meta["b"].frequency == 2


def test_pgdsf_keeps_hot_entries_that_lru_drops():
    """A scan of one-off keys flushes LRU; PGDSF keeps the frequently used ones."""
    hits = {}
    for name in ("lru", "pgdsf"):
        m = MemoryStore(4 * record(0).nbytes, name)
        hot = [key(i) for i in range(3)]
        for n in range(60):
            k = hot[n % 3] if n % 2 == 0 else key(100 + n)
            i = int(k.digest, 16) % 7  # any record: sizes are equal
            if m.get(k) is None:
                m.put(k, record(i))
        hits[name] = m.stats()["hits"]
    assert hits["pgdsf"] > hits["lru"]


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_a_pinned_batch_never_evicts_its_own_members(policy):
    """PGDSF ranks old, often used entries above fresh ones: without pins, warming a batch into a
    full tier evicts the batch's first members to make room for its last."""
    m = MemoryStore(4 * record(0).nbytes, policy)
    old = [key(i) for i in range(4)]
    for i, k in enumerate(old):
        m.put(k, record(i))
        for _ in range(5 * (i > 0)):  # old[0] is cold, the others hot
            m.get(k)
            m.record_reuse(k, 0.5)
    m.record_cost(old, 1.0)
    batch = [key(10 + i) for i in range(3)]
    for pin in (False, True):
        for k in batch:
            m.remove(k)
        with m.pinned(batch if pin else []):
            for i, k in enumerate(batch):
                m.put(k, record(10 + i))
        kept = [m.contains(k) for k in batch]
        assert all(kept) == (pin or policy == "lru"), (pin, kept)  # value-aware policies need the pin
    assert all(m.contains(k) for k in batch)
    with m.pinned([key(20), *batch]):  # a batch larger than the tier: a pinned entry goes after all
        for i in range(2):
            m.put(key(20 + i), record(20 + i))
    assert m.stats()["bytes"] <= m.budget_bytes and m.contains(key(21))
    with m.pinned([key(30)]):
        pass
    assert not m._pins  # released


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_speculative_entries_rank_last_until_used(policy):
    p = LRUPolicy() if policy == "lru" else PGDSFPolicy()
    for k in "ab":
        p.access(k, False)
        p.insert(k, 1)
        p.record_cost(k, 1.0)
    p.insert("s", 1, speculative=True)
    p.insert("t", 1, speculative=True)
    assert p.victim() == "s"  # the oldest speculative entry first, before any entry a request kept
    p.evicted("s")
    assert p.victim() == "t"
    p.access("t", True)  # used: an ordinary entry from now on
    assert p.victim() != "t"
    if policy == "pgdsf":
        p.insert("u", 1, speculative=True)
        assert p.value_of("u")[0] == 0  # the tier below ranks it last too
        assert p.value_of("t")[0] >= 1


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_a_speculative_put_never_evicts_what_requests_kept(policy):
    """A speculative put takes free room or the room of other unused speculative entries; an
    ordinary put evicts speculative entries first: the request-kept population is what it would be
    without them."""
    size = record(0).nbytes
    m = MemoryStore(3 * size, policy)
    for i in range(2):
        assert m.put(key(i), record(i))
    assert m.put(key(10), record(10), speculative=True)  # free room
    assert m.put(key(11), record(11), speculative=True)  # in place of the older speculative entry
    assert not m.contains(key(10)) and all(m.contains(key(i)) for i in (0, 1, 11))
    assert m.put(key(2), record(2))  # an ordinary put: the speculative entry goes, not key 0 or 1
    assert all(m.contains(key(i)) for i in range(3)) and not m.contains(key(11))
    assert not m.put(key(12), record(12), speculative=True)  # only a request's entry could make room
    assert m.stats()["speculative_refused"] == 1 and all(m.contains(key(i)) for i in range(3))
    m.remove(key(2))
    assert m.put(key(12), record(12), speculative=True)
    assert m.get(key(12)) is not None  # used: an ordinary entry from now on
    assert not m.put(key(13), record(13), speculative=True)
    assert m.put(key(3), record(3))
    assert m.contains(key(3)) and m.stats()["bytes"] <= m.budget_bytes
    # entries 10 and 11 went unused; the last put evicted an entry a request had used
    assert (m.stats()["evictions"], m.stats()["speculative_evictions"]) == (3, 2)


def test_tiers_rank_a_speculative_entry_last_on_disk(tmp_path):
    t = TieredStore(MemoryStore(1 << 20, "pgdsf"), DiskStore(tmp_path / "kv", 1 << 22, policy="pgdsf"))
    t.memory.budget_bytes = 2 * t.at_rest(record(0)).nbytes  # two records as held at rest
    try:
        assert t.put(key(0), record(0))
        assert t.put(key(1), record(1), speculative=True)
        assert t.disk.contains(key(1))
        counts = dict(t.disk._cache._sql("SELECT key, access_count FROM Cache").fetchall())
        assert counts[t.disk._name(key(1))] == 0 and counts[t.disk._name(key(0))] >= 1
        assert t.put(key(2), record(2))  # memory is full: the speculative entry leaves memory first
        assert t.memory.contains(key(0)) and not t.memory.contains(key(1))
        assert t.get(key(1), token_ids(1)) is not None  # still on disk
    finally:
        t.close()


def test_cost_profile_interpolates_bilinearly():
    prof = CostProfile(edges=(0, 100, 200))
    for a, b, t in [(0, 100, 1.0), (0, 200, 2.0), (100, 100, 1.5), (100, 200, 3.0)]:
        prof.record(a, b, t)
    assert prof.estimate(50, 150) == pytest.approx((1.0 + 2.0 + 1.5 + 3.0) / 4)
    assert prof.seconds_per_token(0, 200) == pytest.approx(0.01)
    assert CostProfile().estimate(0, 10) is None


def test_loading_controller_raises_ratio_only_to_hide_recompute_under_loading():
    meter = ThroughputMeter()
    ctl = LoadingController(meter)
    assert ctl.ratio(0.15, 1000, 1.0) == 0.15  # no throughput measured yet
    meter.add(1_000_000, 1.0)  # 1 MB/s
    assert ctl.ratio(0.15, 100_000, 1.0) == 0.15  # loading 0.1 s hides under 0.15 s of recompute
    assert ctl.ratio(0.15, 400_000, 1.0) == pytest.approx(0.4)  # loading 0.4 s: recompute 40%
    assert ctl.ratio(0.15, 5_000_000, 1.0) == 1.0


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_chunks_hot_in_memory_keep_their_disk_copy(tmp_path, policy):
    """A hot chunk served from memory for a long time is not lost when the disk fills up and the
    memory finally drops it."""
    one = len(serial.encode(key(0), record(0), torch.float16))
    mem_one = record(0).k.numel() * 4 + 40 * 8
    store = tiered(tmp_path, memory=2 * mem_one, disk=96 * 1024 + 3 * one, policy=policy)
    store.put(key(0), record(0))
    for i in range(1, 12):  # key 0 is used all along; one-off keys stream through both tiers
        assert store.get(key(0), token_ids(0)) is not None
        store.record_cost([key(i)], 1.0)
        store.put(key(i), record(i))
    i = 20
    while store.memory.contains(key(0)) and i < 100:  # key 0 cools down until memory evicts it
        store.record_cost([key(i)], 1.0)
        store.put(key(i), record(i))
        i += 1
    assert not store.memory.contains(key(0))
    store.memory.clear()
    assert same(store.get(key(0), token_ids(0)), record(0))  # on disk
    assert store.disk.volume() <= store.disk.budget_bytes
    assert store.stats()["swap_outs"] >= 1  # the disk had dropped it: written again when memory did
    store.close()


def test_background_writer_runs_every_job_and_leaves_no_idle_thread():
    """An idle worker that has run torch ops slows the request thread down (its own OpenMP team):
    the writer's worker exits when the queue is empty, and no job is stranded by that."""
    from kvrag.engine.serving.writeback import BackgroundWriter

    w = BackgroundWriter(max_jobs=400)  # every job of the burst taken
    done: list[int] = []
    submitters = [
        threading.Thread(target=lambda i=i: [w.submit(lambda j=j: done.append(j)) for j in range(i, 400, 4)])
        for i in range(4)
    ]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    w.flush()
    assert sorted(done) == list(range(400))
    assert not any(t.name == "kvrag-writeback" for t in threading.enumerate())
    w.submit(lambda: 1 / 0)  # a failing job is logged, the next one still runs
    w.submit(lambda: done.append(-1))
    w.close()
    assert done[-1] == -1


def test_background_writer_frees_a_job_before_flush_returns():
    """What a job holds (a request's KV) is freed before flush() returns: freed afterwards, in the
    worker's teardown, a tensor's free could re-take the GIL while the interpreter finalises and the
    process aborted at exit (exit code 134, a script whose last request wrote back)."""
    import functools

    from kvrag.engine.serving.writeback import BackgroundWriter

    freed = threading.Event()

    class Held:
        def __del__(self):
            time.sleep(0.05)  # a large free takes a while
            freed.set()

    w = BackgroundWriter()
    for _ in range(3):
        freed.clear()
        w.submit(functools.partial(lambda held: None, Held()))
        w.flush()
        assert freed.is_set()
        assert not any(t.name == "kvrag-writeback" for t in threading.enumerate())
