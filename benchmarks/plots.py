"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots", "pyplot"]


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), imported on first use: plots are optional."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ttft_vs_quality(plt, summary: dict, path: Path) -> None:
    methods = summary["questions"]["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "rouge_l_full", "ROUGE-L vs full-prefill answer"),
        (axes[1], "f1_gold", "F1 vs gold answers"),
    ):
        for name, s in methods.items():
            x = s["ttft_s"]["median"]
            y = 1.0 if (key == "rouge_l_full" and name == "full") else s.get(key)
            if x is None:
                continue
            if y is None:  # a method without answers (hf): its TTFT as a vertical line
                ax.axvline(x, color="grey", ls=":", lw=1)
                ax.annotate(name, (x, 0.02), rotation=90, fontsize=8, color="grey", xycoords=("data", "axes fraction"))
                continue
            lo, hi = s["ttft_s"]["p10"], s["ttft_s"]["p90"]
            ax.errorbar([x], [y], xerr=[[x - lo], [hi - x]], fmt="o", capsize=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("TTFT median (s); bars p10–p90")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(-0.02, 1.05)
        ax.grid(alpha=0.3)
    fig.suptitle("TTFT vs answer quality per method (workload a)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _per_request_ttft(plt, records: list[dict], workload: str, path: Path) -> None:
    rs = [r for r in records if r["workload"] == workload]
    fig, ax = plt.subplots(figsize=(10, 4))
    for m in dict.fromkeys(r["method"] for r in rs):
        pts = sorted((r["request"] + r.get("repeat", 0) * 1e-3, r["ttft_s"]) for r in rs if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1, label=m)
    ax.set_xlabel("request" + (" (along the stream)" if workload == "stream" else ""))
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(f"TTFT per request ({'b: Zipf stream' if workload == 'stream' else 'a: per question'})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit_rate(plt, records: list[dict], summary: dict, path: Path) -> None:
    rs = [r for r in records if r["workload"] == "stream"]
    fig, ax = plt.subplots(figsize=(10, 4))
    speed = ax.twinx()  # paired TTFT speed-up over full per window (dashed)
    for m in dict.fromkeys(r["method"] for r in rs):
        mine = sorted((r for r in rs if r["method"] == m), key=lambda r: r["request"])
        if not any(r.get("chunk_hits") for r in mine):
            continue
        hits = chunks = 0
        xs, cum = [], []
        for r in mine:
            hits += r.get("chunk_hits", 0)
            chunks += r.get("chunks", 0)
            xs.append(r["request"])
            cum.append(hits / chunks if chunks else 0.0)
        (line,) = ax.plot(xs, cum, lw=1.5, label=f"{m} cumulative")
        wins = summary["stream"]["windows"].get(m, [])
        for w in wins:
            if w["hit_rate"] is not None:
                a, b = w["requests"]
                ax.hlines(w["hit_rate"], a - 0.5, b + 0.5, colors=line.get_color(), lw=3, alpha=0.5)
        pts = [
            ((w["requests"][0] + w["requests"][1]) / 2, 1 / w["ttft_ratio_full_median"])
            for w in wins
            if w["ttft_ratio_full_median"]
        ]
        if pts:
            speed.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                ls="--",
                marker="o",
                color=line.get_color(),
                label=f"{m} speed-up",
            )
    ax.set_xlabel("request (along the stream); bars: hit rate per window; dashed: TTFT speed-up per window")
    ax.set_ylabel("chunk hit rate")
    speed.set_ylabel("TTFT speed-up over full (paired median)")
    speed.set_ylim(bottom=0)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Chunk hit rate and TTFT speed-up over time (b: Zipf stream, bounded store)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _frontier(plt, summary: dict, workload: str, path: Path) -> bool:
    """TTFT × full (paired median) against answer drift (mean), one point per method; for workload
    (r) a hollow second point over the requests with many chunk hits. False: no drift to plot."""
    methods = summary[workload]["methods"]
    subset = summary[workload].get("retrieval", {})
    points = [
        (name, s["ttft_ratio_full"]["median"], s["answer_drift_full"])
        for name, s in methods.items()
        if name != "full" and s["ttft_ratio_full"] and s["ttft_ratio_full"]["median"] is not None
        if s.get("answer_drift_full") is not None
    ]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([1.0], [0.0], "k*", ms=10)
    ax.annotate("full (reference)", (1.0, 0.0), textcoords="offset points", xytext=(-60, 8), fontsize=8)
    for name, x, y in points:
        (dot,) = ax.plot([x], [y], "o")
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        many = (subset.get(name) or {}).get("many_hits")
        if many and many["n"] and many["ttft_ratio_full"]["median"] is not None:
            if many["answer_drift_full"]["mean"] is not None:
                mx, my = many["ttft_ratio_full"]["median"], many["answer_drift_full"]["mean"]
                ax.plot([mx], [my], "o", mfc="none", color=dot.get_color())
                ax.plot([x, mx], [y, my], ":", lw=1, color=dot.get_color())
    ax.set_xlabel("TTFT × full prefill (paired median)")
    ax.set_ylabel("answer drift vs full (nats/token, mean)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    note = "; hollow: requests with many chunk hits" if subset else ""
    ax.set_title(f"Frontier: TTFT vs drift per method ({workload}{note})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(out_dir: Path, records: list[dict], summary: dict) -> list[Path]:
    """Write the run's plots into ``out_dir``; returns the files written."""
    plt = pyplot()
    written = []
    if "questions" in summary:
        p = out_dir / "ttft_vs_quality.png"
        _ttft_vs_quality(plt, summary, p)
        written.append(p)
        p = out_dir / "ttft_per_question.png"
        _per_request_ttft(plt, records, "questions", p)
        written.append(p)
    if "stream" in summary:
        p = out_dir / "stream_ttft.png"
        _per_request_ttft(plt, records, "stream", p)
        written.append(p)
        p = out_dir / "stream_hit_rate.png"
        _hit_rate(plt, records, summary, p)
        written.append(p)
    for workload in summary:  # every workload whose methods were scored
        p = out_dir / f"frontier_{workload.replace('/', '_')}.png"
        if _frontier(plt, summary, workload, p):
            written.append(p)
    return written
