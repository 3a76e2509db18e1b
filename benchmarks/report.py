"""Results: run metadata, aggregation, the markdown table, and guarded merging of runs.

A run's ``results.json`` holds ``{"meta": ..., "records": [...], "summary": ...}``. Every ratio is
computed from records paired within one run (same ``run_id``, same request). Each TTFT ratio is
given twice: against the run's ``full`` (the machine's dtype: bf16 where it computes it natively)
and against a float32 full prefill (``full`` in a float32 run, else ``full+dtype=float32`` run
beside it; "—" without one). Every table names each method's dtype. Results of several
runs can be merged only when they were measured on the same machine, threads, model, dtype, commit
and settings; their ratios still pair only within each run.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.metrics import MixedRunsError, fp32_full, paired_ratios, summarize
from benchmarks.report_retrieval import retrieval_summary, retrieval_table

__all__ = [
    "run_metadata",
    "aggregate",
    "markdown_table",
    "write_results",
    "load_results",
    "merge_results",
    "signature",
    "compare_table",
    "MixedRunsError",
]

#: Metadata that must agree for two runs' records to be pooled.
SIGNATURE_FIELDS = (
    "hostname",
    "cpu_model",
    "cpu_count",
    "torch_threads",
    "model_fingerprint",
    "dtype",
    "git_commit",
    "git_dirty",
    "torch_version",
    "settings",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(args: list[str]) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _program() -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if prog == "kvrag":
        return "python -m benchmarks"
    if prog in ("__main__.py", "-m") or not prog:
        return "python -m benchmarks"
    return f"{prog} (benchmarks)"


def run_metadata(engine, run_id: str, argv: list[str], settings: dict) -> dict:
    """Where and how a run was measured: machine, threads, model, dtype, commit, time, command."""
    import torch
    import transformers

    import kvrag

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    status = _git(["status", "--porcelain", "--untracked-files=no"])
    return {
        "run_id": run_id,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([_program(), *(shlex.quote(a) for a in argv)]),
        "argv": list(argv),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "load_avg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "kvrag_version": kvrag.__version__,
        "torch_threads": torch.get_num_threads(),
        "model_name": getattr(engine, "model_name", None),
        "model_fingerprint": engine.fingerprint,
        "dtype": engine.config.dtype,
        "hf_attn_implementation": getattr(engine.hf_model.config, "_attn_implementation", None),
        "device": engine.config.device,
        "engine_config": {k: _plain(v) for k, v in engine.config.flat().items()},
        "git_commit": _git(["rev-parse", "HEAD"]),
        "git_dirty": bool(status) if status is not None else None,
        "settings": settings,
    }


def _plain(v):
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # the config's sampling: its fields
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return str(v)


#: Settings that may differ between pooled runs (which requests, not how they were measured).
_FREE_SETTINGS = ("n", "start", "seed", "repeat", "out", "stream_requests")


def signature(meta: dict) -> dict:
    """The metadata that must agree before records of two runs may be pooled."""
    sig = {k: meta.get(k) for k in SIGNATURE_FIELDS}
    sig["settings"] = {k: v for k, v in (meta.get("settings") or {}).items() if k not in _FREE_SETTINGS}
    return sig


def _mean(values) -> float | None:
    return summarize(values)["mean"]


def _one(values: set):
    """The value all records agree on (a fixed ratio); None where they differ (``auto``: per request)."""
    return next(iter(values)) if len(values) == 1 else None


def _dtype(rs: list[dict]) -> str | None:
    """The dtype a method's records agree on (None: not recorded)."""
    return _one({r.get("dtype") for r in rs} - {None})


def _fp32_ratios(records: list[dict], method: str, ref: str | None, field: str = "ttft_s") -> list[float]:
    """``method``'s ``field`` over the float32 full prefill's ``ref``, paired per request ([]: no ref)."""
    if ref is None:
        return []
    return (
        [1.0 for r in records if r["method"] == method] if method == ref else paired_ratios(records, method, ref, field)
    )


