"""A request's prefill on the engine thread: plan, settle the budget and the path, run, learn.

:meth:`Prefiller.run` reads top to bottom: the planner looks the prompt's KV up
(:mod:`kvrag.engine.reuse.planner`); a conversation's kept turn is attached; the request's budget
meets the plan (:meth:`~kvrag.engine.reuse.budget.Budget.for_plan`: the other-context rule); the
cost model settles the path (:mod:`kvrag.engine.reuse.paths`); the loading controller may raise the
share (:class:`~kvrag.engine.serving.costs.CostFeedback`); fusion runs the plan
(:func:`~kvrag.engine.reuse.fusion.prefill`); its time teaches the cost model. A cached entry found
damaged while streaming is dropped by the store and the request planned again.

:meth:`Prefiller.start` is what the engine thread runs for a new request (the worker's ``start``):
the prefill and the first token, or the speculation the request adopts; it schedules write-back of
what was computed.
"""

from __future__ import annotations

import logging
import time

import torch

from kvrag.config import EngineConfig
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.grammar import Grammars, sample_next
from kvrag.engine.model.sampling import TextStream, seeded_generator
from kvrag.engine.reuse.budget import Budget
from kvrag.engine.reuse.conversations import Conversations
from kvrag.engine.reuse.fusion import PrefillOptions, PrefillResult, extend, generation_stats, prefill
from kvrag.engine.reuse.planner import Plan, Planner
from kvrag.engine.reuse.segments import PromptTokenizer
from kvrag.engine.serving.costs import CostFeedback
from kvrag.engine.serving.requests import Request
from kvrag.engine.serving.scheduler import Ticket
from kvrag.engine.serving.sequence import RunningSequence
from kvrag.engine.serving.speculation import Speculations
from kvrag.engine.serving.worker import Pause
from kvrag.engine.serving.writeback import WriteBack
from kvrag.engine.store.base import DamagedEntryError
from kvrag.engine.types import CacheLookup, ScoreResult
from kvrag.errors import ContextLengthError, InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["Prefiller"]


