"""Workload (s): Poisson arrivals of RAG requests against ``kvrag serve``, kvrag's default vs ``mode=full``.

``python -m benchmarks serve-load --dataset QA.json --rates 0.1,0.2,0.4 --out DIR`` starts a ``kvrag serve``
process (or uses ``--base-url``), then for each method and rate:

1. opens a fresh tenant (the ``X-Kvrag-Tenant`` header names a new cache namespace), so that each
   run starts from the same cache state whatever ran before it;
2. for kvrag's default, warms the passages of the first ``--warm-frac`` of the question pool
   (``POST /v1/documents``): requests over those questions hit, the others miss until write-back
   has stored their chunks, so hit rates are mixed; ``full`` recomputes everything and is not warmed;
3. sends ``--requests`` chat requests at Poisson arrival times of rate λ (the same draws for every
   method at one rate): a question drawn from the pool, its first ``--top-k`` passages in a
   shuffled order as ``documents``, streamed;
4. measures, client side, TTFT (send to first text piece), inter-token latency (gaps between text
   pieces), end-to-end latency and output tokens/s over the run's span.

A rate is *sustained* when every request succeeded and the p90 TTFT stays within ``--ttft-slo``
seconds (SLO attainment; above the capacity queues grow and TTFT with them). Results go to
``results.json``, ``results.md`` and ``latency_vs_load.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.data import DEFAULT_ANSWER_HINT, DEFAULT_INSTRUCTIONS, DEFAULT_SYSTEM, QAItem, load_dataset
from benchmarks.metrics import percentile
from kvrag.errors import InvalidRequestError, KvragError

__all__ = ["LoadOptions", "LoadRequest", "build_requests", "arrivals", "summarize_run", "run_load", "main"]

#: The methods compared: kvrag's default (the server's config, blend) and the full prefill.
METHODS = {"kvrag": None, "full": "full"}
#: seconds between progress lines while a run is under way
PROGRESS_EVERY_S = 30.0


@dataclass
class LoadOptions:
    """The workload's settings (see ``python -m benchmarks serve-load --help``)."""

    dataset: str
    rates: tuple[float, ...] = (0.1, 0.2, 0.4)
    requests: int = 12
    questions: int = 12
    top_k: int = 3
    warm_frac: float = 0.5
    max_new_tokens: int = 16
    methods: tuple[str, ...] = ("kvrag", "full")
    ttft_slo: float = 10.0
    seed: int = 0
    base_url: str | None = None
    model: str | None = None
    config: list[str] = field(default_factory=list)
    out: str = "bench-results/serve-load"
    plots: bool = True

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise InvalidRequestError("--rates must be positive request rates (requests per second)")
        unknown = sorted(set(self.methods) - METHODS.keys())
        if unknown:
            raise InvalidRequestError(
                f"unknown method(s) {', '.join(unknown)}; serve-load compares {', '.join(METHODS)}"
            )
        if self.requests < 1 or self.questions < 1 or self.top_k < 1 or not 0 <= self.warm_frac <= 1:
            raise InvalidRequestError("--requests, --questions and --top-k must be >= 1 and --warm-frac in [0, 1]")


@dataclass(frozen=True)
class LoadRequest:
    """One request of the workload: the chat messages and the passages they hold."""

    question: int  # index in the pool
    messages: list[dict]
    documents: list[str]


def build_requests(pool: list[QAItem], n: int, top_k: int, rng: random.Random) -> list[LoadRequest]:
    """``n`` requests over questions drawn uniformly from ``pool``, passages shuffled per request."""
    out = []
    for _ in range(n):
        q = rng.randrange(len(pool))
        docs = pool[q].passages[:top_k]
        docs = rng.sample(docs, len(docs))
        user = f"{DEFAULT_INSTRUCTIONS}\n\n{''.join(docs)}Question: {pool[q].question}\n{DEFAULT_ANSWER_HINT}"
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": user}]
        out.append(LoadRequest(q, messages, docs))
    return out


def arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate``; the first at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client, req: LoadRequest, *, mode: str | None, max_new_tokens: int, start: float, at: float) -> dict:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    rec = {"question": req.question, "arrival_s": at, "sent_s": sent - start, "error": None}
    try:
        stream = await client.stream_chat(
            req.messages, documents=req.documents, max_new_tokens=max_new_tokens, mode=mode
        )
        times = []
        async for _ in stream:
            times.append(time.perf_counter())
        gen = stream.generation
    except KvragError as exc:
        return {**rec, "error": f"{type(exc).__name__}: {exc}", "end_s": time.perf_counter() - start}
    s = gen.stats
    return {
        **rec,
        "ttft_s": (times[0] if times else time.perf_counter()) - sent,
        "itl_s": [b - a for a, b in zip(times, times[1:])],
        "latency_s": time.perf_counter() - sent,
        "end_s": time.perf_counter() - start,
        "engine_ttft_s": gen.ttft_s,
        "completion_tokens": s.completion_tokens,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "chunk_hits": s.chunk_hits,
        "chunk_misses": s.chunk_misses,
    }