def _method_summary(records: list[dict], method: str, fp32_ref: str | None = None) -> dict:
    rs = [r for r in records if r["method"] == method]
    ratios = paired_ratios(records, method, "full", "ttft_s") if method != "full" else []
    totals = paired_ratios(records, method, "full", "total_s") if method != "full" else []
    hits = sum(r.get("chunk_hits", 0) for r in rs)
    chunks = sum(r.get("chunks", 0) for r in rs)
    ident = [r["identical_full"] for r in rs if "identical_full" in r]
    return {
        "n": len(rs),
        "dtype": _dtype(rs),
        "ttft_s": summarize(r.get("ttft_s") for r in rs),
        "ttft_ratio_full": summarize(ratios) if method != "full" else None,
        "ttft_ratio_fp32_full": summarize(_fp32_ratios(records, method, fp32_ref)) if fp32_ref else None,
        "total_s": summarize(r.get("total_s") for r in rs),
        "total_ratio_full": summarize(totals) if method != "full" else None,
        "rouge_l_full": _mean(r.get("rouge_l_full") for r in rs),
        "first_word_agree_full": _mean(r.get("first_word_agree_full") for r in rs),
        "first_token_agree_full": _mean(r.get("first_token_agree_full") for r in rs),
        "identical_full": sum(ident) if ident else None,
        "identical_of": len(ident),
        "f1_gold": _mean(r.get("f1_gold") for r in rs),
        "rouge_l_gold": _mean(r.get("rouge_l_gold") for r in rs),
        "delta_logprob_full": summarize(r.get("delta_logprob_full") for r in rs),
        "abs_delta_logprob_full": summarize(
            abs(r["delta_logprob_full"]) for r in rs if r.get("delta_logprob_full") is not None
        ),
        "answer_drift_full": _mean(r.get("answer_drift_full") for r in rs),
        "answer_drift_fp32_full": _mean(r.get("answer_drift_fp32_full") for r in rs),
        "recompute_fraction": _mean(r.get("recompute_fraction") for r in rs),
        "compute_fraction": _mean(r.get("compute_fraction") for r in rs),
        "chunk_hit_rate": hits / chunks if chunks else None,
        "prompt_tokens": summarize(r.get("prompt_tokens") for r in rs),
        "recompute_ratio": _one({r.get("recompute_ratio") for r in rs} - {None}),
    }


def _windows(records: list[dict], method: str, n_windows: int, fp32_ref: str | None = None) -> list[dict]:
    reqs = sorted({r["request"] for r in records})
    if not reqs:
        return []
    out = []
    n = len(reqs)
    for w in range(n_windows):
        lo, hi = (w * n) // n_windows, ((w + 1) * n) // n_windows
        span = set(reqs[lo:hi])
        if not span:
            continue
        rs = [r for r in records if r["request"] in span]
        mine = [r for r in rs if r["method"] == method]
        hits = sum(r.get("chunk_hits", 0) for r in mine)
        chunks = sum(r.get("chunks", 0) for r in mine)
        ratios = paired_ratios(rs, method, "full") if method != "full" else []
        fp32 = _fp32_ratios(rs, method, fp32_ref)
        out.append(
            {
                "window": w,
                "requests": [reqs[lo], reqs[hi - 1]],
                "hit_rate": hits / chunks if chunks else None,
                "ttft_median_s": summarize(r["ttft_s"] for r in mine)["median"],
                "ttft_ratio_full_median": summarize(ratios)["median"] if ratios else None,
                "ttft_ratio_fp32_full_median": summarize(fp32)["median"] if fp32 else None,
            }
        )
    return out


