"""From a request's ``(kind, text)`` parts to positioned segments of token ids.

Each part is tokenised on its own, never across part boundaries: a chunk's tokens (and so its
store key) are then the same wherever it appears in a prompt. The BOS token, when the tokenizer
adds one to a whole text, is put in front once, unless the prompt spells it out itself (a chat
template's rendered text). This is kept apart from the planner, so that planning is ids and store
lookups only and can be tested without a tokenizer.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

__all__ = ["Segment", "PromptTokenizer", "MEMO_TEXTS"]

#: Texts whose token ids :meth:`PromptTokenizer.tokenize` remembers (least recently used forgotten first).
MEMO_TEXTS = 4096


@dataclass(slots=True)
class Segment:
    """A piece of the prompt: ``text`` (always computed) or ``chunk`` (a cacheable document)."""

    kind: str
    text: str
    ids: list[int] = field(default_factory=list)
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


class PromptTokenizer:
    """Tokenises texts on their own (memoised) and prompts part by part.

    Args:
        tokenizer: a Hugging Face tokenizer (called as ``tokenizer(text, add_special_tokens=...)``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # callers' threads tokenise their requests at once
        # the BOS token, only if the tokenizer really adds it to a text (some define one and never add it)
        bos = getattr(tokenizer, "bos_token_id", None)
        with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.bos_id: int | None = (
            bos if bos is not None and len(with_special) > len(plain) and with_special[0] == bos else None
        )

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """Most characters one token stands for: the longest vocabulary entry (a byte-level entry
        has a character per byte, at least as many as the text it decodes to); ``None`` where the
        vocabulary cannot be read. A text of ``n`` characters needs at least ``n / max_token_chars``
        tokens."""
        try:
            vocab = self.tokenizer.get_vocab()
        except Exception:  # a tokenizer without a readable vocabulary: no bound
            return None
        longest = max(map(len, vocab), default=0)
        return longest or None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text on its own (no special tokens added), memoised (thread-safe)."""
        with self._lock:
            ids = self._memo.get(text)
            if ids is not None:
                self._memo.move_to_end(text)
                return ids
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        with self._lock:
            self._memo[text] = ids
            if len(self._memo) > MEMO_TEXTS:
                self._memo.popitem(last=False)
        return ids

    def segment(self, parts: list[tuple[str, str]]) -> tuple[list[Segment], torch.Tensor]:
        """Tokenise (kind, text) parts into positioned segments, and the prompt's ids [N]; empty
        parts are dropped."""
        segments: list[Segment] = []
        pos = 0
        if self.bos_id is not None:
            first = next((t for _, t in parts if t), "")
            if not first.startswith(self.tokenizer.bos_token or "\0"):
                segments.append(Segment("text", self.tokenizer.bos_token, [self.bos_id], 0))
                pos = 1
        for kind, text in parts:
            if not text:
                continue
            ids = self.tokenize(text)
            if not ids:
                continue
            segments.append(Segment(kind, text, ids, pos))
            pos += len(ids)
        return segments, torch.tensor(prompt_ids(segments), dtype=torch.long)


def prompt_ids(segments: list[Segment]) -> list[int]:
    """The prompt's token ids: its segments' ids, in order."""
    return [t for s in segments for t in s.ids]
