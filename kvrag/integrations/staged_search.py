"""A faiss search that reports its current top-k in stages (RAGCache §5.3, §6 "pipelined vector search").

The engine can start prefilling the documents a search will most likely return while the search
still runs (:meth:`~kvrag.Engine.speculate`); for that the search must say what its top-k is so
far. :func:`staged_search` does, for the index kinds faiss serves:

- **IVF** (``IndexIVFFlat``, ``IndexIVFPQ``, ...): the query is assigned to its ``nprobe`` nearest
  lists once (the coarse quantizer's search); the lists are then scanned in ``stages`` slices,
  nearest first, each slice's top-k merged into the running one. After stage ``s`` the result is
  exactly faiss's own search at the width scanned so far (the nearest lists are scanned first,
  as faiss does), so the last stage equals ``index.search`` at ``nprobe``.
- **HNSW**: a graph search cannot be resumed from Python, so each stage is a whole search with a
  wider beam (``efSearch`` growing to the index's own): the stages cost together about
  ``(stages + 1) / 2`` times one search (noted: use few stages on HNSW). The last equals
  ``index.search``.
- **Anything else** (a flat index, an id map around one): one stage, the plain search. A flat
  scan's early candidates say nothing about the final ones.

The shared index is never changed (``index.nprobe`` is not thread-safe to set per call): each
stage passes its width in its own search parameters. faiss releases the GIL while it searches,
so an engine thread prefills meanwhile.

faiss is an optional dependency (``kvrag[llama-index]``, ``kvrag[bench]``): it is imported when a
search is made, not with this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from kvrag.errors import InvalidRequestError

__all__ = ["Stage", "staged_search", "speculating_search", "stage_widths", "check_stages", "DEFAULT_STAGES"]

#: RAGCache splits a search into four stages (§5.3, Figure 11).
DEFAULT_STAGES = 4


class Stage(NamedTuple):
    """One stage of a staged search: the top-k so far.

    Attributes:
        stage: 0-based index of the stage.
        distances: [n, k] float32, best first (faiss's convention: ascending for L2, descending
            for inner product); ``inf`` / ``-inf`` where fewer than k were found.
        ids: [n, k] int64 labels, ``-1`` where fewer than k were found.
        changed: the ids differ from the previous stage's (always True for the first).
        final: this is the last stage: the search's result.
    """

    stage: int
    distances: np.ndarray
    ids: np.ndarray
    changed: bool
    final: bool


def stage_widths(total: int, stages: int) -> list[int]:
    """Cumulative widths of ``stages`` equal slices of ``total`` (lists or beam), each at least 1,
    strictly growing, the last ``total`` (fewer stages when ``total < stages``)."""
    if total < 1:
        raise InvalidRequestError(f"the search width must be at least 1, got {total}")
    if stages < 1:
        raise InvalidRequestError(f"stages must be at least 1, got {stages}")
    widths = sorted({max(1, -(-total * (s + 1) // stages)) for s in range(stages)})
    return widths


def check_stages(stages) -> int:
    """``stages`` if it is a positive integer (a staged search's, or a wrapper's setting of it)."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise InvalidRequestError(f"stages must be a positive integer, got {stages!r}")
    return stages


def _faiss():
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - faiss is installed wherever this is tested
        raise ImportError("staged_search needs faiss: pip install faiss-cpu (kvrag[bench])") from exc
    return faiss


def _queries(index, queries) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] != index.d:
        raise InvalidRequestError(f"queries must be [n, {index.d}] vectors, got shape {tuple(np.shape(queries))}")
    if x.shape[0] == 0:
        raise InvalidRequestError("no queries given")
    return x


def _merge(metric_ip: bool, d0: np.ndarray, i0: np.ndarray, d1: np.ndarray, i1: np.ndarray, k: int):
    """The best k of two top-k lists per row (ids of one IVF list never repeat in another)."""
    d = np.concatenate([d0, d1], axis=1)
    i = np.concatenate([i0, i1], axis=1)
    # missing results sort last whatever their sentinel
    key = np.where(i < 0, np.inf, -d if metric_ip else d)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, order, axis=1), np.take_along_axis(i, order, axis=1)


def staged_search(
    index: Any,
    queries,
    k: int,
    *,
    stages: int = DEFAULT_STAGES,
    nprobe: int | None = None,
    ef_search: int | None = None,
) -> Iterator[Stage]:
    """Search ``index`` for the ``k`` nearest neighbours of ``queries``, yielding the top-k after each stage.

    Args:
        index: a faiss index (IVF and HNSW are staged, anything else is one plain search).
        queries: [n, d] (or [d]) float vectors.
        k: neighbours per query.
        stages: how many stages (at most ``nprobe`` for IVF, ``ef_search`` for HNSW).
        nprobe: IVF lists to scan (default the index's own ``nprobe``); the last stage equals
            ``index.search`` at that ``nprobe``.
        ef_search: HNSW beam of the last stage (default the index's own ``efSearch``).

    Yields:
        :class:`Stage` after each stage; the last has ``final=True``.
    """
    faiss = _faiss()
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidRequestError(f"k must be a positive integer, got {k!r}")
    x = _queries(index, queries)
    check_stages(stages)
    kind = faiss.downcast_index(index)  # an IVF index itself (a wrapper would map ids: plain search)
    if isinstance(kind, faiss.IndexIVF):
        yield from _staged_ivf(faiss, kind, x, k, stages, nprobe)
        return
    if nprobe is not None:
        raise InvalidRequestError(f"nprobe is for IVF indexes; this is a {type(index).__name__}")
    if isinstance(kind, faiss.IndexHNSW):
        yield from _staged_hnsw(faiss, kind, x, k, stages, ef_search)
        return
    if ef_search is not None:
        raise InvalidRequestError(f"ef_search is for HNSW indexes; this is a {type(index).__name__}")
    distances, ids = index.search(x, k)
    yield Stage(0, distances, ids, True, True)