def _steady(windows: list[dict], mine: list[dict]) -> dict:
    """Speed-up (1 / paired TTFT ratio) of the last window against the second, and the most bytes
    each tier held against its budget along the stream."""
    out: dict = {}
    if len(windows) >= 3 and windows[1]["ttft_ratio_full_median"] and windows[-1]["ttft_ratio_full_median"]:
        second, last = 1 / windows[1]["ttft_ratio_full_median"], 1 / windows[-1]["ttft_ratio_full_median"]
        out.update(speedup_second=second, speedup_last=last, last_over_second=last / second)
    for tier in ("memory", "disk"):
        held = [r[f"{tier}_bytes"] for r in mine if r.get(f"{tier}_bytes") is not None]
        budgets = [r[f"{tier}_budget_bytes"] for r in mine if r.get(f"{tier}_budget_bytes") is not None]
        if held and budgets:
            out[f"{tier}_max_bytes"], out[f"{tier}_budget_bytes"] = max(held), min(budgets)
            out[f"{tier}_within_budget"] = max(held) <= min(budgets)
    return out


def _turns(records: list[dict], method: str, fp32_ref: str | None = None) -> list[dict]:
    out = []
    for t in sorted({r["turn"] for r in records if "turn" in r}):
        rs = [r for r in records if r.get("turn") == t]
        mine = [r for r in rs if r["method"] == method]
        ratios = paired_ratios(rs, method, "full") if method != "full" else []
        fp32 = _fp32_ratios(rs, method, fp32_ref)
        out.append(
            {
                "turn": t,
                "n": len(mine),
                "ttft_median_s": summarize(r["ttft_s"] for r in mine)["median"],
                "ttft_ratio_full_median": summarize(ratios)["median"] if ratios else None,
                "ttft_ratio_fp32_full_median": summarize(fp32)["median"] if fp32 else None,
                "prompt_tokens_mean": _mean(r.get("prompt_tokens") for r in mine),
                "conversation_tokens_mean": _mean(r.get("conversation_tokens") for r in mine),
                "deduplicated_chunks": sum(r.get("deduplicated_chunks") or 0 for r in mine),
                "rouge_l_full": _mean(r.get("rouge_l_full") for r in mine),
            }
        )
    return out


def _dtype_of(summary: dict, workload: str, method: str, default: str | None = None) -> str:
    """A method's dtype in a workload's summary (``default``: the run's, for results without it)."""
    s = summary.get(workload, {}).get("methods", {}).get(method) or {}
    return s.get("dtype") or default or "—"


