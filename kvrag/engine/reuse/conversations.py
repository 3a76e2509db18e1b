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
  positions as a cached span, blended like a document chunk (the selection's recompute applies
  to it). Runs only fill positions that neither the exact prefix nor a chunk hit covers.
* **Deduplication** (CRAFT §4.3, conversation-scoped). A chunk that an earlier turn of the same
  conversation placed in its context is dropped from the new request when that earlier copy is
  still in the prompt (the history). In append-only layouts this is exactly CRAFT's rule; in
  docs-first layouts an earlier turn's documents are no longer in the prompt, so nothing is
  dropped there (dropping would remove the only copy).

**Side calls.** A chat app makes other calls under the same conversation id: a chat engine
condenses the question, a chain contextualises it, a memory summarises. Such a call does not
continue the kept turn, and neither must it pay for it nor replace it. A prompt *continues* a kept
turn when it repeats the end of that turn's prompt (its last message and the assistant header,
rendered by the chat template) and goes on past it, at the start (exact prefix) or shifted
(docs-first): the turn is in its history. A side call quotes the history as text inside one message
of its own, so it repeats no turn's end. Only a continuing call reuses the turn's KV. A
conversation keeps two turns: the *main* one, the last call recorded that continued one (or its
first), and a *side* one. A call that continues a kept turn becomes the main one and the turn it
continued the side one (a chain that contextualises the question with the history, then answers
with it, alternates the two); a call that continues none is served without the conversation's KV
(the prefix and chunk caches still apply) and is kept as the side turn: the main one stays.

``mode="full"`` and ``blend`` at ratio 1.0 never reuse anything (an exact full prefill); ``prefix``
mode reuses the exact prefix only. The number of live conversations is bounded
(``EngineConfig.max_conversations``); each keeps about ``tokens x kv_bytes_per_token`` bytes of its
two turns.

**Tenants.** A conversation is keyed by ``(namespace, conversation id)``, a tuple (never a joined
string), and ids with control characters are refused: no id of one tenant names another's
conversation. The live conversations are shared by the fair rule
(:mod:`kvrag.engine.store.tenants`): past the bound, a new conversation ends the least recently used
one of the tenant holding the most (itself on a tie), so a tenant's new conversations end only its
own once it holds the most, and with ``N`` tenants one holding at most ``max_conversations / N``
never loses one to another.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from kvrag.checks import is_int
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.documents import content_id
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.store.base import KVRecord
from kvrag.engine.store.tenants import fair_victim
from kvrag.errors import InvalidRequestError

__all__ = [
    "ConversationState",
    "Continuation",
    "Conversations",
    "ConversationKey",
    "match_runs",
    "check_conversation_id",
    "check_id",
    "MIN_RUN",
]

#: A live conversation's key: ``(namespace, conversation id)``.
ConversationKey = tuple[str, str]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

#: Shortest run of equal tokens reused at a shifted position (shorter ones are template fragments
#: such as ``<|im_end|>\n<|im_start|>user\n`` that may match in the wrong place).
MIN_RUN = 16
_ANCHOR = 8
_MAX_CANDIDATES = 8


