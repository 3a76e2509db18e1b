"""The 8-bit at-rest codec: error bounds, size, the format, and the same floats from every tier."""

from __future__ import annotations

import os

import pytest
import torch

from kvrag import Engine, SamplingParams
from kvrag.config import EngineConfig
from kvrag.engine.store import DiskStore, KVRecord, MemoryStore, TieredStore, build_store, serial
from kvrag.engine.store.codec import AtRest, CodedRecord, Int8Codec, PlainCodec
from kvrag.engine.store.remote import RemoteStore
from kvrag.errors import InvalidRequestError
from tests.engine.store.helpers import key, record, token_ids
from tests.helpers import make_docs

TINY = torch.finfo(torch.float16).tiny  # the smallest step kept (scales are normal fp16 numbers)
PREFIX = "<|im_start|>system\nanswer from the documents<|im_end|>\n<|im_start|>user\n"
SUFFIX = "question: where was the king born?<|im_end|>\n<|im_start|>assistant\n"


def kv_with_outlier_channels(h=2, t=150, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, t, d, generator=g)
    k[:, :, 3] *= 40  # a key channel with outliers all along the tokens (what per-channel keys are for)
    v = torch.randn(h, t, d, generator=g) * torch.rand(h, t, 1, generator=g) * 5
    return k, v


def test_int8_error_is_within_half_a_step_of_each_group():
    k, v = kv_with_outlier_channels()
    codec = Int8Codec(group=64)
    dk, dv = codec.decode_layer(codec.encode_layer(k, v))
    # the steps, from the definition: keys per channel over groups of 64 tokens, values per token
    for a in range(0, k.shape[1], 64):
        blk = k[:, a : a + 64]
        step = (blk.amax(1) - blk.amin(1)) / 255  # [H, D]
        err = (dk[:, a : a + 64] - blk).abs().amax(1)
        assert bool((err <= 0.5 * step * 1.01 + blk.abs().amax(1) * 2e-3 + 1e-6).all())
    step = ((v.amax(2) - v.amin(2)) / 255).clamp_min(TINY)  # [H, T]
    err = (dv - v).abs().amax(2)
    assert bool((err <= 0.5 * step * 1.01 + v.abs().amax(2) * 2e-3 + 1e-6).all())
    # per-channel keys keep the ordinary channels fine despite the outlier channel
    assert (dk[:, :, 0] - k[:, :, 0]).abs().max() < 0.05


def test_int8_is_about_half_of_fp16_at_rest():
    shape = dict(layers=4, heads=3, tokens=512, dim=64)
    rec = record(1, **shape)
    fp16 = len(serial.encode(key(1, tokens=512), rec, PlainCodec("float16")))
    int8 = len(serial.encode(key(1, tokens=512), rec, Int8Codec()))
    assert 1.8 < fp16 / int8 < 2.0


def test_format_round_trip_and_damage_with_the_codec(tmp_path):
    rec = Int8Codec().at_rest(record(2, stats=True))
    data = serial.encode(key(2), rec, rec.codec)
    path = tmp_path / "e"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        h = serial.read_header(fd, len(data))
        back = serial.read_record(fd, h, serial.read_tokens(fd, h))
    finally:
        os.close(fd)
    assert isinstance(back, CodedRecord) and all(torch.equal(a, b) for a, b in zip(back.parts, rec.parts))
    assert torch.equal(back.k, rec.k) and torch.equal(back.v, rec.v)
    bad = bytearray(data)
    bad[h.layer_offset(1) + 5] ^= 0xFF  # one code byte of layer 1
    path.write_bytes(bytes(bad))
    fd = os.open(path, os.O_RDONLY)
    try:
        h = serial.read_header(fd, len(bad))
        with pytest.raises(serial.DamagedEntryError, match="layer 1"):
            serial.read_record(fd, h, serial.read_tokens(fd, h))
    finally:
        os.close(fd)


