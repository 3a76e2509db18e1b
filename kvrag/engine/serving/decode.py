"""Decoding on the engine thread: one batched step per token, prompt-lookup drafts in its padding rows.

:meth:`Decoding.step` is the worker's ``step``: every running sequence puts its next token in its
buffer and samples the one after, all in one pass of the model
(:class:`~kvrag.engine.model.batch.Decoder`). A greedy sequence's drafts ride in the rows the pass
pads anyway; the ones the model's own picks confirm are emitted without a step of their own
(:mod:`kvrag.engine.serving.drafts`: how many pay follows the step cost the engine measures).
:meth:`Decoding.finish` is the worker's ``finish``: a conversation's turn is kept, and the request's
:class:`~kvrag.engine.types.Generation` made.
"""

from __future__ import annotations

import time

import torch

from kvrag.engine.model.batch import Decoder, DecodeRow
from kvrag.engine.model.grammar import sample_next
from kvrag.engine.reuse.conversations import Conversations
from kvrag.engine.serving.drafts import PROBE_EVERY, DraftCandidate, PromptLookup, StepCost, next_width, plan_drafts
from kvrag.engine.serving.sequence import RunningSequence
from kvrag.engine.types import Generation

__all__ = ["Decoding", "CPU_DRAFT_TOKENS", "draft_tokens_for"]

#: drafts a decode step checks at most on a CPU, where ``draft_tokens`` is left to the device
CPU_DRAFT_TOKENS = 4


def draft_tokens_for(draft_tokens: int | None, device: torch.device | str) -> int:
    """``draft_tokens`` as given, or the device's default when None: :data:`CPU_DRAFT_TOKENS` on a
    CPU (a draft row there costs its attention alone, the weights read once for the pass), none on
    a GPU (each draft row launches its own kernels per layer, and the step is launch-bound)."""
    if draft_tokens is not None:
        return draft_tokens
    return CPU_DRAFT_TOKENS if torch.device(device).type == "cpu" else 0