def check_id(name: str, value: str) -> str:
    """``value`` if it is a non-empty string without control characters (a tenant's or a
    conversation's id); :class:`~kvrag.errors.InvalidRequestError` naming ``name`` otherwise."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
    if _CONTROL.search(value):
        raise InvalidRequestError(f"{name} must not contain control characters, got {value!r}")
    return value


def check_conversation_id(conversation_id) -> str | None:
    """Validate a conversation id (a non-empty string without control characters; ints are accepted
    and stringified)."""
    if conversation_id is None:
        return None
    if not (isinstance(conversation_id, str) or is_int(conversation_id)):
        raise InvalidRequestError(f"conversation_id must be a string, got {type(conversation_id).__name__}")
    return check_id("conversation_id", str(conversation_id))


@dataclass(slots=True)
class ConversationState:
    """What a conversation keeps between turns.

    Attributes:
        ids: token ids of the turn (prompt + generated tokens whose KV exists).
        k: [L, Hkv, T, D] keys of those tokens, without RoPE.
        v: [L, Hkv, T, D] values.
        chunks: content ids of every chunk this line of turns placed in its context so far.
        turns: turns recorded on this line.
        prompt_len: tokens of ``ids`` that were the turn's prompt (its answer follows).
    """

    ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    chunks: set[str] = field(default_factory=set)
    turns: int = 0
    prompt_len: int = 0

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


@dataclass(slots=True)
class Continuation:
    """How a prompt continues a kept turn: ``prefix`` tokens in common at the start, then ``runs``
    ``(new_pos, old_pos, length)`` of the turn found shifted (:func:`match_runs`)."""

    state: ConversationState
    prefix: int
    runs: list[tuple[int, int, int]]

    def continues(self, n_new: int) -> bool:
        """Whether a prompt of ``n_new`` tokens goes on from the turn: it repeats the end of the turn's
        prompt (its last message and the assistant header, at least :data:`MIN_RUN` tokens unless at
        the start) and has more after it, the turn's answer and what followed; or it is the turn's
        prompt again (the same turn asked again)."""
        end = self.state.prompt_len
        if end <= 0:
            return False
        if self.prefix == n_new == end:
            return True
        return any(j < end <= j + n and i + end - j < n_new for i, j, n in [(0, 0, self.prefix), *self.runs])


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
    """Live conversations of one engine: a bounded map ``(namespace, id)`` -> its kept turns (main, side).

    Thread-safe. States are replaced whole at the end of each turn and never written into, so a
    request can read one while another turn of the same conversation finishes. Past ``max_live``
    the fair rule of the module's docstring ends one.
    """

    def __init__(self, adapter: ModelAdapter, max_live: int) -> None:
        self.adapter = adapter
        self.max_live = max_live
        # key -> [main, side]: the turn calls continue, and the last call that continued none
        self._live: OrderedDict[ConversationKey, list[ConversationState | None]] = OrderedDict()
        self._held: Counter[str] = Counter()  # namespace -> its live conversations
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: ConversationKey) -> bool:
        return key in self._live

    def kept(self, key: ConversationKey) -> list[ConversationState]:
        """The conversation's kept turns, the main one first (empty if it is not live)."""
        with self._lock:
            turns = self._live.get(key)
            if turns is None:
                return []
            self._live.move_to_end(key)
            return [t for t in turns if t is not None]

    def get(self, key: ConversationKey) -> ConversationState | None:
        """The conversation's main turn (the last one a call continued), or None."""
        with self._lock:
            turns = self._live.get(key)
            if turns is None:
                return None
            self._live.move_to_end(key)
            return turns[0] if turns[0] is not None else turns[1]

    def end(self, key: ConversationKey) -> bool:
        """Forget a conversation; False if it was not live."""
        with self._lock:
            return self._pop(key) is not None

    def clear(self) -> None:
        with self._lock:
            self._live.clear()
            self._held.clear()

    def held(self, namespace: str) -> int:
        """The tenant's live conversations."""
        with self._lock:
            return self._held.get(namespace, 0)

    def _pop(self, key: ConversationKey):
        """Drop a live conversation (the lock held); its turns, or None."""
        turns = self._live.pop(key, None)
        if turns is not None:
            self._held[key[0]] -= 1
            if self._held[key[0]] <= 0:
                del self._held[key[0]]
        return turns

    # -- deduplication ---------------------------------------------------------------------------

    def dedup(self, key: ConversationKey, parts: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int]:
        """Drop chunk parts that an earlier turn placed and whose earlier copy is still in the prompt."""
        placed = set().union(*(t.chunks for t in self.kept(key)))
        if not placed:
            return parts, 0
        out: list[tuple[str, str]] = []
        before: list[str] = []
        dropped = 0
        for kind, text in parts:
            if kind == "chunk" and content_id(text) in placed and text in "".join(before):
                dropped += 1
                continue
            out.append((kind, text))
            before.append(text)
        return out, dropped

    # -- reuse -------------------------------------------------------------------------------------

    def follow(self, key: ConversationKey, ids: list[int]) -> Continuation | None:
        """The kept turn the prompt ``ids`` continues (:meth:`Continuation.continues`; the main turn
        first), or None: the call is a side call, or the conversation has no turn yet."""
        for state in self.kept(key):
            prefix = common_prefix(state.ids, ids, len(ids))
            found = Continuation(state, prefix, match_runs(state.ids, ids, prefix, len(ids)))
            if found.continues(len(ids)):
                return found
        return None

    def attach(self, plan: Plan, follow: Continuation) -> list[tuple[int, int]]:
        """Put the KV of the kept turn the prompt continues into ``plan``; returns the prompt spans
        [a, b) it covers.

        The exact common prefix becomes the plan's prefix (if longer than what the prefix cache
        found); in ``blend``/``reuse`` mode, runs of the kept sequence found elsewhere in the
        prompt become cached spans, recompute candidates like chunk hits.
        """
        state = follow.state
        new = plan.ids
        limit = len(new) - 1  # the last prompt token is always computed
        spans: list[tuple[int, int]] = []
        prefix = min(follow.prefix, limit)
        if prefix > plan.prefix_len:
            plan.prefix_len = prefix
            plan.prefix_records = [(0, state.record(0, prefix, new, 0, "prefix"))]
            plan.chunk_records = [(s, r) for s, r in plan.chunk_records if s >= prefix]
            plan.exact_records = [(s, r) for s, r in plan.exact_records if s >= prefix]
            for use in plan.chunks:
                if use.start + use.length <= prefix:
                    use.hit, use.found, use.source = True, True, "prefix"
                elif use.start < prefix and use.source in ("store", "tree"):
                    use.hit, use.source = False, "computed"
            spans.append((0, prefix))
        if plan.mode not in ("blend", "reuse"):
            plan.check_tail()
            return spans
        covered = sorted(
            [(0, plan.prefix_len)] + [(s, s + r.num_tokens) for s, r in plan.exact_records + plan.chunk_records]
        )
        first_run = len(spans)
        for i, j, n in follow.runs:
            for a, b in _subtract(i, min(i + n, limit), covered):
                plan.chunk_records.append((a, state.record(j + (a - i), b - a, new, a, "conversation")))
                spans.append((a, b))
        plan.chunk_records.sort(key=lambda sr: sr[0])
        for use in plan.chunks:
            end = use.start + use.length
            if not use.hit and any(a <= use.start and end <= b for a, b in spans[first_run:]):
                use.hit, use.found, use.source = True, True, "conversation"
        plan.check_tail()
        return spans

    def record(
        self,
        key: ConversationKey,
        ids: list[int],
        buf: KVBuffer,
        chunk_texts: list[str],
        *,
        prompt_len: int,
        follow: Continuation | None,
    ) -> None:
        """Keep a finished turn: ``ids`` (its prompt's ``prompt_len`` tokens, then its answer) whose KV
        is in ``buf`` [0, len(ids)) (keys with RoPE). A turn that continued a kept one (``follow``)
        becomes the main turn and the one it continued the side turn; one that continued none
        becomes the side turn (the main one stays), or the main one when there is none."""
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
        old = follow.state if follow is not None else None
        chunks = set(old.chunks) if old is not None else set()
        chunks.update(content_id(t) for t in chunk_texts)
        state = ConversationState(ids, k, v, chunks, old.turns + 1 if old is not None else 1, min(prompt_len, n))
        with self._lock:
            main, side = self._pop(key) or (None, None)
            if old is not None:
                main, side = state, old
            elif main is None:
                main = state
            else:  # a side call: the main turn stays
                side = state
            while len(self._live) >= self.max_live:  # room first: the new turn is never the one to go
                tenant = fair_victim(self._held, key[0], 1)
                self._pop(next(k for k in self._live if k[0] == tenant))  # its least recently used
            self._live[key] = [main, side]
            self._held[key[0]] += 1
