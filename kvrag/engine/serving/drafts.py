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

How many drafts pay is the machine's: a draft row's attention over a long context is a small part of
a step on one CPU and half of it on another, where four drafts a step cost more than they save
(figures: docs/journal/figures-from-code.md). So the engine times its decode passes
(:class:`StepCost`: the products once a pass, each row's keys), keeps each request's recent
:class:`HoldRate`, and checks the drafts that raise the step's expected tokens per second
(:func:`plan_drafts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PromptLookup",
    "MAX_NGRAM",
    "PROBE_EVERY",
    "DraftCandidate",
    "HoldRate",
    "StepCost",
    "next_width",
    "plan_drafts",
]

#: Longest n-gram matched (the longest match found is used; 3, then 2, then 1 token).
MAX_NGRAM = 3

#: A greedy sequence the plan gives no draft checks one every this many steps (keeps its hold rate current).
PROBE_EVERY = 8


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

    A draft row costs its attention over the whole context, so a sequence whose guesses keep failing
    checks one at a time, and one that copies checks the most.
    """
    if drafted and confirmed == drafted:
        return min(max(1, width) * 2, most)
    if drafted and not confirmed:
        return max(1, width // 2)
    return width


class StepCost:
    """What a decode pass costs, fitted online: ``seconds ~ fixed + per_key * keys``.

    ``keys`` sums the context every row of the pass attends over. The products read the weights once
    for all the rows of a pass (``fixed``; padding rows are computed anyway), each row's attention
    reads its own context (``per_key`` a key; a row's other work, done once per row, is read into it
    too, as rows and keys grow together at one context), so a draft row costs ``per_key`` times its
    context. How the two compare is the machine's (the module's note). Least squares over sums
    that decay by ``decay`` a pass, so the fit follows the machine's load; no fit until ``min_passes``
    passes were seen and their keys differed (a constant row count says nothing of ``per_key``).
    """

    __slots__ = ("decay", "min_passes", "_n", "_x", "_y", "_xx", "_xy", "_fit", "_seen")

    def __init__(self, decay: float = 0.97, min_passes: int = 8) -> None:
        self.decay, self.min_passes = decay, min_passes
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._fit: tuple[float, float] | None = None
        self._seen = 0

    def observe(self, keys: int, seconds: float) -> None:
        """One pass of ``keys`` keys took ``seconds``."""
        d = self.decay
        self._n, self._x, self._y = self._n * d + 1, self._x * d + keys, self._y * d + seconds
        self._xx, self._xy = self._xx * d + keys * keys, self._xy * d + keys * seconds
        self._seen += 1
        mean = self._x / self._n
        var = self._xx / self._n - mean * mean
        if self._seen >= self.min_passes and var > (0.05 * mean) ** 2:  # keys that differed by ~5%+
            per_key = max(0.0, (self._xy / self._n - mean * self._y / self._n) / var)
            self._fit = (max(0.0, self._y / self._n - per_key * mean), per_key)
        # else: keep the last fit (passes of one shape only move the intercept's evidence)

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_key)`` in seconds, or None before there is evidence for both."""
        return self._fit


class HoldRate:
    """How often a sequence's next draft holds once the ones before it did, over its recent steps.

    Each checked draft up to the first miss is a trial (those after a miss say nothing); the counts
    decay by ``decay`` a trial, so the rate reads the last few trials and a sequence that starts or
    stops copying its passages is followed within a few steps. Starts at one half (a prior of one hit
    in two trials).
    """

    __slots__ = ("decay", "hits", "trials")

    def __init__(self, decay: float = 0.7) -> None:
        self.decay, self.hits, self.trials = decay, 0.0, 0.0

    def update(self, drafted: int, confirmed: int) -> None:
        """A step checked ``drafted`` drafts and kept the first ``confirmed``."""
        for held in [True] * confirmed + [False] * (confirmed < drafted):
            self.hits = self.hits * self.decay + held
            self.trials = self.trials * self.decay + 1

    @property
    def p(self) -> float:
        return (self.hits + 1.0) / (self.trials + 2.0)


@dataclass(frozen=True)
class DraftCandidate:
    """A greedy sequence that may check drafts this step: at most ``most``, each of the next one holding
    with probability ``hold`` once its predecessors did, each row reading ``context`` keys."""

    most: int
    hold: float
    context: int


def plan_drafts(
    candidates: Sequence[DraftCandidate], rows: int, keys: int, cost: tuple[float, float], room: int
) -> list[int]:
    """How many drafts each candidate checks, so the step's expected tokens per second are the most.

    ``rows`` sequences emit a token anyway over ``keys`` keys; ``cost`` is :meth:`StepCost.fit`; at most
    ``room`` drafts in all (the pass's free rows). Draft ``k`` (0-based) of a candidate is expected
    to add ``hold ** (k + 1)`` tokens (a draft counts only when all before it held) and costs
    ``per_key * context`` seconds; drafts are added best gain per second first, while they raise the
    step's rate — so a machine where a draft row is dear checks fewer, one where it is cheap the most.
    """
    fixed, per_key = cost
    tokens, seconds = float(rows), fixed + per_key * keys
    widths = [0] * len(candidates)
    for _ in range(room):
        best, best_rate, gain, dt = -1, 0.0, 0.0, 0.0
        for i, c in enumerate(candidates):
            if widths[i] >= c.most:
                continue
            g, d = c.hold ** (widths[i] + 1), per_key * c.context
            rate = g / d if d > 0 else float("inf")
            if rate > best_rate:
                best, best_rate, gain, dt = i, rate, g, d
        if best < 0:
            break
        if seconds > 0 and (tokens + gain) / (seconds + dt) <= tokens / seconds:
            break  # the likeliest draft left would slow the step's tokens per second
        widths[best] += 1
        tokens, seconds = tokens + gain, seconds + dt
    return widths
