"""Next-token choice and incremental detokenisation with stop strings.

The settings themselves, :class:`~kvrag.config.SamplingParams`, live beside the engine config (which
holds the defaults and imports without torch); they are re-exported here.
"""

from __future__ import annotations

import re

import torch

from kvrag.config import SamplingParams

__all__ = ["SamplingParams", "seeded_generator", "sample", "TextStream"]


def seeded_generator(sampling: SamplingParams) -> torch.Generator | None:
    """A generator seeded with ``sampling.seed`` when it samples with a seed, else ``None`` (torch's global RNG)."""
    if sampling.temperature and sampling.seed is not None:
        return torch.Generator().manual_seed(int(sampling.seed))
    return None


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Pick a token from logits [V]: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    # sampled on the CPU: the seeded generator is a CPU one (and a seed then picks the same tokens on any device)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # always keeps the top token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Turns generated token ids into text pieces, holding back what may still become a stop string.

    ``push`` returns the new text that is safe to emit; ``stopped`` tells whether a stop string
    appeared (the text is cut before it).

    Per token it decodes the ids (the whole text, as the tokenizer renders it) and then looks only
    at the new tail: a stop string that was not in the text before can only begin in its last
    ``len(new text) + longest stop - 1`` characters, found by one search of a compiled alternation;
    what to hold back is the longest end of the text that begins a stop string, at most
    ``longest stop - 1`` set lookups (the stops' proper prefixes, hashed once per request). So a
    token costs O(new text + longest stop) whatever the number of stop strings.
    """

    def __init__(self, tokenizer, stop) -> None:
        self.tokenizer = tokenizer
        self.stop = list(dict.fromkeys(s for s in stop if s))
        self.ids: list[int] = []
        self.text = ""  # final text so far (cut at a stop string)
        self.emitted = 0
        self.stopped = False
        self._longest = max(map(len, self.stop), default=0)
        self._pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None
        # hashes of the stops' proper prefixes (a hit is verified: a collision cannot hold text back)
        self._prefixes = {hash(s[:n]) for s in self.stop for n in range(1, len(s))}
        self._seen = ""  # the text the last push decoded (no stop string in it)

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        if self._pattern is not None:
            # the text before ``same`` is unchanged and held no stop string: one can only begin after
            # ``same - longest + 1`` (the decode may rewrite earlier text: then look at it all)
            same = len(self._seen) if full.startswith(self._seen) else 0
            found = self._pattern.search(full, max(0, same - self._longest + 1))
            if found is not None:
                self.stopped = True
                full = full[: found.start()]
            self._seen = full
        self.text = full
        safe = len(full) - (0 if self.stopped else self._held_back(full))
        piece = full[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return piece

    def _held_back(self, full: str) -> int:
        """Characters at the end of ``full`` that may still become a stop string: the longest end of
        it that is a proper prefix of one."""
        for n in range(min(self._longest - 1, len(full)), 0, -1):
            tail = full[-n:]
            if hash(tail) in self._prefixes and any(s.startswith(tail) and len(s) > n for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Whatever was held back, once generation has ended."""
        piece = self.text[self.emitted :]
        self.emitted = len(self.text)
        return piece
