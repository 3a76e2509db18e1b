"""Smoke test of the engine on one device: does every path run there, and give what it gives on a CPU?

    python -m benchmarks.gpu_smoke --device cuda                        # a tiny random Llama, built offline
    python -m benchmarks.gpu_smoke --device cuda --model smollm2 --dtype bfloat16
    python -m benchmarks.gpu_smoke --device cpu                         # the same checks here (< 1 min)
    python -m benchmarks.gpu_smoke --device cuda --shape smollm2 --words 600 --only timing

Checks, each one line ``PASS``/``FAIL`` (a failure prints its exception and traceback, and the
next check runs):

0. ``gate``: the engine's self-test at load (fused path against transformers) passed on this device.
1. ``ratio 1.0``: a blend at recompute ratio 1.0 gives the full prefill's greedy tokens, on a few prompts.
2. ``default blend``: a second request with the first one's chunks reordered finds them cached and
   blends with the default settings; an answer comes out.
3. ``store round trip``: write-back of missed chunks, then memory hits, then (memory emptied) disk
   hits streamed back to the device, with the memory hits' tokens.
4. ``batched decode``: a few streams decoded together give the tokens each gives alone.
5. ``timing``: TTFT of the full prefill and of the default blend, decode tokens/s (one stream and
   batched); CUDA is synchronized around every wall-clock measurement.

Exit status 1 if any check failed. The model is the engine's ``--model`` (a bundled name, a local
Hugging Face directory or a ``.gguf``) or, by default, a tiny random Llama with a tokenizer trained
on the spot (nothing downloaded); ``--shape smollm2`` gives that random Llama SmolLM2-135M's
dimensions (30 layers, width 576, 9/3 heads, the tiny tokenizer's vocabulary), for timings of the
bundled model's shapes where its weights cannot travel (its answers mean nothing). Stores, gate
verdicts and the disk tier live in a temporary directory, so the self-test runs on this device.

``--only syncs``: where the host waits for the device during a decode request (with and without
drafts) and a default blend, counted by the line of Python that waited (CUDA's sync debug mode).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

from benchmarks.tiny import make_docs, make_tiny_model, make_tokenizer

__all__ = ["main"]

PREFIX = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
SUFFIX = "Question: where was the king born?<|im_end|>\n<|im_start|>assistant\n"
#: SmolLM2-135M's dimensions (its config), for a random model of its shapes (``--shape smollm2``)
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
)


class Checks:
    """Runs checks, prints one PASS/FAIL line each, remembers the failures."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the next one runs
            self.failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            print("    " + traceback.format_exc().rstrip().replace("\n", "\n    "), flush=True)
            return
        print(f"PASS {name}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(args) -> tuple[object, object, str]:
    """(model on the device, tokenizer, name)."""
    from kvrag import Engine
    from kvrag.engine.model.dtypes import resolve_dtype

    if args.model is None:
        tok = make_tokenizer()
        dtype = resolve_dtype(args.dtype, args.device).torch
        if args.shape == "smollm2":
            model = make_tiny_model(len(tok), layers=30, **SMOLLM2_SHAPE)
            return model.to(args.device, dtype), tok, "random llama of SmolLM2-135M's shapes"
        return make_tiny_model(len(tok)).to(args.device, dtype), tok, "tiny random llama"
    # the loader converts a bundled GGUF once (cached) and puts the weights on the device
    with Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype) as loaded:
        return loaded.hf_model, loaded.tokenizer, loaded.model_name


