"""Computing chunk KV for the store.

Where a chunk's KV is computed matters. CacheBlend computes each chunk alone behind the
attention-sink token. On the bundled SmolLM2-135M that KV is far from what the chunk gets inside
a real prompt, and a small recompute budget cannot close the gap; the same chunk computed behind
another document (its KV kept, the document's dropped) is much closer (docs/benchmarks.md,
"Fidelity, honestly"). So by default (``chunk_context="neighbor"``):

- ``warm(chunks)`` computes its list as one stream, in list order, so that each chunk is
  computed behind the documents before it in the list (one pass per window of up to
  :data:`MAX_STREAM_TOKENS`; windows whose chunks are all cached are skipped). A window starts
  behind up to :data:`MAX_CONTEXT_TOKENS` of the list's other documents, taken round the list up
  to its first chunk (the first window's: the list's last documents), never a copy of a document
  inside the window. With no other documents (a list that fits one window, a lone chunk) it goes
  behind the documents this engine computed last (again never one inside the window, as when a
  list is warmed again after eviction), or a built-in passage;
- a chunk a request missed is kept with the KV the request computed for it, in its real context,
  at no extra cost (captured during the prefill).

More documents before a chunk bring its KV closer to what it gets deep inside a prompt. On the
bundled model, 20 MuSiQue questions, six passages warmed in retrieval order and asked shuffled,
the benchmarks' ``hkvd`` selection (CacheBlend's) at 15%: ROUGE-L 0.77 against the full prefill
with one preceding document per chunk, 0.87 with the stream (docs/journal/fidelity.md, "Fidelity,
honestly").

``chunk_context="sink"`` restores CacheBlend's behaviour. Keys carry the context kind, so caches
computed both ways never mix. Keys are stored without RoPE, so the context's length does not
matter when the chunk is placed elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib import resources

import torch

from kvrag.config import CHUNK_CONTEXTS
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer, KVCapture, forward
from kvrag.engine.reuse.attention_stats import STATS_STRIDE, ContextSpan, Tap, block_middles, chunk_statistics
from kvrag.engine.reuse.slices import mark
from kvrag.engine.reuse.variants import context_id
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey
from kvrag.errors import InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["CHUNK_CONTEXTS", "ChunkComputer", "context_label", "warm_list"]

#: Most context tokens a chunk is computed behind, besides the sink (the tail of the documents
#: before it); at most a quarter of the model's context window.
MAX_CONTEXT_TOKENS = 1536

#: Most tokens ``warm()`` computes in one pass (context and chunks); longer lists take several.
#: Longer streams put more documents behind each chunk, but hold the engine longer per pass.
MAX_STREAM_TOKENS = 4096


def context_label(context: str, sink_ids: list[int]) -> str:
    """The context kind in every chunk key, so records computed differently never mix."""
    return "doc-v2" if context == "neighbor" else "sink:" + ",".join(map(str, sink_ids))


class ChunkComputer:
    """Computes the KV records of chunks, behind the configured kind of context.

    Args:
        adapter: the model.
        tokenize: text -> token ids (no special tokens).
        sink_ids: the attention-sink token(s) every context starts with.
        context: one of :data:`CHUNK_CONTEXTS`.
        window: the model's context window (bounds the context put behind a chunk).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        tokenize: Callable[[str], list[int]],
        sink_ids: list[int],
        context: str,
        window: int,
    ):
        if context not in CHUNK_CONTEXTS:
            raise ValueError(f"chunk_context must be one of {CHUNK_CONTEXTS}, got {context!r}")
        self.adapter = adapter
        self.tokenize = tokenize
        self.sink_ids = list(sink_ids)
        self.context = context
        self.label = context_label(context, sink_ids)
        #: most tokens of other documents behind a chunk (0 with the sink context)
        self.context_tokens = 0 if context == "sink" else min(MAX_CONTEXT_TOKENS, window // 4)
        self._recent: list[list[int]] = []  # the documents computed last (oldest first), enough for a context
        self.stats_stride = STATS_STRIDE
        self._builtin: list[int] | None = None

    def _builtin_doc(self) -> list[int]:
        if self._builtin is None:
            text = resources.files("kvrag.engine.reuse").joinpath("data/context.txt").read_text(encoding="utf-8")
            self._builtin = self.tokenize(text)
        return self._builtin

    def _remember(self, ids: list[int]) -> None:
        # write-back calls this from its own thread: build a new list and swap it in, so that a
        # reader (context_ids, under the engine's lock) always sees a whole one
        if not self.context_tokens:
            return
        recent = [*self._recent, list(ids)]
        total = sum(len(d) for d in recent)
        while total - len(recent[0]) >= self.context_tokens:  # the newer docs still fill a context
            total -= len(recent.pop(0))
        self._recent = recent

    def context_ids(
        self, before: Sequence[list[int]] | None = None, exclude: Sequence[list[int]] = (), room: int | None = None
    ) -> tuple[list[int], list[tuple[str, int]]]:
        """Tokens a chunk is computed behind (their KV is dropped), and the documents they come
        from as (content id, tokens in the context): the sink, then the tail of the documents
        ``before`` it (none given: the documents computed last that are not in ``exclude``, the
        chunks about to be computed, so that no chunk goes behind a copy of itself; or a built-in
        passage); at most ``room`` tokens of them (default :attr:`context_tokens`, never more:
        :meth:`window_context_tokens`)."""
        if self.context == "sink":
            return list(self.sink_ids), []
        docs = [doc for doc in before or () if doc]
        if not docs:
            docs = [doc for doc in self._recent if doc not in exclude] or [self._builtin_doc()]
        tail, used = [], []
        room = self.context_tokens if room is None else room
        for doc in reversed(docs):  # the last documents, as many as fill the context (the first cut)
            if room <= 0:
                break
            part = doc[-room:]
            tail[:0] = part
            used.insert(0, (context_id(doc), len(part)))
            room -= len(doc)
        return self.sink_ids + tail, used

    def max_chunk_tokens(self, window: int) -> int:
        """Longest chunk that fits the context window behind its context."""
        return window - len(self.sink_ids) - self.context_tokens - 1

    def compute(self, ids: list[int], before: Sequence[list[int]] | None = None, *, pause=None) -> KVRecord:
        """KV record of a chunk computed behind its context (on the engine thread)."""
        return self.compute_window([ids], before, pause=pause)[0]

    def window_context_tokens(self, max_tokens: int) -> int:
        """Most context tokens behind a window of ``max_tokens``: 3/8 of it, within the computer's
        own bound (a window about a prompt's size puts its chunks at about a prompt's depth)."""
        return min(self.context_tokens, 3 * max_tokens // 8)

    def windows(self, docs: Sequence[list[int]], max_tokens: int = MAX_STREAM_TOKENS) -> list[list[int]]:
        """Indices of ``docs`` computed together: consecutive runs of at most ``max_tokens`` tokens
        behind their context of :meth:`window_context_tokens` (a chunk longer than that is a window
        on its own); with ``chunk_context="sink"``, one chunk each."""
        if self.context == "sink":
            return [[i] for i in range(len(docs))]
        head = len(self.sink_ids) + self.window_context_tokens(max_tokens)
        out: list[list[int]] = []
        total = 0
        for i, ids in enumerate(docs):
            if out and total + len(ids) <= max_tokens:
                out[-1].append(i)
                total += len(ids)
            else:
                out.append([i])
                total = head + len(ids)
        return out

    def compute_window(
        self,
        docs: Sequence[list[int]],
        before: Sequence[list[int]] | None = None,
        *,
        context_tokens: int | None = None,
        pause=None,
    ) -> list[KVRecord]:
        """KV records of chunks computed in one pass, each behind the ones before it in ``docs``, the
        first behind :meth:`context_ids` of ``before`` (at most ``context_tokens`` of them, default
        the computer's bound); each record's ``meta["context"]`` names the
        documents it was computed behind, with Cache-Craft's attention statistics of the chunk
        (:func:`attach_statistics`). Runs on the engine thread, ``pause`` its hook between slices
        of the pass."""
        if self.context == "sink" and len(docs) > 1:
            raise ValueError("chunk_context='sink' computes each chunk alone")
        ids, used = self.context_ids(before, exclude=docs, room=context_tokens)
        context, pos = [], len(ids) - sum(n for _, n in used)
        for cid, n in used:  # the context documents' positions
            context.append(ContextSpan(pos, pos + n, cid))
            pos += n
        caps, spans = [], []
        for doc in docs:
            caps.append(KVCapture(self.adapter, pos, pos + len(doc)))
            spans.append((pos, pos + len(doc)))
            ids += doc
            pos += len(doc)
        tap = Tap([m for a, b in spans for m in block_middles(a, b, self.stats_stride)], self.adapter.n_layers)
        buf = KVBuffer(self.adapter, pos)
        device = self.adapter.device
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        forward(
            self.adapter,
            buf,
            ids_t,
            torch.arange(pos, device=device),
            pos,
            capture=caps,
            taps=[tap],
            last_row_only=True,
            pause=pause,
        )
        records, ranges = [], [(s.start, s.end) for s in context] + spans
        for doc, cap, (a, b) in zip(docs, caps, spans):
            self._remember(doc)
            rec = KVRecord(torch.tensor(doc), cap.k, cap.v, kind="chunk", context=self.label)
            attach_statistics(rec, tap, buf, (a, b), context, self.adapter, self.stats_stride, ranges)
            records.append(rec)
            context.append(ContextSpan(a, b, context_id(doc)))
        return records

    def window_contexts(
        self, docs: Sequence[list[int]], before: Sequence[list[int]] | None = None, *, context_tokens: int | None = None
    ) -> list[tuple[str, ...]]:
        """The ``meta["context"]`` :meth:`compute_window` gives each of ``docs`` (no compute)."""
        if self.context == "sink":
            return [()] * len(docs)
        _, used = self.context_ids(before, exclude=docs, room=context_tokens)
        head = [cid for cid, _ in used]
        return [tuple(head + [context_id(d) for d in docs[:j]]) for j in range(len(docs))]

    def record_from_capture(self, ids: list[int], capture: KVCapture) -> KVRecord:
        """A chunk's record from the KV a request computed for it in its real context."""
        self._remember(ids)
        meta = {"computed": "in-request"}
        if capture.slices is not None:  # computed in fixed slices: exact reuse gives the full prefill's bits
            meta = mark(meta, *capture.slices)
        return KVRecord(torch.tensor(ids), capture.k, capture.v, kind="chunk", context=self.label, meta=meta)


#: Dimensions of the lexical vectors :func:`similarity_order` hashes token ids into.
LEXICAL_DIMS = 2048


def _lexical_vectors(docs: Sequence[list[int]]) -> torch.Tensor:
    """[n, LEXICAL_DIMS] tf-idf of hashed token ids (a cheap similarity when no embeddings are given)."""
    counts = torch.zeros(len(docs), LEXICAL_DIMS)
    for i, doc in enumerate(docs):
        ids = torch.tensor(doc, dtype=torch.long) % LEXICAL_DIMS
        counts[i].index_add_(0, ids, torch.ones(len(doc)))
    df = (counts > 0).sum(dim=0).float()
    return counts * torch.log((1 + len(docs)) / (1 + df))


def similarity_order(docs: Sequence[list[int]], embeddings=None) -> list[int]:
    """An order of ``docs`` in which each is near the ones most like it (FusionRAG's offline step).

    A greedy chain: from the first document, always on to the most similar one not placed yet
    (cosine similarity of ``embeddings`` [n, d] when given, e.g. the retriever's own vectors, else
    of lexical tf-idf vectors). Computed in a stream, each chunk's KV is then computed behind the
    passages most like it: the company it will keep in prompts.
    """
    n = len(docs)
    if n <= 2:
        return list(range(n))
    if embeddings is None:
        x = _lexical_vectors(docs)
    elif isinstance(embeddings, (list, tuple)) and len(embeddings) == n:  # rows: stacked, not built element-wise
        rows = [torch.as_tensor(row, dtype=torch.float32) for row in embeddings]
        if len({tuple(r.shape) for r in rows}) != 1 or rows[0].dim() != 1:
            raise InvalidRequestError("embeddings must be [n_chunks, dim]: rows of one length")
        x = torch.stack(rows)
    else:
        x = torch.as_tensor(embeddings, dtype=torch.float32)
    if x.dim() != 2 or x.shape[0] != n:
        raise InvalidRequestError(f"embeddings must be [n_chunks, dim] = [{n}, d], got {tuple(x.shape)}")
    x = torch.nn.functional.normalize(x, dim=1)
    placed = torch.zeros(n, dtype=torch.bool)
    order, current = [0], 0
    placed[0] = True
    for _ in range(n - 1):
        scores = x @ x[current]
        scores[placed] = -float("inf")
        current = int(torch.argmax(scores))
        placed[current] = True
        order.append(current)
    return order


def attach_statistics(
    record: KVRecord,
    tap: Tap,
    buf: KVBuffer,
    span: tuple[int, int],
    context: list[ContextSpan],
    adapter: ModelAdapter,
    stride: int = STATS_STRIDE,
    ranges: list[tuple[int, int]] | None = None,
) -> None:
    """Record where a chunk's KV was computed: ``meta["context"]`` (the ``context`` chunks' ids) and,
    when the tap saw the chunk, Cache-Craft's ``cci`` and ``weights`` in the meta and the blocks'
    inter-attention in ``stats["block_inter"]``. ``ranges``: every span the pass's chunks will be
    measured over (:func:`chunk_statistics` measures them all at the first call)."""
    record.meta = {**record.meta, "context": [s.id for s in context]}
    stats = chunk_statistics(tap, buf, span, context, adapter.scale, stride, adapter.windows, ranges)
    if stats is not None:
        record.meta.update(cci=stats.cci, weights=list(stats.weights))
        record.stats = {**record.stats, "block_inter": stats.block_inter}


def warm_list(
    computer: ChunkComputer,
    store: KVStore,
    docs: list[list[int]],
    keys: list[StoreKey],
    *,
    run: Callable[[Callable, int], list[KVRecord]],
    window_tokens: int,
    keep: Callable[..., bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    reverse: Callable[[StoreKey, tuple[str, ...]], bool] | None = None,
) -> tuple[int, int]:
    """Compute and store the KV of the chunks of a list that are not cached; returns how many, and
    how many second variants the reverse pass computed.

    The list is cut into windows of at most ``window_tokens`` (cached chunks included: what was
    cached never moves the others); a window with a missing chunk is computed as one stream behind
    the list's other documents, taken round the list and ending just before the window (never a
    copy of a member). Each window's pass is one job for the engine thread: ``run(job, tokens)``
    calls ``job(pause)`` there and returns its records. ``keep(key, record, speculative=)`` stores a
    record (:meth:`~kvrag.engine.reuse.variants.StoredVariants.keep`); default ``store.put``.
    ``reverse(key, context)``: after the pass in list order, a second pass computes the list in
    reverse order for the chunks it says still need their variant behind ``context`` (the content
    ids that pass would compute it behind): each then also has one behind the documents after it in
    the list; ``keep`` stores it beside the first, ``speculative``: kept ahead of need, it takes no
    room a first variant holds. ``progress(windows done, windows)`` is
    called after each window.
    """
    unique, seen = [], set()  # the first occurrence of each chunk
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            unique.append(i)
    passes = [(unique, lambda key, context: not store.contains(key))]
    if reverse is not None and computer.context != "sink" and len(unique) > 1:
        passes.append((unique[::-1], reverse))
    context_tokens = computer.window_context_tokens(window_tokens)
    computed, done = [0, 0], 0
    with store.pinned(keys):  # a batch never evicts its own members
        plans = [(order, needed, computer.windows([docs[i] for i in order], window_tokens)) for order, needed in passes]
        total = sum(len(windows) for _, _, windows in plans)
        for n_pass, (order, needed, windows) in enumerate(plans):
            for window in windows:
                members = [order[w] for w in window]
                first, inside = window[0], {keys[i] for i in members}
                ring = [*order[first + 1 :], *order[:first]]  # round the list, ending just before it
                before = [docs[j] for j in ring if keys[j] not in inside]
                inner = [docs[i] for i in members]
                contexts = computer.window_contexts(inner, before, context_tokens=context_tokens)
                missing = {i for i, context in zip(members, contexts) if needed(keys[i], context)}
                if missing:
                    records = run(
                        lambda pause, inner=inner, before=before: computer.compute_window(
                            inner, before, context_tokens=context_tokens, pause=pause
                        ),
                        sum(map(len, inner)),
                    )
                    for i, record in zip(members, records):
                        if i in missing:
                            (keep or store.put)(keys[i], record, speculative=n_pass > 0)
                    computed[n_pass] += len(missing)
                done += 1
                if progress is not None:
                    progress(done, total)
    return computed[0], computed[1]
