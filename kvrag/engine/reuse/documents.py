"""The prompt's document finder: finding known document texts inside a rendered prompt.

Integrations record the text of every retrieved document here (keyed by content hash). When a
prompt arrives as one string (a chat template rendered by LangChain or LlamaIndex), the segmenter
finds the registered texts in it, wherever they are and whatever surrounds them, and splits the
prompt into ``text, chunk, text, chunk, ..., text``. Nothing is required of the prompt: text that
matches no document is simply computed.

Matching: every registered text is indexed by a hash of its first ``anchor`` characters; the
prompt is scanned with a rolling hash of the same width, and candidate positions are verified
with a plain string comparison. Leftmost, then longest, non-overlapping matches win. A lookup
costs O(prompt) whatever the number of texts: it reads the index in place, without copying it
(``python -m benchmarks registry`` measures it at 100 and 100,000 texts).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

__all__ = ["DocumentFinder", "content_id"]

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


class DocumentFinder:
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
        self._texts: OrderedDict[str, str] = OrderedDict()  # id -> text, oldest first; under the lock
        # anchor hash -> the registered texts that start with it. Written only under the lock, and a
        # bucket is replaced, never mutated: find() reads it without the lock (a dict lookup is atomic,
        # under the GIL and in free-threaded builds alike) and sees each bucket before or after a change.
        self._by_anchor: dict[int, tuple[str, ...]] = {}
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
                h = _hash(text[: self.anchor])
                self._by_anchor[h] = self._by_anchor.get(h, ()) + (text,)
                while len(self._texts) > self.max_entries:
                    _, old = self._texts.popitem(last=False)
                    h = _hash(old[: self.anchor])
                    rest = tuple(t for t in self._by_anchor.get(h, ()) if t != old)
                    if rest:
                        self._by_anchor[h] = rest
                    else:
                        self._by_anchor.pop(h, None)
        return ids

    def find(self, prompt: str) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) character spans of registered texts inside ``prompt``."""
        w = self.anchor
        n = len(prompt)
        by_anchor = self._by_anchor  # read in place, without the lock (see __init__)
        if n < w or not by_anchor:
            return []
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
