"""The benchmark harness: metrics on known inputs, pairing and merge guards, a tiny end-to-end run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import BenchOptions, MixedRunsError, paired_ratios, parse_methods, run_bench
from benchmarks.__main__ import main as bench_main
from benchmarks.data import DEFAULT_SYSTEM, PromptFormat, load_dataset, make_synthetic_dataset, pick_question_pair
from benchmarks.metrics import (
    best_f1,
    f1_score,
    first_word,
    first_word_agreement,
    normalize_answer,
    percentile,
    rouge_l,
    summarize,
)
from benchmarks.report import compare_table, merge_results
from benchmarks.workloads import answer_drift, ordered, zipf_requests
from kvrag import InvalidRequestError

# -- metrics on known inputs ------------------------------------------------------------------------


def test_normalize_and_f1():
    assert normalize_answer("The  Exeter College!") == "exeter college"
    assert f1_score("Exeter College", "exeter college.") == 1.0
    # 1 common token of 3 predicted and 2 gold: P=1/3, R=1/2 -> F1 = 0.4
    assert f1_score("at Exeter University", "Exeter College") == pytest.approx(0.4)
    assert f1_score("Oxford", "Exeter College") == 0.0
    assert f1_score("the", "a") == 1.0  # both empty after normalisation
    assert best_f1("Paris", ["London", "paris"]) == 1.0


def test_rouge_l_known_values():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS("a b c d", "a c d e") = 3 -> P = R = 3/4
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    # LCS = 2 of 2 predicted and 5 reference words: P = 1, R = 0.4 -> F = 4/7
    assert rouge_l("Exeter College", "he studied at Exeter College") == pytest.approx(4 / 7)
    assert rouge_l("Exeter College", "Exeter College Oxford England") == pytest.approx(2 / 3)
    assert rouge_l("", "") == 1.0 and rouge_l("...", "") == 1.0  # no words on either side
    assert rouge_l("something", "") == 0.0


def test_first_word_agreement():
    assert first_word("  The Eiffel Tower.") == "eiffel"
    assert first_word_agreement("Paris, France", "paris is the capital")
    assert not first_word_agreement("Paris", "London")
    assert first_word("") == ""


def test_summaries():
    s = summarize([1.0, 2.0, 3.0, 4.0, None])
    assert s["n"] == 4 and s["median"] == 2.5 and s["p90"] == pytest.approx(3.7)
    assert summarize([])["median"] is None
    assert percentile([5.0], 90) == 5.0


# -- pairing and run guards ---------------------------------------------------------------------


def _rec(run, req, method, ttft, workload="questions"):
    return {"run_id": run, "workload": workload, "request": req, "repeat": 0, "method": method, "ttft_s": ttft}


def test_answer_drift():
    assert answer_drift([-1.0, -2.0], [-1.5, -1.0]) == pytest.approx(0.75)
    assert answer_drift([-0.5], [-0.5]) == 0.0
    with pytest.raises(ValueError):
        answer_drift([-1.0], [-1.0, -2.0])


def test_ratios_pair_within_one_run_only():
    records = [
        _rec("A", 0, "full", 4.0),
        _rec("A", 0, "blend", 1.0),
        _rec("A", 1, "full", 8.0),
        _rec("A", 1, "blend", 1.0),
        _rec("B", 2, "blend", 3.0),  # no full in run B for request 2: never paired with A's
        _rec("B", 0, "blend", 2.0),  # same request id as A's, other run: must not pair with A's full
    ]
    assert sorted(paired_ratios(records, "blend", "full")) == [0.125, 0.25]
    with pytest.raises(MixedRunsError):
        paired_ratios([{"workload": "questions", "request": 0, "method": "full", "ttft_s": 1.0}], "blend", "full")


def _doc(run_id, **meta):
    base = dict(
        run_id=run_id,
        hostname="h",
        cpu_model="c",
        cpu_count=2,
        torch_threads=2,
        model_fingerprint="fp",
        dtype="float32",
        git_commit="abc",
        git_dirty=False,
        torch_version="2",
        settings={"top_k": 6, "n": 2},
    )
    base.update(meta)
    recs = [_rec(run_id, 0, "full", 2.0), _rec(run_id, 0, "blend", 1.0)]
    return {"meta": base, "records": recs}


def test_merge_refuses_different_runs():
    merged = merge_results([_doc("A"), _doc("B", settings={"top_k": 6, "n": 5})])  # n may differ
    assert merged["summary"]["questions"]["methods"]["blend"]["ttft_ratio_full"]["n"] == 2
    for field, value in (
        ("hostname", "other"),
        ("model_fingerprint", "fp2"),
        ("torch_threads", 4),
        ("dtype", "bfloat16"),
        ("git_commit", "def"),
        ("settings", {"top_k": 3, "n": 2}),
    ):
        with pytest.raises(MixedRunsError, match=field):
            merge_results([_doc("A"), _doc("B", **{field: value})])
    with pytest.raises(MixedRunsError, match="twice"):
        merge_results([_doc("A"), _doc("A")])
    table = compare_table([_doc("A"), _doc("B", hostname="other")])
    assert "not comparable" in table and "0.500" in table


# -- methods, data, workload helpers ------------------------------------------------------------------


def test_method_names():
    ms = parse_methods("hf,blend@0.3,blend,prefix,reuse")
    assert [m.name for m in ms] == ["full", "hf", "blend@0.3", "blend", "prefix", "reuse"]
    assert ms[2].ratio == 0.3 and ms[3].ratio is None
    assert [m.name for m in ordered(ms)] == ["full", "hf", "blend@0.3", "blend", "reuse", "prefix"]
    for bad in ("nope", "blend@x", "blend@1.5", "full@0.2", "full,full"):
        with pytest.raises(InvalidRequestError):
            parse_methods(bad)


def test_dataset_validation(tmp_path):
    p = tmp_path / "qa.json"
    p.write_text(json.dumps(make_synthetic_dataset(3, passages=4, words=10)))
    items = load_dataset(p, 2)
    assert len(items) == 2 and len(items[0].passages) == 4
    assert any(items[0].answers[0] in t for t in items[0].passages)  # the answer is in a passage
    for bad in ([], [{"question": "q", "answers": [], "ctxs": [{"text": "x"}]}], [{"question": "q"}]):
        p.write_text(json.dumps(bad))
        with pytest.raises(InvalidRequestError):
            load_dataset(p)
    with pytest.raises(InvalidRequestError, match="not found"):
        load_dataset(tmp_path / "missing.json")


def test_question_pair_shares_the_most_passages_in_another_order():
    qs = ["q0", "q1", "q2", "q3"]
    tops = [
        ["a", "b", "c", "d", "e"],
        ["a", "b", "c", "d", "x"],  # shares 4 with q0, in the same order: prefix reuse's case, skipped
        ["e", "d", "c", "b", "y"],  # shares 4 with q0 (and 3 with q1), reordered
        ["b", "a", "e", "c", "d"],  # shares 5 with q0, reordered: the most
    ]
    assert pick_question_pair(qs, tops) == ("q0", "q3", 5)
    assert pick_question_pair(qs[:3], tops[:3]) == ("q0", "q2", 4)
    assert pick_question_pair(qs[1:], tops[1:]) == ("q1", "q3", 4)  # q2/q3 share 4 too: the earliest wins
    assert pick_question_pair(qs[1:3], tops[1:3], min_shared=3) == ("q1", "q2", 3)
    with pytest.raises(InvalidRequestError, match="in another order"):
        pick_question_pair(qs[:2], tops[:2])
    with pytest.raises(InvalidRequestError, match="top_ids"):
        pick_question_pair(qs, tops[:3])


def test_prompt_format_and_zipf(tiny_tokenizer):
    fmt = PromptFormat(tiny_tokenizer)
    items = load_dataset_from(make_synthetic_dataset(4, passages=5, words=5))
    req = fmt.request(items[0], [2, 0, 1], workload="questions", request=0)
    assert req.prefix.startswith("<|im_start|>system") and req.prefix.endswith("\n\n")
    assert req.suffix.startswith(f"Question: {items[0].question}\nAnswer within 5 words.")
    assert req.suffix.endswith("<|im_start|>assistant\n") and req.chunks[0] == items[0].passages[2]
    assert fmt.style == "chat"
    base = copy.deepcopy(tiny_tokenizer)  # a base model's tokenizer: no chat template
    base.chat_template = None
    plain = PromptFormat(base).request(items[0], [2, 0, 1], workload="questions", request=0)
    assert PromptFormat(base).style == "completion" and plain.chunks == req.chunks
    assert plain.prefix.startswith(DEFAULT_SYSTEM) and "<|im_start|>" not in plain.prefix + plain.suffix
    assert plain.suffix == f"Question: {items[0].question}\nAnswer within 5 words.\n\nAnswer:"
    reqs, pool = zipf_requests(items, 50, 3, 1.2, seed=0)
    assert all(len(set(p)) == 3 for _, p in reqs)
    counts = [sum(p.count(i) for _, p in reqs) for i in range(len(pool["pool"]))]
    assert max(counts) > 3 * (sum(counts) / len(counts))  # popularity is skewed


def load_dataset_from(data):
    from benchmarks.data import QAItem, passage_text

    return [QAItem(i, d["question"], d["answers"], [passage_text(c) for c in d["ctxs"]]) for i, d in enumerate(data)]


# -- a tiny end-to-end run ----------------------------------------------------------------------------


def test_end_to_end_tiny_model_dir(tmp_path, tiny_model, tiny_tokenizer):
    """The CLI over a model directory (the tiny random Llama saved with save_pretrained); the bf16 full
    prefill beside the (explicitly) float32 run loads the directory's model in bf16."""
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    data = tmp_path / "qa.json"
    assert bench_main(["make-dataset", "--out", str(data), "--n", "3", "--passages", "3", "--words", "8"]) == 0
    out = tmp_path / "run"
    rc = bench_main(
        [
            "--dataset",
            str(data),
            "--n",
            "2",
            "--top-k",
            "3",
            "--model",
            str(model_dir),
            "--config",
            f'cache_dir="{tmp_path / "cache"}"',
            "--config",
            "dtype=float32",
            "--methods",
            "hf,full,full+dtype=bfloat16,prefix,reuse,blend,blend@1.0",
            "--max-new-tokens",
            "4",
            "--workloads",
            "a,b",
            "--stream-requests",
            "5",
            "--stream-methods",
            "full,blend",
            "--stream-max-new-tokens",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    meta = doc["meta"]
    for key in (
        "run_id",
        "hostname",
        "cpu_count",
        "torch_threads",
        "model_fingerprint",
        "dtype",
        "git_commit",
        "timestamp",
        "command",
    ):
        assert key in meta
    a = doc["summary"]["questions"]["methods"]
    assert set(a) == {"full", "hf", "full+dtype=bfloat16", "prefix", "reuse", "blend", "blend@1.0"}
    assert a["full+dtype=bfloat16"]["dtype"] == "bfloat16" and a["blend"]["dtype"] == "float32"
    assert doc["summary"]["questions"]["fp32_full"] == "full"  # a float32 run: its own full
    assert a["full+dtype=bfloat16"]["ttft_ratio_fp32_full"]["n"] == 2
    assert a["blend@1.0"]["identical_full"] == 2 and a["prefix"]["identical_full"] == 2
    assert a["reuse"]["chunk_hit_rate"] == 1.0 and a["blend"]["chunk_hit_rate"] == 1.0
    assert a["blend"]["ttft_ratio_full"]["n"] == 2
    rows = [r for r in doc["records"] if r["workload"] == "questions"]
    assert all(r["prompt_tokens_match_full"] for r in rows if r["method"] == "hf")  # same token ids
    assert all(abs(r["delta_logprob_full"]) < 1e-4 for r in rows if r["method"] == "prefix")  # exact reuse
    assert all(r["delta_logprob_full"] == 0.0 for r in rows if r["method"] == "full")
    # teacher-forced drift on full's own answer: none for an exact prefix, some for reuse
    assert all(r["answer_drift_full"] < 1e-4 for r in rows if r["method"] == "prefix")
    assert a["reuse"]["answer_drift_full"] > a["prefix"]["answer_drift_full"]
    assert "answer_drift_full" not in next(r for r in rows if r["method"] == "full")
    b = doc["summary"]["stream"]
    assert b["methods"]["blend"]["n"] == 5 and len(b["windows"]["blend"]) == 5
    assert doc["extras"]["stream"]["store"]["memory_budget_bytes"] < doc["extras"]["stream"]["pool_kv_bytes"]
    for name in ("results.md", "ttft_vs_quality.png", "stream_ttft.png", "stream_hit_rate.png"):
        assert (out / name).stat().st_size > 0
    assert "| blend@1.0 |" in (out / "results.md").read_text()
    # merging a run with itself is refused; compare shows each run's own ratios
    assert bench_main(["merge", str(out), str(out), "--out", str(tmp_path / "m")]) == 2
    assert bench_main(["compare", str(out)]) == 0


def test_a_float32_full_prefill_beside_a_bfloat16_run(tmp_path, tiny_model, tiny_tokenizer):
    """make bench's setting, small: the run in bf16 and ``full+dtype=float32`` beside it (an engine
    handed in: a converted copy of its model). Every row names its dtype; every TTFT is divided by
    the bf16 full's and by the float32 full's on the same request; the float32 full's drift against
    the bf16 full is measured; blend still finds what the run warmed."""
    from kvrag import Engine
    from tests.helpers import as_dtype

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(2, passages=3, words=10)))
    engine = Engine.from_model(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer, cache_dir=str(tmp_path / "c"))
    try:
        res = run_bench(
            BenchOptions(
                dataset=str(data),
                n=2,
                top_k=3,
                methods="hf,full,full+dtype=float32,blend@0.3",
                max_new_tokens=3,
                workloads="a",
                out=str(tmp_path / "o"),
                plots=False,
                progress=False,
            ),
            engine=engine,
        )
    finally:
        engine.close()
    a = res["summary"]["questions"]
    assert a["fp32_full"] == "full+dtype=float32"
    m = a["methods"]
    assert {k: s["dtype"] for k, s in m.items()} == {
        "full": "bfloat16",
        "hf": "bfloat16",
        "full+dtype=float32": "float32",
        "blend@0.3": "bfloat16",
    }
    for name in ("full", "hf", "blend@0.3"):
        assert m[name]["ttft_ratio_fp32_full"]["n"] == 2
    assert m["full+dtype=float32"]["ttft_ratio_fp32_full"]["median"] == 1.0  # the reference itself
    assert m["full+dtype=float32"]["ttft_ratio_full"]["n"] == 2  # float32 full over bf16 full, paired
    rows = [r for r in res["records"] if r["method"] == "full+dtype=float32"]
    assert all(r["chunk_hits"] == 0 and r["dtype"] == "float32" for r in rows)
    assert all(r.get("answer_drift_full") is not None for r in rows)  # bf16 full vs float32 full
    assert all("answer_drift_fp32_full" not in r for r in rows)  # the reference against itself
    fulls = {r["request"]: r for r in res["records"] if r["method"] == "full"}
    for r in rows:  # bf16 full's distance from the float32 full, measured both ways: the same
        assert fulls[r["request"]]["answer_drift_fp32_full"] == pytest.approx(r["answer_drift_full"])
    assert m["blend@0.3"]["answer_drift_fp32_full"] is not None
    assert m["blend@0.3"]["chunk_hit_rate"] == 1.0
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| method | dtype |" in md and "TTFT × fp32 full" in md and "answer drift vs fp32 full" in md
    assert "| full+dtype=float32 | float32 |" in md and "| blend@0.3 | bfloat16 |" in md


