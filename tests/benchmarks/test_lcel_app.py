"""``python -m benchmarks lcel-app``'s request stream, its data file and its figures (no model)."""

from __future__ import annotations

import json

import pytest

from benchmarks.lcel_app import REWORDINGS, numbered_sources, request_order, summarize


def test_the_rewordings_are_16_distinct_questions_each_reworded():
    returns = json.loads(REWORDINGS.read_text())["returns"]
    assert len(returns) == 16 and len({r["question"] for r in returns}) == 16
    assert all(r["reworded"].strip() and r["reworded"].endswith(("?", ".")) for r in returns)


def test_the_stream_interleaves_each_return_gap_first_asks_later():
    returns = {q: f"again {q}" for q in range(20, 36)}
    order = request_order(list(range(20, 44)), returns, gap=8)
    assert len(order) == 40 and sum(kind == "return" for kind, _, _ in order) == 16
    position = {(kind, q): i for i, (kind, q, _) in enumerate(order)}
    for q in returns:  # asked first, then again right after the question 8 places later
        assert position[("return", q)] == position[("first", q + 8)] + 1
    assert order[:8] == [("first", q, None) for q in range(20, 28)]


def test_returns_past_the_end_come_last():
    order = request_order([1, 2, 3], {2: "two?", 3: "three?"}, gap=2)
    assert order == [("first", 1, None), ("first", 2, None), ("first", 3, None), ("return", 2, "two?"),
                     ("return", 3, "three?")]  # fmt: skip


def test_numbered_sources():
    from langchain_core.documents import Document

    assert numbered_sources([Document("A\na."), Document("B\nb.")]) == "[1] A\na.\n\n[2] B\nb."


def test_figures():
    def row(kind, found, seen, ttft, full):
        path = "full" if not found else "blend"
        times = dict(ttft=ttft, full_ttft=full, engine_ttft=ttft, full_engine_ttft=full)
        return dict(kind=kind, found=found, seen=seen, k=5, path=path, answer="a", full_answer="a", **times)

    rows = [row("first", 0, 0, 1.0, 1.0), row("first", 0, 0, 1.2, 1.0), row("return", 5, 5, 0.2, 1.0),
            row("return", 3, 4, 0.3, 1.0)]  # fmt: skip
    f = summarize(rows)
    assert f["zero_hit"] == 2 and f["zero_hit_median_ratio"] == pytest.approx(1.1)
    assert f["summed_ratio"] == pytest.approx(2.7 / 4.0)
    assert (f["returns"], f["returns_all_seen"], f["returns_found_what_they_saw"]) == (2, 1, 1)
