"""Chunk KV computed ahead of requests: :meth:`Warming.warm` (a list of documents, as windows queued
like requests) and :meth:`Warming.speculate` (the candidates of a staged search, as speculative work
that gives way to requests: RAGCache's speculative pipelining at chunk level)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from kvrag.config import EngineConfig
from kvrag.engine.reuse.access import AccessTable
from kvrag.engine.reuse.chunks import ChunkComputer, similarity_order, warm_list
from kvrag.engine.reuse.planner import Planner
from kvrag.engine.reuse.segments import PromptTokenizer
from kvrag.engine.reuse.variants import StoredVariants
from kvrag.engine.serving.progress import progress_reporter
from kvrag.engine.serving.speculation import Speculation, Speculations
from kvrag.engine.serving.worker import Pause
from kvrag.engine.store.base import KVStore
from kvrag.engine.types import WarmResult
from kvrag.errors import ContextLengthError, InvalidRequestError

__all__ = ["Warming"]


class Warming:
    """Computes and stores chunk KV outside requests.

    Args:
        config: the engine's settings (``warm_window_tokens``, ``warm_variants``).
        tokenizer: the prompt tokenizer (a chunk is tokenised as it is inside prompts).
        computer: computes chunk KV behind its context.
        store, planner, variants: where chunk KV is kept, its keys, its variants.
        access: CRAFT's chunk-access table (the order warmed chunks were computed in).
        run: ``run(job, tokens)`` runs ``job(pause)`` on the engine thread, queued like a request.
        speculations: the engine's live speculations.
        context_window: most tokens a request may hold.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PromptTokenizer,
        computer: ChunkComputer,
        store: KVStore,
        planner: Planner,
        variants: StoredVariants,
        access: AccessTable,
        run: Callable,
        speculations: Speculations,
        *,
        context_window: int,
    ) -> None:
        self.config, self.tokenizer, self.computer = config, tokenizer, computer
        self.store, self.planner, self.variants, self.access = store, planner, variants, access
        self.run, self.speculations, self.context_window = run, speculations, context_window

    def warm(
        self,
        chunks: list[str],
        *,
        order: str,
        embeddings,
        progress: bool | Callable[[int, int], None],
        namespace: str,
    ) -> WarmResult:
        """:meth:`kvrag.Engine.warm` of validated chunks for tenant ``namespace``."""
        if order not in ("given", "similar"):
            raise InvalidRequestError(f"order must be 'given' or 'similar', got {order!r}")
        if embeddings is not None and order != "similar":
            raise InvalidRequestError("embeddings are used with order='similar' only")
        t0 = time.perf_counter()
        tokenized = [self.tokenizer.tokenize(t) for t in chunks]
        kept = [i for i, ids in enumerate(tokenized) if ids]
        docs, texts = [tokenized[i] for i in kept], [chunks[i] for i in kept]
        self._check_lengths(docs)
        if order == "similar":
            if embeddings is not None and len(embeddings) != len(chunks):
                raise InvalidRequestError(f"embeddings has {len(embeddings)} rows for {len(chunks)} chunks")
            placed = similarity_order(docs, None if embeddings is None else [embeddings[i] for i in kept])
            docs, texts = [docs[i] for i in placed], [texts[i] for i in placed]
        keys = [self.planner.chunk_key(ids, namespace) for ids in docs]
        wanted = self.config.warm_variants_for(order)
        with progress_reporter(progress, "kvrag warm") as report:
            computed, variants = warm_list(
                self.computer,
                self.store,
                docs,
                keys,
                run=self.run,  # bounded: a full queue refuses the window (OverloadedError)
                window_tokens=self._window_tokens(),
                keep=self._keep,
                progress=report,
                reverse=(lambda key, context: self.variants.wants(key, context, wanted)) if wanted > 1 else None,
            )
        self.access.computed(namespace, texts)  # the stream's order: frequency order's ties follow it
        tokens = sum(len(d) for d in docs)
        return WarmResult(computed, len(docs) - computed, tokens, time.perf_counter() - t0, variants=variants)

    def speculate(self, chunks: Sequence[str], *, namespace: str, key: Hashable | None, dynamic: bool) -> Speculation:
        """:meth:`kvrag.Engine.speculate` of validated chunks for tenant ``namespace``."""
        docs = [ids for ids in (self.tokenizer.tokenize(t) for t in chunks) if ids]
        self._check_lengths(docs)
        keys = [self.planner.chunk_key(ids, namespace) for ids in docs]
        missing = sum(len(ids) for ids, k in zip(docs, keys) if not self.store.contains(k))

        def job(handle: Speculation, pause: Pause) -> int:
            def run(window, tokens: int):
                handle.window = (tokens, handle.pauses)
                records = window(pause)
                handle.computed += tokens
                handle.window = None
                return records

            keep = lambda k, record, speculative: self._keep(k, record, True)  # noqa: E731
            computed, _ = warm_list(
                self.computer, self.store, docs, keys, run=run, window_tokens=self._window_tokens(), keep=keep
            )
            return computed

        return self.speculations.start("chunks", key, missing, job, dynamic=dynamic, namespace=namespace)

    def _window_tokens(self) -> int:
        return min(self.config.warm_window_tokens, self.context_window)

    def _check_lengths(self, docs: list[list[int]]) -> None:
        limit = self.computer.max_chunk_tokens(self.context_window)
        for ids in docs:
            if len(ids) > limit:
                raise ContextLengthError(len(ids), limit, "a single chunk behind its context")

    def _keep(self, key, record, speculative: bool) -> None:
        self.variants.keep(key, record, tuple(record.meta.get("context", ())), speculative=speculative)