def test_tables_without_a_float32_reference_or_recorded_dtypes():
    """Records from before the dtype was recorded (and runs without a float32 full): the run's dtype
    fills the column and "× fp32 full" reads "—"; a float32 run's own full is its float32 reference."""
    from benchmarks.report import aggregate, markdown_table

    doc = _doc("A")
    summary = aggregate(doc["records"])
    assert summary["questions"]["fp32_full"] is None
    table = markdown_table(summary, "questions", dtype="float32")
    assert "| blend | float32 | 1.000 | 1.000 | 0.500× | — |" in table
    recs = [dict(r, dtype="float32") for r in doc["records"]]
    summary = aggregate(recs)
    assert summary["questions"]["fp32_full"] == "full"
    assert summary["questions"]["methods"]["blend"]["ttft_ratio_fp32_full"]["median"] == 0.5
    assert "| full | float32 | 2.000 | 2.000 | 1.000× | 1.000× |" in markdown_table(summary, "questions")


def test_stream_compares_policies_side_by_side_within_budgets(tmp_path, tiny_model, tiny_tokenizer):
    from kvrag import Engine

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(4, passages=4, words=10)))
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path / "c"), disk_tier=True)
    try:
        res = run_bench(
            BenchOptions(
                dataset=str(data),
                n=4,
                top_k=3,
                methods="full,blend",
                workloads="b",
                stream_requests=10,
                stream_max_new_tokens=2,
                eviction_policy="lru,pgdsf",
                windows=5,
                out=str(tmp_path / "o"),
                plots=False,
                progress=False,
            ),
            engine=engine,
        )
    finally:
        engine.close()
    doc = json.loads(Path(res["paths"]["json"]).read_text())
    b = doc["summary"]["stream"]
    assert set(b["methods"]) == {"full", "blend/lru", "blend/pgdsf"}
    for m in ("blend/lru", "blend/pgdsf"):
        st = b["steady_state"][m]
        assert st["memory_within_budget"] and st["disk_within_budget"]
        assert st["last_over_second"] > 0
    assert (
        doc["extras"]["stream"]["store"]["disk_budget_bytes"] == doc["extras"]["stream"]["store"]["memory_budget_bytes"]
    )
    assert "| blend/pgdsf | " in (tmp_path / "o" / "results.md").read_text()