def turns_table(summary: dict, dtype: str | None = None) -> str:
    """Per turn of the conversations: TTFT, paired speed-up, reused conversation tokens (markdown)."""
    lines = [
        "| method | dtype | turn | prompt tokens | TTFT median (s) | TTFT × full | TTFT × fp32 full | "
        "conversation tokens reused | chunks deduplicated | ROUGE-L vs full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, ts in summary.get("conversations", {}).get("turns", {}).items():
        for t in ts:
            lines.append(
                f"| {m} | {_dtype_of(summary, 'conversations', m, dtype)} | {t['turn'] + 1} | "
                f"{_fmt(t['prompt_tokens_mean'], '.0f')} | {_fmt(t['ttft_median_s'])} | "
                f"{_fmt(t['ttft_ratio_full_median'])} | {_fmt(t.get('ttft_ratio_fp32_full_median'))} | "
                f"{_fmt(t['conversation_tokens_mean'], '.0f')} | "
                f"{t['deduplicated_chunks']} | {_fmt(t['rouge_l_full'])} |"
            )
    return "\n".join(lines)


def aggregate(records: list[dict], n_windows: int = 5) -> dict:
    """Per workload, per method: medians, p90s, paired ratios to ``full``, fidelity means."""
    by_workload: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_workload[r["workload"]].append(r)
    out = {}
    for wl, rs in by_workload.items():
        methods = list(dict.fromkeys(r["method"] for r in rs))
        ref = fp32_full(rs)
        out[wl] = {"methods": {m: _method_summary(rs, m, ref) for m in methods}, "fp32_full": ref}
        if "hf" in methods:  # our full prefill against transformers' own forward, paired per request
            out[wl]["full_over_hf"] = summarize(paired_ratios(rs, "full", "hf"))
        if wl == "stream":
            out[wl]["windows"] = {m: _windows(rs, m, n_windows, ref) for m in methods}
            out[wl]["steady_state"] = {
                m: _steady(out[wl]["windows"][m], [r for r in rs if r["method"] == m]) for m in methods if m != "full"
            }
        if wl == "conversations":
            out[wl]["turns"] = {m: _turns(rs, m, ref) for m in methods}
        if wl.startswith("retrieval/"):
            out[wl]["retrieval"] = retrieval_summary(rs)
    return out


def _fmt(v, spec: str = ".3f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def markdown_table(summary: dict, workload: str, dtype: str | None = None) -> str:
    """The benchmark table of one workload (markdown); ``dtype``: the run's, for results that do not
    record one per method."""
    methods = summary[workload]["methods"]
    # the drift from the float32 full prefill too, where a bf16 run scored one (`full+dtype=float32`)
    vs_fp32 = any(s.get("answer_drift_fp32_full") is not None for s in methods.values())
    head = (
        "| method | dtype | TTFT median (s) | TTFT p90 (s) | TTFT × full (paired median) | "
        "TTFT × fp32 full (paired median) | total (s) | "
        "ROUGE-L vs full | first word = full | identical to full | F1 gold | ROUGE-L gold | "
        "mean abs Δ log p(gold) vs full | answer drift vs full (nats/token) | "
        + ("answer drift vs fp32 full | " if vs_fp32 else "")
        + "recomputed | chunk hits |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, s in methods.items():
        name = key
        if key == "blend" and s.get("recompute_ratio") is not None:
            name = f"blend (r={s['recompute_ratio']:g})"
        ratio = s["ttft_ratio_full"]["median"] if s["ttft_ratio_full"] else (1.0 if name == "full" else None)
        fp32 = s.get("ttft_ratio_fp32_full")
        fp32 = fp32["median"] if fp32 else None
        ident = f"{s['identical_full']}/{s['identical_of']}" if s["identical_of"] else ("ref" if key == "full" else "—")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    s.get("dtype") or dtype or "—",
                    _fmt(s["ttft_s"]["median"]),
                    _fmt(s["ttft_s"]["p90"]),
                    _fmt(ratio, ".3f") + ("" if ratio is None else "×"),
                    _fmt(fp32, ".3f") + ("" if fp32 is None else "×"),
                    _fmt(s["total_s"]["median"]),
                    _fmt(s["rouge_l_full"]) if name != "full" else "ref",
                    _fmt(s["first_word_agree_full"], ".0%") if name != "full" else "ref",
                    ident,
                    _fmt(s["f1_gold"]),
                    _fmt(s["rouge_l_gold"]),
                    _fmt(s["abs_delta_logprob_full"]["mean"], ".3f") if name != "full" else "ref",
                    _fmt(s["answer_drift_full"], ".3f") if name != "full" else "ref",
                    *([_fmt(s.get("answer_drift_fp32_full"), ".3f")] if vs_fp32 else []),
                    _fmt(s["recompute_fraction"], ".0%"),
                    _fmt(s["chunk_hit_rate"], ".0%"),
                ]
            )
            + " |"
        )
    fh = summary[workload].get("full_over_hf")
    if fh and fh["n"]:
        lines += [
            "",
            f"Our full prefill vs transformers' own forward (hf), paired per request: "
            f"median {fh['median']:.3f}×, p90 {fh['p90']:.3f}× (n={fh['n']}).",
        ]
    return "\n".join(lines)


