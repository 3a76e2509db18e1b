"""Next-token choice and incremental detokenisation with stop strings.

The settings themselves, :class:`~kvrag.config.SamplingParams`, live beside the engine config (which
holds the defaults and imports without torch); they are re-exported here.
"""

from __future__ import annotations

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
    """

    def __init__(self, tokenizer, stop) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # final text so far (cut at a stop string)
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            full = full[:cut]
        self.text = full
        safe = len(full)
        if not self.stopped:  # hold back a tail that could be the start of a stop string
            for s in self.stop:
                for n in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:n]):
                        safe = min(safe, len(full) - n)
                        break
        piece = full[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return piece

    def flush(self) -> str:
        """Whatever was held back, once generation has ended."""
        piece = self.text[self.emitted :]
        self.emitted = len(self.text)
        return piece
