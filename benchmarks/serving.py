"""Serving benchmark: batched decode, inter-token gaps during a long prefill, sync vs async TTFT.

    python -m benchmarks serving [--dataset QA.json] [--repeat 3] [--only throughput,gaps,ttft,answers]
                        [--streams 8] [--context-tokens 0] [--gap-prompt-tokens 4096] [--slices 0.1,1e9]
                        [--questions 20] [--drafts 0,4] [--config F=V ...]

Measurements on one engine, each repeated (medians reported, every run kept in the JSON):

- **throughput**: decode tokens/s of 1 stream, then of ``--streams`` streams started together
  (each prompt behind ``--context-tokens`` tokens of fresh passages: decode over a RAG prompt's KV);
  counted over the window in which every stream of the run is decoding (from the last first
  token to the first last token), from the text pieces the consumers receive.
- **gaps**: a stream decodes while a cold prompt of ``--gap-prompt-tokens`` tokens (fresh passages,
  nothing cached) is submitted; the gaps between the stream's pieces from that submission to the
  long request's first token, p50/p99 and max, once per ``prefill_slice_s`` of ``--slices``
  (``1e9``: the prefill never pauses, as before the engine thread).
- **ttft**: the same blend request (six passages, warmed), alternately from a plain call
  (``generate``) and from an asyncio task through the integrations' bridge (one worker thread that
  iterates ``engine.stream``), TTFT as the engine reports it and as the caller sees its first piece.
- **answers** (needs ``--dataset``): single-stream decode of RAG answers: each of ``--questions``
  questions, its top-6 passages in the chat template, answered greedily (``--max-new-tokens``, full
  prefill) once per ``draft_tokens`` value of ``--drafts`` (order rotated per question); decode
  tokens/s = (tokens - 1) / seconds after the first token, paired per question against the first
  value; the tokens compared with the first value's (prompt-lookup drafts must not change them).

The machine may be shared: the load average is recorded before and after each measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

from benchmarks.data import PromptFormat, QAItem, load_dataset, make_synthetic_dataset, passage_text
from benchmarks.metrics import percentile

__all__ = ["measure_throughput", "measure_gaps", "measure_ttft", "main"]

_LONG_PROMPT = "Count from 1 to 3000, one number per line, with no other text."


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


class _Timed(threading.Thread):
    """Consumes a stream in its own thread, noting when each piece arrives."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.times = stream, []

    def run(self) -> None:
        for _ in self.stream:
            self.times.append(time.perf_counter())


def _counting_prompt(engine, run: int | None = None, context_tokens: int = 0) -> str:
    """A prompt the model answers at length, in its chat template (bare, it may end at once); with
    ``context_tokens``, behind about that many tokens of passages (decode over a RAG prompt's KV)."""
    text = _LONG_PROMPT if run is None else f"{_LONG_PROMPT} (run {run})"
    if context_tokens > 0:
        passages = _cold_chunks(context_tokens, 7919 + (run or 0), engine.count_tokens)
        text = "\n\n".join(passages) + "\n\n" + text
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _tokens_per_s(engine, n: int, max_new_tokens: int, context_tokens: int = 0) -> dict:
    prompts = [_counting_prompt(engine, i, context_tokens) for i in range(n)]
    streams = [_Timed(engine.stream(prompt=p, max_new_tokens=max_new_tokens, mode="full")) for p in prompts]
    for s in streams:
        s.start()
    for s in streams:
        s.join()
    begin = max(s.times[0] for s in streams)
    end = min(s.times[-1] for s in streams)
    pieces = sum(sum(begin < t <= end for t in s.times) for s in streams)
    return {"streams": n, "window_s": end - begin, "pieces": pieces, "tokens_per_s": pieces / max(end - begin, 1e-9)}


def measure_throughput(engine, *, streams: int = 8, max_new_tokens: int = 96, context_tokens: int = 0) -> dict:
    """Decode tokens/s of one stream and of ``streams`` streams together (same engine, same run),
    each stream's prompt about ``context_tokens`` tokens of passages longer than the bare one."""
    one = _tokens_per_s(engine, 1, max_new_tokens, context_tokens)
    many = _tokens_per_s(engine, streams, max_new_tokens, context_tokens)
    return {
        "context_tokens": context_tokens,
        "one": one,
        "many": many,
        "speedup": many["tokens_per_s"] / one["tokens_per_s"],
    }