def windows_table(summary: dict, dtype: str | None = None) -> str:
    """Hit rate and paired speed-up per window of the stream, then steady state per method (markdown)."""
    wins = summary.get("stream", {}).get("windows", {})
    lines = [
        "| method | dtype | window | requests | chunk hit rate | TTFT median (s) | TTFT × full | TTFT × fp32 full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, ws in wins.items():
        for w in ws:
            lines.append(
                f"| {m} | {_dtype_of(summary, 'stream', m, dtype)} | {w['window'] + 1} | "
                f"{w['requests'][0]}–{w['requests'][1]} | "
                f"{_fmt(w['hit_rate'], '.0%')} | {_fmt(w['ttft_median_s'])} | "
                f"{_fmt(w['ttft_ratio_full_median'])} | {_fmt(w.get('ttft_ratio_fp32_full_median'))} |"
            )
    steady = summary.get("stream", {}).get("steady_state", {})
    if steady:
        mib = lambda b: "—" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
        lines += [
            "",
            "| method | dtype | speed-up over full, 2nd window | speed-up over full, last window | last / 2nd | "
            "memory max / budget (MiB) | disk max / budget (MiB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, st in steady.items():
            lines.append(
                f"| {m} | {_dtype_of(summary, 'stream', m, dtype)} | {_fmt(st.get('speedup_second'), '.2f')} | "
                f"{_fmt(st.get('speedup_last'), '.2f')} | "
                f"{_fmt(st.get('last_over_second'), '.2f')} | {mib(st.get('memory_max_bytes'))} / "
                f"{mib(st.get('memory_budget_bytes'))} | {mib(st.get('disk_max_bytes'))} / "
                f"{mib(st.get('disk_budget_bytes'))} |"
            )
    return "\n".join(lines)


def write_results(out_dir: Path, meta: dict, records: list[dict], summary: dict, extras: dict) -> dict:
    """Write results.json and results.md into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "extras": _plain(extras), "summary": summary, "records": records}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    md = [
        f"# python -m benchmarks — run {meta['run_id']}",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['timestamp']} · {meta['cpu_model']} × {meta['cpu_affinity']} cores · torch threads "
        f"{meta['torch_threads']} · load avg at start {_fmt((meta.get('load_avg_start') or [None])[0], '.2f')} · "
        f"model {meta['model_name']} ({meta['dtype']}, fingerprint {str(meta['model_fingerprint'])[:12]}) · "
        f"commit {str(meta['git_commit'])[:10]}{' (dirty)' if meta.get('git_dirty') else ''}",
        "",
    ]
    names = {
        "questions": "(a) per question, chunks pre-warmed",
        "stream": "(b) Zipf stream, bounded store",
        "conversations": "(c) multi-turn conversations (append-only layout)",
        "retrieval/corpus": "(r) retrieval corpus, the store warmed with the whole corpus",
        "retrieval/writeback": "(r) retrieval corpus, the store filled by write-back (cold start)",
    }
    for wl in summary:
        md += [f"## {names.get(wl, wl)}", "", markdown_table(summary, wl, meta.get("dtype")), ""]
        if wl == "stream":
            st = extras.get("stream") or {}
            if st:
                md += [
                    f"Stream: {st['requests']} requests, Zipf s={st['zipf_s']} over {st['pool_passages']} passages "
                    f"({st['working_set_passages']} touched, {st['working_set_kv_bytes'] / 2**20:.0f} MiB of KV); "
                    f"store {st['store'].get('eviction_policy')} with a budget of "
                    f"{st['store'].get('memory_budget_bytes', 0) / 2**20:.0f} MiB per method.",
                    "",
                ]
            md += [windows_table(summary, meta.get("dtype")), ""]
        if wl == "conversations":
            md += [turns_table(summary, meta.get("dtype")), ""]
        if wl.startswith("retrieval/"):
            md += _retrieval_md(summary[wl]["retrieval"], extras.get(wl) or {}, meta.get("dtype"))
    if meta.get("wall_s") is not None:
        cpu = meta.get("cpu_s")
        md.append(
            f"Wall time {meta['wall_s']:.0f} s"
            + (f" (process CPU {cpu:.0f} s)" if cpu else "")
            + f"; load average at end {_fmt((meta.get('load_avg_end') or [None])[0], '.2f')}. "
            "Timings on a shared machine are indicative; ratios are paired per request within this run."
        )
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    return {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}


def _retrieval_md(per_method: dict, facts: dict, dtype: str | None = None) -> list[str]:
    md = []
    if facts:
        md += [
            f"{facts['requests']} requests ({facts['questions']} questions, {facts['returns']} returns reworded, "
            f"Zipf s={facts['zipf_s']}), top-{facts['top_k']} of {facts['pool_passages']} pooled passages "
            f"({facts['pool_kv_bytes'] / 2**20:.0f} MiB of KV; {facts['retrieved_passages']} retrieved) by "
            f"{facts['embedder']} embeddings; store {facts['store_mode']}"
            + (f", warmed in {facts['corpus_order']} order" if facts.get("corpus_order") else "")
            + ". Every method has its own engine and store.",
            "",
        ]
    md += [retrieval_table(per_method, "all", dtype=dtype), ""]
    md += [retrieval_table(per_method, "many_hits", facts.get("min_hits"), facts.get("top_k"), dtype=dtype), ""]
    if facts.get("returns"):
        md += [retrieval_table(per_method, "first_asks", dtype=dtype), ""]
        md += [retrieval_table(per_method, "returns", dtype=dtype), ""]
    return md


def load_results(path: str | Path) -> dict:
    """Read a results.json (a file or the run's output directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict) or "meta" not in doc or "records" not in doc or "run_id" not in doc["meta"]:
        raise ValueError(f"{p} is not a python -m benchmarks results.json")
    return doc


def merge_results(docs: list[dict]) -> dict:
    """Pool the records of several runs measured under one signature.

    Raises:
        MixedRunsError: the runs differ in machine, threads, model, dtype, commit or settings, or
            one run is given twice. Ratios are never formed across runs.
    """
    if not docs:
        raise ValueError("nothing to merge")
    ids = [d["meta"]["run_id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise MixedRunsError(f"run {next(i for i in ids if ids.count(i) > 1)} is given twice")
    ref = signature(docs[0]["meta"])
    for d in docs[1:]:
        sig = signature(d["meta"])
        diff = [k for k in SIGNATURE_FIELDS if sig[k] != ref[k]]
        if diff:
            raise MixedRunsError(
                f"refusing to merge run {d['meta']['run_id']} into {ids[0]}: they differ in {', '.join(diff)}; "
                "ratios are only meaningful within one run"
            )
    records = [r for d in docs for r in d["records"]]
    meta = dict(docs[0]["meta"], run_id="+".join(ids), merged_from=[d["meta"] for d in docs])
    return {"meta": meta, "extras": {}, "summary": aggregate(records), "records": records}


def compare_table(docs: list[dict], workload: str = "questions") -> str:
    """Runs side by side, each with its own within-run paired ratios; nothing divides across runs."""
    cols = [d["meta"]["run_id"][:8] for d in docs]
    sums = [d.get("summary") or aggregate(d["records"]) for d in docs]
    methods = list(dict.fromkeys(m for s in sums for m in s.get(workload, {}).get("methods", {})))
    head = (
        "| method | "
        + " | ".join(
            f"{c} dtype | {c} TTFT (s) | {c} × full (within run) | {c} × fp32 full (within run) | {c} ROUGE-L vs full"
            for c in cols
        )
        + " |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in methods:
        cells = []
        for d, s in zip(docs, sums):
            ms = s.get(workload, {}).get("methods", {}).get(m)
            if ms is None:
                cells += ["—"] * 5
                continue
            ratio = ms["ttft_ratio_full"]["median"] if ms["ttft_ratio_full"] else None
            fp32 = ms.get("ttft_ratio_fp32_full")
            cells += [
                ms.get("dtype") or d["meta"].get("dtype") or "—",
                _fmt(ms["ttft_s"]["median"]),
                _fmt(ratio),
                _fmt(fp32["median"] if fp32 else None),
                _fmt(ms["rouge_l_full"]),
            ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    sigs = [signature(d["meta"]) for d in docs]
    diff = [k for k in SIGNATURE_FIELDS if any(s[k] != sigs[0][k] for s in sigs)]
    if diff:
        lines += [
            "",
            f"Runs differ in {', '.join(diff)}: absolute times are not comparable across them; "
            "only each run's own paired ratios are.",
        ]
    return "\n".join(lines)
