"""Multi-turn conversations: a conversation's KV kept live across turns, and chunk deduplication.

How a caller uses it (the public API is on :class:`~kvrag.engine.Engine`)::

    g1 = engine.generate(prompt=turn1_prompt, conversation_id="user-42")
    g2 = engine.generate(prompt=turn2_prompt, conversation_id="user-42")   # reuses turn 1's KV
    engine.end_conversation("user-42")                                      # frees it

After each turn the engine keeps the turn's token ids (prompt + generated answer) and their KV
(keys stored without RoPE, like chunk records). On the next turn of the same conversation:

* **Exact prefix.** The longest common token prefix of the new prompt and the kept sequence is
  reused as is (no recompute). This covers the whole history of *append-only* layouts, where each
  turn's documents sit in that turn's user message and turn n's prompt extends turn n-1's prompt +
  answer.
* **Shifted history.** In *docs-first* layouts (the system message carries this turn's documents,
  the history follows) the history sits behind documents that changed, so no exact prefix covers
  it. The kept sequence is aligned with the new prompt token by token (runs of at least
  ``MIN_RUN`` equal tokens, found through 8-token anchors), and each run's KV is placed at its new
  positions as a cached span, blended like a document chunk (CacheBlend's HKVD recompute applies
  to it). Runs only fill positions that neither the exact prefix nor a chunk hit covers.
* **Deduplication** (CRAFT §4.3, conversation-scoped). A chunk that an earlier turn of the same
  conversation placed in its context is dropped from the new request when that earlier copy is
  still in the prompt (the history). In append-only layouts this is exactly CRAFT's rule; in
  docs-first layouts an earlier turn's documents are no longer in the prompt, so nothing is
  dropped there (dropping would remove the only copy).

``mode="full"`` and ``blend`` at ratio 1.0 never reuse anything (an exact full prefill); ``prefix``
mode reuses the exact prefix only. The number of live conversations is bounded (LRU,
``EngineConfig.max_conversations``); each keeps about ``tokens x kv_bytes_per_token`` bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.documents import content_id
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.store.base import KVRecord
from kvrag.errors import InvalidRequestError

__all__ = ["ConversationState", "Conversations", "match_runs", "check_conversation_id", "MIN_RUN"]

#: Shortest run of equal tokens reused at a shifted position (shorter ones are template fragments
#: such as ``<|im_end|>\n<|im_start|>user\n`` that may match in the wrong place).
MIN_RUN = 16
_ANCHOR = 8
_MAX_CANDIDATES = 8


def check_conversation_id(conversation_id) -> str | None:
    """Validate a conversation id (a non-empty string; ints are accepted and stringified)."""
    if conversation_id is None:
        return None
    if isinstance(conversation_id, bool) or not isinstance(conversation_id, (str, int)):
        raise InvalidRequestError(f"conversation_id must be a string, got {type(conversation_id).__name__}")
    cid = str(conversation_id)
    if not cid:
        raise InvalidRequestError("conversation_id must be a non-empty string")
    return cid


@dataclass(slots=True)
class ConversationState:
    """What a conversation keeps between turns.

    Attributes:
        ids: token ids of the last turn (prompt + generated tokens whose KV exists).
        k: [L, Hkv, T, D] keys of those tokens, without RoPE.
        v: [L, Hkv, T, D] values.
        chunks: content ids of every chunk the conversation placed in its context so far.
        turns: turns recorded.
    """

    ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    chunks: set[str] = field(default_factory=set)
    turns: int = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def record(self, start: int, length: int, new_ids: list[int], at: int, kind: str) -> KVRecord:
        """The KV of kept positions [start, start+length) as a record for new positions ``at``."""
        return KVRecord(
            torch.tensor(new_ids[at : at + length]),
            self.k[:, :, start : start + length],
            self.v[:, :, start : start + length],
            kind=kind,
            context="conversation",
        )


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_runs(
    old: list[int], new: list[int], start: int, end: int, min_run: int = MIN_RUN
) -> list[tuple[int, int, int]]:
    """Runs of ``new[start:end]`` that occur in ``old``: ``(new_pos, old_pos, length)``, in order.

    Greedy left to right: at each position the 8-token anchor is looked up in ``old``; the
    candidate that continues the previous run is tried first, then the one that extends furthest.
    Runs shorter than ``min_run`` are ignored.
    """
    if end - start < min_run or len(old) < min_run:
        return []
    index: dict[tuple[int, ...], list[int]] = {}
    for j in range(len(old) - _ANCHOR + 1):
        bucket = index.setdefault(tuple(old[j : j + _ANCHOR]), [])
        if len(bucket) < _MAX_CANDIDATES:
            bucket.append(j)
    runs: list[tuple[int, int, int]] = []
    i, next_old = start, -1
    while i + _ANCHOR <= end:
        cands = index.get(tuple(new[i : i + _ANCHOR]))
        if not cands:
            i += 1
            continue
        best_j, best_len = -1, 0
        for j in sorted(cands, key=lambda c: c != next_old):
            n = 0
            while i + n < end and j + n < len(old) and old[j + n] == new[i + n]:
                n += 1
            if n > best_len:
                best_j, best_len = j, n
        if best_len >= min_run:
            runs.append((i, best_j, best_len))
            i += best_len
            next_old = best_j + best_len
        else:
            i += 1
    return runs


def _subtract(a: int, b: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Pieces of [a, b) outside the sorted, disjoint intervals ``covered``."""
    out, pos = [], a
    for s, e in covered:
        if e <= pos or s >= b:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < b:
        out.append((pos, b))
    return out