def test_injected_engine_and_bad_options(tmp_path, tiny_engine):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(2, passages=2, words=6)))
    res = run_bench(
        BenchOptions(
            dataset=str(data),
            n=1,
            top_k=2,
            methods="full,blend@0.5",
            max_new_tokens=2,
            repeat=3,
            workloads="a",
            out=str(tmp_path / "o"),
            plots=False,
            progress=False,
        ),
        engine=tiny_engine,
    )
    recs = [r for r in res["records"] if r["method"] == "blend@0.5"]
    assert sorted(r["repeat"] for r in recs) == [0, 1, 2]
    assert res["summary"]["questions"]["methods"]["blend@0.5"]["ttft_ratio_full"]["n"] == 3
    assert tiny_engine.count_tokens("still open") > 0  # an injected engine is left open
    with pytest.raises(InvalidRequestError, match="prefix cache"):
        run_bench(
            BenchOptions(
                dataset=str(data),
                n=1,
                methods="full,prefix",
                order="given",
                repeat=2,
                workloads="a",
                out=str(tmp_path / "g"),
                progress=False,
            ),
            engine=tiny_engine,
        )
    with pytest.raises(InvalidRequestError, match="workload"):
        run_bench(BenchOptions(dataset=str(data), workloads="z", out=str(tmp_path / "z")), engine=tiny_engine)
    held_out = run_bench(
        BenchOptions(
            dataset=str(data),
            n=1,
            skip=1,
            methods="full",
            max_new_tokens=1,
            workloads="a",
            out=str(tmp_path / "s"),
            plots=False,
            progress=False,
        ),
        engine=tiny_engine,
    )  # --skip 1: the second question
    second = load_dataset(data)[1].question
    assert [r["question"] for r in held_out["records"]] == [second] and held_out["meta"]["settings"]["skip"] == 1
    with pytest.raises(InvalidRequestError, match="--skip"):
        run_bench(BenchOptions(dataset=str(data), skip=-1, out=str(tmp_path / "k")), engine=tiny_engine)
    with pytest.raises(InvalidRequestError, match="has 2 questions, 3 were asked for"):
        run_bench(BenchOptions(dataset=str(data), n=1, skip=2, out=str(tmp_path / "k")), engine=tiny_engine)