class Decoding:
    """The decode side of a request's life on the engine thread.

    Args:
        decoder: the model's batched decode step.
        conversations: where a conversation's finished turn is kept.
        draft_tokens: most prompt-lookup drafts one step checks (0: none).
        drafts_given: ``draft_tokens`` was set, not the device's default (said in :meth:`description`).
    """

    def __init__(
        self, decoder: Decoder, conversations: Conversations, draft_tokens: int, *, drafts_given: bool = True
    ) -> None:
        self.decoder, self.conversations = decoder, conversations
        self.draft_tokens, self.drafts_given = draft_tokens, drafts_given
        self.step_cost = StepCost()  # a decode pass's seconds, fitted as the engine decodes (drafts plan with it)

    def description(self) -> str:
        """The decode step's path and its drafts, in a line (:attr:`EngineInfo.decode`)."""
        n = self.draft_tokens
        if n == 0:
            why = (
                "draft_tokens=0" if self.drafts_given else "none by default on a GPU: a draft row's launches cost more"
            )
            drafts = f"no prompt-lookup drafts ({why})"
        else:
            drafts = (
                f"prompt-lookup drafts: up to {n} a step for greedy requests, in the pass's padding rows, "
                "as many as the measured step cost says pay"
            )
        return f"{self.decoder.description}; {drafts}"

    def step(self, seqs: list[RunningSequence]) -> None:
        """Put each sequence's ``token`` in its buffer and sample its next one: one batched pass.

        A greedy sequence's prompt-lookup drafts ride in the rows the pass pads anyway, at the
        positions after its token; the ones the model's own picks confirm are emitted too (``ahead``)
        and their KV kept. A constrained sequence's rows are masked by its grammar one after the other
        (each after the tokens before it), so a draft is confirmed only where the grammar allows it,
        and the matcher advances on confirmed tokens alone.
        """
        drafts = self._drafts(seqs)
        rows = [DecodeRow(seq.buf, seq.token, seq.pos) for seq in seqs]
        for seq, draft in zip(seqs, drafts):
            rows += [DecodeRow(seq.buf, t, seq.pos + 1 + j) for j, t in enumerate(draft)]
        t0 = time.perf_counter()
        logits = self.decoder.step(rows)
        if len(rows) <= self.decoder.group:  # one pass: the products once, each row's attention
            self.step_cost.observe(sum(r.pos + 1 for r in rows), time.perf_counter() - t0)
        at = len(seqs)  # the first draft row
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            sp, grammar = seq.req.sampling, seq.grammar  # a constrained sequence's rows are masked in turn
            token = sample_next(logits[i], sp, seq.generator, grammar)
            confirmed = []
            for j, guess in enumerate(draft):
                if token != guess:
                    break
                confirmed.append(guess)
                token = sample_next(logits[at + j], sp, seq.generator, grammar)
            at += len(draft)
            seq.pos += 1 + len(confirmed)
            seq.buf.length = seq.pos  # a rejected draft's KV is not the sequence's
            seq.ahead, seq.token = confirmed, token
            seq.stats.decode_steps += 1
            seq.stats.draft_tokens += len(draft)
            seq.stats.draft_accepted += len(confirmed)
            if seq.drafter is not None:
                seq.drafter.extend([*confirmed, token])
            if draft:
                seq.draft_width = next_width(seq.draft_width, len(draft), len(confirmed), self.draft_tokens)
                seq.draft_hold.update(len(draft), len(confirmed))

    def _drafts(self, seqs: list[RunningSequence]) -> list[list[int]]:
        """Each sequence's drafts for this step: greedy ones only, in the rows the pass pads anyway,
        never past its token limit, and at most ``draft_tokens`` for the whole step (a draft row's
        attention slows every sequence of the step).

        How many: once the engine has timed passes of different sizes (:class:`StepCost`), as many as
        raise the step's expected tokens per second (:func:`plan_drafts`, from each sequence's recent
        hold rate and what a row of its context costs); a greedy sequence that gets none checks one
        every :data:`PROBE_EVERY` steps, so its hold rate (and the fit) stay current. Before that, each
        sequence's ``draft_width`` (:func:`next_width`).
        """
        most = self.draft_tokens
        free = min((-len(seqs)) % self.decoder.group, most)  # a step checks at most `most` drafts in all
        caps = []  # per sequence, the most drafts it may check (0: none, e.g. a sampled request)
        for seq in seqs:
            k = min(most, free, seq.max_tokens - len(seq.generated) - 1)
            k = k if k > 0 and seq.req.sampling.temperature == 0 else 0
            if k and seq.drafter is None:  # made at the first step, not before the first token
                seq.drafter = PromptLookup([*seq.req.ids.tolist(), *seq.generated])
                seq.draft_width = most
            caps.append(k)
        cost = self.step_cost.fit()
        if cost is None:
            widths = [min(cap, seq.draft_width or most) for seq, cap in zip(seqs, caps)]
        else:
            live = [i for i, cap in enumerate(caps) if cap]
            planned = plan_drafts(
                [DraftCandidate(caps[i], seqs[i].draft_hold.p, seqs[i].pos + 1) for i in live],
                len(seqs),
                sum(seq.pos + 1 for seq in seqs),
                cost,
                free,
            )
            widths = [0] * len(seqs)
            for i, w in zip(live, planned):
                probe = w == 0 and seqs[i].stats.decode_steps % PROBE_EVERY == 0
                widths[i] = 1 if probe else w
        out: list[list[int]] = []
        for seq, k in zip(seqs, widths):
            k = min(k, free)
            draft = seq.drafter.propose(k) if k > 0 else []
            if draft and seq.grammar is not None:  # a draft the grammar forbids is not checked (nor those after it)
                draft = draft[: seq.grammar.allowed(draft)]
            free -= len(draft)
            out.append(draft)
        return out

    def finish(self, seq: RunningSequence) -> Generation:
        """Keep a conversation's turn; the request's result."""
        req = seq.req
        if req.conversation is not None:
            chunk_texts = [s.text for s in seq.plan.segments if s.kind == "chunk"]
            self.conversations.record(
                req.conversation,
                req.ids.tolist() + seq.generated,
                seq.buf,
                chunk_texts,
                prompt_len=req.num_tokens,
                follow=req.follow,
            )
        total = time.perf_counter() - seq.t0
        seq.stats.completion_tokens = len(seq.generated)
        seq.stats.decode_s = total - seq.ttft
        return Generation(seq.text.text, seq.generated, seq.finish, seq.ttft, total, seq.stats)