def _cold_chunks(tokens: int, seed: int, count) -> list[str]:
    """Passages of random words, about ``tokens`` tokens in all, never seen before (a fresh seed)."""
    from benchmarks.registry_lookup import make_passages

    out: list[str] = []
    total, i = 0, 0
    while total < tokens:
        text = make_passages(1, seed=seed * 1000 + i)[0]
        out.append(text)
        total += count(text)
        i += 1
    return out


def measure_gaps(engine, *, prompt_tokens: int = 4096, slice_s: float, seed: int) -> dict:
    """Gaps between a decoding stream's pieces while a cold ``prompt_tokens`` prefill runs.

    Measured on an engine over ``engine``'s weights built with ``prefill_slice_s=slice_s`` (the
    setting is the engine's, fixed when it is built), with a store and engine thread of its own.
    """
    from kvrag import Engine

    config = engine.config.replace(prefill_slice_s=slice_s)
    with Engine(
        engine.hf_model, engine.tokenizer, config, weights_digest=engine.weights_digest, name=engine.model_name
    ) as sliced:
        return _gaps(sliced, prompt_tokens, slice_s, seed)


def _gaps(engine, prompt_tokens: int, slice_s: float, seed: int) -> dict:
    chunks = _cold_chunks(prompt_tokens - 40, seed, engine.count_tokens)
    running = _Timed(engine.stream(prompt=_counting_prompt(engine), max_new_tokens=4000, mode="full"))
    running.start()
    while not running.times:
        if not running.is_alive():
            raise RuntimeError("the decoding stream ended before its first piece")
        time.sleep(0.01)
    submitted = time.perf_counter()
    long = engine.stream(chunks, "Passages:\n", "Which passage mentions a castle?", max_new_tokens=1)
    first = None
    for _ in long:
        first = first or time.perf_counter()
    first = first or time.perf_counter()
    running.stream.close()
    running.join()
    # the last gap ends at the long prompt's first token: a prefill that never pauses is one long gap
    marks = [submitted] + [t for t in running.times if submitted < t <= first] + [first]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    g = long.generation
    return {
        "slice_s": slice_s,
        "prompt_tokens": g.stats.prompt_tokens,
        "ttft_s": g.ttft_s,
        "gaps": len(gaps),
        "gap_p50_s": percentile(gaps, 50),
        "gap_p99_s": percentile(gaps, 99),
        "gap_max_s": max(gaps, default=None),
        "stream_outlived_prefill": running.times[-1] > first if running.times else False,
    }


def _ttft_async(engine, request: dict) -> tuple[float, float]:
    from kvrag.calls import open_in_thread

    async def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        box = {}

        def make():
            box["stream"] = engine.stream(**request)
            return box["stream"]

        first = None
        async for _ in await open_in_thread(make):
            first = first or time.perf_counter() - t0
        return box["stream"].generation.ttft_s, first

    return asyncio.run(run())


