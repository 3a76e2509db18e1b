"""``python -m benchmarks weights``: the decode step's weight formats side by side on one engine.

    python -m benchmarks weights --model qwen2.5-coder-1.5b --dataset ../shared/data/musique_dev.json \\
        --n 20 --formats plain,int8,int4 --out DIR
    python -m benchmarks weights ... --formats plain,int4,int4@torch   # kvrag's int4 kernel vs torch's

Each question's RAG prompt (its first ``--top-k`` passages, chat template) is prefilled once and kept
as an exact prefix; each format then reuses it (the same KV and first token, nearly free) and answers
greedily with the decode step's weights in that format. Reported per
format: decode tokens per second after the RAG prompt, answers identical to the plain weights', and
F1 / exact match against the gold answers; plus each format's bytes and build time. ``int4@torch`` is
``int4`` on torch's kernel where kvrag's own builds (the two side by side on the same prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.data import PromptFormat, load_dataset
from benchmarks.metrics import best_f1, normalize_answer
from benchmarks.real_models import resolve_model
from kvrag.errors import KvragError

__all__ = ["main"]


def run(a: argparse.Namespace) -> dict:
    from kvrag import Engine

    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    model = resolve_model(a.model, Path(a.cache_dir) if a.cache_dir else None)
    engine = Engine.from_pretrained(model, cache_dir=a.cache_dir or None, num_threads=a.threads, draft_tokens=0)
    decoders = {}
    for fmt in formats:
        t0 = time.perf_counter()
        decoders[fmt] = _decoder(engine, fmt)
        decoders[fmt].built_s = time.perf_counter() - t0
        print(f"{fmt}: {decoders[fmt].description}", flush=True)
    fmt_prompt = PromptFormat(engine.tokenizer)
    rows = []
    with engine:
        for item in load_dataset(a.dataset, a.skip + a.n)[a.skip :]:
            req = fmt_prompt.request(item, list(range(min(a.top_k, len(item.passages)))), workload="w", request=0)
            row: dict = {"question": item.index, "answers": item.answers}
            # stores the prompt's exact prefix: every format's prefill below reuses it alike (the same first token)
            engine.generate(req.chunks, req.prefix, req.suffix, mode="prefix", max_new_tokens=1)
            engine.flush()
            for fmt in formats:
                engine.decoding.decoder = decoders[fmt]
                g = engine.generate(req.chunks, req.prefix, req.suffix, mode="prefix", max_new_tokens=a.max_new_tokens)
                tps = (len(g.token_ids) - 1) / g.stats.decode_s if len(g.token_ids) > 1 and g.stats.decode_s else None
                row[fmt] = {
                    "text": g.text,
                    "tokens": g.token_ids,
                    "tokens_per_s": tps,
                    "prompt_tokens": g.stats.prompt_tokens,
                    "f1": best_f1(g.text, item.answers),
                    "em": any(normalize_answer(g.text) == normalize_answer(x) for x in item.answers),
                }
            rows.append(row)
            print(
                f"q{item.index}: "
                + ", ".join(f"{f} {row[f]['tokens_per_s'] or 0:.1f} tok/s F1 {row[f]['f1']:.2f}" for f in formats),
                flush=True,
            )
    ref = formats[0]
    summary = {
        f: {
            "tokens_per_s_median": statistics.median(r[f]["tokens_per_s"] for r in rows if r[f]["tokens_per_s"]),
            "f1": statistics.fmean(r[f]["f1"] for r in rows),
            "em": sum(r[f]["em"] for r in rows) / len(rows),
            f"identical_to_{ref}": sum(r[f]["tokens"] == r[ref]["tokens"] for r in rows),
            "bytes": getattr(decoders[f].weights, "nbytes", None),
            "build_s": decoders[f].built_s,
            "description": decoders[f].description,
        }
        for f in formats
    }
    return {"settings": vars(a), "engine": engine.info().to_dict(), "rows": rows, "summary": summary}


def _decoder(engine, fmt: str):
    """The decoder of ``fmt``; ``int4@torch``: int4 with kvrag's own kernel set aside while it is built."""
    from kvrag.engine.model import quantized
    from kvrag.engine.model.batch import Decoder

    weights, _, kernel = fmt.partition("@")
    if kernel not in ("", "torch") or (kernel and weights != "int4"):
        raise SystemExit(f"unknown format {fmt!r} (int4@torch is the one variant)")
    if not kernel:
        return Decoder(engine.adapter, engine.config.decode_group, weights=weights)
    own = quantized.int4_kernel
    quantized.int4_kernel = lambda: (None, "set aside by int4@torch")
    try:
        return Decoder(engine.adapter, engine.config.decode_group, weights=weights)
    finally:
        quantized.int4_kernel = own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--formats", default="plain,int8,int4", help="the first is the reference")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        result = run(a)
    except KvragError as exc:
        print(f"python -m benchmarks weights: {exc}", file=sys.stderr)
        return 2
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "weights.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1))
    return 0