def test_warm_in_other_company(tmp_path, tiny_engine, monkeypatch):
    """--warm-company other: each passage of a request is warmed on its own, behind passages of other
    questions only, into an emptied store (the prompt's lead text cached again); the request then
    finds all its passages cached."""
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(3, passages=3, words=6)))
    items = load_dataset(data, 3)
    calls = []
    real_warm = tiny_engine.warm
    monkeypatch.setattr(tiny_engine, "warm", lambda docs: calls.append(list(docs)) or real_warm(docs))
    opts = dict(
        dataset=str(data),
        n=3,
        top_k=2,
        methods="full,reuse",
        max_new_tokens=2,
        workloads="a",
        plots=False,
        progress=False,
        score="none",
    )
    res = run_bench(
        BenchOptions(**opts, warm_company="other", warm_others=2, out=str(tmp_path / "o")), engine=tiny_engine
    )
    calls = calls[1:]  # the benchmark's own warm-up request first
    assert len(calls) == 3 * 2
    for item, pair in zip(items, (calls[i : i + 2] for i in range(0, len(calls), 2))):
        mine = set(item.passages[:2])
        assert sorted(c[-1] for c in pair) == sorted(mine)  # each passage last, behind...
        assert all(len(c) == 3 and not mine & set(c[:-1]) for c in pair)  # ...two of other questions
    reuse = [r for r in res["records"] if r["method"] == "reuse"]
    assert all(r["chunk_hits"] == 2 for r in reuse)
    # the emptied store gets the prompt's lead text back: reuse (first after full) finds it cached
    assert all(r["prefix_tokens"] > 0 for r in reuse)
    assert res["meta"]["settings"]["warm_company"] == "other"
    with pytest.raises(InvalidRequestError, match="other questions"):
        run_bench(BenchOptions(**{**opts, "n": 1}, warm_company="other", out=str(tmp_path / "x")), engine=tiny_engine)
    with pytest.raises(InvalidRequestError, match="warm-company"):
        run_bench(BenchOptions(**opts, warm_company="elsewhere", out=str(tmp_path / "y")), engine=tiny_engine)


