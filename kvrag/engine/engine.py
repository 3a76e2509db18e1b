"""The :class:`Engine` facade: the one public API that tests, benchmarks and integrations use."""

from __future__ import annotations

import atexit
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch
from typing_extensions import Unpack

from kvrag.config import AUTO, EngineConfig, check_quality
from kvrag.engine.model import loading
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.batch import Decoder, DecodeRow
from kvrag.engine.model.bundled import BUNDLED, find_bundled
from kvrag.engine.model.dtypes import DtypeChoice, weights_dtype
from kvrag.engine.model.host import on_own_thread, tune_malloc
from kvrag.engine.model.sampling import SamplingParams, TextStream, sample, seeded_generator
from kvrag.engine.reuse import calibration
from kvrag.engine.reuse.access import AccessStats, AccessTable, check_chunk_order
from kvrag.engine.reuse.calibration import CalibrationQuestion, CalibrationResult, QualityCalibration
from kvrag.engine.reuse.chunks import ChunkComputer, context_label, similarity_order, warm_list
from kvrag.engine.reuse.conversations import Conversations, check_conversation_id
from kvrag.engine.reuse.documents import DocumentFinder
from kvrag.engine.reuse.fusion import PrefillOptions, PrefillResult, extend, generation_stats, prefill
from kvrag.engine.reuse.gate import load_gate
from kvrag.engine.reuse.planner import Plan, Planner, reuses_nothing
from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.segments import PromptTokenizer
from kvrag.engine.reuse.selection import auto_kind, configured_params
from kvrag.engine.reuse.selection import check_selection as check_selection_name
from kvrag.engine.reuse.variants import StoredVariants, VariantIndex
from kvrag.engine.serving.costs import CostFeedback
from kvrag.engine.serving.drafts import (
    PROBE_EVERY,
    DraftCandidate,
    PromptLookup,
    StepCost,
    next_width,
    plan_drafts,
)
from kvrag.engine.serving.progress import progress_reporter
from kvrag.engine.serving.requests import (
    Request,
    RequestArgs,
    check_chunks,
    check_dedup,
    check_mode,
    check_namespace,
    check_request_args,
    check_selection,
    check_text,
    request_parts,
)
from kvrag.engine.serving.scheduler import Scheduler, Ticket
from kvrag.engine.serving.sequence import RunningSequence
from kvrag.engine.serving.speculation import Speculation, Speculations
from kvrag.engine.serving.worker import Pause, StreamJob, Worker
from kvrag.engine.serving.writeback import WriteBack
from kvrag.engine.store.base import DamagedEntryError, KVStore
from kvrag.engine.store.policy import check_policy
from kvrag.engine.store.tiered import build_store
from kvrag.engine.types import CacheLookup, EngineInfo, Generation, GenerationStream, ScoreResult, WarmResult
from kvrag.errors import ContextLengthError, InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["Engine", "get_engine", "drop_engines"]

#: Engines not closed yet: at interpreter exit their threads are let finish first (see _quiesce_at_exit).
_LIVE: weakref.WeakSet = weakref.WeakSet()

#: Seconds an engine may take at interpreter exit to finish what it runs.
EXIT_WAIT_S = 60.0


@atexit.register
def _quiesce_at_exit() -> None:
    """Let live engines' threads end before the interpreter tears down.

    The engine and write-back threads are daemons; one still inside a torch op while the
    interpreter finalises aborts the process ("terminate called without an active exception",
    exit code 134): a script whose last request had just returned could die that way. Refreshes
    not started are dropped; running work and write-back finish (bounded by ``EXIT_WAIT_S``).
    """
    for engine in list(_LIVE):
        try:
            engine._quiesce(EXIT_WAIT_S)
        except Exception:  # exiting anyway: never fail the interpreter's shutdown
            log.debug("kvrag: an engine did not finish at exit", exc_info=True)