async def _run_one(base_url: str, opts: LoadOptions, method: str, rate: float, pool, requests, times) -> list[dict]:
    from kvrag.client import AsyncClient

    tenant = f"serve-load-{uuid.uuid4().hex[:8]}-{method}-{rate}"  # a fresh cache for this run
    async with AsyncClient(base_url, tenant=tenant, timeout=3600) as client:
        if METHODS[method] != "full":
            warm = [p for item in pool[: round(opts.warm_frac * len(pool))] for p in item.passages[: opts.top_k]]
            if warm:
                await client.warm(warm)
        start = time.perf_counter()
        jobs = [
            asyncio.ensure_future(
                _one(client, req, mode=METHODS[method], max_new_tokens=opts.max_new_tokens, start=start, at=at)
            )
            for req, at in zip(requests, times)
        ]
        ticker = asyncio.ensure_future(_progress(jobs, f"{method} at {rate:g} req/s"))
        try:
            done = await asyncio.gather(*jobs)
        finally:
            ticker.cancel()
        return [{"method": method, "rate": rate, **rec} for rec in done]


async def _progress(jobs: list[asyncio.Future], what: str, every_s: float = PROGRESS_EVERY_S) -> None:
    """A line on stderr every ``every_s`` seconds while a run's requests are out (a run takes minutes)."""
    t0 = time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        answered = sum(j.done() for j in jobs)
        print(
            f"serve-load: {what}: {answered}/{len(jobs)} answered after {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def summarize_run(records: list[dict], *, ttft_slo: float) -> dict:
    """One (method, rate) run: latency percentiles, throughput, hit rate, and whether it was sustained."""
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    itl = [g for r in ok for g in r["itl_s"]]
    span = max((r["end_s"] for r in records), default=0.0) - min((r["sent_s"] for r in records), default=0.0)
    chunks = sum(r["chunk_hits"] + r["chunk_misses"] for r in ok)
    p90 = percentile(ttft, 90)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": p90,
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "latency_p50_s": percentile([r["latency_s"] for r in ok], 50),
        "engine_ttft_p50_s": percentile([r["engine_ttft_s"] for r in ok], 50),
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / span if span > 0 else None,
        "requests_per_s": len(ok) / span if span > 0 else None,
        "hit_rate": sum(r["chunk_hits"] for r in ok) / chunks if chunks else None,
        "sustained": bool(ok) and len(ok) == len(records) and p90 is not None and p90 <= ttft_slo,
    }


def highest_sustained(summary: dict[str, dict[str, dict]]) -> dict[str, float | None]:
    """Per method, the highest rate whose run was sustained (None if none was)."""
    return {
        method: max((float(rate) for rate, s in runs.items() if s["sustained"]), default=None)
        for method, runs in summary.items()
    }