def _engine(model, tok, directory: str, max_new_tokens: int, **config):
    from kvrag import Engine, SamplingParams

    device = str(next(model.parameters()).device)
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    return Engine.from_model(model, tok, device=device, cache_dir=directory, sampling=sampling, **config)


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="a bundled name, HF directory or .gguf (default: tiny random Llama)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per request in the checks")
    p.add_argument("--reps", type=int, default=3, help="timed requests per measurement")
    p.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny", help="the random model's shapes")
    p.add_argument("--words", type=int, default=60, help="words per passage in the timing check (6 passages)")
    p.add_argument("--only", nargs="+", default=None, help="run only these checks (setup always runs)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: --device cuda but torch.cuda.is_available() is False")
        return 1
    versions = f"torch {torch.__version__}"
    try:
        import transformers
        import triton

        versions += f", transformers {transformers.__version__}, triton {triton.__version__}"
    except ImportError:
        versions += ", no triton"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_smoke on {args.device} ({where}); {versions}", flush=True)

    checks = Checks()
    engines: list = []
    state: dict = {}
    new = args.new_tokens
    tmp = tempfile.TemporaryDirectory(prefix="kvrag-gpu-smoke-")

    def setup() -> str:
        model, tok, name = _load(args)
        state["model"], state["tok"] = model, tok
        eng = _engine(model, tok, os.path.join(tmp.name, "main"), new)
        engines.append(eng)
        state["engine"] = eng
        info = eng.info()
        return f"{name} on {info.device} in {info.dtype} ({info.dtype_reason}); decode {info.decode}"

    def gate() -> str:
        info = state["engine"].info()
        _expect(info.gate_ok, f"the self-test failed: {info.gate}")
        return info.gate

    def ratio_one() -> str:
        eng = state["engine"]
        docs = make_docs(4, seed=1)
        eng.warm(docs)
        prompts = [docs, docs[::-1], [docs[2], docs[0], docs[3]]]
        for i, chunks in enumerate(prompts):
            full = eng.generate(chunks, PREFIX, SUFFIX, mode="full")
            blend = eng.generate(chunks, PREFIX, SUFFIX, mode="blend", recompute_ratio=1.0)
            _expect(
                blend.token_ids == full.token_ids,
                f"prompt {i}: blend at ratio 1.0 gave {blend.token_ids}, the full prefill {full.token_ids}",
            )
        return f"{len(prompts)} prompts, {len(full.token_ids)} greedy tokens each identical"

    def default_blend() -> str:
        eng = state["engine"]
        docs = make_docs(4, seed=2)
        first = eng.generate(docs, PREFIX, SUFFIX)  # nothing cached: runs full and writes the chunks back
        eng.flush()
        again = eng.generate(docs[::-1], PREFIX, SUFFIX)
        s = again.stats
        _expect(s.chunks_found == len(docs), f"{s.chunks_found} of {len(docs)} chunks found in the cache")
        _expect(s.path == "blend", f"path {s.path!r} ({s.path_reason}), not a blend")
        _expect(again.finish_reason in ("stop", "length"), f"finish_reason {again.finish_reason!r}")
        return (
            f"first request {first.stats.chunk_hits}/{len(docs)} chunks cached; "
            f"reordered: {s.chunks_found}/{len(docs)} found, "
            f"path {s.path} ({s.selection}, recomputed {s.recompute_ratio:.0%} of cached tokens), "
            f"{len(again.token_ids)} tokens {again.text[:40]!r}"
        )

    def store_round_trip() -> str:
        # nothing but the chunks may differ between the two hits: no prefix blocks, no refreshed
        # variants, no ratio that depends on how fast the disk is
        eng = _engine(
            state["model"],
            state["tok"],
            os.path.join(tmp.name, "store"),
            new,
            disk_tier=True,
            prefix_cache=False,
            tree_refresh=False,
            loading_controller=False,
            memory_budget_bytes=1 << 30,
        )
        engines.append(eng)
        docs = make_docs(4, seed=3)
        first = eng.generate(docs, PREFIX, SUFFIX)
        eng.flush()  # write-back: the missed chunks' KV into memory and onto disk
        _expect(first.stats.chunk_hits == 0, f"a fresh store hit {first.stats.chunk_hits} chunks")
        mem = eng.generate(docs, PREFIX, SUFFIX)
        tiers = [c.tier for c in mem.stats.chunks]
        _expect(mem.stats.chunk_hits == len(docs) and set(tiers) == {"memory"}, f"memory hits: tiers {tiers}")
        eng.store.memory.clear()
        disk = eng.generate(docs, PREFIX, SUFFIX)
        tiers = [c.tier for c in disk.stats.chunks]
        _expect(disk.stats.chunk_hits == len(docs) and set(tiers) == {"disk"}, f"disk hits: tiers {tiers}")
        _expect(disk.token_ids == mem.token_ids, f"disk hits gave {disk.token_ids}, memory hits {mem.token_ids}")
        st = eng.store.stats()
        return (
            f"write-back of {len(docs)} chunks, then {len(docs)} memory hits and {len(docs)} disk hits "
            f"({st['load']['bytes'] / 1e6:.2f} MB streamed in), same {len(mem.token_ids)} tokens, path {mem.stats.path}"
        )

    def batched_decode() -> str:
        eng = state["engine"]
        docs = make_docs(5, seed=4)
        prompts = [docs[i : i + 2] for i in range(4)]
        alone = [eng.generate(c, PREFIX, SUFFIX, mode="full", max_new_tokens=2 * new).token_ids for c in prompts]
        steps = eng.queue_stats()["decode_steps"]
        streams = [eng.stream(c, PREFIX, SUFFIX, mode="full", max_new_tokens=2 * new) for c in prompts]
        together = []
        for s in streams:
            for _ in s:
                pass
            together.append(s.generation.token_ids)
        steps = eng.queue_stats()["decode_steps"] - steps
        for i, (a, b) in enumerate(zip(alone, together)):
            _expect(a == b, f"stream {i}: batched gave {b}, alone {a}")
        tokens = sum(map(len, together))
        return f"{len(prompts)} streams, {tokens} tokens in {steps} decode steps, each as decoded alone"

    def timing() -> str:
        eng = state["engine"]
        docs = make_docs(6, words=args.words, seed=5)
        eng.warm(docs)
        rng = random.Random(0)
        orders = [rng.sample(docs, len(docs)) for _ in range(args.reps + 1)]

        def ttft(mode_args: dict, orders: list[list[str]]) -> tuple[float, object]:
            times, last = [], None
            for chunks in orders:
                _sync(device)
                last = eng.generate(chunks, PREFIX, SUFFIX, max_new_tokens=1, **mode_args)
                times.append(last.ttft_s)
            return statistics.median(times[1:]), last  # the first one warms up

        full_s, full = ttft({"mode": "full"}, orders)
        blend_s, blend = ttft({}, orders)
        # one stream, then a batch of 8: decode tokens per second of wall clock
        _sync(device)
        one = eng.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=64)
        one_tps = len(one.token_ids) / max(one.total_s - one.ttft_s, 1e-9)
        _sync(device)
        t0 = time.perf_counter()
        streams = [
            eng.stream(orders[i % len(orders)], PREFIX, SUFFIX, mode="full", max_new_tokens=64) for i in range(8)
        ]
        for s in streams:
            for _ in s:
                pass
        _sync(device)
        wall = time.perf_counter() - t0
        batch_tokens = sum(len(s.generation.token_ids) for s in streams)
        line = (
            f"TIMING {args.device} {eng.info().dtype} prompt {full.stats.prompt_tokens} tokens: "
            f"TTFT full {full_s * 1e3:.1f} ms, default blend {blend_s * 1e3:.1f} ms "
            f"({blend_s / full_s:.2f}x; path {blend.stats.path}, {blend.stats.selection or '-'}, "
            f"recomputed {blend.stats.recompute_ratio:.0%}); decode {one_tps:.0f} tok/s (1 stream), "
            f"{batch_tokens / wall:.0f} tok/s (8 streams, prefills included)"
        )
        print(line, flush=True)
        return "see the TIMING line"

    def syncs() -> str:
        """Where the host waits for the device: every synchronising call (``torch.cuda.set_sync_debug_mode``)
        during one decode request and one default blend, counted by the line of Python that made it."""
        import collections
        import warnings

        debug = (lambda mode: torch.cuda.set_sync_debug_mode(mode)) if device.type == "cuda" else (lambda mode: None)
        eng = state["engine"]
        docs = make_docs(6, words=args.words, seed=6)
        eng.warm(docs)
        out = []
        for what, kwargs in (
            ("decode 32 tokens", dict(mode="full", max_new_tokens=32)),
            ("decode 32 tokens, no drafts", dict(mode="full", max_new_tokens=32, draft_tokens=0)),
            ("default blend, 1 token", dict(max_new_tokens=1)),
        ):
            draft = kwargs.pop("draft_tokens", None)
            if draft is not None:
                previous, eng.decoding.draft_tokens = eng.decoding.draft_tokens, draft
            _sync(device)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                debug("warn")
                try:
                    t0 = time.perf_counter()
                    g = eng.generate(docs[::-1], PREFIX, SUFFIX, **kwargs)
                    wall = time.perf_counter() - t0
                finally:
                    debug(0)
            if draft is not None:
                eng.decoding.draft_tokens = previous
            sites = collections.Counter(
                f"{os.path.relpath(w.filename)}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)
            )
            tokens = max(len(g.token_ids), 1)
            out.append(
                f"{what}: {sum(sites.values())} syncs in {wall * 1e3:.0f} ms ({sum(sites.values()) / tokens:.1f} a "
                f"token, {len(g.token_ids)} tokens, path {g.stats.path}); top: "
                + "; ".join(f"{site} x{n}" for site, n in sites.most_common(6))
            )
        for line in out:
            print("SYNCS " + line, flush=True)
        return "see the SYNCS lines"

    try:
        checks.run("setup", setup)
        wanted = {
            "gate": gate,
            "ratio 1.0": ratio_one,
            "default blend": default_blend,
            "store round trip": store_round_trip,
            "batched decode": batched_decode,
            "timing": timing,
            "syncs": syncs,
        }
        for name, fn in wanted.items():
            if "engine" in state and (args.only is None or name.split()[0] in args.only):
                checks.run(name, fn)
    finally:
        for eng in engines:
            try:
                eng.close()
            except Exception as e:  # noqa: BLE001
                print(f"(closing an engine: {type(e).__name__}: {e})")
        tmp.cleanup()
    if checks.failed:
        print(f"gpu_smoke: {len(checks.failed)} check(s) failed: {', '.join(checks.failed)}")
        return 1
    print("gpu_smoke: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