def _ttft_sync(engine, request: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    stream = engine.stream(**request)
    first = None
    for _ in stream:
        first = first or time.perf_counter() - t0
    return stream.generation.ttft_s, first


def measure_ttft(engine, request: dict, *, reps: int = 5) -> dict:
    """The same request, alternately sync and async, ``reps`` times each: median TTFTs."""
    engine.warm(request["chunks"])
    engine.flush()
    _ttft_sync(engine, request)  # settles the prefix cache
    engine.flush()
    runs = {"sync": [], "async": []}
    for _ in range(reps):
        for name, fn in (("sync", _ttft_sync), ("async", _ttft_async)):
            runs[name].append(fn(engine, request))
            engine.flush()
    out = {
        name: {"engine_ttft_s": [r[0] for r in rs], "first_piece_s": [r[1] for r in rs]} for name, rs in runs.items()
    }
    for name in runs:
        for key in ("engine_ttft_s", "first_piece_s"):
            out[name][key + "_median"] = statistics.median(out[name][key])
    out["async_over_sync"] = out["async"]["engine_ttft_s_median"] / out["sync"]["engine_ttft_s_median"]
    return out


def _ttft_request(engine, dataset: str | None) -> dict:
    if dataset:
        item = load_dataset(dataset, 1)[0]
    else:
        row = make_synthetic_dataset(1, passages=6, words=90, seed=0)[0]
        item = QAItem(0, row["question"], row["answers"], [passage_text(c) for c in row["ctxs"]])
    req = PromptFormat(engine.tokenizer).request(item, list(range(min(6, len(item.passages)))), workload="s", request=0)
    return dict(chunks=req.chunks, prefix=req.prefix, suffix=req.suffix, mode="blend", max_new_tokens=8)


def measure_answers(engine, items: list[QAItem], drafts: list[int], max_new_tokens: int) -> dict:
    """Greedy RAG answers, each question once per ``draft_tokens`` value (see the module's **answers**)."""
    fmt = PromptFormat(engine.tokenizer)
    base = engine.decoding.draft_tokens
    rows = []
    try:
        for qi, item in enumerate(items):
            req = fmt.request(item, list(range(min(6, len(item.passages)))), workload="d", request=qi)
            prompt = req.prefix + "".join(f"{c}\n\n" for c in req.chunks) + req.suffix
            row: dict = {"question": item.index, "by_drafts": {}}
            turn = qi % len(drafts)
            for k in drafts[turn:] + drafts[:turn]:
                engine.decoding.draft_tokens = k
                g = engine.generate(prompt=prompt, max_new_tokens=max_new_tokens, mode="full", temperature=0.0)
                s = g.stats
                row["by_drafts"][k] = {
                    "tokens": len(g.token_ids),
                    "token_ids": g.token_ids,
                    "decode_s": s.decode_s,
                    "tokens_per_s": (len(g.token_ids) - 1) / s.decode_s if s.decode_s > 0 else None,
                    "steps": s.decode_steps,
                    "drafted": s.draft_tokens,
                    "accepted": s.draft_accepted,
                    "prompt_tokens": s.prompt_tokens,
                }
            rows.append(row)
            ref = row["by_drafts"][drafts[0]]
            print(
                f"  question {item.index}: {ref['prompt_tokens']} prompt tokens, {ref['tokens']} answer tokens;",
                ", ".join(
                    f"drafts {k}: {_tps(r['tokens_per_s'])} ({r['steps']} steps, {r['accepted']}/{r['drafted']} kept)"
                    for k, r in row["by_drafts"].items()
                ),
                flush=True,
            )
    finally:
        engine.decoding.draft_tokens = base
    fit = engine.decoding.step_cost.fit()  # what the drafts were planned with at the end (None: no fit yet)
    cost = None if fit is None else {"fixed_ms": fit[0] * 1e3, "per_1k_keys_ms": fit[1] * 1e6}
    return {"rows": rows, "summary": _answers_summary(rows, drafts), "step_cost": cost}


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} tok/s"