class _ServerProcess:
    """A ``kvrag serve`` process on a free loopback port, stopped on exit."""

    def __init__(self, opts: LoadOptions, out: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = [sys.executable, "-m", "kvrag.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.command.append("--trust-tenant-header")  # each run opens a fresh tenant by header (a loopback server)
        if opts.model:
            self.command += ["--model", opts.model]
        for pair in opts.config:
            self.command += ["--config", pair]
        self._log = (out / "server.log").open("w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600) -> None:
        from kvrag.client import Client

        with Client(self.url) as client:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                if client.health():
                    return
                time.sleep(0.5)
        raise KvragError(f"kvrag serve did not start (see {self._log.name})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def run_load(opts: LoadOptions, *, argv: list[str] | None = None) -> dict:
    """Run the workload; returns (and writes) the results document."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    pool = load_dataset(opts.dataset, opts.questions)
    server = None if opts.base_url else _ServerProcess(opts, out)
    load_before = os.getloadavg()
    records: list[dict] = []
    try:
        if server is not None:
            server.wait_ready()
        base_url = opts.base_url or server.url
        for rate in opts.rates:
            rng = random.Random(f"{opts.seed}-{rate}")  # the same requests and arrivals for every method
            requests = build_requests(pool, opts.requests, opts.top_k, rng)
            times = arrivals(rate, opts.requests, rng)
            for method in opts.methods:
                run = asyncio.run(_run_one(base_url, opts, method, rate, pool, requests, times))
                s = summarize_run(run, ttft_slo=opts.ttft_slo)
                print(
                    f"serve-load: {method} at {rate:g} req/s: TTFT p50 {_fmt(s['ttft_p50_s'])} s, "
                    f"p99 {_fmt(s['ttft_p99_s'])} s, {s['errors']} errors",
                    file=sys.stderr,
                )
                records += run
    finally:
        if server is not None:
            server.stop()
    summary = {
        method: {
            str(rate): summarize_run(
                [r for r in records if r["method"] == method and r["rate"] == rate], ttft_slo=opts.ttft_slo
            )
            for rate in opts.rates
        }
        for method in opts.methods
    }
    meta = {
        "options": asdict(opts),
        "argv": argv,
        "server_command": server.command if server is not None else None,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    doc = {"meta": meta, "summary": summary, "highest_sustained_rate": highest_sustained(summary), "records": records}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(markdown(doc))
    if opts.plots:
        plot_latency_vs_load(summary, out / "latency_vs_load.png", ttft_slo=opts.ttft_slo)
    return doc


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * scale:.{digits}f}"


def markdown(doc: dict) -> str:
    """The results as a markdown table, one row per (method, rate)."""
    lines = [
        "| method | rate (req/s) | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | tok/s | req/s "
        "| hit rate | errors | sustained |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, runs in doc["summary"].items():
        for rate, s in runs.items():
            lines.append(
                f"| {method} | {rate} | {_fmt(s['ttft_p50_s'])} | {_fmt(s['ttft_p99_s'])} "
                f"| {_fmt(s['itl_p50_s'], 1000, 0)} | {_fmt(s['itl_p99_s'], 1000, 0)} "
                f"| {_fmt(s['output_tokens_per_s'], 1, 1)} | {_fmt(s['requests_per_s'], 1, 3)} "
                f"| {_fmt(s['hit_rate'])} | {s['errors']} | {'yes' if s['sustained'] else 'no'} |"
            )
    best = ", ".join(f"{m}: {r if r is not None else 'none'}" for m, r in doc["highest_sustained_rate"].items())
    slo = doc["meta"]["options"]["ttft_slo"]
    lines += ["", f"Highest sustained rate (no errors, p90 TTFT <= {slo:g} s): {best}"]
    before, after = doc["meta"]["loadavg_before"], doc["meta"]["loadavg_after"]
    lines.append(f"Load average before/after (1 min): {before[0]:.1f} / {after[0]:.1f} on {doc['meta']['cpus']} CPUs")
    return "\n".join(lines) + "\n"


def plot_latency_vs_load(summary: dict, path: Path, *, ttft_slo: float) -> None:
    """TTFT and inter-token latency (p50 solid, p99 dashed) against the offered rate, per method."""
    from benchmarks.plots import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, runs in summary.items():
        rates = [float(r) for r in runs]
        for ax, key, scale in ((left, "ttft", 1.0), (right, "itl", 1000.0)):
            (line,) = ax.plot(rates, [_y(s[f"{key}_p50_s"], scale) for s in runs.values()], "o-", label=f"{method} p50")
            ax.plot(
                rates,
                [_y(s[f"{key}_p99_s"], scale) for s in runs.values()],
                "s--",
                color=line.get_color(),
                label=f"{method} p99",
            )
    left.axhline(ttft_slo, color="grey", ls=":", lw=1, label="TTFT SLO (p90)")
    for ax, label in ((left, "TTFT (s)"), (right, "inter-token latency (ms)")):
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("kvrag serve: latency vs load (workload s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _y(value, scale: float) -> float:
    return float("nan") if value is None else value * scale


def parser() -> argparse.ArgumentParser:
    d = LoadOptions(dataset="")
    p = argparse.ArgumentParser(
        prog="python -m benchmarks serve-load",
        description="Workload (s): Poisson arrivals of RAG requests against kvrag serve, kvrag's default vs mode=full.",
    )
    p.add_argument("--dataset", required=True, help="QA JSON: [{question, answers, ctxs: [{title, text}]}]")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="request rates (req/s), comma list")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per (method, rate)")
    p.add_argument("--questions", type=int, default=d.questions, help="question pool (the dataset's first N)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="passages per request")
    p.add_argument("--warm-frac", type=float, default=d.warm_frac, help="share of the pool whose passages are warmed")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--methods", default=",".join(d.methods), help="kvrag (the server's default), full")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo, help="p90 TTFT (s) within which a rate is sustained")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--base-url", default=None, help="a running kvrag serve (default: start one)")
    p.add_argument("--model", default=None, help="the started server's model (default: bundled)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE", help="the started server's config")
    p.add_argument("--out", default=d.out)
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    try:
        opts = LoadOptions(
            dataset=a.dataset,
            rates=tuple(float(r) for r in a.rates.split(",") if r),
            requests=a.requests,
            questions=a.questions,
            top_k=a.top_k,
            warm_frac=a.warm_frac,
            max_new_tokens=a.max_new_tokens,
            methods=tuple(m for m in a.methods.split(",") if m),
            ttft_slo=a.ttft_slo,
            seed=a.seed,
            base_url=a.base_url,
            model=a.model,
            config=a.config,
            out=a.out,
            plots=not a.no_plots,
        )
        doc = run_load(opts, argv=argv)
    except (KvragError, ValueError) as exc:
        print(f"python -m benchmarks serve-load: {exc}", file=sys.stderr)
        return 2
    print(markdown(doc))
    print(f"wrote {opts.out}/ (results.json, results.md{', latency_vs_load.png' if opts.plots else ''})")
    return 0
