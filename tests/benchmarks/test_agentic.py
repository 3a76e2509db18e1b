"""``python -m benchmarks agentic`` on a tiny random Qwen2-family model with a tool-rendering template."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain")

from benchmarks.__main__ import main as bench_main  # noqa: E402
from benchmarks.agentic import summarize  # noqa: E402
from benchmarks.data import make_synthetic_dataset  # noqa: E402
from kvrag.engine import get_engine  # noqa: E402
from tests.helpers import QWEN_TOOLS_TEMPLATE, make_tiny_model, make_tokenizer  # noqa: E402


@pytest.mark.slow  # loads MiniLM and LangGraph (~15 s on 2 busy cores)
def test_agentic_command_writes_each_call_and_run_as_it_comes(tmp_path, one_thread):
    tok = make_tokenizer()
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    tok.save_pretrained(tmp_path / "model")
    vocab = len(tok) + 1  # llguidance counts one more token than the tiny tokenizer holds
    make_tiny_model(vocab, "qwen2", layers=2, max_position_embeddings=4096).save_pretrained(tmp_path / "model")
    (tmp_path / "qa.json").write_text(json.dumps(make_synthetic_dataset(1, passages=3, words=30)))
    out = tmp_path / "agentic.jsonl"
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "qa.json"), "--n", "1", "--k", "2"]
    try:
        assert bench_main(["agentic", *args, "--max-tokens", "48", "--max-searches", "1", "--out", str(out)]) == 0
    finally:
        get_engine(str(tmp_path / "model")).close()  # this test's engine only (others may share the registry)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows][0] == "settings" and rows[-1]["kind"] == "summary"
    calls = [r for r in rows if r["kind"] == "call"]
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["mode"] for r in runs] == ["kvrag", "full"] and all(r["error"] is None for r in runs)
    # the first call is forced to search (random weights write JSON whitespace until max_tokens: no call)
    assert [c["content"].startswith("<tool_call>\n{") for c in calls if c["step"] == 0] == [True, True]
    assert all(c["cache_read"] == 0 for c in calls if c["mode"] == "full")
    assert rows[-1] == {"kind": "summary", **summarize(rows[:-1])}


def test_the_summary_counts_runs_whose_later_calls_all_reuse_and_their_ttft():
    def call(q, mode, step, ttft, cached):
        return {"kind": "call", "question": q, "mode": mode, "step": step, "ttft_s": ttft, "cache_read": cached}

    def run(q, mode, f1, searched=True):
        return {"kind": "run", "question": q, "mode": mode, "f1": f1, "searched": searched}

    rows = [
        *(call(0, "kvrag", s, t, c) for s, t, c in ((0, 1.0, 0), (1, 0.5, 900), (2, 0.25, 950))),
        run(0, "kvrag", 1.0),
        *(call(1, "kvrag", s, t, c) for s, t, c in ((0, 1.0, 10), (1, 0.25, 0))),
        run(1, "kvrag", 0.0, searched=False),
        *(call(0, "full", s, t, 0) for s, t in ((0, 1.0), (1, 2.0), (2, 2.0))),
        run(0, "full", 0.5),
        *(call(1, "full", s, t, 0) for s, t in ((0, 1.0), (1, 2.0))),
        run(1, "full", 0.5),
        call(2, "kvrag", 0, 1.0, 0),  # one call only (its forced call cut by max_tokens): no later call
        run(2, "kvrag", 0.0, searched=False),
    ]
    s = summarize(rows)
    assert s["kvrag"]["runs_with_later_calls"] == 2 and s["kvrag"]["runs_all_later_calls_reuse"] == 1
    assert s["kvrag"]["later_calls_reusing"] == 2 and s["full"]["runs_all_later_calls_reuse"] == 0
    assert s["kvrag"]["later_ttft_s"] == 1.0 and s["full"]["later_ttft_s"] == 6.0
    assert s["later_ttft_ratio"] == pytest.approx(1 / 6)
    assert (
        s["kvrag"]["f1_mean"] == pytest.approx(1 / 3)
        and s["kvrag"]["runs_searched"] == 1
        and s["full"]["runs_searched"] == 2
    )
