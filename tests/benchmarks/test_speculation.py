"""The speculative-pipelining bench (benchmarks.speculation): its index, and one tiny run of every arm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.data import make_synthetic_dataset
from benchmarks.speculation import ARMS, build_index, main, near_copies, near_texts, paired, stage_changes, texts_of

faiss = pytest.importorskip("faiss")
staged_search = pytest.importorskip("kvrag.integrations.staged_search").staged_search


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
    assert "stage changes (4 queries, 3 stages" in printed and "| arm | prefill tokens |" in printed
    assert "stage_changes" in result
    for arm, r in runs.items():  # the totals queueing noise does not move
        assert r["prefill_tokens"] >= sum(row["computed_tokens"] for row in r["rows"]) > 0, arm
        assert r["busy_s"] > 0 and r["makespan_s"] >= max(row["ttft_s"] for row in r["rows"]), arm
        assert r["paired_p25_s"] <= r["paired_median_s"] <= r["paired_p75_s"], arm
    assert runs["none"]["paired_median_s"] == 0 and runs["none"]["speculation_tokens"] == 0


def test_unknown_arms_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--arms", "none,sometimes", "--dataset", str(tmp_path / "missing.json")])


def _two_list_index():
    """Two IVF lists (L2) with centroids at x=0 and x=10; the query at x=4.9 is nearer the first list,
    its nearest point (x=6) lies in the second."""
    quantizer = faiss.IndexFlatL2(2)
    quantizer.add(np.array([[0, 0], [10, 0]], dtype=np.float32))
    index = faiss.IndexIVFFlat(quantizer, 2, 2)
    index.is_trained = True
    index.add(np.array([[0, 0], [1, 0], [6, 0], [10, 0]], dtype=np.float32))
    return index


def test_stage_changes_counts_a_list_that_changes_at_the_last_stage():
    index = _two_list_index()
    queries = np.array([[4.9, 0], [0.2, 0]], dtype=np.float32)  # the second finds its nearest at once
    stats = stage_changes(index, queries, 1, stages=2, nprobe=2)
    changed, settled = stats["rows"]
    assert changed == {
        "stages": 2,
        "changed_after_first": 1,
        "first_is_final": False,
        "final_changed": True,
        "settled_at": 2,
    }
    assert settled["changed_after_first"] == 0 and settled["first_is_final"] and settled["settled_at"] == 1
    assert stats["share_changed_after_first"] == 0.5 and stats["mean_changed_stages"] == 0.5
    assert stats["share_final_changed"] == 0.5 and stats["mean_lost_fraction"] == 0.25
    one = stage_changes(index, queries, 1, stages=1, nprobe=2)  # one stage: nothing can change
    assert one["share_changed_after_first"] == 0 and one["mean_lost_fraction"] == 0


def test_stage_changes_agrees_with_the_staged_search_on_a_random_index():
    rng = np.random.default_rng(1)
    index = build_index(_unit_rows(rng, 50, 16), 2000, 16, seed=1)
    queries = _unit_rows(rng, 30, 16)
    stats = stage_changes(index, queries, 5, stages=8, nprobe=16)
    for q, row in zip(queries, stats["rows"]):
        history = [s.ids[0] for s in staged_search(index, q[None, :], 5, stages=8, nprobe=16)]
        assert row["changed_after_first"] == sum(not np.array_equal(a, b) for a, b in zip(history, history[1:]))
        assert all(np.array_equal(h, history[-1]) for h in history[row["settled_at"] - 1 :])
        assert row["first_is_final"] == (row["settled_at"] == 1)
    assert 0 < stats["share_changed_after_first"] <= 1  # random data: lists do change


def _unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_near_distractors_are_noisy_copies_standing_for_other_passages():
    rng = np.random.default_rng(0)
    passages = _unit_rows(rng, 5, 32)
    copies = near_copies(passages, 12, 0.7, np.random.default_rng(1))
    assert copies.shape == (12, 32) and np.allclose(np.linalg.norm(copies, axis=1), 1, atol=1e-5)
    origin = passages[np.arange(12) % 5]
    assert np.allclose(np.sum(copies * origin, axis=1), 0.7, atol=1e-4)
    texts = near_texts(5, 12)
    assert texts.min() >= 0 and texts.max() < 5 and not np.any(texts == np.arange(12) % 5)
    assert len(set(texts[:5].tolist())) == 5 and near_texts(1, 3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        near_copies(passages, 3, 1.0, rng)

    index = build_index(passages, 100, 4, seed=2, near_distractors=12, near_cos=0.7)
    assert index.ntotal == 5 + 12 + 100
    index.nprobe = 4
    _, ids = index.search(near_copies(passages, 12, 0.7, np.random.default_rng(2)), 1)  # the index's copies
    assert ids[:, 0].tolist() == list(range(5, 17))  # each copy finds itself, after the passages


def test_texts_of_maps_ids_to_prompt_chunks():
    passages = ["a", "b", "c"]
    near = np.array([2, 0])  # ids 3 and 4 stand for "c" and "a"
    assert texts_of([1, 3, 99, -1, 4], passages, near) == ["b", "c", "a"]  # a random distractor (99), none (-1)
    assert texts_of([2, 3, 0], passages, near) == ["c", "a"]  # each text once


def test_paired_differences_are_per_request():
    def run(arm, ttfts):
        return {"arm": arm, "rows": [{"request": i, "ttft_s": t} for i, t in enumerate(ttfts)]}

    runs = [run("none", [1.0, 2.0, 3.0]), run("always", [1.5, 2.0, 4.0]), run("dynamic", [1.0, 1.0, 3.0])]
    runs[2]["rows"].reverse()  # rows are matched by request, not by position
    paired(runs)
    assert runs[0]["paired_median_s"] == 0
    assert runs[1]["paired_median_s"] == 0.5 and runs[1]["paired_p75_s"] == 0.75
    assert runs[2]["paired_median_s"] == 0 and runs[2]["paired_p25_s"] == -0.5
    alone = [run("always", [1.0])]
    paired(alone)  # no `none` arm: nothing to pair with
    assert "paired_median_s" not in alone[0]


def test_a_dry_run_needs_no_model(tmp_path, one_thread, capsys):  # one_thread: restores the threads faiss sets
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(4, passages=3, words=12)))
    out = tmp_path / "dry.json"
    argv = ["--model", str(tmp_path / "no-model-here"), "--dataset", str(data), "--n", "4", "--dry-run"]
    argv += ["--n-distractors", "300", "--nlist", "8", "--stages", "4", "--top-k", "3", "--embedder", "lexical"]
    argv += ["--near-distractors", "40", "--out", str(out)]
    assert main(argv) == 0
    assert "the top-k changes after stage 1 for" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["loads"] == [] and len(result["stage_changes"]["rows"]) == 4
    assert 0 <= result["stage_changes"]["share_changed_after_first"] <= 1
