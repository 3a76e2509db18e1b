"""``python -m benchmarks models``: a real model's RAG answers, kvrag against its own full prefill and
against llama.cpp on the same GGUF, paired per question in one run.

    python -m benchmarks models --model qwen2.5-coder-1.5b --dataset ../shared/data/musique_dev.json \\
        --skip 0 --n 20 --llama-server /path/to/llama-server --out DIR

Per question (its first ``--top-k`` passages): a **first ask** in retrieval order (nothing cached:
kvrag's 0-hit path; it stores the passages' KV as requests do), kvrag's **full prefill** of the
reordered prompt (the reference; it stores nothing), the **reordered** ask (the passages shuffled:
kvrag blends the cached KV, computed in another order; its drift is scored before the idle-time
refresh computes that prompt exactly), the **exact repeat** (the reordered prompt again), and a
**decode probe** (the same passages, asked for a longer answer, ``--decode-tokens`` of it whatever the
end token: tokens per second after a RAG prompt). llama.cpp gets the same
prompt strings on a server with its prompt cache and ``--cache-reuse`` on, erased before each first
ask. Answers are scored as the papers do: F1 and exact match against the gold answers; kvrag's blend
also by answer drift against its full prefill (the full answer teacher-forced, mean |Δ log p|).
``--load`` measures loading (seconds, peak RSS) in child processes: first time and from the cache.
``--only decode`` runs the decode probe alone (kvrag's prompt asked once first, as the stages before it
would; llama.cpp's from an erased cache; the TTFT stages and answer quality skipped), kvrag and
llama.cpp interleaved per question.
``--no-llama`` and ``--no-kvrag`` run one engine alone (a model too large for both in memory at once);
``--quick`` asks kvrag only the first ask (0-hit: a full prefill that stores the passages), the blend
and the decode probe. The engine's own load (from the cache when ``--load`` ran) is timed in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.data import PromptFormat, load_dataset
from benchmarks.llamacpp import LlamaServer, find_server
from benchmarks.metrics import best_f1, drift, normalize_answer
from benchmarks.real_models import resolve_model
from kvrag.errors import KvragError

__all__ = ["main", "measure_load"]

DECODE_HINT = "Explain the answer in three sentences, citing the passages."


def measure_load(model: str, cache_dir: str, settings: dict) -> dict:
    """Load ``model`` in a child process: its seconds to a ready engine, its peak RSS (bytes) then, and
    its peak RSS after one short request (the weights kvrag maps from its conversion cache are read
    in on first use, as llama.cpp's mapped GGUF is)."""
    code = (
        "import json, resource, sys, time; t0 = time.perf_counter(); from kvrag import Engine; "
        f"e = Engine.from_pretrained({model!r}, cache_dir={cache_dir!r}, **json.loads(sys.argv[1])); "
        "s = time.perf_counter() - t0; rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024; "
        "e.generate([' '.join(['passage text'] * 200)], 'Read this.', ' Question?', max_new_tokens=4); "
        "print(json.dumps({'seconds': s, 'peak_rss_loaded_bytes': rss, 'decode': e.info().decode}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(settings)], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise KvragError(f"loading {model} failed in the child process (exit {proc.returncode})")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_bytes": usage.ru_maxrss * 1024}


def _f1_em(text: str, golds: list[str]) -> tuple[float, bool]:
    return best_f1(text, golds), any(normalize_answer(text) == normalize_answer(g) for g in golds)


def _tokenizer(model: str):
    """The GGUF's tokenizer alone (no weights): llama.cpp's prompts when kvrag does not run."""
    from transformers import AutoTokenizer

    path = Path(model)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def run(a: argparse.Namespace) -> dict:
    from kvrag import Engine

    model = resolve_model(a.model, Path(a.cache_dir) if a.cache_dir else None)
    settings = dict(json.loads(a.settings)) if a.settings else {}
    cache_dir = a.cache_dir or None
    out: dict = {"settings": {**vars(a), "model_file": model}, "load": {}, "rows": []}
    if a.load:
        out["load"] = {
            "first": measure_load(model, a.load_cache_dir, settings),
            "cached": measure_load(model, a.load_cache_dir, settings),
        }
        print(f"load: {json.dumps(out['load'])}", flush=True)
    items = load_dataset(a.dataset, a.skip + a.n)[a.skip :]
    rng = random.Random(a.seed)
    engine = None
    if not a.no_kvrag:
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(model, cache_dir=cache_dir, num_threads=a.threads, **settings)
        out["load"]["in_process"] = {"seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak_rss()}
        print(f"engine loaded: {json.dumps(out['load']['in_process'])}", flush=True)
        out["engine"] = engine.info().to_dict()
    fmt = PromptFormat(engine.tokenizer if engine is not None else _tokenizer(model))
    server = None
    if not a.no_llama:
        server = LlamaServer(find_server(a.llama_server), Path(model), threads=a.threads, flash_attn=a.flash_attn)
    with engine or contextlib.nullcontext(), server or contextlib.nullcontext():
        for item in items:
            k = min(a.top_k, len(item.passages))
            retrieved = list(range(k))
            reordered = retrieved[:]
            while k > 1 and reordered == retrieved:
                rng.shuffle(reordered)
            first = fmt.request(item, retrieved, workload="m", request=item.index)
            again = fmt.request(item, reordered, workload="m", request=item.index)
            decode_suffix = again.suffix.replace(fmt.answer_hint, DECODE_HINT) if fmt.answer_hint else again.suffix
            row: dict = {"question": item.index, "answers": item.answers, "order": reordered}
            if a.only == "decode":
                _only_decode(engine, server, a, row, again, decode_suffix)
                out["rows"].append(row)
                print(_decode_line(row), flush=True)
                continue
            if engine is not None:
                _ask_kvrag(engine, a, row, first, again, decode_suffix)
            if server is not None:
                _ask_llama(server, a, row, first, again, decode_suffix)
            for key in ("kvrag_full", "kvrag_blend", "kvrag_exact", "llama_reordered"):
                if key in row:
                    row[key]["f1"], row[key]["em"] = _f1_em(row[key]["text"], item.answers)
            out["rows"].append(row)
            print(_row_line(row), flush=True)
    out["summary"] = summarize_decode(out["rows"]) if a.only == "decode" else summarize(out["rows"])
    if engine is not None:
        out["load"]["in_process"]["peak_rss_after_bytes"] = _peak_rss()
    return out


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ask_kvrag(engine, a: argparse.Namespace, row: dict, first, again, decode_suffix: str) -> None:
    """kvrag's stages of one question (module docstring) into ``row``."""

    def ask(r, suffix=None, **kw):
        g = engine.generate(r.chunks, r.prefix, suffix or r.suffix, max_new_tokens=a.max_new_tokens, **kw)
        s = g.stats
        tps = (len(g.token_ids) - 1) / s.decode_s if len(g.token_ids) > 1 and s.decode_s > 0 else None
        return {"ttft_s": g.ttft_s, "text": g.text, "tokens": g.token_ids, "tokens_per_s": tps,
                "cached": s.cached_tokens, "exact": s.exact_tokens, "prompt_tokens": s.prompt_tokens,
                "path": s.path, "hits": s.chunk_hits}  # fmt: skip

    row["kvrag_first"] = ask(first)
    engine.flush()
    if a.quick:  # the first ask (0-hit: a full prefill that stores) stands for the full prefill
        row["kvrag_blend"] = ask(again)
        _decode_probe(engine, a, row, again, decode_suffix)
        return
    row["kvrag_full"] = ask(again, mode="full")  # stores nothing: the blend below finds what the first ask left
    row["kvrag_blend"] = ask(again)
    full_text = row["kvrag_full"]["text"]
    if full_text.strip():  # the blend's drift, before the idle-time refresh makes this prompt exact
        ref = engine.score(full_text, again.chunks, again.prefix, again.suffix, mode="full").token_logprobs
        got = engine.score(full_text, again.chunks, again.prefix, again.suffix).token_logprobs
        row["blend_drift"] = drift(got, ref)
    engine.flush()
    row["kvrag_exact"] = ask(again)
    _decode_probe(engine, a, row, again, decode_suffix)


def _decode_probe(engine, a: argparse.Namespace, row: dict, again, decode_suffix: str) -> None:
    """kvrag's decode probe: ``--decode-tokens`` tokens whatever the end token, after ``again``."""
    probe = engine.generate(again.chunks, again.prefix, decode_suffix, max_new_tokens=a.decode_tokens, ignore_eos=True)
    s = probe.stats
    row["kvrag_decode"] = {
        "tokens": len(probe.token_ids),
        "tokens_per_s": (len(probe.token_ids) - 1) / s.decode_s if s.decode_s else None,
        "prompt_tokens": s.prompt_tokens,
        "draft_tokens": s.draft_tokens,
        "draft_accepted": s.draft_accepted,
    }
    engine.flush()


def _llama_decode(server: LlamaServer, a: argparse.Namespace, row: dict, again, decode_suffix: str) -> None:
    """llama.cpp's decode probe, the same prompt string and length as kvrag's."""
    c = server.complete(_text(again, decode_suffix), max_tokens=a.decode_tokens, ignore_eos=True)
    row["llama_decode"] = {"tokens": c.decode_tokens, "tokens_per_s": c.tokens_per_s}


def _text(r, suffix=None) -> str:
    """A request's prompt as one string (what llama.cpp is sent)."""
    return r.prefix + "".join(r.chunks) + (suffix or r.suffix)


def _ask_llama(server: LlamaServer, a: argparse.Namespace, row: dict, first, again, decode_suffix: str) -> None:
    """llama.cpp's stages of one question, the same prompt strings, its cache erased first."""

    server.erase_cache()
    for name, prompt in (("first", _text(first)), ("reordered", _text(again)), ("exact", _text(again))):
        c = server.complete(prompt, max_tokens=a.max_new_tokens)
        row[f"llama_{name}"] = {"ttft_s": c.prompt_s, "text": c.text, "evaluated": c.prompt_tokens,
                                "cached": c.cached_tokens, "tokens_per_s": c.tokens_per_s}  # fmt: skip
    _llama_decode(server, a, row, again, decode_suffix)


def _only_decode(engine, server, a: argparse.Namespace, row: dict, again, decode_suffix: str) -> None:
    """``--only decode``: the decode probe alone, on kvrag and on llama.cpp (its cache erased first).
    kvrag's prompt is asked once for a token first and its write-back finished (as in the full run,
    where the probe follows the exact repeat): the probe's decode then shares the engine with nothing else."""
    if engine is None:
        raise SystemExit("--only decode needs kvrag (not --no-kvrag)")
    engine.generate(again.chunks, again.prefix, decode_suffix, max_new_tokens=1)
    engine.flush()
    _decode_probe(engine, a, row, again, decode_suffix)
    if server is not None:
        server.erase_cache()
        _llama_decode(server, a, row, again, decode_suffix)


def _decode_line(r: dict) -> str:
    k = r["kvrag_decode"]
    line = (
        f"q{r['question']}: {k['prompt_tokens']} prompt tokens; kvrag decode {k['tokens_per_s'] or 0:.1f} tok/s "
        f"(drafts {k['draft_accepted']}/{k['draft_tokens']} held)"
    )
    return line + (f", llama.cpp {r['llama_decode']['tokens_per_s'] or 0:.1f} tok/s" if "llama_decode" in r else "")


def summarize_decode(rows: list[dict]) -> dict:
    """``--only decode``: the median decode rates and the median of kvrag's paired ratio to llama.cpp."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    s = {
        "questions": len(rows),
        "decode_tokens_per_s": {"kvrag": med([r["kvrag_decode"]["tokens_per_s"] for r in rows])},
    }
    paired = [r for r in rows if "llama_decode" in r and r["llama_decode"]["tokens_per_s"]]
    if paired:
        s["decode_tokens_per_s"]["llama"] = med([r["llama_decode"]["tokens_per_s"] for r in paired])
        s["paired"] = {
            "kvrag_over_llama_decode": med(
                [r["kvrag_decode"]["tokens_per_s"] / r["llama_decode"]["tokens_per_s"] for r in paired]
            )
        }
    return s


def _row_line(r: dict) -> str:
    if "kvrag_first" in r and "kvrag_full" not in r:  # --quick
        line = (
            f"q{r['question']}: kvrag first {r['kvrag_first']['ttft_s']:.2f} s, blend {r['kvrag_blend']['ttft_s']:.2f}"
        )
        if "llama_first" in r:
            line += (
                f", llama.cpp first {r['llama_first']['ttft_s']:.2f}, reordered {r['llama_reordered']['ttft_s']:.2f}"
            )
        line += f"; decode {r['kvrag_decode']['tokens_per_s'] or 0:.1f}"
        return line + (f" vs {r['llama_decode']['tokens_per_s'] or 0:.1f}" if "llama_decode" in r else "") + " tok/s"
    if "kvrag_first" not in r:  # --no-kvrag
        return (
            f"q{r['question']}: llama.cpp first {r['llama_first']['ttft_s']:.2f} s, reordered "
            f"{r['llama_reordered']['ttft_s']:.2f}, exact {r['llama_exact']['ttft_s']:.3f}; decode "
            f"{r['llama_decode']['tokens_per_s'] or 0:.1f} tok/s; F1 {r['llama_reordered']['f1']:.2f}"
        )
    kvrag = (
        f"q{r['question']}: kvrag first {r['kvrag_first']['ttft_s']:.2f} s, blend {r['kvrag_blend']['ttft_s']:.2f}, "
        f"full {r['kvrag_full']['ttft_s']:.2f}, exact {r['kvrag_exact']['ttft_s']:.3f}"
    )
    f1 = f"F1 full {r['kvrag_full']['f1']:.2f} blend {r['kvrag_blend']['f1']:.2f}"
    if "llama_first" not in r:
        return f"{kvrag}; decode {r['kvrag_decode']['tokens_per_s'] or 0:.1f} tok/s; {f1}"
    return (
        f"{kvrag}; llama.cpp first {r['llama_first']['ttft_s']:.2f}, reordered {r['llama_reordered']['ttft_s']:.2f}, "
        f"exact {r['llama_exact']['ttft_s']:.3f}; decode {r['kvrag_decode']['tokens_per_s'] or 0:.1f} vs "
        f"{r['llama_decode']['tokens_per_s'] or 0:.1f} tok/s; {f1} llama {r['llama_reordered']['f1']:.2f}"
    )


def summarize(rows: list[dict]) -> dict:
    """Medians of each stage's TTFT, paired ratios, decode rates, F1/EM means, identical answers."""

    llama = all("llama_first" in r for r in rows)
    stages = ("kvrag_first", "kvrag_blend", "kvrag_full", "kvrag_exact")
    if llama:
        stages += ("llama_first", "llama_reordered", "llama_exact")

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    if not all("kvrag_full" in r for r in rows):  # --no-kvrag, --quick: the stages that ran
        stages = tuple(k for k in ("kvrag_first", "kvrag_blend", *stages[4:]) if all(k in r for r in rows))
        return {
            "questions": len(rows),
            "ttft_s": {k: med([r[k]["ttft_s"] for r in rows]) for k in stages},
            "decode_tokens_per_s": {
                k: med([r[f"{k}_decode"]["tokens_per_s"] for r in rows])
                for k in ("kvrag", "llama")
                if all(f"{k}_decode" in r for r in rows)
            },
            "quality": {"llama_reordered": {"f1": statistics.fmean(r["llama_reordered"]["f1"] for r in rows)}}
            if llama
            else {},
            "paired": {  # the first ask (0-hit) stands for the full prefill here
                "blend_over_first": med([r["kvrag_blend"]["ttft_s"] / r["kvrag_first"]["ttft_s"] for r in rows])
                if "kvrag_blend" in stages
                else None,
            },
        }

    def ratio(a: str, b: str, field: str = "ttft_s"):
        return med([r[a][field] / r[b][field] for r in rows if r[a][field] and r[b][field]])

    s = {
        "questions": len(rows),
        "ttft_s": {k: med([r[k]["ttft_s"] for r in rows]) for k in stages},
        "paired": {
            "blend_over_full": ratio("kvrag_blend", "kvrag_full"),
            "first_over_full": ratio("kvrag_first", "kvrag_full"),
            "exact_over_full": ratio("kvrag_exact", "kvrag_full"),
        },
        "decode_tokens_per_s": {"kvrag": med([r["kvrag_decode"]["tokens_per_s"] for r in rows])},
        "quality": {
            k: {
                "f1": statistics.fmean(r[k]["f1"] for r in rows),
                "em": sum(r[k]["em"] for r in rows) / len(rows),
            }
            for k in ("kvrag_blend", "kvrag_full", "kvrag_exact") + (("llama_reordered",) if llama else ())
        },
        "identical_to_full": {
            k: sum(r[k]["tokens"] == r["kvrag_full"]["tokens"] for r in rows) for k in ("kvrag_blend", "kvrag_exact")
        },
        "blend_drift": med([r.get("blend_drift") for r in rows]),
    }
    if llama:
        s["paired"] |= {
            "first_over_llama_first": ratio("kvrag_first", "llama_first"),
            "blend_over_llama_reordered": ratio("kvrag_blend", "llama_reordered"),
            "exact_over_llama_exact": ratio("kvrag_exact", "llama_exact"),
        }
        s["decode_tokens_per_s"]["llama"] = med([r["llama_decode"]["tokens_per_s"] for r in rows])
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks models", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (fetched), or a .gguf path")
    p.add_argument("--dataset", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--seed", type=int, default=0, help="the reordered asks' passage orders")
    p.add_argument("--threads", type=int, default=2, help="kvrag's and llama.cpp's threads")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64, help="the decode probe's answer length")
    p.add_argument("--settings", default="", help='EngineConfig settings as JSON, e.g. \'{"weights": "int4"}\'')
    p.add_argument("--cache-dir", default="", help="kvrag's cache directory (default: the user's)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (default: $LLAMA_SERVER)")
    p.add_argument("--no-llama", action="store_true", help="kvrag only (its full prefill the reference)")
    p.add_argument("--no-kvrag", action="store_true", help="llama.cpp only (a model too large to hold both)")
    p.add_argument(
        "--quick", action="store_true", help="kvrag: the first ask, the blend and the decode probe only (large models)"
    )
    p.add_argument("--flash-attn", default="auto", choices=("on", "off", "auto"))
    p.add_argument("--only", choices=("decode",), default=None, help="run the decode probe alone")
    p.add_argument("--load", action="store_true", help="also measure loading, first time and from the cache")
    p.add_argument("--load-cache-dir", default="", help="an empty cache directory for --load's first time")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.no_llama and a.no_kvrag:
        print("python -m benchmarks models: --no-llama and --no-kvrag leave nothing to run", file=sys.stderr)
        return 2
    if a.load and not a.load_cache_dir:
        a.load_cache_dir = str(Path(a.out) / "load-cache")
    t0 = time.time()
    try:
        result = run(a)
    except KvragError as exc:
        print(f"python -m benchmarks models: {exc}", file=sys.stderr)
        return 2
    result["seconds"] = time.time() - t0
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "models.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1))
    return 0