def test_every_tier_yields_the_same_floats(tmp_path, remote_server):
    rec = record(3, tokens=100)
    k3 = key(3, tokens=100)

    def stack(**tiers):
        return TieredStore(MemoryStore(1 << 24), tiers.get("disk"), remote=tiers.get("remote"), codec="int8")

    disk = DiskStore(tmp_path / "kv", 1 << 24, codec="int8")
    remote = RemoteStore(remote_server.url, codec="int8")
    writer = stack(disk=disk, remote=remote)
    writer.put(k3, rec)
    from_memory = writer.get(k3, token_ids(3, 100))
    assert isinstance(from_memory, CodedRecord) and from_memory.tier == "memory"
    writer.memory.clear()
    from_disk = writer.get(k3, token_ids(3, 100))
    from_remote = stack(remote=RemoteStore(remote_server.url, codec="int8")).get(k3, token_ids(3, 100))
    assert (from_disk.tier, from_remote.tier) == ("disk", "remote")
    for layer in range(rec.num_layers):
        want = from_memory.layer(layer)
        for got in (from_disk.layer(layer), from_remote.layer(layer)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(from_memory.k, rec.k)  # it did go through the codec
    # a plain store on the same server never reads the codec's entries (other keys)
    assert RemoteStore(remote_server.url).get(k3, token_ids(3, 100)) is None
    writer.close()


def test_engine_answers_alike_from_memory_disk_and_remote(tiny_model, tiny_tokenizer, tmp_path, remote_server):
    docs = make_docs(4, seed=3)
    kw = dict(
        kv_codec="int8",
        sampling=SamplingParams(max_new_tokens=4),
        loading_controller=False,
        remote_url=remote_server.url,
    )
    eng = Engine.from_model(tiny_model, tiny_tokenizer, disk_tier=True, cache_dir=str(tmp_path), **kw)
    eng.warm(docs)
    mem = eng.generate(docs, PREFIX, SUFFIX)
    eng.store.memory.clear()
    disk = eng.generate(docs, PREFIX, SUFFIX)
    eng.close()
    other = Engine.from_model(tiny_model, tiny_tokenizer, **kw)  # memory + remote: a fresh process's view
    remote = other.generate(docs, PREFIX, SUFFIX)
    other.close()
    assert [c.tier for c in mem.stats.chunks] == ["memory"] * 4
    assert [c.tier for c in disk.stats.chunks] == ["disk"] * 4
    assert [c.tier for c in remote.stats.chunks] == ["remote"] * 4
    assert mem.token_ids == disk.token_ids == remote.token_ids


def test_the_codec_defaults_to_int8_with_a_remote_tier(tmp_path, remote_server):
    for dtype in ("bfloat16", "float16", "float32"):
        assert EngineConfig(dtype=dtype).resolved_kv_codec() == "plain"
    assert EngineConfig(disk_tier=True).resolved_kv_codec() == "plain"
    assert EngineConfig(remote_url="redis://h:6379/0").resolved_kv_codec() == "int8"
    assert EngineConfig(remote_url="redis://h:6379/0", kv_codec="plain").resolved_kv_codec() == "plain"
    assert build_store(EngineConfig(dtype="bfloat16")).at_rest.name == "plain"  # memory alone: as computed
    store = build_store(EngineConfig(remote_url=remote_server.url, disk_tier=True, cache_dir=str(tmp_path)))
    try:
        assert store.remote.at_rest.tag == store.disk.at_rest.tag == store.at_rest.tag == AtRest("int8").tag
    finally:
        store.close()


def test_config_validates_the_remote_fields():
    assert EngineConfig(kv_codec="int8", remote_url="rediss://:pw@cache.example:6380/1").kv_codec == "int8"
    for bad in (
        dict(kv_codec="int4"),
        dict(remote_url="http://x"),
        dict(remote_timeout_s=0),
        dict(remote_ttl_s=-1),
        dict(remote_url="redis://h:99999"),
    ):
        with pytest.raises(InvalidRequestError):
            EngineConfig(**bad)


def test_a_clone_keeps_the_codes_and_decoding_to_encode_again_would_not():
    codec = Int8Codec()
    rec = codec.at_rest(record(4, tokens=130))
    twin = rec.clone()
    assert isinstance(twin, CodedRecord) and codec.at_rest(twin) is twin
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(twin.parts, rec.parts))
    assert twin.meta == rec.meta and twin.meta is not rec.meta
    # why a copy must stay codes: the decoded floats quantize again onto other levels
    again = codec.at_rest(KVRecord(rec.token_ids, rec.k, rec.v))
    assert not all(torch.equal(a, b) for a, b in zip(again.parts, rec.parts))
    plain = record(5)
    copy = plain.clone()
    assert torch.equal(copy.k, plain.k) and copy.k.data_ptr() != plain.k.data_ptr() and copy.meta == plain.meta
