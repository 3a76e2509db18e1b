"""The chunk registry and the segmenter: finding known document texts inside a rendered prompt.

Integrations record the text of every retrieved document here (keyed by content hash). When a
prompt arrives as one string (a chat template rendered by LangChain or LlamaIndex), the segmenter
finds the registered texts in it, wherever they are and whatever surrounds them, and splits the
prompt into ``text, chunk, text, chunk, ..., text``. Nothing is required of the prompt: text that
matches no document is simply computed.

Matching: every registered text is indexed by a hash of its first ``anchor`` characters; the
prompt is scanned with a rolling hash of the same width, and candidate positions are verified
with a plain string comparison. Leftmost, then longest, non-overlapping matches win.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

__all__ = ["ChunkRegistry", "content_id"]

_BASE = 257
_MOD = (1 << 61) - 1


def content_id(text: str) -> str:
    """Content hash of a document text (hex SHA-256, 32 chars)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _hash(s: str) -> int:
    h = 0
    for ch in s:
        h = (h * _BASE + ord(ch)) % _MOD
    return h


class ChunkRegistry:
    """Bounded, thread-safe set of document texts, searchable inside prompts.

    Args:
        max_entries: most recently registered texts kept (older ones are forgotten).
        min_chars: texts shorter than this are not registered (not worth caching).
        anchor: characters hashed to find candidate positions (must be <= min_chars).
    """

    def __init__(self, max_entries: int = 100_000, min_chars: int = 32, anchor: int = 32) -> None:
        if anchor > min_chars:
            raise ValueError("anchor must be <= min_chars")
        self.max_entries = max_entries
        self.min_chars = min_chars
        self.anchor = anchor
        self._texts: OrderedDict[str, str] = OrderedDict()  # id -> text
        self._by_anchor: dict[int, set[str]] = {}  # anchor hash -> ids
        self._lock = threading.Lock()
        self._pow = pow(_BASE, anchor - 1, _MOD)

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return content_id(text) in self._texts

    def register(self, texts) -> list[str]:
        """Record texts; returns their content ids (texts too short are skipped, id still given)."""
        ids = []
        with self._lock:
            for text in texts:
                if not isinstance(text, str):
                    raise TypeError(f"documents must be strings, got {type(text).__name__}")
                cid = content_id(text)
                ids.append(cid)
                if len(text) < self.min_chars:
                    continue
                if cid in self._texts:
                    self._texts.move_to_end(cid)
                    continue
                self._texts[cid] = text
                self._by_anchor.setdefault(_hash(text[: self.anchor]), set()).add(cid)
                while len(self._texts) > self.max_entries:
                    old_id, old = self._texts.popitem(last=False)
                    bucket = self._by_anchor.get(_hash(old[: self.anchor]))
                    if bucket is not None:
                        bucket.discard(old_id)
                        if not bucket:
                            del self._by_anchor[_hash(old[: self.anchor])]
        return ids

    def forget(self, texts) -> None:
        with self._lock:
            for text in texts:
                cid = content_id(text)
                old = self._texts.pop(cid, None)
                if old is not None:
                    bucket = self._by_anchor.get(_hash(old[: self.anchor]), set())
                    bucket.discard(cid)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._by_anchor.clear()

    def find(self, prompt: str) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) character spans of registered texts inside ``prompt``."""
        w = self.anchor
        n = len(prompt)
        if n < w or not self._texts:
            return []
        with self._lock:
            by_anchor = {h: [self._texts[i] for i in ids] for h, ids in self._by_anchor.items()}
        spans: list[tuple[int, int]] = []
        h = _hash(prompt[:w])
        i = 0
        next_free = 0
        while True:
            if i >= next_free:
                cands = by_anchor.get(h)
                if cands:
                    best = max((len(t) for t in cands if prompt.startswith(t, i)), default=0)
                    if best:
                        spans.append((i, i + best))
                        next_free = i + best
            if i + w >= n:
                break
            h = ((h - ord(prompt[i]) * self._pow) * _BASE + ord(prompt[i + w])) % _MOD
            i += 1
        return spans

    def split(self, prompt: str) -> list[tuple[str, str]]:
        """The prompt as (kind, text) parts: ``text`` and ``chunk`` alternating as found."""
        parts: list[tuple[str, str]] = []
        pos = 0
        for start, end in self.find(prompt):
            if start > pos:
                parts.append(("text", prompt[pos:start]))
            parts.append(("chunk", prompt[start:end]))
            pos = end
        if pos < len(prompt):
            parts.append(("text", prompt[pos:]))
        return parts
