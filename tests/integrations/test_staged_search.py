"""The staged faiss search: each stage is faiss's own search at the width scanned so far."""

from __future__ import annotations

import numpy as np
import pytest

from kvrag import InvalidRequestError
from kvrag.integrations.staged_search import stage_widths, staged_search

faiss = pytest.importorskip("faiss")

D = 16


@pytest.fixture(scope="module")
def vectors():
    rng = np.random.default_rng(7)
    return rng.standard_normal((4000, D)).astype("float32"), rng.standard_normal((9, D)).astype("float32")


def ivf(vectors, metric, nlist=40, pq=False):
    base, _ = vectors
    quantizer = faiss.IndexFlat(D, metric)
    index = (
        faiss.IndexIVFPQ(quantizer, D, nlist, 4, 8, metric) if pq else faiss.IndexIVFFlat(quantizer, D, nlist, metric)
    )
    index.train(base)
    index.add(base)
    return index


def plain(index, queries, k, nprobe):
    """faiss's own search at ``nprobe`` (a copy of the index, so the shared one is never touched)."""
    copy = faiss.clone_index(index)
    copy.nprobe = nprobe
    return copy.search(queries, k)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("nprobe", [1, 3, 8, 40])
@pytest.mark.parametrize("stages", [1, 2, 4, 9])
@pytest.mark.parametrize("k", [1, 6, 25])
def test_every_stage_equals_faiss_at_the_width_scanned_so_far(vectors, metric, nprobe, stages, k):
    m = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    index = ivf(vectors, m)
    _, queries = vectors
    result = list(staged_search(index, queries, k, stages=stages, nprobe=nprobe))
    widths = stage_widths(nprobe, stages)
    assert len(result) == len(widths) == min(stages, nprobe)
    assert [s.final for s in result] == [False] * (len(widths) - 1) + [True]
    previous = None
    for stage, width in zip(result, widths):
        d, i = plain(index, queries, k, width)
        np.testing.assert_array_equal(stage.ids, i)
        np.testing.assert_allclose(stage.distances, d, rtol=1e-5, atol=1e-5)
        assert stage.changed == (previous is None or not np.array_equal(previous, stage.ids))
        previous = stage.ids
    assert index.nprobe == 1  # the shared index is never changed


def test_ivfpq_by_residual_equals_faiss(vectors):
    index = ivf(vectors, faiss.METRIC_L2, pq=True)
    _, queries = vectors
    last = list(staged_search(index, queries, 10, stages=4, nprobe=12))[-1]
    d, i = plain(index, queries, 10, 12)
    np.testing.assert_array_equal(last.ids, i)
    np.testing.assert_allclose(last.distances, d, rtol=1e-5, atol=1e-4)


def test_default_nprobe_is_the_index_own_and_fewer_results_than_k_are_padded(vectors):
    base, queries = vectors
    quantizer = faiss.IndexFlatL2(D)
    index = faiss.IndexIVFFlat(quantizer, D, 8)
    index.train(base)
    index.add(base[:5])  # a few vectors: most lists empty
    index.nprobe = 2
    last = list(staged_search(index, queries[:1], 10, stages=2))[-1]
    d, i = index.search(queries[:1], 10)
    np.testing.assert_array_equal(last.ids, i)
    assert (last.ids == -1).any()


def test_hnsw_stages_grow_the_beam_and_end_at_faiss_search(vectors):
    base, queries = vectors
    index = faiss.IndexHNSWFlat(D, 16)
    index.add(base)
    index.hnsw.efSearch = 48
    result = list(staged_search(index, queries, 5, stages=4))
    assert len(result) == 4 and result[-1].final
    d, i = index.search(queries, 5)
    np.testing.assert_array_equal(result[-1].ids, i)
    assert index.hnsw.efSearch == 48


def test_flat_index_is_one_plain_search(vectors):
    base, queries = vectors
    index = faiss.IndexFlatL2(D)
    index.add(base)
    (only,) = staged_search(index, queries, 3, stages=4)
    d, i = index.search(queries, 3)
    assert only.final and only.changed
    np.testing.assert_array_equal(only.ids, i)


def test_a_search_interleaved_with_another_keeps_its_own_width(vectors):
    """Two staged searches of one index at different nprobe, advanced in turn: each ends at its own."""
    index = ivf(vectors, faiss.METRIC_L2)
    _, queries = vectors
    a, b = staged_search(index, queries, 5, nprobe=4), staged_search(index, queries, 5, nprobe=20)
    stages_a, stages_b = [], []
    for sa, sb in zip(a, b):
        stages_a.append(sa)
        stages_b.append(sb)
    np.testing.assert_array_equal(stages_a[-1].ids, plain(index, queries, 5, 4)[1])
    np.testing.assert_array_equal(stages_b[-1].ids, plain(index, queries, 5, 20)[1])


def test_bad_arguments_are_clear_errors(vectors):
    index = ivf(vectors, faiss.METRIC_L2)
    _, queries = vectors
    with pytest.raises(InvalidRequestError, match="k must be"):
        next(staged_search(index, queries, 0))
    with pytest.raises(InvalidRequestError, match="stages"):
        next(staged_search(index, queries, 3, stages=0))
    with pytest.raises(InvalidRequestError, match="nprobe"):
        next(staged_search(index, queries, 3, nprobe=0))
    with pytest.raises(InvalidRequestError, match=r"\[n, 16\]"):
        next(staged_search(index, queries[:, :4], 3))
    flat = faiss.IndexFlatL2(D)
    with pytest.raises(InvalidRequestError, match="nprobe is for IVF"):
        next(staged_search(flat, queries, 3, nprobe=4))
    assert stage_widths(10, 4) == [3, 5, 8, 10]
    assert stage_widths(2, 4) == [1, 2]
