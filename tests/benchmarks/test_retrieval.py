"""Workload (r): the corpus, the stream of returning questions, and a tiny run in both store modes."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from benchmarks import BenchOptions, make_synthetic_dataset, run_bench
from benchmarks.corpus import REWORDINGS, Corpus, corpus_order, make_embedder, question_stream
from benchmarks.data import QAItem
from kvrag import InvalidRequestError
from tests.helpers import make_docs


def _items(n: int) -> list[QAItem]:
    return [QAItem(i, f"question {i}?", [f"answer {i}"], [f"passage {i}.{j}\n\n" for j in range(3)]) for i in range(n)]


def test_questions_come_first_in_order_then_back_reworded_after_their_first_ask():
    items = _items(6)
    asks = question_stream(items, 40, 1.2, seed=3)
    assert len(asks) == 40 and [a.position for a in asks] == list(range(40))
    firsts = [a for a in asks if a.occurrence == 0]
    assert [a.question for a in firsts] == list(range(6))  # first asks in dataset order
    assert all(a.text == items[a.question].question and a.wording == -1 for a in firsts)
    first_at = {a.question: a.position for a in firsts}
    for a in asks:
        if a.occurrence:
            assert a.position > first_at[a.question]
            assert a.text == REWORDINGS[a.wording].format(q=items[a.question].question) != items[a.question].question
    per_question = Counter(a.question for a in asks)
    assert sorted(per_question.values())[-1] > 2 * sorted(per_question.values())[0]  # Zipf: skewed
    occurrences = [a.occurrence for a in asks if a.question == asks[-1].question]
    assert occurrences == list(range(len(occurrences)))
    assert question_stream(items, 40, 1.2, seed=3) == asks  # seeded
    assert question_stream(items, 40, 1.2, seed=4) != asks
    assert [a.question for a in question_stream(items, 4, 1.0, seed=0)] == [0, 1, 2, 3]  # fewer than N: no returns


def test_corpus_pools_passages_once_and_retrieves_the_nearest():
    items = [
        QAItem(
            0, "Who painted the harbour?", ["a"], ["The harbour was painted by Ada.\n\n", "Trains run at noon.\n\n"]
        ),
        QAItem(1, "When do trains run?", ["b"], ["Trains run at noon.\n\n", "Bread is baked at dawn.\n\n"]),
    ]
    corpus = Corpus(items, make_embedder("lexical"))
    assert corpus.passages == [
        "The harbour was painted by Ada.\n\n",
        "Trains run at noon.\n\n",
        "Bread is baked at dawn.\n\n",
    ]
    assert corpus.owner == [0, 0, 1]
    assert np.allclose(np.linalg.norm(corpus.vectors, axis=1), 1.0)
    top = corpus.search(["who painted that harbour", "bread baked when?"], 2)
    assert [t[0] for t in top] == [0, 2] and all(len(t) == 2 for t in top)
    with pytest.raises(InvalidRequestError, match="top-k"):
        corpus.search(["x"], 4)
    assert corpus_order(corpus, "dataset", 0) == (corpus.passages, {})
    shuffled, how = corpus_order(corpus, "shuffled", 0)
    assert sorted(shuffled) == sorted(corpus.passages) and how == {}
    similar, how = corpus_order(corpus, "similar", 0)  # kvrag's own way: warm by similarity, the retriever's vectors
    assert similar == shuffled and how["order"] == "similar"
    assert np.array_equal(how["embeddings"], np.stack([corpus.vectors[corpus.passages.index(t)] for t in similar]))
    with pytest.raises(InvalidRequestError, match="embedder"):
        make_embedder("tfidf")


def test_minilm_embeds_to_unit_vectors_that_rank_the_paraphrase_first():
    pytest.importorskip("sentence_transformers")
    embed = make_embedder("minilm")
    vecs = embed(["Where was the composer born?", "The composer was born in Vienna.", "Bread is baked at dawn."])
    assert vecs.dtype == np.float32 and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]


def _run_r(tmp_path, engine, data, methods: str, **options) -> dict:
    """Workload (r) in both store modes over ``data``: 6 requests, top-3, 2 new tokens."""
    base = dict(
        dataset=str(data),
        top_k=3,
        workloads="r",
        store="writeback,corpus",
        retrieval_methods=methods,
        retrieval_requests=6,
        retrieval_max_new_tokens=2,
        embedder="lexical",
        out=str(tmp_path / "o"),
        progress=False,
    )
    return run_bench(BenchOptions(**{**base, **options}), engine=engine)


def test_retrieval_workload_both_store_modes(tmp_path, tiny_engine):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(4, passages=3, words=6)))
    methods = "full,probe@0.5,epic@0.5+chunk_context=sink,probe@0.5+warm_window_tokens=512"
    res = _run_r(tmp_path, tiny_engine, data, methods, n=4)
    recs = res["records"]
    names = methods.split(",")
    for mode in ("writeback", "corpus"):
        rows = [r for r in recs if r["workload"] == f"retrieval/{mode}"]
        assert len(rows) == 6 * len(names)
        assert [r["method"] for r in rows[: len(names)]] == names  # per request, full first
        blended = [r for r in rows if r["method"] != "full"]
        for r in blended:
            assert r["uncached_share"] == pytest.approx(1 - r["cached_tokens"] / r["prompt_tokens"])
            assert r["ttft_excess_full"] == pytest.approx(r["ttft_ratio_full"] - r["uncached_share"])
            assert r["many_hits"] == (r["chunk_hits"] >= 2)  # two thirds of top-3
            assert r["blended_chunks"] + r["exact_chunks"] == r["chunk_hits"]
            assert "answer_drift_full" in r
        summary = res["summary"][f"retrieval/{mode}"]["retrieval"]
        assert set(summary) == set(names[1:])
        assert summary["probe@0.5"]["all"]["n"] == 6
    wb = [r for r in recs if r["workload"] == "retrieval/writeback" and r["method"] != "full"]
    # each method has a store of its own, starting cold: the first request misses for every one of
    # them (a shared store would hold the first method's write-back by the second)
    assert all(r["chunk_hits"] == 0 and r["uncached_share"] == 1.0 for r in wb if r["request"] == 0)
    # nothing reused: the full prefill's computation, so drift 0 without a scoring prefill
    assert all(r["answer_drift_full"] == 0.0 and r["drift_unscored"] for r in wb if r["request"] == 0)
    returns = [r for r in wb if r["occurrence"] > 0]
    assert returns and all(r["chunk_hits"] >= 1 for r in returns)  # its own passages came back
    assert all("drift_unscored" not in r for r in returns)  # chunk KV reused: scored
    corpus = [r for r in recs if r["workload"] == "retrieval/corpus" and r["method"] != "full"]
    assert all(r["chunk_hits"] == 3 for r in corpus)  # the whole pool was warmed
    facts = res["extras"]["retrieval/corpus"]
    assert facts["corpus_order"] == "similar" and set(facts["warmed"]) == set(names[1:])
    # one warm per kind of chunk KV (neighbor, sink; another warm window), copied whole into each
    # method's store, second variants included (each warm's source engine closed once copied);
    # warmed by similarity, a neighbor warm keeps two variants per chunk (sink: one)
    warmed = facts["warmed"].values()
    assert all(w["computed"] == facts["pool_passages"] for w in warmed)
    assert all(w["copied"] == w["computed"] + w["variants"] for w in warmed)
    assert any(w["variants"] == facts["pool_passages"] for w in warmed)
    assert all(w["shared_with"] == [] for w in facts["warmed"].values())
    md = (tmp_path / "o" / "results.md").read_text()
    assert "(r) retrieval corpus, the store filled by write-back" in md and "at least 2 of 3 chunk hits" in md
    for mode in ("writeback", "corpus"):
        assert (tmp_path / "o" / f"frontier_retrieval_{mode}.png").stat().st_size > 0


def test_retrieval_options_are_checked(tmp_path, tiny_engine):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(2, passages=2, words=4)))
    base = dict(dataset=str(data), n=2, top_k=2, workloads="r", embedder="lexical", out=str(tmp_path / "o"))
    for bad, match in (
        (dict(store="disk"), "--store"),
        (dict(corpus_order="random"), "--corpus-order"),
        (dict(embedder="bm25"), "--embedder"),
        (dict(retrieval_min_hits=3), "--retrieval-min-hits"),
        (dict(retrieval_methods="probe@0.15,hf+mode=full"), "transformers"),
        (dict(retrieval_score="epic@0.3"), "--retrieval-score"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            run_bench(BenchOptions(**{**base, **bad}), engine=tiny_engine)


def test_a_copied_warm_is_the_warm_itself(tiny_engine):
    from benchmarks.engines import MethodEngines
    from benchmarks.methods import Method
    from benchmarks.retrieval import _warm_stores

    texts = make_docs(5, words=30)
    how = {"order": "similar", "embeddings": make_embedder("lexical")(texts)}
    with MethodEngines(tiny_engine) as engines:
        own = engines.own("own", Method("own"))
        own.warm(texts, **how)
        owned = {
            "a": engines.own("a", Method("a")),
            "b": engines.own("b", Method("b", {"max_variants": 2})),  # the same warm (two variants)
            "c": engines.own("c", Method("c", {"max_variants": 1})),  # one variant: a warm of its own
        }
        facts = _warm_stores(engines, owned, texts, how, {}, progress=False)
        assert facts["a"]["shared_with"] == ["b"] and facts["b"]["copied"] == 10
        assert facts["c"]["shared_with"] == [] and facts["c"]["copied"] == 5
        for text in texts:
            ids = own.prompt_tokenizer.tokenize(text)
            key = own.planner.chunk_key(ids)
            want = own.store.get(key, ids)
            for eng in owned.values():
                got = eng.store.get(key, ids)
                assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
                assert got.meta["context"] == want.meta["context"]
                want_keys = [key] if eng is owned["c"] else own.variants.index.keys(key)
                assert [v.key for v in eng.variants.index.variants(key)] == want_keys
                assert len(want_keys) == (1 if eng is owned["c"] else 2)


def test_a_reordered_method_is_scored_against_the_full_prefill_in_its_order(tmp_path, tiny_engine, monkeypatch):
    import benchmarks.retrieval as retrieval

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(3, passages=3, words=6)))
    methods = "full,probe@0.5+order=frequency,full+order=frequency,probe@0.5"
    written = []
    real = retrieval._run_mode

    def spy(ctx, *a, **kw):  # each store mode's records are on disk before the next mode starts
        written.append(json.loads((tmp_path / "o" / "results.json").read_text()) if written else None)
        return real(ctx, *a, **kw)

    monkeypatch.setattr(retrieval, "_run_mode", spy)
    res = _run_r(tmp_path, tiny_engine, data, methods, n=3, retrieval_score="all", plots=False)
    assert {r["workload"] for r in written[1]["records"]} == {"retrieval/writeback"}
    rows = [r for r in res["records"] if r["workload"] == "retrieval/writeback"]
    # the other full prefill runs right after full (it is the reordered method's reference)
    assert [r["method"] for r in rows[:4]] == ["full", "full+order=frequency", "probe@0.5+order=frequency", "probe@0.5"]
    ordered_rows = [r for r in rows if r["method"] == "probe@0.5+order=frequency"]
    assert all(r["drift_reference"] == "full+order=frequency" for r in ordered_rows)
    assert all("answer_drift_own_order" in r and "answer_drift_full" in r for r in ordered_rows)
    first = [r for r in ordered_rows if r["request"] == 0]
    # nothing stored: its prefill is the full prefill in its own order, not in retrieval order's
    assert first[0]["answer_drift_own_order"] == 0.0 and "drift_unscored" not in first[0]
    assert all("answer_drift_own_order" not in r for r in rows if r["method"] == "probe@0.5")
    # the reference ran in exactly the reordered method's prompt order (its own table's, not full's)
    refs = {r["request"]: r for r in rows if r["method"] == "full+order=frequency"}
    assert all(r["reference_in_own_order"] for r in ordered_rows)
    assert all(r["prompt_order"] == refs[r["request"]]["prompt_order"] for r in ordered_rows)
    assert all(sorted(r["prompt_order"]) == sorted(r["passages"]) for r in ordered_rows)
    summary = res["summary"]["retrieval/writeback"]["retrieval"]["probe@0.5+order=frequency"]
    assert summary["returns"]["n"] + summary["first_asks"]["n"] == 6
    md = (tmp_path / "o" / "results.md").read_text()
    assert "Returning questions:" in md and "drift vs full in its chunk order" in md


def test_a_second_reordered_method_in_another_order_gets_a_reference_in_its_order(tmp_path, tiny_engine, monkeypatch):
    """Two methods share ``full+order=frequency``; the reference runs in the first one's order, and the
    second one's drift is taken against a full prefill run in the order it used (here forced to differ)."""
    import benchmarks.retrieval as retrieval

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(3, passages=3, words=6)))
    real_order, real_reference = retrieval._prompt_order, retrieval._reference
    references = []

    def order(engine, method, req):
        perm = real_order(engine, method, req)
        return perm[::-1] if method.name == "probe@0.3+order=frequency" else perm

    def reference(runners, name, req, max_new):
        references.append(list(req.chunks))
        return real_reference(runners, name, req, max_new)

    monkeypatch.setattr(retrieval, "_prompt_order", order)
    monkeypatch.setattr(retrieval, "_reference", reference)
    methods = "full,probe@0.5+order=frequency,probe@0.3+order=frequency,full+order=frequency"
    res = _run_r(tmp_path, tiny_engine, data, methods, n=3, retrieval_score="all", plots=False, store="writeback")
    rows = [r for r in res["records"] if r["workload"] == "retrieval/writeback"]
    refs = {r["request"]: r for r in rows if r["method"] == "full+order=frequency"}
    first = [r for r in rows if r["method"] == "probe@0.5+order=frequency"]
    second = [r for r in rows if r["method"] == "probe@0.3+order=frequency"]
    assert all(r["reference_in_own_order"] and r["prompt_order"] == refs[r["request"]]["prompt_order"] for r in first)
    assert all(not r["reference_in_own_order"] for r in second)
    assert all(r["prompt_order"] == refs[r["request"]]["prompt_order"][::-1] for r in second)
    # one full prefill in the second order per request whose store held a chunk (blank ones are exact)
    assert len(references) == sum(r["chunk_hits"] > 0 for r in second)
    assert all("answer_drift_own_order" in r for r in second)
