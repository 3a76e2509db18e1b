"""Prompt-lookup drafts: guesses of a greedy answer's next tokens, checked in the padding rows of a decode step.

A RAG answer copies: it restates the question and names what the passages name. So the tokens
that followed the last few generated tokens where they last occurred in the prompt (or earlier in
the answer) are often the ones the model is about to write (prompt-lookup decoding, as in
transformers' ``prompt_lookup_num_tokens`` and vLLM's n-gram speculator).

A decode step already runs ``decode_group`` rows and pads the ones no request uses
(:mod:`kvrag.engine.model.batch`); on a CPU the weights are read once for all of them, so a draft
checked in a padding row costs only that row's attention. The engine puts a greedy request's
drafts in those rows at the positions after its token; a row's logits depend on its own inputs
only (fixed-shape products, attention per row over its own buffer), so the row of a draft that
matches what the model picks computes exactly what the next plain step would have computed. The
tokens emitted are the same, bit for bit, as without drafts (tested); a step just emits more
than one when the guesses hold.

:class:`PromptLookup` keeps, per sequence, where each n-gram (``1..max_ngram`` tokens) last
ended, so a draft costs a few dictionary lookups, not a scan of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PromptLookup", "MAX_NGRAM", "next_width"]

#: Longest n-gram matched (the longest match found is used; 3, then 2, then 1 token).
MAX_NGRAM = 3


class PromptLookup:
    """The continuation, in a sequence's own tokens, of its last n-gram's latest earlier occurrence.

    Args:
        tokens: the prompt's token ids.
        max_ngram: longest n-gram matched.
    """

    __slots__ = ("tokens", "max_ngram", "_ends", "_indexed")

    def __init__(self, tokens: Sequence[int], max_ngram: int = MAX_NGRAM) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.tokens: list[int] = [int(t) for t in tokens]
        self.max_ngram = max_ngram
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in _ends
        self._index(len(self.tokens) - 1)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the sequence emitted (in order)."""
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow the sequence (none when its tail never occurred before)."""
        if k <= 0 or not self.tokens:
            return []
        last = len(self.tokens) - 1
        self._index(last)  # every n-gram ending before the last token: "earlier" occurrences
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), 0, -1):
            start = self._ends.get(tuple(toks[last - n + 1 :]))
            if start is not None:
                return toks[start : start + k]
        return []

    def _index(self, upto: int) -> None:
        """Record the n-grams ending at positions [indexed, upto) (later ones overwrite: latest wins)."""
        toks, ends, m = self.tokens, self._ends, self.max_ngram
        for end in range(self._indexed, upto):
            for n in range(1, min(m, end + 1) + 1):
                ends[tuple(toks[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, upto)


def next_width(width: int, drafted: int, confirmed: int, most: int) -> int:
    """How many drafts a sequence's next step checks, after a step that checked ``drafted`` and
    kept ``confirmed``: half as many after a miss at the first draft, twice as many (at most
    ``most``) after all held, as many otherwise.

    A draft row costs its attention over the whole context (about 6.5 ms a row at 3.7K tokens for
    SmolLM2 here, against ~41 ms for the step), so a sequence whose guesses keep failing checks one
    at a time, and one that copies checks the most.
    """
    if drafted and confirmed == drafted:
        return min(max(1, width) * 2, most)
    if drafted and not confirmed:
        return max(1, width // 2)
    return width