def test_cli_dispatch(capsys):
    from benchmarks.__main__ import main as bench_main

    assert bench_main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "blend" in out and "hf" in out and "prefix" in out


def test_conversations_workload(tmp_path, tiny_engine):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(4, passages=3, words=6)))
    res = run_bench(
        BenchOptions(
            dataset=str(data),
            n=4,
            workloads="c",
            conv_turns=2,
            conv_top_k=2,
            conv_max_new_tokens=3,
            conv_methods="full,hf,blend,conv",
            out=str(tmp_path / "o"),
            plots=False,
            progress=False,
        ),
        engine=tiny_engine,
    )
    recs = res["records"]
    assert {(r["conversation"], r["turn"]) for r in recs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    conv = [r for r in recs if r["method"] == "conv"]
    assert all(r["conversation_tokens"] == 0 for r in conv if r["turn"] == 0)
    assert all(r["conversation_tokens"] > 0 for r in conv if r["turn"] == 1)  # the first turn's KV reused
    assert all(r["prompt_tokens_match_full"] for r in recs if r["method"] == "hf")
    assert all(r["chunk_hits"] >= 2 for r in recs if r["method"] == "blend")  # chunks found in the prompt
    turns = res["summary"]["conversations"]["turns"]["conv"]
    assert [t["turn"] for t in turns] == [0, 1] and turns[1]["ttft_ratio_full_median"] is not None
    with pytest.raises(InvalidRequestError, match="prefix"):
        run_bench(
            BenchOptions(
                dataset=str(data),
                n=2,
                workloads="c",
                conv_methods="full,prefix",
                out=str(tmp_path / "c"),
                progress=False,
            ),
            engine=tiny_engine,
        )