def _staged_ivf(faiss, index, x: np.ndarray, k: int, stages: int, nprobe: int | None) -> Iterator[Stage]:
    nprobe = index.nprobe if nprobe is None else nprobe
    if not isinstance(nprobe, int) or isinstance(nprobe, bool) or nprobe < 1:
        raise InvalidRequestError(f"nprobe must be a positive integer, got {nprobe!r}")
    nprobe = min(nprobe, index.nlist)
    widths = stage_widths(nprobe, stages)
    n = x.shape[0]
    metric_ip = index.metric_type == faiss.METRIC_INNER_PRODUCT
    # the coarse assignment once, nearest lists first (as IndexIVF.search does)
    coarse_d, coarse_i = index.quantizer.search(x, nprobe)
    coarse_d = np.ascontiguousarray(coarse_d, dtype=np.float32)
    coarse_i = np.ascontiguousarray(coarse_i, dtype=np.int64)
    best_d = np.full((n, k), -np.inf if metric_ip else np.inf, dtype=np.float32)
    best_i = np.full((n, k), -1, dtype=np.int64)
    lo = 0
    for s, hi in enumerate(widths):
        assign = np.ascontiguousarray(coarse_i[:, lo:hi])
        centroid_d = np.ascontiguousarray(coarse_d[:, lo:hi])
        params = faiss.SearchParametersIVF()
        params.nprobe = hi - lo  # this slice's lists: the index's own nprobe is left alone
        d = np.empty((n, k), dtype=np.float32)
        i = np.empty((n, k), dtype=np.int64)
        # the C++ call: the Python wrapper of search_preassigned refuses per-call parameters
        index.search_preassigned_c(
            n,
            faiss.swig_ptr(x),
            k,
            faiss.swig_ptr(assign),
            faiss.swig_ptr(centroid_d),
            faiss.swig_ptr(d),
            faiss.swig_ptr(i),
            False,
            params,
        )
        previous = best_i
        best_d, best_i = _merge(metric_ip, best_d, best_i, d, i, k)
        yield Stage(
            s, best_d.copy(), best_i.copy(), s == 0 or not np.array_equal(previous, best_i), s == len(widths) - 1
        )
        lo = hi


def _staged_hnsw(faiss, index, x: np.ndarray, k: int, stages: int, ef_search: int | None) -> Iterator[Stage]:
    ef = index.hnsw.efSearch if ef_search is None else ef_search
    if not isinstance(ef, int) or isinstance(ef, bool) or ef < 1:
        raise InvalidRequestError(f"ef_search must be a positive integer, got {ef!r}")
    widths = [w for w in stage_widths(ef, stages) if w >= k] or [ef]
    if widths[-1] != ef:
        widths.append(ef)
    previous = None
    for s, width in enumerate(widths):
        params = faiss.SearchParametersHNSW()
        params.efSearch = width
        d, i = index.search(x, k, params=params)
        changed = previous is None or not np.array_equal(previous, i)
        previous = i
        yield Stage(s, d, i, changed, s == len(widths) - 1)


def speculating_search(
    engine: Any,
    index: Any,
    query,
    k: int,
    texts: Callable[[np.ndarray], list[str]],
    *,
    stages: int = DEFAULT_STAGES,
    nprobe: int | None = None,
    namespace: str | None = None,
    speculate: Callable[[np.ndarray], Any] | None = None,
) -> Stage:
    """A staged search of one query that has ``engine`` compute its candidates' KV while it runs.

    RAGCache's dynamic speculative pipelining at the chunk level (Algorithm 2): after each stage
    whose candidate list changed (the last one excepted: the request that follows computes what it
    misses itself), :meth:`~kvrag.Engine.speculate` computes the candidates' missing KV in idle
    engine time; a newer list cancels the speculation of the older one, and a final list unlike
    the last speculated one cancels that too. Returns the last stage (``index.search``'s result).

    Args:
        engine: the :class:`~kvrag.Engine`.
        index: the faiss index.
        query: one [d] vector.
        k: neighbours.
        texts: the documents' texts of a row of ids (``-1`` entries left out), in rank order.
        stages, nprobe: as for :func:`staged_search`.
        namespace: the tenant whose cache is warmed.
        speculate: instead of the chunk-level speculation, what to start on a changed candidate
            list (its row of ids): it returns the :class:`~kvrag.engine.serving.speculation.Speculation`
            it started (or None; a changed list cancels the previous one here either way);
            prompt-level speculation passes :meth:`~kvrag.Engine.speculate_request` of the prompt the
            list would make. A final list unlike the last speculated one cancels that one; an equal
            one leaves it to the request that follows (which adopts it).
    """
    if speculate is None:
        key = object()  # this search's own: its speculations replace one another only

        def speculate(ids: np.ndarray) -> Any:
            return engine.speculate(texts(ids), namespace=namespace, key=key)

    handle = None
    for stage in staged_search(index, query, k, stages=stages, nprobe=nprobe):
        if stage.final:
            if stage.changed and handle is not None:
                handle.cancel()
            return stage
        if stage.changed:
            new = speculate(stage.ids[0])
            if handle is not None and new is not handle:
                handle.cancel()  # the list changed (a no-op where the key replaced it already)
            handle = new
    raise AssertionError("a staged search ends with a final stage")  # pragma: no cover
