"""``python -m benchmarks saturation`` on the tiny model: it runs, and what it checks holds."""

from __future__ import annotations

import argparse

from benchmarks.saturation import run
from kvrag.engine.serving import writeback


def test_saturation_keeps_its_bounds_and_the_idle_answers(tiny_model, tiny_tokenizer):
    args = argparse.Namespace(
        model=(tiny_model, tiny_tokenizer),
        requests=6,
        clients=3,
        docs=2,
        memory_mib=1,
        writeback_jobs=1,
        max_new_tokens=2,
    )
    out = run(args)
    assert writeback.MAX_QUEUED_JOBS == 256  # restored
    assert out["answers_identical"] == "6/6"
    assert out["writeback"]["peak_queued"] <= 1 and out["writeback"]["dropped"] > 0
    assert out["memory_tier"]["peak_bytes"] <= out["memory_tier"]["budget_bytes"]
    assert out["rss"]["within"]
