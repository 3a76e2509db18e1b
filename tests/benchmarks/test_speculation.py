"""The speculative-pipelining bench (benchmarks.speculation): its index, and one tiny run of every arm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.data import make_synthetic_dataset
from benchmarks.speculation import ARMS, build_index, main

faiss = pytest.importorskip("faiss")


def test_the_index_holds_the_passages_first_then_unit_distractors():
    passages = np.eye(4, 8, dtype=np.float32)
    index = build_index(passages, 300, 4, seed=0)
    assert index.ntotal == 304 and index.metric_type == faiss.METRIC_INNER_PRODUCT
    index.nprobe = 4
    _, ids = index.search(passages, 1)
    assert ids[:, 0].tolist() == [0, 1, 2, 3]  # each passage finds itself


def test_a_tiny_run_of_every_arm(tmp_path, tiny_model, tiny_tokenizer, one_thread, capsys):
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(4, passages=3, words=12)))
    out = tmp_path / "speculation.json"
    argv = ["--model", str(model_dir), "--dataset", str(data), "--n", "4", "--n-distractors", "500"]
    argv += ["--nlist", "8", "--stages", "3", "--top-k", "3", "--loads", "0.5", "--embedder", "lexical"]
    argv += ["--config", f'cache_dir="{tmp_path / "cache"}"', "--out", str(out)]
    assert main(argv) == 0

    printed = capsys.readouterr().out
    assert "| dynamic |" in printed
    result = json.loads(out.read_text())
    (load,) = result["loads"]
    runs = {r["arm"]: r for r in load["arms"]}
    assert set(runs) == set(ARMS)
    for arm, r in runs.items():
        assert len(r["rows"]) == 4 and all(row["ttft_s"] > 0 for row in r["rows"]), arm
        assert 0 <= r["adoption_rate"] <= 1 and r["wasted_tokens"] >= 0
        assert r["mean_non_overlapped_s"] <= r["mean_search_s"] + 1e-9
    assert runs["oracle"]["mean_search_s"] == 0 and runs["oracle"]["mean_non_overlapped_s"] == 0
    assert runs["none"]["adoption_rate"] == 0 and runs["none"]["speculation_counts"]["started"] == 0
    assert runs["chunks"]["adoption_rate"] == 0
    for arm in ("dynamic", "always"):  # every request speculated its first stage: run, or dropped before running
        counts = runs[arm]["speculation_counts"]
        assert counts["started"] + counts["cancelled"] >= 4, arm
    assert all(row["stages"] >= 1 for arm in ("none", "dynamic") for row in runs[arm]["rows"])


def test_unknown_arms_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--arms", "none,sometimes", "--dataset", str(tmp_path / "missing.json")])
