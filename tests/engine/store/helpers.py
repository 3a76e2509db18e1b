"""Records, keys and subprocess jobs for the store tests (run as ``python -m tests.engine.store.helpers``)."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

from kvrag.engine.store import serial
from kvrag.engine.store.base import KVRecord, StoreKey, chunk_key

ROOT = str(Path(__file__).resolve().parents[3])  # the repository: tests/engine/store/helpers.py


def record(i: int, tokens: int = 40, layers: int = 4, heads: int = 2, dim: int = 8, stats: bool = False) -> KVRecord:
    """A deterministic record number ``i`` (fp16-exact values, so any at-rest dtype keeps them)."""
    g = torch.Generator().manual_seed(i)
    shape = (layers, heads, tokens, dim)
    k = torch.randn(shape, generator=g).half().float()
    v = torch.randn(shape, generator=g).half().float()
    extra = {"inter": torch.randn(layers, tokens, generator=g)} if stats else {}
    return KVRecord(token_ids(i, tokens), k, v, meta={"i": i}, stats=extra)


def token_ids(i: int, tokens: int = 40) -> torch.Tensor:
    return torch.arange(tokens) * 7 + i * 1000


def key(i: int, namespace: str = "test", tokens: int = 40) -> StoreKey:
    return chunk_key(namespace, "fingerprint", token_ids(i, tokens))


def same(rec, ref: KVRecord) -> bool:
    return bool(
        torch.equal(rec.k.float(), ref.k.float())
        and torch.equal(rec.v.float(), ref.v.float())
        and torch.equal(rec.token_ids, ref.token_ids)
    )


#: Ways an entry's bytes get damaged (:func:`damage`).
DAMAGE = ("truncate", "extend", "flip", "overwrite", "splice", "garbage")


def damage(blob: bytes, how: str, rng, other: bytes) -> bytes:
    """``blob`` (an encoded entry) damaged one way; ``other`` is another entry of the same layout
    (``splice`` puts this entry's header on its body). ``rng`` is a ``random.Random``."""
    out = bytearray(blob)
    if how == "truncate":
        return bytes(out[: rng.randrange(len(out))])
    if how == "extend":
        return bytes(out) + rng.randbytes(rng.randint(1, 64))
    if how == "flip":
        for pos in rng.sample(range(len(out) * 8), rng.randint(1, 8)):
            out[pos // 8] ^= 1 << (pos % 8)
        return bytes(out)
    if how == "overwrite":
        start = rng.randrange(len(out))
        out[start : start + 8] = rng.randbytes(rng.randint(1, 8))
        return bytes(out)
    if how == "splice":
        _, header_len, _ = struct.unpack("<8sII", blob[:16])  # the documented prelude
        cut = (16 + header_len + 63) // 64 * 64  # the body starts at the next 64-byte boundary
        return blob[:cut] + other[cut:]
    if how == "garbage":
        return serial.MAGIC + rng.randbytes(rng.randint(0, 300))
    raise ValueError(how)


def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def engine_job(model, tokenizer, tmp_path, prefix: str, suffix: str):
    """Save the tiny model and a job of 20 documents in 5 requests of 4; (model dir, job path)."""
    from tests.helpers import make_docs

    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    docs = make_docs(20, words=40, seed=7)
    job = {
        "docs": docs,
        "prefix": prefix,
        "suffix": suffix,
        "requests": [list(range(i, i + 4)) for i in range(0, 20, 4)],
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return model_dir, path


def run_helper(job: str, *args, timeout: float = 300):
    """Run one of this module's jobs in a fresh process (its ``CompletedProcess``, checked)."""
    import subprocess

    cmd = [sys.executable, "-m", "tests.engine.store.helpers", job, *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out


def run_engine_job(model_dir, cache_dir, job_path, out_path, mode: str, *remote_url: str) -> None:
    """Run :func:`_engine` in a fresh process (``mode``: ``warm`` or ``cold``)."""
    run_helper("engine", model_dir, cache_dir, job_path, out_path, mode, *remote_url)


# -- jobs run in child processes ------------------------------------------------------------------


def _writer(directory: str, start: int, count: int, tokens: int) -> None:
    """Write records start.. forever-ish (the parent kills us), printing each index once stored."""
    from kvrag.engine.store.disk import DiskStore

    store = DiskStore(directory, 1 << 34)
    for i in range(start, start + count):
        store.put(key(i, tokens=tokens), record(i, tokens=tokens))
        print(i, flush=True)


def _mixed(directory: str, seed: int, n: int) -> None:
    """Put and get a shared key range; report reads that came back wrong (must be none)."""
    import random

    from kvrag.engine.store.disk import DiskStore

    rng = random.Random(seed)
    store = DiskStore(directory, 200_000)  # small: evictions race with reads in other processes
    wrong = hits = 0
    for _ in range(n):
        i = rng.randrange(24)
        if rng.random() < 0.5:
            store.put(key(i), record(i))
        else:
            rec = store.get(key(i), token_ids(i))
            if rec is not None:
                hits += 1
                wrong += not same(rec, record(i))
    print(json.dumps({"wrong": wrong, "hits": hits, "volume": store.volume(), "stats": store.stats()}))


def _full_disk(directory: str, limit: int) -> None:
    """Cap this process's file size (a full disk, as write(2) sees it) and keep serving."""
    import logging
    import resource
    import signal

    from kvrag.engine.store.disk import DiskStore
    from kvrag.engine.store.memory import MemoryStore
    from kvrag.engine.store.tiered import TieredStore

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    store = TieredStore(MemoryStore(1 << 30), DiskStore(directory, 1 << 30))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(2) instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    kept = [store.put(key(i, tokens=400), record(i, tokens=400)) for i in range(30)]
    served = sum(same(store.get(key(i, tokens=400), token_ids(i, 400)), record(i, tokens=400)) for i in range(30))
    disk = store.disk.stats()
    print(
        json.dumps(
            {"kept": sum(kept), "served": served, "disk_puts": disk["puts"], "write_errors": disk["write_errors"]}
        )
    )


def _engine(model_dir: str, cache_dir: str, docs_path: str, out_path: str, warm: bool, remote_url=None) -> None:
    """Answer the questions in ``docs_path`` with an engine over a disk tier (or, given
    ``remote_url``, over a remote tier alone); report answers and tiers."""
    from kvrag import Engine, SamplingParams

    job = json.load(open(docs_path))
    tiers = dict(remote_url=remote_url) if remote_url else dict(disk_tier=True)
    engine = Engine.from_pretrained(
        model_dir,
        cache_dir=cache_dir,
        sampling=SamplingParams(max_new_tokens=8),
        loading_controller=False,
        num_threads=1,
        **tiers,
    )
    if warm:
        engine.warm(job["docs"])
    out = []
    for req in job["requests"]:
        g = engine.generate([job["docs"][i] for i in req], job["prefix"], job["suffix"])
        out.append({"tokens": g.token_ids, "tiers": [c.tier for c in g.stats.chunks], "hits": g.stats.chunk_hits})
    engine.close()
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    job, args = sys.argv[1], sys.argv[2:]
    if job == "writer":
        _writer(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif job == "mixed":
        _mixed(args[0], int(args[1]), int(args[2]))
    elif job == "full_disk":
        _full_disk(args[0], int(args[1]))
    elif job == "engine":
        _engine(args[0], args[1], args[2], args[3], args[4] == "warm", *args[5:6])
    else:
        raise SystemExit(f"unknown job {job}")


class Payload:
    """Unpickling this creates ``path``: proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def entry_path(store, k) -> str:
    with store._cache.transact():
        ((name,),) = store._cache._sql("SELECT filename FROM Cache WHERE key = ?", (store._name(k),))
    return os.path.join(store.directory, name)
