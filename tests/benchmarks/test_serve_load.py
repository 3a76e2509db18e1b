"""Workload (s): the load generator's pieces, and one small run against ``kvrag serve`` (tiny engine)."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.data import make_synthetic_dataset
from benchmarks.serve_load import (
    LoadOptions,
    arrivals,
    build_requests,
    highest_sustained,
    run_load,
    summarize_run,
)
from kvrag.errors import InvalidRequestError


def test_arrivals_are_a_seeded_poisson_process():
    times = arrivals(4.0, 4000, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g > 0 for g in gaps)
    assert 0.23 < sum(gaps) / len(gaps) < 0.27  # mean gap 1/rate
    assert arrivals(4.0, 10, random.Random(1)) == times[:10]


def test_requests_carry_their_passages_as_documents(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(make_synthetic_dataset(4, passages=5)))
    from benchmarks.data import load_dataset

    pool = load_dataset(path)
    reqs = build_requests(pool, 6, 3, random.Random(0))
    for r in reqs:
        assert sorted(r.documents) == sorted(pool[r.question].passages[:3])
        assert all(d in r.messages[-1]["content"] for d in r.documents)
        assert pool[r.question].question in r.messages[-1]["content"]


def record(ttft, *, error=None, hits=1, misses=1, end=1.0):
    return {
        "error": error,
        "ttft_s": ttft,
        "itl_s": [0.01, 0.03],
        "latency_s": ttft + 0.04,
        "engine_ttft_s": ttft,
        "sent_s": 0.0,
        "end_s": end,
        "completion_tokens": 3,
        "chunk_hits": hits,
        "chunk_misses": misses,
    }


def test_summary_and_the_sustained_rule():
    ok = summarize_run([record(0.5), record(1.5, hits=2, misses=0, end=2.0)], ttft_slo=2.0)
    assert ok["sustained"] and ok["errors"] == 0 and ok["hit_rate"] == 0.75
    assert ok["ttft_p50_s"] == 1.0 and ok["itl_p50_s"] == 0.02 and ok["output_tokens_per_s"] == 3.0
    assert not summarize_run([record(0.5), record(5.0)], ttft_slo=2.0)["sustained"]  # p90 over the SLO
    failed = summarize_run([record(0.5), {"error": "ServerError: overloaded", "sent_s": 0.0, "end_s": 1.0}], ttft_slo=2)
    assert failed["errors"] == 1 and not failed["sustained"]
    runs = {"kvrag": {"0.5": ok, "1.0": ok, "2.0": failed}, "full": {"0.5": failed}}
    assert highest_sustained(runs) == {"kvrag": 1.0, "full": None}


def test_bad_options():
    with pytest.raises(InvalidRequestError, match="rates"):
        LoadOptions(dataset="x", rates=(0.0,))
    with pytest.raises(InvalidRequestError, match="unknown method"):
        LoadOptions(dataset="x", methods=("blend",))


def test_a_small_run_against_the_server(serve_tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from kvrag.server import ServerSettings, TenantMap

    _, url = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))  # it opens tenants by header
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(make_synthetic_dataset(3, passages=3, words=40)))
    opts = LoadOptions(
        dataset=str(path),
        rates=(20.0, 40.0),
        requests=3,
        questions=3,
        top_k=2,
        warm_frac=1.0,
        max_new_tokens=2,
        base_url=url,
        out=str(tmp_path / "out"),
    )
    doc = run_load(opts)
    assert len(doc["records"]) == 2 * 2 * 3 and all(r["error"] is None for r in doc["records"])
    kvrag, full = doc["summary"]["kvrag"]["20.0"], doc["summary"]["full"]["20.0"]
    assert kvrag["hit_rate"] == 1.0 and full["hit_rate"] == 0.0  # warmed passages hit; full reuses nothing
    assert all(r["completion_tokens"] == 2 and len(r["itl_s"]) <= 1 for r in doc["records"])
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["highest_sustained_rate"] == doc["highest_sustained_rate"]
    assert (tmp_path / "out" / "latency_vs_load.png").stat().st_size > 0
    assert "| kvrag | 20.0 |" in (tmp_path / "out" / "results.md").read_text()


def test_a_run_under_way_reports_progress(capsys):
    import asyncio

    from benchmarks.serve_load import _progress

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [loop.create_future() for _ in range(3)]
        jobs[0].set_result(None)
        ticker = asyncio.ensure_future(_progress(jobs, "kvrag at 0.1 req/s", every_s=0.01))
        await asyncio.sleep(0.05)
        ticker.cancel()

    asyncio.run(main())
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("serve-load: kvrag at 0.1 req/s: 1/3 answered after") for line in lines)
