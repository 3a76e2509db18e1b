"""Exact means identical: prompts answered from exactly stored KV against ``mode="full"``.

    python -m benchmarks exact-identity --dataset QA.json --n 40            # identity over dev prompts
    python -m benchmarks exact-identity --dataset QA.json --cost --pairs 8  # what slicing costs a full prefill

Identity: for question i, its documents (the first ``--top-k`` passages, dataset order) are stored by an
earlier prompt with the same documents in the same order and another question (question i+1's); then
question i is asked (the engine's default request: exact prefix blocks and exact chunk variants reused,
the rest computed) and compared with a ``mode="full"`` engine of the same settings (its own store): greedy
tokens identical or not, and the drift, the mean |Δ log p| per token of the full answer scored under both
(teacher-forced).

Cost: one process, the same ~3.6K-token RAG prompt (passages added until ``--tokens``), full prefills
in slices of each ``--slices`` size and in one pass, interleaved (A B A B ...): the median of the
paired ratios sliced / one pass. A shared machine's noise hits both sides of a pair alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

__all__ = ["main"]


def _engine(args, **config):
    from kvrag import Engine, SamplingParams

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    return Engine.from_pretrained(args.model, dtype=args.dtype, sampling=sampling, **config)


def _identity(args) -> int:
    from benchmarks.data import PromptFormat, load_dataset

    items = load_dataset(args.dataset, args.skip + args.n + 1)
    det = args.deterministic == "on"
    same_math = dict(deterministic=det, deterministic_slice_tokens=args.slice_tokens)
    engine = _engine(args, **same_math)
    full = _engine(args, mode="full", write_back=False, prefix_cache=False, **same_math)  # the reference
    fmt = PromptFormat(engine.tokenizer)
    same, drifts, exact_share, rows = 0, [], [], []
    try:
        for i in range(args.skip, args.skip + args.n):
            item, other = items[i], items[i + 1]
            order = list(range(min(args.top_k, len(item.passages))))
            req = fmt.request(item, order, workload="x", request=i)
            warm = fmt.request(other, [], workload="x", request=i)  # only its question is used
            ref = full.generate(req.chunks, req.prefix, req.suffix)
            ref_lp = full.score(ref.text, req.chunks, req.prefix, req.suffix, mode="full").token_logprobs
            engine.generate(
                req.chunks, req.prefix, warm.suffix, max_new_tokens=1
            )  # stores them behind another question
            engine.flush()
            lp = engine.score(ref.text, req.chunks, req.prefix, req.suffix).token_logprobs  # nothing written back
            got = engine.generate(req.chunks, req.prefix, req.suffix)
            s = got.stats
            ident = got.token_ids == ref.token_ids
            drift = statistics.fmean(abs(a - b) for a, b in zip(lp, ref_lp, strict=True)) if lp else 0.0
            same += ident
            drifts.append(drift)
            exact_share.append(s.exact_tokens / s.prompt_tokens)
            rows.append((i, s.prompt_tokens, s.exact_tokens, s.computed_tokens, ident, drift))
            if args.verbose:
                print(f"q{i}: {s.prompt_tokens} tokens, {s.exact_tokens} exact, {s.computed_tokens} computed, "
                      f"identical={ident}, drift={drift:.4f}", flush=True)  # fmt: skip
    finally:
        engine.close()
        full.close()
    n = args.n
    print(f"model {args.model or 'SmolLM2-135M (bundled)'}, dtype {args.dtype}, deterministic {args.deterministic} "
          f"(slices of {args.slice_tokens}), top-k {args.top_k}, greedy {args.max_new_tokens} tokens")  # fmt: skip
    print(f"identical tokens: {same}/{n}; drift (mean |d log p| per token vs mode=full): {statistics.fmean(drifts):.4f}"
          f" (max {max(drifts):.4f}); exact share of the prompt: median {statistics.median(exact_share):.3f}; "
          f"computed tokens: median {statistics.median(r[3] for r in rows):.0f} of "
          f"{statistics.median(r[1] for r in rows):.0f}")  # fmt: skip
    return 0


def _cost(args) -> int:
    from benchmarks.data import PromptFormat, load_dataset
    from kvrag import RequestOptions
    from kvrag.engine.reuse.fusion import PrefillOptions, prefill

    engine = _engine(args)
    try:
        fmt = PromptFormat(engine.tokenizer)
        item = load_dataset(args.dataset, 1)[0]
        chunks, count = [], engine.count_tokens(fmt.head + fmt.question_head + item.question + fmt.tail)
        for p in item.passages:
            if count >= args.tokens:
                break
            chunks.append(p)
            count += engine.count_tokens(p)
        req = fmt.request(item, list(range(len(chunks))), workload="x", request=0)
        r = engine.requests.build(
            chunks=req.chunks, prefix=req.prefix, suffix=req.suffix, options=RequestOptions(mode="full")
        )
        plan = engine.prefiller.planner.plan(r.segments, mode="full", use_prefix=False)
        ad, n = engine.adapter, plan.num_tokens
        sizes = [0, *args.slices]
        if args.threads:
            torch.set_num_threads(args.threads)

        def once(size: int) -> tuple[float, torch.Tensor]:
            t0 = time.perf_counter()
            res = prefill(ad, plan, n, options=PrefillOptions(slice_tokens=size))
            return time.perf_counter() - t0, res.last_hidden

        times: dict[int, list[float]] = {s: [] for s in sizes}
        hidden = {}
        for s in sizes:  # warm-up, one each
            hidden[s] = once(s)[1]
        for _ in range(args.pairs):
            for s in sizes:
                times[s].append(once(s)[0])
        print(f"{n}-token prompt, dtype {args.dtype}, {torch.get_num_threads()} threads, {args.pairs} rounds")
        base = times[0]
        print(f"one pass: median {statistics.median(base):.3f} s")
        for s in args.slices:
            ratios = [a / b for a, b in zip(times[s], base, strict=True)]
            same = torch.equal(hidden[s], hidden[0])
            print(f"slices of {s}: median {statistics.median(times[s]):.3f} s, paired ratio median "
                  f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
                  f"last hidden equal to one pass's: {same}")  # fmt: skip
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks exact-identity", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--skip", type=int, default=0, help="questions skipped first (runs split across processes)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--deterministic", choices=("on", "off"), default="on")
    p.add_argument("--slice-tokens", type=int, default=256)
    p.add_argument("--cost", action="store_true", help="measure what slicing costs a full prefill instead")
    p.add_argument("--tokens", type=int, default=3600, help="--cost: the prompt's length, about")
    p.add_argument("--slices", type=int, nargs="+", default=[256, 512], help="--cost: slice sizes")
    p.add_argument("--pairs", type=int, default=8, help="--cost: interleaved rounds")
    p.add_argument("--threads", type=int, default=None, help="--cost: torch threads (default: torch's)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    return _cost(args) if args.cost else _identity(args)


if __name__ == "__main__":
    raise SystemExit(main())
