"""Workload (r)'s summary: per method, over all requests and over those with many chunk hits.

The acceptance measure of issue 17 is the median over requests of ``ttft_excess_full`` (TTFT × full
minus the share of prompt tokens not found in the store), beside the mean answer drift, both over
the requests with at least ``min_hits`` of k chunk hits (``many_hits`` in the records). TTFT is also
divided by a float32 full prefill's where the run has one (``full+dtype=float32``; "× fp32 full").
"""

from __future__ import annotations

from benchmarks.metrics import fp32_full, paired_ratios, summarize

__all__ = ["retrieval_figures", "retrieval_summary", "retrieval_table"]


def _mean(rs: list[dict], key: str) -> float | None:
    return summarize(r.get(key) for r in rs)["mean"]


def retrieval_figures(rs: list[dict], fp32_ratios: list[float] | None = None) -> dict:
    """Means and summaries of a set of workload (r) records (one method's, or a subset of them);
    ``fp32_ratios``: their TTFTs over the float32 full prefill's, paired per request."""
    ident = [r["identical_full"] for r in rs if "identical_full" in r]
    dtypes = {r.get("dtype") for r in rs} - {None}
    return {
        "n": len(rs),
        "dtype": next(iter(dtypes)) if len(dtypes) == 1 else None,
        "chunk_hits": _mean(rs, "chunk_hits"),
        "chunks": _mean(rs, "chunks"),
        "exact_chunks": _mean(rs, "exact_chunks"),
        "blended_chunks": _mean(rs, "blended_chunks"),
        "exact_tokens": _mean(rs, "exact_tokens"),
        "blended_tokens": _mean(rs, "blended_tokens"),
        "prompt_tokens": _mean(rs, "prompt_tokens"),
        "recompute_fraction": _mean(rs, "recompute_fraction"),
        "uncached_share": _mean(rs, "uncached_share"),
        "ttft_ratio_full": summarize(r.get("ttft_ratio_full") for r in rs),
        "ttft_ratio_fp32_full": summarize(fp32_ratios or []),
        "ttft_excess_full": summarize(r.get("ttft_excess_full") for r in rs),
        "answer_drift_full": summarize(r.get("answer_drift_full") for r in rs),
        "answer_drift_own_order": summarize(r.get("answer_drift_own_order") for r in rs),
        "rouge_l_full": _mean(rs, "rouge_l_full"),
        "identical_full": sum(ident) if ident else None,
        "identical_of": len(ident),
    }


def retrieval_summary(records: list[dict]) -> dict:
    """``{method: {"all": figures, "many_hits": figures}}`` of one workload's records (full excluded)."""
    ref = fp32_full(records)
    refs = [r for r in records if r["method"] == ref]

    def figures(name: str, rs: list[dict]) -> dict:
        ratios = paired_ratios(rs + refs, name, ref) if ref and name != ref else None
        return retrieval_figures(rs, ratios)

    out = {}
    for name in dict.fromkeys(r["method"] for r in records if r["method"] != "full"):
        mine = [r for r in records if r["method"] == name]
        out[name] = {
            "all": figures(name, mine),
            "many_hits": figures(name, [r for r in mine if r.get("many_hits")]),
            "first_asks": figures(name, [r for r in mine if not r.get("occurrence")]),
            "returns": figures(name, [r for r in mine if r.get("occurrence")]),
        }
    return out


def _f(v, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def retrieval_table(
    per_method: dict, subset: str, min_hits: int | None = None, k: int | None = None, *, dtype: str | None = None
) -> str:
    """One markdown table of :func:`retrieval_summary`'s figures, ``subset`` ``all``, ``many_hits``,
    ``first_asks`` or ``returns`` (a question asked again, reworded);
    ``dtype``: the run's, for figures that do not record one."""
    head = (
        "| method | dtype | requests | chunk hits | exact / blended chunks | recomputed (of blended) | "
        "not in store | TTFT × full, median (mean) | TTFT × fp32 full, median | "
        "**TTFT × full − not in store, median** | "
        "drift, mean (median) | drift vs full in its chunk order, mean | ROUGE-L vs full | identical |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, both in per_method.items():
        s = both[subset]
        dt = s.get("dtype") or dtype or "—"
        if not s["n"]:
            lines.append(f"| {name} | {dt} | 0 |" + " — |" * (head.count("|") - 4))
            continue
        t, e, d = s["ttft_ratio_full"], s["ttft_excess_full"], s["answer_drift_full"]
        fp32 = (s.get("ttft_ratio_fp32_full") or {}).get("median")
        ident = f"{s['identical_full']}/{s['identical_of']}" if s["identical_of"] else "—"
        lines.append(
            f"| {name} | {dt} | {s['n']} | {_f(s['chunk_hits'], '.2f')} of {_f(s['chunks'], '.0f')} | "
            f"{_f(s['exact_chunks'], '.2f')} / {_f(s['blended_chunks'], '.2f')} | "
            f"{_f(s['recompute_fraction'], '.1%')} | {_f(s['uncached_share'], '.1%')} | "
            f"{_f(t['median'])} ({_f(t['mean'])}) | {_f(fp32)} | **{_f(e['median'])}** | "
            f"{_f(d['mean'])} ({_f(d['median'])}) | {_f((s.get('answer_drift_own_order') or {}).get('mean'))} | "
            f"{_f(s['rouge_l_full'])} | {ident} |"
        )
    if subset in ("first_asks", "returns"):
        lines.insert(0, ("First asks" if subset == "first_asks" else "Returning questions") + ":\n")
    if subset == "many_hits" and min_hits is not None:
        lines.insert(0, f"Requests with at least {min_hits}" + (f" of {k}" if k else "") + " chunk hits:\n")
    return "\n".join(lines)
