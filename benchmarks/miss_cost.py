"""``python -m benchmarks miss-cost``: where a request that finds nothing cached spends more than ``mode="full"``.

    python -m benchmarks miss-cost --model bundled --n 8 --top-k 6
    python -m benchmarks miss-cost --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --n 8

One engine (``--dtype``, default bfloat16). For each of ``--n`` dev questions from ``--skip`` (passages no
earlier prompt held), the question's top-k prompt (``benchmarks.data.PromptFormat``, ~3.6K tokens at
k = 6) is asked twice, streamed: in the default mode with the store emptied first (nothing is found: the
cost model sends it down the full path, and it captures its chunks' KV for write-back), and with
``mode="full"``, the order alternated, write-back flushed before each call (off the clock). Each call's
phases are timed by wrapping the engine's functions (seconds, summed over the call): building the request
(segmenting, per-segment tokenising: the caller's thread), planning (registry and store lookups), the
captures' allocation, the chunk-KV copies inside the pass, the statistics' query tap, the forward pass,
write-back scheduling (before the first token reaches the caller: ``schedule`` ran there until issue 60),
and the stream's time to the first token. The first pair (a fresh engine's first default request: the
one-time costs) is reported apart from the medians. Timings on a shared machine are noisy: the pairs are
what to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

DEV_SET = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"

__all__ = ["main", "Phases"]


class Phases:
    """Seconds per phase, summed over the calls of one request (wrapped functions, any thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time ``owner.name`` (a function or method) under ``phase`` until :meth:`undo`."""
        inner = getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def undo(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)
        self._undo.clear()

    @contextmanager
    def request(self):
        self.seconds.clear()
        yield self.seconds


def wrap_engine(phases: Phases) -> None:
    """Wrap the request path's phases (module functions are wrapped where they are looked up)."""
    from kvrag.engine.model import runner
    from kvrag.engine.reuse import attention_stats, fusion, planner
    from kvrag.engine.serving import prefill, requests, writeback

    phases.wrap(requests.Requests, "build", "build request (segment, tokenize)")
    phases.wrap(planner.Planner, "plan", "plan (lookups)")
    phases.wrap(fusion, "_captures", "allocate captures")
    phases.wrap(runner.KVCapture, "take", "chunk KV copies (in the pass)")
    phases.wrap(attention_stats.Tap, "observe", "statistics' query tap")
    phases.wrap(prefill, "prefill", "prefill (forward, copies and tap included)")
    phases.wrap(writeback.WriteBack, "schedule", "write-back scheduling")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks miss-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled", help="a GGUF or model path, or 'bundled' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dataset", default=str(DEV_SET))
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE", help="EngineConfig override")
    p.add_argument("--out", help="write every call's phases here (JSON)")
    a = p.parse_args(argv)

    from benchmarks.data import PromptFormat, load_dataset
    from benchmarks.real_models import resolve_model
    from kvrag import Engine
    from kvrag.config import parse_overrides

    overrides = {"dtype": a.dtype, **({"num_threads": a.threads} if a.threads else {}), **parse_overrides(a.config)}
    model = None if a.model == "bundled" else resolve_model(a.model)
    engine = Engine.from_pretrained(model, **overrides)
    fmt = PromptFormat(engine.tokenizer)
    items = load_dataset(a.dataset, a.skip + a.n)[a.skip :]
    engine.generate(prompt="Say hello.", mode="full", max_new_tokens=2)  # load; the default path stays cold
    info = engine.info()
    print(f"{info.model} in {info.dtype}, {info.threads} threads, commit-time code", flush=True)
    phases = Phases()
    wrap_engine(phases)
    rows = []
    try:
        for i, item in enumerate(items):
            req = fmt.request(item, list(range(min(a.top_k, len(item.passages)))), workload="z", request=i)
            kwargs = dict(chunks=req.chunks, prefix=req.prefix, suffix=req.suffix, max_new_tokens=2)
            for mode in ("full", "default") if i % 2 else ("default", "full"):
                engine.flush()
                if mode == "default":
                    engine.store.clear()
                with phases.request() as seconds:
                    t0 = time.perf_counter()
                    stream = engine.stream(**kwargs, **({"mode": "full"} if mode == "full" else {}))
                    first = None
                    for _ in stream:
                        if first is None:
                            first = time.perf_counter() - t0
                    g = stream.generation
                    row = {"question": a.skip + i, "mode": mode, "ttft": first, "engine_ttft": g.ttft_s}
                    row.update(path=g.stats.path, found=g.stats.chunk_hits, tokens=g.stats.prompt_tokens)
                    row.update(seconds)
                rows.append(row)
                print(
                    f"q{a.skip + i} {mode:7s} {row['tokens']} tokens, path {row['path']}, TTFT {first:.3f} s "
                    + " ".join(f"{k.split(' ')[0]}={v * 1e3:.1f}ms" for k, v in seconds.items()),
                    flush=True,
                )
    finally:
        phases.undo()
        engine.close()
    pairs = [
        (rows[j], rows[j + 1]) if rows[j]["mode"] == "default" else (rows[j + 1], rows[j])
        for j in range(0, len(rows), 2)
    ]
    first_pair, rest = pairs[0], pairs[1:]
    keys = sorted({k for r in rows for k in r if k not in ("question", "mode", "path", "found", "tokens")})
    print(f"\nmedian over {len(rest)} pairs after the first (default | full | default - full), milliseconds:")
    summary = {}
    for k in keys:
        d = statistics.median(r[0].get(k, 0.0) for r in rest) if rest else 0.0
        f = statistics.median(r[1].get(k, 0.0) for r in rest) if rest else 0.0
        diff = statistics.median(r[0].get(k, 0.0) - r[1].get(k, 0.0) for r in rest) if rest else 0.0
        summary[k] = {"default": d, "full": f, "diff": diff}
        print(f"  {k:45s} {d * 1e3:9.1f} {f * 1e3:9.1f} {diff * 1e3:+9.1f}")
    ratios = [d["ttft"] / f["ttft"] for d, f in rest]
    eratios = [d["engine_ttft"] / f["engine_ttft"] for d, f in rest]
    print(
        f"  TTFT ratio default / full: median {statistics.median(ratios):.3f}"
        f" (engine's {statistics.median(eratios):.3f})"
    )
    d, f = first_pair
    print(f"first pair (the fresh engine's first default request): TTFT {d['ttft']:.3f} vs full {f['ttft']:.3f} s")
    print("  " + ", ".join(f"{k} {d.get(k, 0.0) * 1e3:.1f}/{f.get(k, 0.0) * 1e3:.1f} ms" for k in keys if k != "ttft"))
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": vars(a), "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
