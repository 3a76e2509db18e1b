"""A running request between its prefill and its last token (nano-vllm's ``Sequence``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrag.engine.model.grammar import GrammarMatcher
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.model.sampling import TextStream
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.serving.drafts import HoldRate, PromptLookup
from kvrag.engine.serving.requests import Request
from kvrag.engine.types import GenerationStats

__all__ = ["RunningSequence"]


@dataclass(slots=True, kw_only=True)
class RunningSequence:
    """The decoding state of one request.

    Attributes:
        req: the validated request.
        plan: what its prefill reused and computed.
        buf: its KV, positions [0, ``pos``) valid.
        pos: where the next token's KV goes (the prompt length, then one more per decoded token).
        token: the next token to emit, sampled but not yet in ``buf``.
        ahead: tokens to emit before ``token``, already in ``buf`` (prompt-lookup drafts a decode
            step confirmed, :mod:`kvrag.engine.serving.drafts`).
        drafter: a greedy request's prompt lookup, made at its first decode step (None before, and
            for a sampled request).
        draft_width: most drafts its next step checks before the engine has a step cost to plan with
            (adapts to how well its drafts hold: :func:`~kvrag.engine.serving.drafts.next_width`).
        draft_hold: how often its drafts have held lately (the plan's odds once there is a step cost).
        max_tokens: most tokens it may generate (``max_new_tokens`` within the context window).
        generated: tokens emitted so far.
        text: the detokeniser (stop strings).
        generator: the seeded sampler's generator, if any.
        grammar: a constrained request's matcher (:mod:`kvrag.engine.model.grammar`), which has consumed
            every token sampled, ``token`` included; None for free text.
        stats: what the request did (prefill figures now; completion figures at the end).
        t0: when the request was made (``time.perf_counter``); TTFT counts from there.
        ttft: seconds from ``t0`` to the first token.
        finish: ``length`` until a stop (end of sequence, a stop string, a complete constrained output)
            makes it ``stop``.
        done: no more tokens.
        after_first_token: work the engine thread runs once the first token has been handed to the
            caller, before the next decode step (the request's write-back scheduling: off its TTFT).
    """

    req: Request
    plan: Plan
    buf: KVBuffer
    pos: int
    token: int
    max_tokens: int
    text: TextStream
    generator: torch.Generator | None
    stats: GenerationStats
    t0: float
    ttft: float
    generated: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    drafter: PromptLookup | None = None
    draft_width: int = 0
    draft_hold: HoldRate = field(default_factory=HoldRate)
    grammar: GrammarMatcher | None = None
    finish: str = "length"
    done: bool = False
    after_first_token: Callable[[], None] | None = None

    def accept(self, eos_ids: set[int]) -> str:
        """Emit the tokens ``ahead``, then ``token``, until a stop; returns the text that became safe to show."""
        tokens, self.ahead = [*self.ahead, self.token], []
        pieces = []
        for token in tokens:
            pieces.append(self._emit(token, eos_ids))
            if self.done:
                break
        if not self.done and self.grammar is not None and self.grammar.stopped:  # the output is complete
            self.finish, self.done = "stop", True
        return "".join(pieces)

    def _emit(self, token: int, eos_ids: set[int]) -> str:
        if self.done or len(self.generated) >= self.max_tokens:
            self.done = True
            return ""
        if token in eos_ids or (self.grammar is not None and token in self.grammar.eos_ids):
            self.finish, self.done = "stop", True
            return ""
        self.generated.append(token)
        piece = self.text.push(token)
        if self.text.stopped:
            self.finish, self.done = "stop", True
        elif len(self.generated) >= self.max_tokens:
            self.done = True
        return piece
