"""Sampling settings, next-token choice, and incremental detokenisation with stop strings."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvrag.errors import InvalidRequestError

__all__ = ["SamplingParams", "sample", "TextStream"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request decodes. ``None`` fields take the engine config's defaults.

    Pass one to :meth:`~kvrag.Engine.generate` / :meth:`~kvrag.Engine.stream` as ``sampling=``
    (or the same names as keywords)::

        engine.generate(chunks=docs, suffix=question, sampling=SamplingParams(max_new_tokens=32))

    Attributes:
        max_new_tokens: most tokens generated (an integer >= 0).
        temperature: 0 for greedy decoding; > 0 samples (with ``top_p``).
        top_p: nucleus sampling threshold in (0, 1], used when ``temperature`` > 0.
        stop: stop strings (one string or several); the text is cut before the first one found.
        seed: sampling seed (``None``: nondeterministic when sampling).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | tuple[str, ...] | list[str] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got {n!r}")
        t = self.temperature
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise InvalidRequestError(f"temperature must be a number >= 0, got {t!r}")
            object.__setattr__(self, "temperature", float(t))
        p = self.top_p
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
            object.__setattr__(self, "top_p", float(p))
        stop = self.stop
        if stop is not None:
            stops = (stop,) if isinstance(stop, str) else stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
            object.__setattr__(self, "stop", tuple(stops))
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not -(2**63) <= s < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64) (torch's range), got {s!r}")

    def resolved(self, defaults) -> SamplingParams:
        """Every ``None`` field taken from ``defaults`` (an :class:`~kvrag.EngineConfig`); ``stop`` a tuple."""
        return SamplingParams(
            max_new_tokens=defaults.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            stop=self.stop or (),
            seed=defaults.seed if self.seed is None else self.seed,
        )

    @classmethod
    def of(cls, sampling: SamplingParams | None, **fields) -> SamplingParams:
        """``sampling``, or one built from keyword ``fields`` (``None`` = not given); not both."""
        given = {k: v for k, v in fields.items() if v is not None}
        if sampling is None:
            return cls(**given)
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if given:
            raise InvalidRequestError(f"give either sampling= or {', '.join(sorted(given))} as keywords, not both")
        return sampling

    def generator(self) -> torch.Generator | None:
        """A seeded generator when sampling with a seed, else ``None``."""
        if self.temperature and self.seed is not None:
            return torch.Generator().manual_seed(int(self.seed))
        return None

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Pick a token from logits [V]: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
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
