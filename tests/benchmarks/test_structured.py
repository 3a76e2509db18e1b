"""``python -m benchmarks structured`` on a tiny random Qwen2-family model with a tool-rendering template."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain_core")

from benchmarks.__main__ import main as bench_main  # noqa: E402
from benchmarks.data import make_synthetic_dataset  # noqa: E402
from kvrag.engine import get_engine  # noqa: E402
from tests.helpers import QWEN_TOOLS_TEMPLATE, make_tiny_model, make_tokenizer  # noqa: E402


def test_structured_command_writes_a_row_per_question(tmp_path, one_thread):
    tok = make_tokenizer()
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    make_tiny_model(len(tok), "qwen2", layers=2, max_position_embeddings=4096).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "qa.json").write_text(json.dumps(make_synthetic_dataset(2, passages=2, words=30)))
    out = tmp_path / "structured.json"
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "qa.json"), "--n", "2"]
    try:
        assert bench_main(["structured", *args, "--top-k", "2", "--max-tokens", "4", "--out", str(out)]) == 0
    finally:
        get_engine(str(tmp_path / "model")).close()  # this test's engine only (others may share the registry)
    result = json.loads(out.read_text())
    assert result["summary"]["questions"] == 2 and len(result["rows"]) == 2
    row = result["rows"][0]
    assert {"structured_valid", "tool_valid", "tool_calls", "answer_f1", "tool_cache_read"} <= set(row)
    assert row["tool_cache_read"] > 0  # the second call reused the passages the first one computed