class Prefiller:
    """Plans and runs prefills (on the engine thread), and estimates them (on the caller's).

    Args:
        config: the engine's settings.
        adapter: the model.
        planner: what the cache holds of a prompt.
        conversations: kept conversations (a turn's KV attached to the plan, the next turn kept).
        costs: the cost model, the cost profile and the loading controller.
        writeback: what a request computed, stored after its first token.
        speculations: prefills done ahead, adopted by the request they speculated.
        tokenizer: the prompt tokenizer (its ``tokenizer``, the model's, detokenises a request's text).
        grammars: constraints compiled for the tokenizer (a constrained request's first token is masked).
        context_window: most tokens a request may hold.
    """

    def __init__(
        self,
        config: EngineConfig,
        adapter: ModelAdapter,
        planner: Planner,
        conversations: Conversations,
        costs: CostFeedback,
        writeback: WriteBack,
        speculations: Speculations,
        tokenizer: PromptTokenizer,
        grammars: Grammars,
        *,
        context_window: int,
    ) -> None:
        self.config, self.adapter, self.planner, self.conversations = config, adapter, planner, conversations
        self.costs, self.writeback, self.speculations = costs, writeback, speculations
        self.tokenizer, self.grammars, self.context_window = tokenizer, grammars, context_window

    # -- on the engine thread ------------------------------------------------------------------

    def start(self, req: Request, t0: float, pause: Pause) -> RunningSequence:
        """Prefill the request and sample its first token (or take the speculation it adopts); write-back
        of what it computed is scheduled once that token has reached the caller
        (:attr:`RunningSequence.after_first_token`: copying the keys the chunk statistics read and
        queueing the jobs are not on the request's TTFT)."""
        held = self.speculations.take(req.adopt) if req.adopt is not None else None
        if held is not None:
            seq, res = held
            seq.req, seq.t0, seq.ttft = req, t0, time.perf_counter() - t0
            seq.stats.prefill_s = seq.ttft
            self.count_lookups(req)
        else:
            seq, res = self.begin(req, t0, pause)
        plan = seq.plan
        seq.after_first_token = lambda: self.writeback.schedule(plan, res)
        return seq

    def begin(self, req: Request, t0: float, pause: Pause | None) -> tuple[RunningSequence, PrefillResult]:
        """Prefill the request and sample its first token (a speculative one's lookups are looks)."""
        n = req.num_tokens
        sp = req.sampling
        max_tokens = min(sp.max_new_tokens, self.context_window - n)
        plan, budget, res = self.run(req, capacity=n + max_tokens, pause=pause, quiet=req.speculative)
        logits = self.adapter.logits(res.last_hidden)[0]
        generator = seeded_generator(sp)
        grammar = self.grammars.matcher(sp.constraint) if sp.constraint is not None else None
        token = sample_next(logits, sp, generator, grammar)
        ttft = time.perf_counter() - t0
        stats = generation_stats(plan, budget, res, self.adapter.n_layers, ttft)
        stats.conversation_spans = list(req.conversation_spans or [])
        stats.conversation_tokens = sum(b - a for a, b in stats.conversation_spans)
        stats.deduplicated_chunks = req.deduplicated
        seq = RunningSequence(
            req=req,
            plan=plan,
            buf=res.buf,
            pos=n,
            token=token,
            max_tokens=max_tokens,
            text=TextStream(self.tokenizer.tokenizer, sp.stop),
            generator=generator,
            grammar=grammar,
            stats=stats,
            t0=t0,
            ttft=ttft,
        )
        return seq, res

    def run(
        self, req: Request, *, capacity: int, pause: Pause | None = None, quiet: bool = False
    ) -> tuple[Plan, Budget, PrefillResult]:
        """Plan and run a request's prefill; a damaged cached entry re-plans it.

        The plan's path is settled by the cost model once it holds everything it could reuse (the
        conversation's turn included): a request whose reuse cannot win runs as a full prefill (or
        reuses exact KV only), and still writes back what it computes. Returns the plan, the budget
        it ran with and the prefill's result."""
        use_prefix = self.config.prefix_cache and req.mode != "full"
        attempts, limit = 0, 1
        while True:
            # each failed attempt drops the damaged entry it met, so a request is planned again at
            # most once per cached entry it uses; past that (entries keep failing) it runs in full
            mode = req.mode if attempts < limit else "full"
            plan = self.planner.plan(
                req.segments,
                mode=mode,
                full=req.budget.reuses_nothing(mode),
                use_prefix=use_prefix and mode != "full",
                namespace=req.namespace,
                quiet=quiet,
            )
            if req.conversation is not None and attempts == 0:  # the kept turn this prompt continues, if any
                req.follow = self.conversations.follow(req.conversation, plan.ids)
            spans = self.conversations.attach(plan, req.follow) if req.follow is not None and not plan.is_full else []
            budget = req.budget.for_plan(plan)
            self.costs.paths.settle(plan, budget, price=req.priced)
            blended = {start for start, _ in plan.chunk_records}  # what of the turn's KV the chosen path still uses
            req.conversation_spans = [(a, b) for a, b in spans if b <= plan.prefix_len or a in blended]
            if attempts == 0:
                limit = len(plan.cached_spans()) + 1
            attempts += 1
            budget = self.costs.loading_budget(plan, budget)
            options = self._options(plan, budget, use_prefix and mode != "full")
            t0 = time.perf_counter()
            try:
                res = prefill(self.adapter, plan, capacity, budget=budget, options=options, pause=pause)
            except DamagedEntryError:  # found while streaming; the store dropped it: plan again
                if mode == "full":
                    raise
                log.debug("kvrag: a cached entry was damaged; re-planning the request", exc_info=True)
                continue
            if res.buf.k.is_cuda:  # CUDA kernels run asynchronously: time the prefill's work, not its launches
                torch.cuda.synchronize(res.buf.k.device)
            self.costs.observe(plan, budget, res.trace.token_layers, time.perf_counter() - t0, res.recomputed_tokens)
            return plan, budget, res

    def _options(self, plan: Plan, budget: Budget, use_prefix: bool) -> PrefillOptions:
        """What the prefill of ``plan`` captures besides computing: prefix mode keeps the whole exact
        prompt (as vLLM does); the other modes keep the text before the first chunk (system prompt,
        instructions), which every request repeats; and the chunks write-back wants. Every mode keeps
        the prompt's tail when it computes the whole prompt exactly, with its last hidden state: the
        same prompt again computes nothing."""
        capture_end = 0
        if use_prefix:
            capture_end = plan.exact_end() if plan.mode == "prefix" else min(plan.exact_end(), plan.first_chunk_start())
            capture_end = min(capture_end, plan.tail_start())  # the tail is kept apart (Plan.tail)
        return PrefillOptions.from_config(
            self.config,
            self.adapter.n_layers,
            budget.selection,
            capture_end=capture_end,
            capture_chunks=self.writeback.captures(plan),
            keep_recomputed=self.writeback.keeps_recomputed(plan),
            capture_tail=plan.tail_digest is not None,  # set by the planner only where the prefix cache is used
        )

    def score(self, req: Request, continuation: list[int], t0: float, pause: Pause | None) -> ScoreResult:
        """Prefill ``req`` and teacher-force ``continuation``: each token's log-probability (the request
        made at ``t0``)."""
        n = req.num_tokens
        plan, budget, res = self.run(req, capacity=n + len(continuation), pause=pause)
        logits = [self.adapter.logits(res.last_hidden)]
        if len(continuation) > 1:
            logits.append(extend(self.adapter, res.buf, torch.tensor(continuation[:-1]), n, pause=pause))
        logp = torch.log_softmax(torch.cat(logits), dim=-1)
        per_token = logp[torch.arange(len(continuation)), torch.tensor(continuation)].tolist()
        stats = generation_stats(plan, budget, res, self.adapter.n_layers, time.perf_counter() - t0)
        return ScoreResult(float(sum(per_token)), len(continuation), per_token, stats)

    def continuation(self, req: Request, text: str) -> list[int]:
        """The token ids of a continuation to score after ``req``'s prompt (one clear error: empty, or
        past the context window with the prompt)."""
        ids = self.tokenizer.tokenize(text)
        if not ids:
            raise InvalidRequestError("continuation is empty")
        if req.num_tokens + len(ids) > self.context_window:
            raise ContextLengthError(req.num_tokens + len(ids), self.context_window, "prompt + continuation")
        return ids

    def count_lookups(self, req: Request) -> None:
        """An adopted speculation's lookups were looks: make them again as the request's uses (hits
        counted, eviction ranks and variant reuses updated), as if it had planned them itself."""
        self.planner.plan(
            req.segments,
            mode=req.mode,
            full=req.budget.reuses_nothing(req.mode),
            use_prefix=self.config.prefix_cache and req.mode != "full",
            namespace=req.namespace,
        )

    # -- on the caller's thread: key lookups only ------------------------------------------------

    def ticket(self, req: Request) -> Ticket:
        """A request's place in the queue: its prompt tokens, and how many of them the cache holds.

        Estimated by key lookups only (nothing loaded); the plan made when it starts may differ (an
        entry evicted meanwhile).
        """
        n = req.num_tokens
        if req.budget.reuses_nothing(req.mode):
            return Ticket(tokens=n, compute=n)
        prefix = self._prefix_length(req)
        # chunk KV is looked up only for the modes that reuse it (a lookup may ask a remote tier)
        chunks = sum(len(s.ids) for s in self._stored_chunks(req, prefix)) if req.mode in ("blend", "reuse") else 0
        cached = min(n - 1, prefix + chunks)
        return Ticket(tokens=n, cached=cached, compute=n - cached + round(req.budget.share * chunks))

    def lookup(self, req: Request) -> CacheLookup:
        """Key lookups only: the exact prefix in the prefix cache, then the chunks stored past it."""
        prefix = self._prefix_length(req)
        stored = self._stored_chunks(req, prefix)
        return CacheLookup(
            prompt_tokens=req.num_tokens,
            prefix_tokens=prefix,
            chunks=sum(s.kind == "chunk" for s in req.segments),
            chunks_stored=len(stored),
            chunk_tokens_stored=sum(len(s.ids) for s in stored),
        )

    def _prefix_length(self, req: Request) -> int:
        """Leading tokens of the prompt held exactly in the prefix cache (key lookups only)."""
        if not self.config.prefix_cache:
            return 0
        return self.planner.prefix_cache.cached_length(req.ids.tolist(), req.num_tokens - 1, namespace=req.namespace)

    def _stored_chunks(self, req: Request, prefix: int) -> list:
        """The prompt's chunks past ``prefix`` of which the store holds a variant (key lookups only)."""
        planner = self.planner
        return [
            s
            for s in req.segments
            if s.kind == "chunk"
            and s.start >= prefix
            and planner.variants.holds(planner.chunk_key(s.ids, req.namespace))
        ]