class Conversations:
    """Live conversations of one engine: bounded LRU map id -> :class:`ConversationState`.

    Thread-safe. States are replaced whole at the end of each turn and never written into, so a
    request can read one while another turn of the same conversation finishes.
    """

    def __init__(self, adapter: ModelAdapter, max_live: int) -> None:
        self.adapter = adapter
        self.max_live = max_live
        self._live: OrderedDict[str, ConversationState] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, conversation_id: str) -> bool:
        return conversation_id in self._live

    def get(self, conversation_id: str) -> ConversationState | None:
        with self._lock:
            state = self._live.get(conversation_id)
            if state is not None:
                self._live.move_to_end(conversation_id)
            return state

    def end(self, conversation_id: str) -> bool:
        with self._lock:
            return self._live.pop(conversation_id, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._live.clear()

    # -- deduplication ---------------------------------------------------------------------------

    def dedup(self, conversation_id: str, parts: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int]:
        """Drop chunk parts that an earlier turn placed and whose earlier copy is still in the prompt."""
        state = self.get(conversation_id)
        if state is None or not state.chunks:
            return parts, 0
        out: list[tuple[str, str]] = []
        before: list[str] = []
        dropped = 0
        for kind, text in parts:
            if kind == "chunk" and content_id(text) in state.chunks and text in "".join(before):
                dropped += 1
                continue
            out.append((kind, text))
            before.append(text)
        return out, dropped

    # -- reuse -------------------------------------------------------------------------------------

    def attach(self, plan: Plan, conversation_id: str) -> list[tuple[int, int]]:
        """Put the conversation's kept KV into ``plan``; returns the prompt spans [a, b) it covers.

        The exact common prefix becomes the plan's prefix (if longer than what the prefix cache
        found); in ``blend``/``reuse`` mode, runs of the kept sequence found elsewhere in the
        prompt become cached spans, HKVD candidates like chunk hits.
        """
        state = self.get(conversation_id)
        if state is None:
            return []
        new = plan.ids
        limit = len(new) - 1  # the last prompt token is always computed
        spans: list[tuple[int, int]] = []
        prefix = common_prefix(state.ids, new, limit)
        if prefix > plan.prefix_len:
            plan.prefix_len = prefix
            plan.prefix_records = [(0, state.record(0, prefix, new, 0, "prefix"))]
            plan.chunk_records = [(s, r) for s, r in plan.chunk_records if s >= prefix]
            plan.exact_records = [(s, r) for s, r in plan.exact_records if s >= prefix]
            for use in plan.chunks:
                if use.start + use.length <= prefix:
                    use.hit, use.source = True, "prefix"
                elif use.start < prefix and use.source in ("store", "tree"):
                    use.hit, use.source = False, "computed"
            spans.append((0, prefix))
        if plan.mode not in ("blend", "reuse"):
            return spans
        covered = sorted((s, s + r.num_tokens) for s, r in plan.exact_records + plan.chunk_records)
        first_run = len(spans)
        for i, j, n in match_runs(state.ids, new, plan.prefix_len, limit):
            for a, b in _subtract(i, i + n, covered):
                plan.chunk_records.append((a, state.record(j + (a - i), b - a, new, a, "conversation")))
                spans.append((a, b))
        plan.chunk_records.sort(key=lambda sr: sr[0])
        for use in plan.chunks:
            end = use.start + use.length
            if not use.hit and any(a <= use.start and end <= b for a, b in spans[first_run:]):
                use.hit, use.source = True, "conversation"
        return spans

    def record(self, conversation_id: str, ids: list[int], buf: KVBuffer, chunk_texts: list[str]) -> None:
        """Keep a finished turn: ``ids`` whose KV is in ``buf`` [0, len(ids)) (keys with RoPE)."""
        if self.max_live <= 0:
            return
        n = min(len(ids), buf.length)
        ids = ids[:n]
        rope = self.adapter.rope(torch.arange(n, device=self.adapter.device))
        k = torch.empty_like(buf.k[:, :, :n])
        with torch.inference_mode():
            for layer in range(buf.k.shape[0]):  # undo each layer's own RoPE
                k[layer] = self.adapter.remove_rope(buf.k[layer, :, :n], *rope.layer(layer))
        v = buf.v[:, :, :n]
        with self._lock:
            old = self._live.pop(conversation_id, None)
            chunks = set(old.chunks) if old is not None else set()
            chunks.update(content_id(t) for t in chunk_texts)
            turns = old.turns + 1 if old is not None else 1
            self._live[conversation_id] = ConversationState(ids, k, v, chunks, turns)
            while len(self._live) > self.max_live:
                self._live.popitem(last=False)
