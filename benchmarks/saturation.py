"""A saturated engine stays inside its bounds: requests that all bring new documents, many at once.

    python -m benchmarks saturation [--model smollm2|tiny] [--requests 200] [--clients 16]
                                    [--docs 3] [--memory-mib 64] [--writeback-jobs 8] [--out FILE]

Each request brings ``--docs`` passages nobody sent before (every chunk misses, every miss is a
write-back job) and ``--clients`` threads send them at once, so the engine runs ``max_running``
requests and queues the rest, the memory tier (``--memory-mib``) evicts all the time, and the
write-back queue (bounded at ``--writeback-jobs`` jobs here, to see it full) drops what it cannot
take. Recorded while it runs, every 20 ms: the write-back queue's jobs and bytes, the memory
tier's bytes, the process's RSS. Then the same requests, one at a time, on a fresh idle engine
(nothing dropped): the answers must be identical, token for token.

The RSS bound checked: the RSS after the engine was built and warmed by one request, plus the
memory tier's budget, plus the write-back queue's byte bound, plus ``max_running`` requests' KV
buffers (their prompts' tokens at the model's bytes per token), plus 256 MiB of allocator slack.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.registry_lookup import make_passages

__all__ = ["main"]

QUESTION = "\nQuestion: which city did the passages name first? Answer briefly."
PREFIX = "Answer the question from the passages below.\n\n"


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _engine(model, memory: int, max_new: int):
    """An engine over ``model``: ``"smollm2"`` (the bundled model), ``"tiny"`` (a tiny random Llama) or
    ``(hf_model, tokenizer)`` already in memory."""
    from kvrag import Engine, SamplingParams

    sampling = SamplingParams(max_new_tokens=max_new)
    config = dict(sampling=sampling, memory_budget_bytes=memory, max_queued=256, disk_tier=False)
    if model == "tiny":
        from benchmarks.tiny import make_tiny_model, make_tokenizer

        tok = make_tokenizer()
        model = (make_tiny_model(len(tok)), tok)
    if isinstance(model, tuple):
        return Engine.from_model(*model, **config)
    return Engine.from_pretrained(**config)


def _requests(n: int, docs: int) -> list[list[str]]:
    return [make_passages(docs, seed=1000 + i, chars=400) for i in range(n)]


def _ask(engine, docs: list[str]):
    g = engine.generate(docs, PREFIX, QUESTION)
    return g.text, g.stats.prompt_tokens


def run(args) -> dict:
    """The measurement (``args``: the command line's; ``args.model`` may be ``(hf_model, tokenizer)``)."""
    from kvrag.engine.serving import writeback

    default = writeback.MAX_QUEUED_JOBS
    writeback.MAX_QUEUED_JOBS = args.writeback_jobs  # the writer built with the engine reads it
    try:
        return _run(args)
    finally:
        writeback.MAX_QUEUED_JOBS = default


def _run(args) -> dict:
    requests = _requests(args.requests, args.docs)
    memory = args.memory_mib * 1024**2
    engine = _engine(args.model, memory, args.max_new_tokens)
    try:
        _ask(engine, make_passages(args.docs, seed=1, chars=400))  # warm: first-call allocations
        engine.flush()
        base_rss = _rss()
        samples = {"queued": 0, "queued_bytes": 0, "memory_bytes": 0, "rss": base_rss}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                wb = engine.writeback.stats()
                for name, value in (
                    ("queued", wb["queued"]),
                    ("queued_bytes", wb["queued_bytes"]),
                    ("memory_bytes", engine.store.stats()["bytes"]),  # a MemoryStore: no disk tier here
                    ("rss", _rss()),
                ):
                    samples[name] = max(samples[name], value)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            saturated = list(pool.map(lambda d: _ask(engine, d), requests))
        seconds = time.perf_counter() - t0
        engine.flush()
        stop.set()
        watcher.join()
        wb = engine.writeback.stats()
        kv_per_token = engine.adapter.n_layers * engine.adapter.n_kv_heads * engine.adapter.head_dim * 2
        kv_per_token *= engine.adapter.dtype.itemsize
        running_kv = engine.config.max_running * max(t for _, t in saturated) * kv_per_token
        rss_bound = base_rss + memory + wb["max_bytes"] + running_kv + 256 * 1024**2
        store = engine.store.stats()
    finally:
        engine.close()
    idle = _engine(args.model, memory, args.max_new_tokens)
    try:
        alone = [_ask(idle, d) for d in requests]
        idle_wb = idle.writeback.stats()
    finally:
        idle.close()
    same = sum(a[0] == b[0] for a, b in zip(saturated, alone))
    return {
        "model": args.model if isinstance(args.model, str) else "given",
        "requests": args.requests,
        "clients": args.clients,
        "docs_per_request": args.docs,
        "seconds": round(seconds, 2),
        "writeback": {
            "max_jobs": wb["max_jobs"],
            "max_bytes": wb["max_bytes"],
            "peak_queued": samples["queued"],
            "peak_queued_bytes": samples["queued_bytes"],
            "dropped": wb["dropped"],
            "idle_engine_dropped": idle_wb["dropped"],
        },
        "memory_tier": {
            "budget_bytes": memory,
            "peak_bytes": samples["memory_bytes"],
            "evictions": store["evictions"],
        },
        "rss": {
            "after_load": base_rss,
            "peak": samples["rss"],
            "bound": rss_bound,
            "within": samples["rss"] <= rss_bound,
        },
        "answers_identical": f"{same}/{len(requests)}",
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks saturation", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--memory-mib", type=int, default=64)
    p.add_argument("--writeback-jobs", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    out = run(args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0