class Engine:
    """An embedded PyTorch engine that reuses the KV cache of document chunks.

    Build it with :meth:`from_pretrained` (the bundled SmolLM2-135M-Instruct by default) or
    :meth:`from_model` (transformers objects already in memory).

    Calls are thread-safe, and any number of threads may call at once. One engine thread runs all
    model compute (:mod:`kvrag.engine.serving.worker`): a call validates its request on the caller's
    thread, queues it (cache-aware order, bounded: a full queue raises
    :class:`~kvrag.errors.OverloadedError`; :mod:`kvrag.engine.serving.scheduler`) and waits for its
    result. Running requests decode together, one batched step per token
    (:mod:`kvrag.engine.model.batch`), and a long prefill (or a ``warm()`` window) runs in slices
    between those steps. A request's output does not depend on what else runs.
    """

    def __init__(
        self,
        hf_model,
        tokenizer,
        config: EngineConfig,
        *,
        weights_digest: str,
        name: str = "",
        store: KVStore | None = None,
        compute_dtype: DtypeChoice | None = None,
    ) -> None:
        _check_config(config)
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model_name = name or str(getattr(hf_model.config, "name_or_path", "") or "model")
        self.weights_digest = weights_digest
        self.adapter = ModelAdapter(hf_model)
        config = _check_device(config, self.adapter.device)
        # the weights' dtype is the compute dtype (``compute_dtype``: what the loader resolved, and
        # why; else the weights' own, checked against ``config.dtype``); ``config.dtype`` names it from here on
        weights = weights_dtype(self.adapter.dtype, config.dtype if compute_dtype is None else compute_dtype.name)
        #: the compute dtype and why (``dtype="auto"``: what the hardware computes natively)
        self.compute_dtype = weights if compute_dtype is None else compute_dtype
        self._drafts_given = config.draft_tokens is not None
        self.config = config = config.replace(
            dtype=self.compute_dtype.name, draft_tokens=_draft_tokens(config.draft_tokens, self.adapter.device)
        )
        log.info("kvrag: %s computes in %s (%s)", self.model_name, self.compute_dtype.name, self.compute_dtype.why)
        #: what the process's allocator does with a prefill's temporaries (:mod:`kvrag.engine.model.host`)
        self.malloc = (
            tune_malloc(config.tune_malloc)
            if self.adapter.device.type == "cpu"
            else f"unchanged (computes on {self.adapter.device.type})"
        )
        self.fingerprint = loading.fingerprint_model(weights_digest, tokenizer, self.compute_dtype.name)
        self.store: KVStore = store if store is not None else build_store(config)
        self.costs = CostFeedback(
            self.store, self.adapter.n_layers, config.loading_controller, config.cost_model, self.adapter.device.type
        )
        window = self.adapter.max_positions
        self.context_window = min(window, config.max_context) if config.max_context else window
        bos = tokenizer.bos_token_id
        sink = bos if bos is not None else tokenizer.eos_token_id
        self.sink_ids = [int(sink)] if sink is not None else []
        # blend/reuse only where placement and ratio 1.0 are proven exact for these weights (cached)
        self.gate = load_gate(
            self.adapter, hf_model, self.sink_ids, fingerprint=self.fingerprint, cache_dir=config.resolved_cache_dir()
        )
        self.prompt_tokenizer = PromptTokenizer(tokenizer)
        kv_shape = (self.adapter.n_layers, self.adapter.n_kv_heads, self.adapter.head_dim)
        self.variants = StoredVariants(self.store, VariantIndex(config.max_variants), kv_shape)
        self.planner = Planner(
            self.variants,
            PrefixCache(self.store, self.fingerprint, config.prefix_block_tokens),
            self.costs.paths,
            fingerprint=self.fingerprint,
            namespace=config.namespace,
            context_label=context_label(config.chunk_context, self.sink_ids),
            kv_shape=kv_shape,
        )
        self.chunk_computer = ChunkComputer(
            self.adapter, self.prompt_tokenizer.tokenize, self.sink_ids, config.chunk_context, self.context_window
        )
        self.eos_ids = loading.eos_ids(tokenizer, hf_model)
        #: the decode step (packed weights on a CPU where they check out: Engine.info().decode)
        self.decoder = Decoder(self.adapter, config.decode_group)
        self.step_cost = StepCost()  # a decode pass's seconds, fitted as the engine decodes (drafts plan with it)
        log.info("kvrag: decode %s", self.decoder.description)
        self.documents = DocumentFinder()
        self.conversations = Conversations(self.adapter, config.max_conversations)
        calibrated = calibration.load(config.resolved_cache_dir(), self.fingerprint, self._probe_key())
        #: the probe deviation from which ``recompute_ratio="auto"`` recomputes a block (None: unknown)
        self.auto_threshold = (
            config.auto_threshold if config.auto_threshold is not None else calibrated.get("threshold")
        )
        #: Cache-Craft's alpha for ``selection="craft"`` with ``"auto"``
        self.auto_alpha = calibrated.get("alpha", 1.0)
        #: as ``kvrag calibrate`` measured this model: whether foreign KV runs ``foreign_selection``
        #: (None: not calibrated, it does), and the share of a foreign chunk per quality (empty: the
        #: built-in shares, ``EngineConfig.quality``)
        self.foreign_calibrated, self.foreign_shares = (
            calibration.load_shares(config.resolved_cache_dir(), self.fingerprint, config.foreign_selection)
            if config.foreign_selection
            else (None, {})
        )
        self.scheduler = Scheduler(
            max_running=config.max_running,
            max_queued=config.max_queued,
            max_queued_tokens=config.max_queued_tokens,
            starvation_window=config.starvation_window,
        )
        #: torch intra-op threads of the engine thread: ``num_threads``, else torch's count when the engine was built
        self.threads = config.num_threads or torch.get_num_threads()
        self._worker = Worker(
            scheduler=self.scheduler,
            start=self._start,
            step=self._decode_step,
            finish=self._finish,
            eos_ids=self.eos_ids,
            slice_s=config.prefill_slice_s,
            setup=lambda: torch.set_num_threads(self.threads),  # whatever the caller's threads set since
        )
        #: CRAFT's chunk-access table: recent retrievals per namespace (frequency order, promotion)
        self.access = AccessTable(config.chunk_access_window, config.promotion_threshold)
        self.writeback = WriteBack(
            config,
            self.store,
            self.planner,
            self.variants,
            self.chunk_computer,
            run=self._run_internal,
            worker=self._worker,
            promoted=self.access.promoted,
            stored=self.access.stored,
            computed=self.access.computed,
        )
        #: live speculations (RAGCache's speculative pipelining: :meth:`speculate`, :meth:`speculate_request`)
        self.speculations = Speculations(self._worker, self.adapter.n_layers)
        self._closed = False
        _LIVE.add(self)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, config: EngineConfig | None = None, store: KVStore | None = None, **overrides
    ) -> Engine:
        """Load a model and build an engine.

        Args:
            model: ``None`` for the bundled SmolLM2-135M-Instruct, a local Hugging Face model
                directory, or a local ``.gguf`` file. Nothing is downloaded.
            config: an :class:`EngineConfig`; keyword ``overrides`` replace its fields.
            store: a KV store to use instead of a new in-memory one.
        """
        config = (config or EngineConfig()).replace(**overrides)
        if model is not None:
            config = config.replace(model=str(model))
        _check_config(config)  # before the model loads: a bad name fails at once

        def build() -> Engine:
            loaded = loading.load_model(config.model, config.dtype, config.device, config.resolved_cache_dir())
            return cls(
                loaded.hf_model,
                loaded.tokenizer,
                config,
                weights_digest=loaded.weights_digest,
                name=loaded.name,
                store=store,
                compute_dtype=loaded.dtype,
            )

        return _built(build, config)

    @classmethod
    def from_model(
        cls, hf_model, tokenizer, *, config: EngineConfig | None = None, store: KVStore | None = None, **overrides
    ) -> Engine:
        """Build an engine over a transformers model and tokenizer already in memory.

        The engine computes in the model's own dtype (it never converts a model it is handed):
        ``dtype="auto"`` (the default) accepts it, an explicit ``dtype`` must be the weights'.
        """
        config = (config or EngineConfig()).replace(**overrides)
        _check_config(config)
        loading.check_architecture(hf_model.config)
        hf_model.eval()
        return _built(
            lambda: cls(hf_model, tokenizer, config, weights_digest=loading.state_dict_digest(hf_model), store=store),
            config,
        )

    # -- public API -------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """Tokens of a text on its own."""
        return len(self.prompt_tokenizer.tokenize(check_text("text", text)))

    def register(self, texts: Sequence[str]) -> list[str]:
        """Record document texts so that prompts given as one string are split at them.

        Returns the texts' content ids. Texts shorter than 32 characters are not worth caching
        and are not registered.
        """
        return self.documents.register(check_chunks(texts))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages (``[{"role", "content"}]``) with the model's own chat template."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def split_prompt(self, prompt: str) -> list[tuple[str, str]]:
        """The prompt as ``(kind, text)`` parts, ``chunk`` where a registered text occurs."""
        return self.documents.split(check_text("prompt", prompt))

    # -- CRAFT's chunk-access table (kvrag.engine.reuse.access) ---------------------------------------

    def record_retrieval(
        self, documents: Sequence[str | Sequence[str]], *, order: str = "retrieval", namespace: str | None = None
    ) -> list[int]:
        """Count one retrieval of ``documents`` in the tenant's chunk-access table; their prompt order.

        Call it once per retrieval (the retriever wrappers and node postprocessors do), not per LLM
        call; speculative or repeated work must not call it. Each document is its text, or the
        texts of the forms it may take in a prompt (all counted, as one document).

        Args:
            documents: the retrieved documents, in retrieval order.
            order: ``"retrieval"`` (the given order) or ``"frequency"`` (CRAFT: most retrieved in the
                window first, after the longest chunk sequence the tenant holds exactly; ties in retrieval
                order, or behind a held sequence in the order their KV was first computed:
                :meth:`kvrag.engine.reuse.access.AccessTable.order`).
            namespace: the tenant (default ``config.namespace``).

        Returns:
            Indices into ``documents``, in the order to put them in the prompt.
        """
        order = check_chunk_order(order)
        namespace = check_namespace(self.config, namespace)
        if isinstance(documents, (str, bytes)):
            raise InvalidRequestError("documents must be a list of texts, not a single string")
        documents = list(documents)
        try:
            ranked = self.access.order(namespace, documents, order)
            self.access.record(namespace, documents)
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from None
        return ranked

    def chunk_access(self, namespace: str | None = None) -> AccessStats:
        """The tenant's chunk-access table now: window, retrievals counted, chunks, promoted, top counts."""
        return self.access.stats(check_namespace(self.config, namespace))

    def _order_chunks(self, chunks, order: str | None, args: dict) -> tuple[list[str] | None, list[str]]:
        """``chunks`` in the order asked for, and the retrieval to count (none without chunks).

        A later turn of a conversation keeps the given order (its history would be recomputed).
        """
        order = check_chunk_order("retrieval" if order is None else order)
        if args.get("prompt") is not None:
            if order != "retrieval":
                raise InvalidRequestError(
                    "chunk_order orders chunks=; a prompt given as one string is used as it is (order the "
                    "documents before rendering it: a retriever wrapper's order='frequency')"
                )
            return chunks, []
        chunks = check_chunks(chunks)
        if order == "retrieval" or len(chunks) < 2:
            return chunks, chunks
        namespace = check_namespace(self.config, args.get("namespace"))
        conversation = check_conversation_id(args.get("conversation_id"))
        if conversation is not None and self._conversation_key(conversation, namespace) in self.conversations:
            return chunks, chunks
        return [chunks[i] for i in self.access.order(namespace, chunks, order)], chunks

    def warm(
        self,
        chunks: Sequence[str],
        *,
        order: str = "given",
        embeddings=None,
        progress: bool | Callable[[int, int], None] = False,
        namespace: str | None = None,
    ) -> WarmResult:
        """Precompute and store the KV of chunks that are not cached yet (for tenant ``namespace``).

        With ``chunk_context="neighbor"`` (default) the list is computed as one stream (windows of
        up to ``config.warm_window_tokens``; a window is skipped when all its chunks are cached),
        each chunk behind the documents before it, the first behind the list's last ones: closer to
        how they will appear inside prompts. With ``config.warm_variants=2`` (the default for
        ``order="similar"``) the list is computed again in reverse order, and each chunk keeps a
        second variant, behind the documents after it; a request uses the one whose context it
        shares more (Cache-Craft's CFO). Each window is
        one job for the engine thread, queued like a request (running streams go on decoding while
        it computes; a full queue raises :class:`~kvrag.errors.OverloadedError`, the windows
        computed before stay stored). With ``"sink"`` each chunk is computed alone behind the
        attention-sink token (CacheBlend).

        Args:
            chunks: document texts.
            order: ``"given"`` computes the list in its order: give the passages you expect to be
                retrieved together, in retrieval order. ``"similar"`` (for a whole corpus) first puts
                each passage next to the ones most like it, so its KV is computed in the company it
                will keep in prompts (FusionRAG's offline step;
                see :func:`~kvrag.engine.reuse.chunks.similarity_order`).
            embeddings: [n, d] vectors of ``chunks`` for ``order="similar"`` (the retriever's own);
                default a lexical similarity.
            progress: show a progress bar (tqdm when installed, else log lines), or a callback
                ``progress(windows done, windows)``.
            namespace: the tenant whose cache is warmed (default ``config.namespace``).
        """
        self._check_open()
        chunks = check_chunks(chunks)
        namespace = check_namespace(self.config, namespace)
        if order not in ("given", "similar"):
            raise InvalidRequestError(f"order must be 'given' or 'similar', got {order!r}")
        if embeddings is not None and order != "similar":
            raise InvalidRequestError("embeddings are used with order='similar' only")
        t0 = time.perf_counter()
        tokenized = [self.prompt_tokenizer.tokenize(t) for t in chunks]
        kept = [i for i, ids in enumerate(tokenized) if ids]
        docs = [tokenized[i] for i in kept]
        texts = [chunks[i] for i in kept]
        limit = self.chunk_computer.max_chunk_tokens(self.context_window)
        for ids in docs:
            if len(ids) > limit:
                raise ContextLengthError(len(ids), limit, "a single chunk behind its context")
        if order == "similar":
            if embeddings is not None and len(embeddings) != len(chunks):
                raise InvalidRequestError(f"embeddings has {len(embeddings)} rows for {len(chunks)} chunks")
            vectors = None if embeddings is None else [embeddings[i] for i in kept]
            placed = similarity_order(docs, vectors)
            docs, texts = [docs[i] for i in placed], [texts[i] for i in placed]
        keys = [self.planner.chunk_key(ids, namespace) for ids in docs]
        wanted = self.config.warm_variants_for(order)
        with progress_reporter(progress, "kvrag warm") as report:
            computed, variants = warm_list(
                self.chunk_computer,
                self.store,
                docs,
                keys,
                run=self._run_job,  # bounded: a full queue refuses the window (OverloadedError)
                window_tokens=min(self.config.warm_window_tokens, self.context_window),
                keep=lambda key, record, speculative: self.variants.keep(
                    key, record, tuple(record.meta.get("context", ())), speculative=speculative
                ),
                progress=report,
                reverse=(lambda key, context: self.variants.wants(key, context, wanted)) if wanted > 1 else None,
            )
        self.access.computed(namespace, texts)  # the stream's order: frequency order's ties follow it
        return WarmResult(
            computed, len(docs) - computed, sum(len(d) for d in docs), time.perf_counter() - t0, variants=variants
        )

    def generate(
        self, chunks: Sequence[str] | None = None, prefix: str = "", suffix: str = "", **request: Unpack[RequestArgs]
    ) -> Generation:
        """Generate a completion for ``prefix + chunks + suffix``.

        Args:
            chunks: document texts, in prompt order; their KV is reused when cached.
            prefix: text before the chunks (system prompt, instructions, chat template head).
            suffix: text after the chunks (the question, the chat template's assistant header).
            **request: the :class:`~kvrag.engine.serving.requests.RequestArgs` — ``prompt`` (the whole
                prompt as one string instead), ``sampling`` or its fields (``max_new_tokens``,
                ``temperature``, ``top_p``, ``stop``, ``seed``), ``mode``, ``recompute_ratio``,
                ``selection``, ``conversation_id``, ``dedup``, ``namespace``, ``chunk_order``.

        ``chunks`` are one retrieval: they are counted once in the namespace's chunk-access table
        (:meth:`record_retrieval`). ``chunk_order="frequency"`` puts them in CRAFT's order first
        (the longest chunk sequence held exactly first, then most retrieved lately, ties as
        :meth:`record_retrieval` says), except in a later turn of a
        conversation, whose kept history would otherwise be recomputed; ``"retrieval"`` (default)
        keeps the given order.
        """
        stream = self.stream(chunks, prefix, suffix, **request)
        for _ in stream:
            pass
        assert stream.generation is not None
        return stream.generation

    def stream(
        self, chunks: Sequence[str] | None = None, prefix: str = "", suffix: str = "", **request: Unpack[RequestArgs]
    ) -> GenerationStream:
        """Like :meth:`generate`, but yields text pieces as they are decoded.

        The request is validated and queued before this returns (a full queue raises
        :class:`~kvrag.errors.OverloadedError`); ``.generation`` holds the result once the stream is
        exhausted. Closing the stream early cancels the request and frees its KV. Its TTFT counts
        from this call (segmenting and tokenising the prompt included).
        """
        t0 = time.perf_counter()
        args = check_request_args(request)
        chunks, retrieved = self._order_chunks(chunks, args.pop("chunk_order", None), args)
        req = self._request(chunks=chunks, prefix=prefix, suffix=suffix, **args)
        if retrieved:  # a valid request's chunks are one retrieval: counted once, after validation
            self.access.record(req.namespace, retrieved)
        req.adopt = self.speculations.adopt(_signature(req)) if req.conversation is None else None
        if req.adopt is not None:  # its prefill is done (or running): it starts before anything that computes
            n = int(req.ids.shape[0])
            ticket = Ticket(tokens=n, cached=n - 1, compute=1)
        else:
            ticket = self._ticket(req)
        return GenerationStream(self._worker.stream(ticket, StreamJob(req, t0)))

    # -- speculation: RAGCache's speculative pipelining (serving.speculation) --------------------------

    def speculate(
        self,
        chunks: Sequence[str],
        *,
        namespace: str | None = None,
        key: Hashable | None = None,
        dynamic: bool = True,
    ) -> Speculation:
        """Compute the KV of the candidate chunks that the cache does not hold, while the search runs.

        Chunk-level speculation: call it with each changed candidate list of a staged search
        (:func:`~kvrag.integrations.staged_search.staged_search`). The chunks are computed as in
        :meth:`warm` (``order="given"``), as speculative background work: it starts only when no
        request waits and stops at its next pause when one arrives. What it computes is kept as
        speculative store entries (only free room, evicted first until a request uses them); a
        chunk finished stays stored whatever the search decides.

        Args:
            chunks: the candidate texts, in retrieval order.
            namespace: the tenant (default ``config.namespace``).
            key: the caller's request key: a newer speculation of the same key cancels this one
                (Algorithm 2: the list changed). ``None``: never replaced.
            dynamic: ``False`` queues it as ordinary work that never gives way (the always-speculate
                baseline of the benchmarks).

        Returns:
            A :class:`~kvrag.engine.serving.speculation.Speculation` (``cancel()``, ``wait()``,
            ``state``, ``result``: chunks kept).
        """
        self._check_open()
        chunks = check_chunks(chunks)
        namespace = check_namespace(self.config, namespace)
        docs = [ids for ids in (self.prompt_tokenizer.tokenize(t) for t in chunks) if ids]
        limit = self.chunk_computer.max_chunk_tokens(self.context_window)
        for ids in docs:
            if len(ids) > limit:
                raise ContextLengthError(len(ids), limit, "a single chunk behind its context")
        keys = [self.planner.chunk_key(ids, namespace) for ids in docs]
        missing = sum(len(ids) for ids, k in zip(docs, keys) if not self.store.contains(k))

        def job(handle: Speculation, pause: Pause) -> int:
            def run(window, tokens: int):
                handle.window = (tokens, handle.pauses)
                records = window(pause)
                handle.computed += tokens
                handle.window = None
                return records

            computed, _ = warm_list(
                self.chunk_computer,
                self.store,
                docs,
                keys,
                run=run,
                window_tokens=min(self.config.warm_window_tokens, self.context_window),
                keep=lambda k, record, speculative: self.variants.keep(
                    k, record, tuple(record.meta.get("context", ())), speculative=True
                ),
            )
            return computed

        return self.speculations.start("chunks", key, missing, job, dynamic=dynamic)

    def speculate_request(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        key: Hashable | None = None,
        dynamic: bool = True,
        **request: Unpack[RequestArgs],
    ) -> Speculation:
        """Prefill a request the search will probably end in, before it ends (prompt-level speculation).

        Takes the request as :meth:`stream` does. Its prefill runs as speculative work (only when no
        request waits, stopped at its next pause when one arrives or when it is cancelled), its
        first token is sampled, and its KV is held. A later :meth:`stream` or :meth:`generate` of
        the identical request (same prompt tokens, mode, ratio, selection, sampling and tenant)
        adopts it: its prefill is not run again, and its output is the one it would have computed.
        Any other request runs afresh. Its lookups are looks, and its write-back waits for its
        adoption: a speculation that loses leaves the cache as it found it.

        Args:
            key: the caller's request key: a newer speculation of the same key cancels this one.
            dynamic: ``False`` queues it as ordinary work that never gives way (the baseline).

        Raises:
            InvalidRequestError: a bad request, or a ``conversation_id`` (conversations are not speculated).
        """
        args = check_request_args(request)
        if args.get("conversation_id") is not None:
            raise InvalidRequestError("a conversation's turn is not speculated: leave out conversation_id")
        chunks, _ = self._order_chunks(chunks, args.pop("chunk_order", None), args)  # a speculation counts nothing
        req = self._request(chunks=chunks, prefix=prefix, suffix=suffix, **args)
        req.speculative = True
        tokens = self._ticket(req).compute

        def job(handle: Speculation, pause: Pause):
            return self._begin(req, time.perf_counter(), pause)

        return self.speculations.start("prompt", key, tokens, job, signature=_signature(req), dynamic=dynamic)

    def end_conversation(self, conversation_id: str, *, namespace: str | None = None) -> bool:
        """Forget a conversation's kept KV and chunk set; False if it was not live."""
        key = self._conversation_key(check_conversation_id(conversation_id), check_namespace(self.config, namespace))
        return self.conversations.end(key)

    def score(
        self,
        continuation: str,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        mode: str | None = None,
        recompute_ratio: float | None = None,
        selection: str | None = None,
        chunk_order: str | None = None,
    ) -> ScoreResult:
        """Log-likelihood of ``continuation`` right after the prompt, under the chosen prefill mode.

        ``chunk_order`` orders ``chunks`` as :meth:`generate` would (scoring counts no retrieval).
        """
        cont = check_text("continuation", continuation)
        chunks, _ = self._order_chunks(chunks, chunk_order, {"prompt": prompt})
        req = self._request(
            chunks=chunks,
            prefix=prefix,
            suffix=suffix,
            prompt=prompt,
            sampling=SamplingParams(max_new_tokens=0, temperature=0.0),
            mode=mode,
            recompute_ratio=recompute_ratio,
            selection=selection,
        )
        return self._score(req, cont)

    def _score(self, req: Request, continuation: str, *, internal: bool = False) -> ScoreResult:
        """:meth:`score` of a built request, on the engine thread (``internal``: never refused)."""
        cont_ids = self.prompt_tokenizer.tokenize(continuation)
        if not cont_ids:
            raise InvalidRequestError("continuation is empty")
        n = int(req.ids.shape[0])
        if n + len(cont_ids) > self.context_window:
            raise ContextLengthError(n + len(cont_ids), self.context_window, "prompt + continuation")
        t0 = time.perf_counter()

        def run(pause: Pause):
            plan, res = self._prefill(req, capacity=n + len(cont_ids), pause=pause)
            logits = [self.adapter.logits(res.last_hidden)]
            if len(cont_ids) > 1:
                logits.append(extend(self.adapter, res.buf, torch.tensor(cont_ids[:-1]), n, pause=pause))
            logp = torch.log_softmax(torch.cat(logits), dim=-1)
            return plan, res, logp[torch.arange(len(cont_ids)), torch.tensor(cont_ids)].tolist()

        tokens = n + len(cont_ids)
        if internal:
            plan, res, per_token = self._run_internal(run, tokens)
        else:
            plan, res, per_token = self._worker.call(self._ticket(req), run)
        stats = generation_stats(plan, res, self.adapter.n_layers, time.perf_counter() - t0)
        return ScoreResult(float(sum(per_token)), len(cont_ids), per_token, stats)

    def lookup(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        namespace: str | None = None,
    ) -> CacheLookup:
        """How much of this prompt the cache holds now, without loading or changing anything.

        Key lookups only (the prefix cache, then each chunk's key), so it is cheap and never counts
        as a hit or a use; a request made next may still find less (an entry evicted or damaged in
        between). Takes the prompt as :meth:`generate` does.
        """
        req = self._request(
            chunks=chunks,
            prefix=prefix,
            suffix=suffix,
            prompt=prompt,
            sampling=SamplingParams(max_new_tokens=0, temperature=0.0),
            namespace=namespace,
        )
        return self._lookup(req)

    def calibrate(
        self,
        questions: Sequence[CalibrationQuestion],
        *,
        target: float = 0.15,
        progress: bool | Callable[[int, int], None] = False,
        facts: dict | None = None,
    ) -> CalibrationResult:
        """Measure this model's constants of ``recompute_ratio="auto"`` on dev questions; save and use them.

        ``auto`` recomputes every probed block whose KV deviation reaches a threshold (with
        ``craft``: ``alpha * CFO`` of each chunk); both constants have a scale of their own per model.
        Each question's passages are warmed together in retrieval order, then the question is
        prefilled with them in prompt order, blended by the probe at ``target`` (the favourable
        case); the constants are those at which ``auto`` recomputes ``target`` of the cached tokens
        there (in foreign company it then measures more, up to ``auto_max_ratio``). They are written
        for this model's fingerprint and probe settings under the cache directory
        (:mod:`kvrag.engine.reuse.calibration`), where every engine of this model finds them; this
        one uses them at once (a set ``config.auto_threshold`` still wins).

        The store is emptied after each question (no question may find another's chunks): calibrate
        on an engine of its own. One with a disk or remote tier is refused: those would be emptied too.

        Args:
            questions: the dev questions (20 of the dev set are the usual choice).
            target: the share of the cached tokens ``auto`` is to recompute in the favourable case.
            progress: show a progress bar (tqdm when installed, else log lines), or a callback
                ``progress(questions done, questions)``.
            facts: more to record beside the constants (what the questions were, e.g. ``top_k``).

        Raises:
            InvalidRequestError: bad questions or target, a store with persistent tiers, or questions
                that blended nothing (nothing measured).
        """
        self._check_open()
        questions = calibration.check_questions(questions)
        target = calibration.check_target(target)
        if self.config.disk_tier or self.config.remote_url:
            raise InvalidRequestError(
                "calibrate empties the store after each question; use an engine without disk_tier and remote_url"
            )
        t0 = time.perf_counter()
        measured = calibration.Measurements()
        with progress_reporter(progress, "kvrag calibrate", unit="question") as report:
            for done, q in enumerate(questions, 1):
                self.warm(q.retrieved)
                self.flush()
                req = self._request(
                    chunks=q.chunks,
                    prefix=q.prefix,
                    suffix=q.suffix,
                    sampling=SamplingParams(max_new_tokens=0),
                    mode="blend",
                    recompute_ratio=target,
                    selection="probe",
                )
                req.priced = False  # calibration measures the blend, whatever it costs here
                n = int(req.ids.shape[0])  # the prefill runs on the engine thread, as requests do
                plan, res = self._run_internal(lambda pause, r=req, n=n: self._prefill(r, capacity=n, pause=pause), n)
                measured.add(
                    res.measured, [(u.length, u.fix) for u in plan.chunks if u.source == "store" and u.fix is not None]
                )
                self.store.clear()
                if report is not None:
                    report(done, len(questions))
        threshold, alpha = measured.constants(target)
        probe = self._probe_key()
        facts = {
            **(facts or {}),
            "alpha": alpha,
            "target": target,
            "questions": len(questions),
            "model": self.model_name,
        }
        path = calibration.save(self.config.resolved_cache_dir(), self.fingerprint, probe, threshold, facts)
        if self.config.auto_threshold is None:
            self.auto_threshold = threshold
        self.auto_alpha = alpha
        return calibration.CalibrationResult(
            threshold, alpha, probe, path, len(questions), measured.blocks, time.perf_counter() - t0
        )

    def calibrate_qualities(
        self,
        questions: Sequence[CalibrationQuestion],
        *,
        max_new_tokens: int = 16,
        others: int = 3,
        shares: Sequence[float] = calibration.QUALITY_GRID,
        seed: int = 0,
        progress: bool | Callable[[int, int], None] = False,
        facts: dict | None = None,
    ) -> QualityCalibration:
        """Measure this model's share of foreign KV per ``quality``; save and use them.

        On a prompt whose chunk KV was computed in other company, ``"auto"`` recomputes a share of
        each foreign chunk set by ``quality`` (``config.foreign_selection``'s tokens). How much such
        KV drifts, and how much each share buys back, is the model's own. For each question its
        full prefill answers (greedy, ``max_new_tokens``); then each of its passages is warmed on
        its own behind ``others`` passages of other questions, and that answer is scored
        (teacher-forced) under full prefill, under CacheBlend's probe at 15% and under
        ``foreign_selection`` at each of ``shares``. Per quality the least share whose mean answer
        drift reaches the quality's target (a multiple of the probe's drift:
        :data:`~kvrag.engine.reuse.calibration.QUALITY_TARGETS`) is kept (a quality no share reaches
        keeps the built-in one; where even ``fast``'s needs more than the probe's 15%, foreign KV is
        left to the probe on this model: no switch), written for this model's
        fingerprint under the cache directory (where every engine of this model finds it) and used
        by this engine at once. Each measured prefill is the blend itself (the cost model does not
        turn it into a full prefill).

        The store is emptied before and after each question: calibrate on an engine of its own.
        One with a disk or remote tier is refused (those would be emptied too).

        Args:
            questions: the dev questions (at least 2: each one's passages are warmed behind others').
            max_new_tokens: length of the full prefill's answer that is scored.
            others: passages of other questions warmed before each passage.
            shares: the shares of a foreign chunk tried, each in (0, 1].
            seed: which passages of other questions go before each passage.
            progress: a progress bar (tqdm when installed, else log lines), or a callback
                ``progress(questions done, questions)``.
            facts: more to record beside the shares.

        Raises:
            InvalidRequestError: bad questions or arguments, no ``foreign_selection``, a store with
                persistent tiers, too few passages of other questions, or no question answered.
        """
        self._check_open()
        questions = calibration.check_questions(questions)
        selection = self.config.foreign_selection
        if selection is None:
            raise InvalidRequestError("config.foreign_selection is None: no foreign share to calibrate")
        if self.config.disk_tier or self.config.remote_url:
            raise InvalidRequestError(
                "calibrate empties the store after each question; use an engine without disk_tier and remote_url"
            )
        for name, value in (("max_new_tokens", max_new_tokens), ("others", others)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        ok = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1  # noqa: E731
        if (
            isinstance(shares, (str, bytes))
            or not isinstance(shares, Sequence)
            or not shares
            or not all(map(ok, shares))
        ):
            raise InvalidRequestError(f"shares must be a non-empty list of shares in (0, 1], got {shares!r}")
        grid = sorted({float(x) for x in shares})
        pool = list(dict.fromkeys(p for q in questions for p in q.retrieved))
        fewest = min(sum(p not in set(q.chunks) for p in pool) for q in questions)
        if fewest < others:  # checked before any work
            raise InvalidRequestError(
                f"the quality calibration needs {others} passages of other questions before each passage; "
                f"a question has {fewest} (give more questions or fewer others)"
            )
        rng = random.Random(seed)
        ref_selection, ref_share = calibration.QUALITY_REFERENCE
        t0 = time.perf_counter()
        measured = calibration.QualityMeasurements()

        def drift(answer: str, q: CalibrationQuestion, ref: list[float] | None, mode: str, sel=None, ratio=None):
            req = self._request(
                chunks=q.chunks,
                prefix=q.prefix,
                suffix=q.suffix,
                sampling=SamplingParams(max_new_tokens=0, temperature=0.0),
                mode=mode,
                recompute_ratio=ratio,
                selection=sel,
            )
            req.priced = False  # the blend is measured, whatever the cost model would choose
            got = self._score(req, answer, internal=True).token_logprobs
            return got if ref is None else calibration.drift(got, ref)

        with progress_reporter(progress, "kvrag calibrate qualities", unit="question") as report:
            for done, q in enumerate(questions, 1):
                self.store.clear()
                answer = self.generate(
                    q.chunks, q.prefix, q.suffix, mode="full", max_new_tokens=max_new_tokens, temperature=0.0
                ).text
                self.flush()
                self.store.clear()  # nothing the full prefill wrote back is found by the blends
                if answer.strip():
                    mine = set(q.chunks)
                    strangers = [p for p in pool if p not in mine]
                    for passage in q.chunks:
                        self.warm(rng.sample(strangers, others) + [passage])
                    self.flush()
                    ref = drift(answer, q, None, "full")
                    measured.add(
                        drift(answer, q, ref, "blend", ref_selection, ref_share),
                        {s: drift(answer, q, ref, "blend", selection, s) for s in grid},
                    )
                if report is not None:
                    report(done, len(questions))
        self.store.clear()
        switch, chosen, reached = measured.shares()
        means = measured.means()
        reference = measured.reference_drift()
        facts = {
            **(facts or {}),
            "reached": reached,
            "reference": {"selection": ref_selection, "share": ref_share, "drift": reference},
            "drifts": {f"{s:g}": d for s, d in means.items()},
            "targets": dict(calibration.QUALITY_TARGETS),
            "questions": len(measured.reference),
            "max_new_tokens": max_new_tokens,
            "model": self.model_name,
        }
        path = calibration.save_shares(
            self.config.resolved_cache_dir(), self.fingerprint, selection, switch, chosen, facts
        )
        self.foreign_calibrated, self.foreign_shares = switch, dict(chosen)
        return QualityCalibration(
            switch,
            chosen,
            reached,
            reference,
            means,
            selection,
            path,
            len(measured.reference),
            time.perf_counter() - t0,
        )

    def info(self) -> EngineInfo:
        """What this engine runs: model, family, compute dtype and why, device, threads, context
        window, and the correctness gate's verdict (see :class:`~kvrag.engine.types.EngineInfo`)."""
        return EngineInfo(
            model=self.model_name,
            family=self.adapter.family.name,
            dtype=self.compute_dtype.name,
            dtype_reason=self.compute_dtype.why,
            device=str(self.adapter.device),
            threads=self.threads,
            context_window=self.context_window,
            gate_ok=self.gate.ok,
            gate=self.gate.summary(),
            decode=f"{self.decoder.description}; {self._drafts_description()}",
            blend=self._blend_description(),
            malloc=self.malloc,
        )

    def _blend_description(self) -> str:
        """:attr:`EngineInfo.blend`: the default selection and budget, and the foreign-company switch."""
        cfg = self.config
        if cfg.recompute_ratio != AUTO:
            return f"{cfg.selection} at {float(cfg.recompute_ratio):.0%} of the cached tokens"
        own, foreign = cfg.quality_shares(calibrated=self.foreign_shares)
        if self._auto_measures(cfg.selection):
            text = f"{cfg.selection}, auto ({cfg.quality}): measured per request, up to {cfg.auto_max_ratio:.0%}"
        else:
            text = f"{cfg.selection}, auto ({cfg.quality}): {own:.0%} (no calibrated threshold)"
        if self._foreign_switch(None, AUTO):
            text += (
                f"; KV from other company (overlap < {cfg.foreign_overlap:g}): {cfg.foreign_selection},"
                f" {foreign:.0%} of each foreign chunk, {own:.0%} of the others"
            )
        return text

    def queue_stats(self) -> dict:
        """The engine thread's load now: ``running`` (requests holding a decoding slot), ``waiting``
        (requests and jobs queued), ``queued_tokens`` (their prompt tokens), ``decode_steps``, and
        ``busy_s`` (seconds the engine thread has had work since the engine started)."""
        return self._worker.stats()

    def flush(self) -> None:
        """Wait until background write-back is stored: the KV of chunks seen for the first time, and
        the knowledge tree's refreshes (those waiting for an idle engine run now)."""
        self.writeback.flush()

    def close(self) -> None:
        """Refuse new requests, let queued and running ones finish, finish write-back, release the store."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self.speculations.cancel_all()
        self.writeback.cancel_refreshes()  # background work not started yet is not worth waiting for
        self._worker.wait_idle()
        self.writeback.close()  # its chunk computations still run on the engine thread
        self._worker.stop()  # the thread, idle now, ends instead of lingering
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _quiesce(self, timeout: float) -> None:
        """Drop refreshes not started, let running work and write-back finish (the exit hook)."""
        self.speculations.cancel_all()
        self.writeback.cancel_refreshes()
        if self._worker.wait_idle(timeout=timeout):
            self.writeback.flush()
            self._worker.stop(timeout=timeout)  # no engine thread lingers into the interpreter's teardown

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this engine is closed")

    def _probe_key(self) -> str:
        """The probe settings a calibration belongs to: the one place that names them (loaded in
        ``__init__``, saved by :meth:`calibrate`)."""
        probe = configured_params(self.config, "probe").resolved(self.adapter.n_layers)
        return calibration.probe_key(probe.probe_layer, probe.probe_stride, probe.deviation)

    def _request(
        self,
        *,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        prompt: str | None = None,
        sampling: SamplingParams,
        mode: str | None = None,
        recompute_ratio: float | None = None,
        selection: str | None = None,
        quality: str | None = None,
        conversation_id: str | None = None,
        dedup: bool | None = None,
        namespace: str | None = None,
    ) -> Request:
        """Validate a request and segment its prompt: one clear error per bad argument."""
        self._check_open()
        cfg = self.config
        parts = request_parts(chunks, prefix, suffix, prompt, self.split_prompt)
        namespace = check_namespace(cfg, namespace)
        conversation = check_conversation_id(conversation_id)
        if conversation is not None:
            conversation = self._conversation_key(conversation, namespace)
        check_dedup(dedup)
        deduplicated = 0
        if conversation is not None and (cfg.conversation_dedup if dedup is None else dedup):
            parts, deduplicated = self.conversations.dedup(conversation, parts)
        mode, ratio = check_mode(cfg, mode, recompute_ratio)
        self.gate.require(self.model_name, mode, ratio)
        foreign_switch = self._foreign_switch(selection, ratio)
        selection = check_selection(cfg, selection)
        quality = check_quality(cfg.quality if quality is None else quality)
        segments, ids = self.prompt_tokenizer.segment(parts)
        n = int(ids.shape[0])
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give a prefix, chunks or a suffix with some text")
        if n >= self.context_window:
            raise ContextLengthError(n, self.context_window)
        return Request(
            segments=segments,
            ids=ids,
            mode=mode,
            ratio=ratio,
            sampling=sampling.resolved(cfg.sampling),
            selection=selection,
            foreign_switch=foreign_switch,
            quality=quality,
            namespace=namespace,
            conversation=conversation,
            deduplicated=deduplicated,
        )

    def _conversation_key(self, conversation_id: str, namespace: str) -> str:
        """A conversation is scoped to its tenant (the default tenant's keys are the ids themselves)."""
        return conversation_id if namespace == self.config.namespace else f"{namespace}\0{conversation_id}"

    def _ticket(self, req: Request) -> Ticket:
        """A request's place in the queue: its prompt tokens, and how many of them the cache holds.

        Estimated by key lookups only (nothing loaded); the plan made when it starts may
        differ (an entry evicted meanwhile).
        """
        n = int(req.ids.shape[0])
        ratio, auto, _ = self._budget(req)  # with "auto", its cap: the most it may recompute
        if reuses_nothing(req.mode, ratio, auto):
            return Ticket(tokens=n, compute=n)
        prefix = self._prefix_length(req)
        # chunk KV is looked up only for the modes that reuse it (a lookup may ask a remote tier)
        chunks = sum(len(s.ids) for s in self._stored_chunks(req, prefix)) if req.mode in ("blend", "reuse") else 0
        cached = min(n - 1, prefix + chunks)
        return Ticket(tokens=n, cached=cached, compute=n - cached + round(ratio * chunks))

    def _prefix_length(self, req: Request) -> int:
        """Leading tokens of the prompt held exactly in the prefix cache (key lookups only)."""
        if not self.config.prefix_cache:
            return 0
        return self.planner.prefix_cache.cached_length(
            req.ids.tolist(), int(req.ids.shape[0]) - 1, namespace=req.namespace
        )

    def _stored_chunks(self, req: Request, prefix: int) -> list:
        """The prompt's chunks past ``prefix`` of which the store holds a variant (key lookups only)."""
        return [
            s
            for s in req.segments
            if s.kind == "chunk"
            and s.start >= prefix
            and self.variants.holds(self.planner.chunk_key(s.ids, req.namespace))
        ]

    def _lookup(self, req: Request) -> CacheLookup:
        """Key lookups only: the exact prefix in the prefix cache, then the chunks stored past it."""
        prefix = self._prefix_length(req)
        stored = self._stored_chunks(req, prefix)
        return CacheLookup(
            prompt_tokens=int(req.ids.shape[0]),
            prefix_tokens=prefix,
            chunks=sum(s.kind == "chunk" for s in req.segments),
            chunks_stored=len(stored),
            chunk_tokens_stored=sum(len(s.ids) for s in stored),
        )

    def _run_job(self, job, tokens: int, *, bounded: bool = True):
        """Run ``job(pause)`` on the engine thread, queued as ``tokens`` of compute; ``bounded=False``
        for internal work (write-back, calibration) that a full queue must never refuse."""
        return self._worker.call(Ticket(tokens=tokens, compute=tokens, bounded=bounded), job)

    def _run_internal(self, job, tokens: int):
        """:meth:`_run_job` for internal work: never refused."""
        return self._run_job(job, tokens, bounded=False)

    def _prefill(
        self, req: Request, *, capacity: int, pause: Pause | None = None, quiet: bool = False
    ) -> tuple[Plan, PrefillResult]:
        """Plan and run a request's prefill (on the engine thread); a damaged cached entry re-plans it.

        The plan's path is settled by the cost model once it holds everything it could reuse (the
        conversation's turn included): a request whose reuse cannot win runs as a full prefill
        (or reuses exact KV only), and still writes back what it computes."""
        cfg = self.config
        use_prefix = cfg.prefix_cache and req.mode != "full"
        attempts, limit = 0, 1
        while True:
            # each failed attempt drops the damaged entry it met, so a request is planned again at
            # most once per cached entry it uses; past that (entries keep failing) it runs in full
            mode = req.mode if attempts < limit else "full"
            ratio, auto, threshold = self._budget(req)
            plan = self.planner.plan(
                req.segments,
                mode=mode,
                ratio=ratio,
                use_prefix=use_prefix and mode != "full",
                namespace=req.namespace,
                auto=auto,
                quiet=quiet,
            )
            if req.conversation is not None and attempts == 0:  # the kept turn this prompt continues, if any
                req.follow = self.conversations.follow(req.conversation, plan.ids)
            spans = self.conversations.attach(plan, req.follow) if req.follow is not None and not plan.is_full else []
            plan.selection = req.selection
            overlap = plan.company_overlap() if req.foreign_switch and plan.path == "blend" else None
            if overlap is not None and overlap < cfg.foreign_overlap:
                # chunk KV computed in other company: the tokens nearest the question carry the drift
                # (issue 35's measurements), so spend the budget there, without a probe: each chunk
                # adds its quality's share, by the company its own KV was computed in
                own, foreign = cfg.quality_shares(req.quality, self.foreign_shares)
                plan.selection, plan.auto, threshold = cfg.foreign_selection, False, None
                plan.ratio = plan.dial_ratio(own, foreign, cfg.foreign_overlap)
            self.planner.choose(plan, price=req.priced)
            blended = {start for start, _ in plan.chunk_records}  # what of the turn's KV the chosen path still uses
            req.conversation_spans = [(a, b) for a, b in spans if b <= plan.prefix_len or a in blended]
            if attempts == 0:
                limit = len(plan.cached_spans()) + 1
            attempts += 1
            self.costs.adjust(plan)
            capture_end = 0
            if use_prefix and mode != "full":
                # prefix mode keeps the whole exact prompt (as vLLM does); the others keep the text
                # before the first chunk (system prompt, instructions), which every request repeats.
                capture_end = plan.exact_end() if mode == "prefix" else min(plan.exact_end(), plan.first_chunk_start())
            options = PrefillOptions.from_config(
                cfg,
                self.adapter.n_layers,
                selection=plan.selection,
                capture_end=capture_end,
                capture_chunks=self.writeback.captures(plan),
                auto_threshold=threshold,
                auto_alpha=self.auto_alpha,
                keep_recomputed=self.writeback.keeps_recomputed(plan),
            )
            t0 = time.perf_counter()
            try:
                res = prefill(self.adapter, plan, capacity, options=options, pause=pause)
            except DamagedEntryError:  # found while streaming; the store dropped it: plan again
                if mode == "full":
                    raise
                log.debug("kvrag: a cached entry was damaged; re-planning the request", exc_info=True)
                continue
            if res.buf.k.is_cuda:  # CUDA kernels run asynchronously: time the prefill's work, not its launches
                torch.cuda.synchronize(res.buf.k.device)
            self.costs.observe(plan, res.trace.token_layers, time.perf_counter() - t0, res.recomputed_tokens)
            return plan, res

    def _budget(self, req: Request) -> tuple[float, bool, float | None]:
        """(ratio, auto, threshold) of a request: ``"auto"`` measures with a threshold where it can."""
        cfg = self.config
        if req.ratio != AUTO:
            return float(req.ratio), False, None
        if self._auto_measures(req.selection):
            return cfg.auto_max_ratio, True, self.auto_threshold
        return cfg.quality_shares(req.quality)[0], False, None

    def _auto_measures(self, selection: str) -> bool:
        """Whether ``"auto"`` measures each request's budget with ``selection`` (a selection that
        measures itself, or a probe with a known threshold), rather than recomputing ``quality``'s share."""
        kind = auto_kind(selection)
        return kind == "self" or (kind == "threshold" and self.auto_threshold is not None)

    def _foreign_switch(self, selection: str | None, ratio) -> bool:
        """Whether a request may switch to ``config.foreign_selection`` on chunk KV computed in other
        company: it names no selection, the default one is the probe, its ratio is ``"auto"``, and
        ``kvrag calibrate`` did not find the switch worse than the probe on this model."""
        cfg = self.config
        named = selection is not None or ratio != AUTO
        return (
            not named
            and cfg.selection == "probe"
            and cfg.foreign_selection is not None
            and self.foreign_calibrated is not False
        )

    # -- a request's life on the engine thread: prefill, batched decode steps, finish -----------------

    def _start(self, req: Request, t0: float, pause: Pause) -> RunningSequence:
        """Prefill the request and sample its first token (or take the speculation it adopts); schedules
        write-back of what it computed."""
        held = self.speculations.take(req.adopt) if req.adopt is not None else None
        if held is not None:
            seq, res = held
            seq.req, seq.t0, seq.ttft = req, t0, time.perf_counter() - t0
            seq.stats.prefill_s = seq.ttft
            self._count_lookups(req)
        else:
            seq, res = self._begin(req, t0, pause)
        self.writeback.schedule(seq.plan, res)
        return seq

    def _count_lookups(self, req: Request) -> None:
        """An adopted speculation's lookups were looks: make them again as the request's uses (hits
        counted, eviction ranks and variant reuses updated), as if it had planned them itself."""
        ratio, auto, _ = self._budget(req)
        use_prefix = self.config.prefix_cache and req.mode != "full"
        self.planner.plan(
            req.segments, mode=req.mode, ratio=ratio, use_prefix=use_prefix, namespace=req.namespace, auto=auto
        )

    def _begin(self, req: Request, t0: float, pause: Pause) -> tuple[RunningSequence, PrefillResult]:
        """Prefill the request and sample its first token (a speculative one's lookups are looks)."""
        n = int(req.ids.shape[0])
        sp = req.sampling
        budget = min(sp.max_new_tokens, self.context_window - n)
        plan, res = self._prefill(req, capacity=n + budget, pause=pause, quiet=req.speculative)
        logits = self.adapter.logits(res.last_hidden)[0]
        generator = seeded_generator(sp)
        token = sample(logits, sp.temperature, sp.top_p, generator)
        ttft = time.perf_counter() - t0
        stats = generation_stats(plan, res, self.adapter.n_layers, ttft)
        stats.conversation_spans = list(req.conversation_spans or [])
        stats.conversation_tokens = sum(b - a for a, b in stats.conversation_spans)
        stats.deduplicated_chunks = req.deduplicated
        seq = RunningSequence(
            req=req,
            plan=plan,
            buf=res.buf,
            pos=n,
            token=token,
            budget=budget,
            text=TextStream(self.tokenizer, sp.stop),
            generator=generator,
            stats=stats,
            t0=t0,
            ttft=ttft,
        )
        return seq, res

    def _decode_step(self, seqs: list[RunningSequence]) -> None:
        """Put each sequence's ``token`` in its buffer and sample its next one: one batched pass.

        A greedy sequence's prompt-lookup drafts ride in the rows the pass pads anyway, at the
        positions after its token; the ones the model's own picks confirm are emitted too (``ahead``)
        and their KV kept (:mod:`kvrag.engine.serving.drafts`).
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
            sp = seq.req.sampling
            token = sample(logits[i], sp.temperature, sp.top_p, seq.generator)
            confirmed = []
            for j, guess in enumerate(draft):
                if token != guess:
                    break
                confirmed.append(guess)
                token = sample(logits[at + j], sp.temperature, sp.top_p, seq.generator)
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
                seq.draft_width = next_width(seq.draft_width, len(draft), len(confirmed), self.config.draft_tokens)
                seq.draft_hold.update(len(draft), len(confirmed))

    def _drafts_description(self) -> str:
        n = self.config.draft_tokens
        if n == 0:
            why = (
                "draft_tokens=0" if self._drafts_given else "none by default on a GPU: a draft row's launches cost more"
            )
            return f"no prompt-lookup drafts ({why})"
        return (
            f"prompt-lookup drafts: up to {n} a step for greedy requests, in the pass's padding rows, "
            "as many as the measured step cost says pay"
        )

    def _drafts(self, seqs: list[RunningSequence]) -> list[list[int]]:
        """Each sequence's drafts for this step: greedy ones only, in the rows the pass pads anyway,
        never past its token budget, and at most ``config.draft_tokens`` for the whole step (a draft
        row's attention slows every sequence of the step).

        How many: once the engine has timed passes of different sizes (:class:`StepCost`), as many as
        raise the step's expected tokens per second (:func:`plan_drafts`, from each sequence's recent
        hold rate and what a row of its context costs); a greedy sequence that gets none checks one
        every :data:`PROBE_EVERY` steps, so its hold rate (and the fit) stay current. Before that, each
        sequence's ``draft_width`` (:func:`next_width`).
        """
        most = self.config.draft_tokens
        free = min((-len(seqs)) % self.decoder.group, most)  # a step checks at most `most` drafts in all
        caps = []  # per sequence, the most drafts it may check (0: none, e.g. a sampled request)
        for seq in seqs:
            k = min(most, free, seq.budget - len(seq.generated) - 1)
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
            free -= len(draft)
            out.append(draft)
        return out

    def _finish(self, seq: RunningSequence) -> Generation:
        """Keep a conversation's turn; the request's result."""
        req = seq.req
        if req.conversation is not None:
            chunk_texts = [s.text for s in seq.plan.segments if s.kind == "chunk"]
            self.conversations.record(
                req.conversation,
                req.ids.tolist() + seq.generated,
                seq.buf,
                chunk_texts,
                prompt_len=int(req.ids.shape[0]),
                follow=req.follow,
            )
        total = time.perf_counter() - seq.t0
        seq.stats.completion_tokens = len(seq.generated)
        seq.stats.decode_s = total - seq.ttft
        return Generation(seq.text.text, seq.generated, seq.finish, seq.ttft, total, seq.stats)


def _signature(req: Request) -> tuple:
    """What a request must share with a prompt speculation to adopt it: the same prefill and sampling."""
    return (
        tuple(req.ids.tolist()),
        req.mode,
        req.ratio,
        req.selection,
        req.foreign_switch,
        req.quality,
        req.namespace,
        repr(req.sampling),
    )


# -- process-wide engines, shared by integrations so that constructing an LLM wrapper is cheap ------------

_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()


def _built(build: Callable[[], Engine], config: EngineConfig) -> Engine:
    """``build()`` on a thread of its own, so the caller's thread keeps no OpenMP pool of kvrag's making
    (decode steps on the engine thread stay fast: :mod:`kvrag.engine.model.host`); ``num_threads``
    applies to the caller's thread too, as when the engine was built there."""
    engine = on_own_thread(build)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return engine


def _check_config(config: EngineConfig) -> None:
    """What the config cannot check without torch: the selection and its parameters against the
    selection registry, the eviction policy against the store's (one clear error each)."""
    configured_params(config)
    if config.foreign_selection is not None:
        check_selection_name(config.foreign_selection)
    check_policy(config.eviction_policy)


#: drafts a decode step checks at most on a CPU, where ``draft_tokens`` is left to the device
CPU_DRAFT_TOKENS = 4


def _draft_tokens(draft_tokens: int | None, device: torch.device) -> int:
    """``draft_tokens`` as given, or the device's default when None: :data:`CPU_DRAFT_TOKENS` on a
    CPU (a draft row there costs its attention alone, the weights read once for the pass), none on
    a GPU (each draft row launches its own kernels per layer, and the step is launch-bound)."""
    if draft_tokens is not None:
        return draft_tokens
    return CPU_DRAFT_TOKENS if torch.device(device).type == "cpu" else 0


def _check_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """The config with the device the weights are on. The engine computes where the weights are and
    never moves a model it is handed: a ``device`` other than the CPU (the default) must be theirs."""
    asked = torch.device(config.device)
    if asked.type == "cpu":
        return config if device.type == "cpu" else config.replace(device=str(device))
    if asked.type != device.type or asked.index not in (None, device.index):
        raise InvalidRequestError(
            f"device={config.device!r} but the model's weights are on {device}: move the model first "
            f"(model.to({config.device!r})) or leave device at its default"
        )
    return config


def _engine_key(config: EngineConfig) -> tuple:
    fields = []
    for name in config.__slots__:
        value = getattr(config, name)
        fields.append((name, repr(value)))
    return tuple(fields)


def get_engine(model: str | None = None, **config) -> Engine:
    """The engine for this model and configuration, loaded on first use and shared afterwards.

    Args:
        model: as for :meth:`Engine.from_pretrained` (``None`` = bundled SmolLM2-135M-Instruct).
        **config: :class:`EngineConfig` fields (dtype, device, recompute_ratio, ...).
    """
    bundled = find_bundled(model) if isinstance(model, str) else None
    if bundled is not None:  # any name of a bundled model: one engine per model
        model = None if bundled is BUNDLED[0] else bundled.name
    cfg = EngineConfig().replace(**config)  # an old field name says where it went
    cfg = cfg.replace(model=model) if model is not None else cfg
    key = _engine_key(cfg)
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = Engine.from_pretrained(config=cfg)
            _engines[key] = engine
        return engine


def drop_engines() -> None:
    """Close and forget every shared engine (tests, shutdown)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