def _answers_summary(rows: list[dict], drafts: list[int]) -> dict:
    out = {}
    for k in drafts:
        runs = [r["by_drafts"][k] for r in rows]
        paired = [
            r["by_drafts"][k]["tokens_per_s"] / r["by_drafts"][drafts[0]]["tokens_per_s"]
            for r in rows
            if r["by_drafts"][k]["tokens_per_s"] and r["by_drafts"][drafts[0]]["tokens_per_s"]
        ]
        tps = [x["tokens_per_s"] for x in runs if x["tokens_per_s"]]
        out[k] = {
            "tokens_per_s_median": statistics.median(tps) if tps else None,
            "over_first_median": statistics.median(paired) if paired else None,
            "identical": sum(r["by_drafts"][k]["token_ids"] == r["by_drafts"][drafts[0]]["token_ids"] for r in rows),
            "questions": len(rows),
            "tokens_per_step": sum(x["tokens"] - 1 for x in runs) / max(1, sum(x["steps"] for x in runs)),
            "drafts_kept": sum(x["accepted"] for x in runs) / max(1, sum(x["drafted"] for x in runs)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.specs import command_line_overrides
    from kvrag import Engine

    p = argparse.ArgumentParser(prog="python -m benchmarks serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", default=None, help="QA JSON for the TTFT request (default: a synthetic one)")
    p.add_argument("--only", default="throughput,gaps,ttft")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per stream (throughput)")
    p.add_argument(
        "--context-tokens", type=int, default=0, help="passages before each throughput prompt (decode over RAG KV)"
    )
    p.add_argument("--gap-prompt-tokens", type=int, default=4096)
    p.add_argument("--slices", default="0.1,1e9", help="prefill_slice_s values of the gaps measurement")
    p.add_argument("--ttft-reps", type=int, default=5)
    p.add_argument("--questions", type=int, default=20, help="questions of --dataset answered (answers)")
    p.add_argument("--skip", type=int, default=0, help="dataset questions skipped first (answers)")
    p.add_argument("--drafts", default="0,4", help="draft_tokens values compared (answers; the first is the reference)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--out", default=None, help="write every run as JSON here")
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    engine = Engine.from_pretrained(a.model, **command_line_overrides(a.config))
    results: dict = {"config": dict(vars(a)), "runs": []}
    seed = random.Random().randrange(10**6)  # fresh passages every run: the long prompt is cold
    try:
        for rep in range(a.repeat):
            run: dict = {"repeat": rep}
            if "throughput" in only:
                run["throughput"] = _throughput_run(engine, a)
            if "gaps" in only:
                run["gaps"] = []
                for s in (float(x) for x in a.slices.split(",")):
                    run["gaps"].append(_gaps_run(engine, a, s, seed))
                    seed += 1
            if "ttft" in only:
                run["ttft"] = _ttft_run(engine, a)
            if "answers" in only:
                run["answers"] = _answers_run(engine, a)
            results["runs"].append(run)
    finally:
        engine.close()
    _summary(results)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def _throughput_run(engine, a) -> dict:
    figures = measure_throughput(
        engine, streams=a.streams, max_new_tokens=a.max_new_tokens, context_tokens=a.context_tokens
    )
    t = dict(load=_load(), **figures)
    one, many = t["one"]["tokens_per_s"], t["many"]["tokens_per_s"]
    print(
        f"decode after ~{a.context_tokens} context tokens: 1 stream {one:.1f} tok/s,",
        f"{a.streams} streams {many:.1f} tok/s: {t['speedup']:.2f}x",
        _load_note(t),
    )
    return t


def _gaps_run(engine, a, slice_s: float, seed: int) -> dict:
    g = dict(load=_load(), **measure_gaps(engine, prompt_tokens=a.gap_prompt_tokens, slice_s=slice_s, seed=seed))
    print(
        f"gaps at prefill_slice_s={slice_s:g}: {g['gaps']} gaps,",
        f"p50 {_s(g['gap_p50_s'])}, p99 {_s(g['gap_p99_s'])}, max {_s(g['gap_max_s'])};",
        f"the {g['prompt_tokens']}-token prompt's TTFT {_s(g['ttft_s'])}",
        _load_note(g),
    )
    return g


def _ttft_run(engine, a) -> dict:
    t = dict(load=_load(), **measure_ttft(engine, _ttft_request(engine, a.dataset), reps=a.ttft_reps))
    sync, asyn = t["sync"], t["async"]
    print(
        f"TTFT: sync {sync['engine_ttft_s_median']:.3f} s, async {asyn['engine_ttft_s_median']:.3f} s",
        f"({t['async_over_sync']:.3f}x); first piece {sync['first_piece_s_median']:.3f} s /",
        f"{asyn['first_piece_s_median']:.3f} s",
        _load_note(t),
    )
    return t


def _answers_run(engine, a) -> dict:
    if not a.dataset:
        raise SystemExit("--only answers needs --dataset (a QA JSON such as ../shared/data/musique_dev.json)")
    items = load_dataset(a.dataset, a.skip + a.questions)[a.skip :]
    drafts = [int(x) for x in a.drafts.split(",")]
    t = dict(load=_load(), **measure_answers(engine, items, drafts, a.max_new_tokens))
    for k, f in t["summary"].items():
        print(
            f"answers, draft_tokens={k}: median {_tps(f['tokens_per_s_median'])},",
            f"{f['over_first_median']:.2f}x draft_tokens={drafts[0]} (paired median),",
            f"{f['tokens_per_step']:.2f} tokens a step, {f['drafts_kept']:.0%} of drafts kept,",
            f"identical {f['identical']}/{f['questions']}",
            _load_note(t),
        )
    if t["step_cost"]:
        c = t["step_cost"]
        print(
            f"decode pass as the engine fitted it: {c['fixed_ms']:.1f} ms",
            f"+ {c['per_1k_keys_ms']:.2f} ms per 1K keys read",
        )
    return t


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def _load_note(figures: dict) -> str:
    return f"(load average {figures['load']:.1f} before, {_load():.1f} after)"


def _summary(results: dict) -> None:
    runs = results["runs"]

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    if any("throughput" in r for r in runs):
        print(f"median decode speedup: {med([r['throughput']['speedup'] for r in runs]):.2f}x")
    if any("gaps" in r for r in runs):
        for i, first in enumerate(runs[0]["gaps"]):
            p99 = med([r["gaps"][i]["gap_p99_s"] for r in runs])
            print(f"median gap p99 at slice {first['slice_s']:g} s: {p99:.3f} s")
    if any("ttft" in r for r in runs):
        print(f"median async/sync TTFT: {med([r['ttft']['async_over_sync'] for r in runs]):.3f}")
