"""The :class:`Engine` facade: it builds the parts and is the one public API that tests, benchmarks
and integrations use. What runs a request lives in the serving layer (:mod:`kvrag.engine.serving`:
validation, prefill, decode, write-back); a walk through one request: docs/how-it-works.md."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from kvrag.config import EngineConfig
from kvrag.engine.model import loading
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.dtypes import DtypeChoice, weights_dtype
from kvrag.engine.model.host import loading_memory, on_own_thread, tune_malloc
from kvrag.engine.model.sampling import SamplingParams
from kvrag.engine.options import RequestOptions
from kvrag.engine.reuse.access import AccessStats
from kvrag.engine.reuse.conversations import check_conversation_id
from kvrag.engine.reuse.gate import load_gate
from kvrag.engine.serving.assembly import assemble
from kvrag.engine.serving.decode import draft_tokens_for
from kvrag.engine.serving.requests import (
    Request,
    check_chunks,
    check_engine_config,
    check_namespace,
    check_text,
    describe_blend,
    signature,
)
from kvrag.engine.serving.scheduler import Ticket
from kvrag.engine.serving.speculation import Speculation
from kvrag.engine.serving.worker import Pause, StreamJob
from kvrag.engine.store.base import KVStore
from kvrag.engine.store.tiered import build_store
from kvrag.engine.tools import render_chat
from kvrag.engine.types import CacheLookup, EngineInfo, Generation, GenerationStream, ScoreResult, WarmResult
from kvrag.errors import InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["Engine"]


class Engine:
    """An embedded PyTorch engine that reuses the KV cache of document chunks.

    Build it with :meth:`from_pretrained` (the bundled SmolLM2-135M-Instruct by default) or
    :meth:`from_model` (transformers objects already in memory).

    Calls are thread-safe, and any number of threads may call at once. One engine thread runs all
    model compute (:mod:`kvrag.engine.serving.worker`): a call validates its request on the caller's
    thread, queues it (cache-aware order, bounded: a full queue raises
    :class:`~kvrag.errors.OverloadedError`) and waits for its result. Running requests decode
    together, one batched step per token, and a long prefill (or a ``warm()`` window) runs in slices
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
        quantized_source: bool = False,
    ) -> None:
        check_engine_config(config)
        self.hf_model, self.tokenizer, self.weights_digest = hf_model, tokenizer, weights_digest
        self.model_name = name or str(getattr(hf_model.config, "name_or_path", "") or "model")
        self.adapter = adapter = ModelAdapter(hf_model)
        config = loading.check_device(config, adapter.device)
        # the weights' dtype is the compute dtype (what the loader resolved, and why; else the weights'
        # own, checked against config.dtype); config.dtype names it from here on
        weights = weights_dtype(adapter.dtype, config.dtype if compute_dtype is None else compute_dtype.name)
        self.compute_dtype = compute_dtype or weights
        drafts_given = config.draft_tokens is not None
        self.config = config = config.replace(
            dtype=self.compute_dtype.name, draft_tokens=draft_tokens_for(config.draft_tokens, adapter.device)
        )
        log.info("kvrag: %s computes in %s (%s)", self.model_name, self.compute_dtype.name, self.compute_dtype.why)
        on_cpu = adapter.device.type == "cpu"
        #: what the process's allocator does with a prefill's temporaries (:mod:`kvrag.engine.model.host`)
        self.malloc = tune_malloc(config.tune_malloc) if on_cpu else f"unchanged (computes on {adapter.device.type})"
        self.fingerprint = loading.fingerprint_model(weights_digest, tokenizer, self.compute_dtype.name)
        self.store: KVStore = store if store is not None else build_store(config)
        self.context_window = min(adapter.max_positions, config.max_context or adapter.max_positions)
        sink = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.sink_ids = [int(sink)] if sink is not None else []
        self.eos_ids = loading.eos_ids(tokenizer, hf_model)
        #: torch intra-op threads of the engine thread: ``num_threads``, else torch's count when the engine was built
        self.threads = config.num_threads or torch.get_num_threads()
        with loading_memory():  # the self-test's and the decode weights' temporaries go back when freed
            # blend/reuse only where placement and ratio 1.0 are proven exact for these weights (cached)
            self.gate = load_gate(
                adapter, hf_model, self.sink_ids, fingerprint=self.fingerprint, cache_dir=config.resolved_cache_dir()
            )
            self.parts = parts = assemble(
                config,
                adapter,
                tokenizer,
                self.store,
                self.gate,
                fingerprint=self.fingerprint,
                sink_ids=self.sink_ids,
                eos_ids=self.eos_ids,
                context_window=self.context_window,
                model_name=self.model_name,
                threads=self.threads,
                drafts_given=drafts_given,
                quantized_source=quantized_source,
            )
        # the parts a request goes through (docs/how-it-works.md), by the names tests and tools use
        self.prompt_tokenizer, self.documents, self.variants, self.planner, self.chunk_computer = (
            parts.prompt_tokenizer, parts.documents, parts.variants, parts.planner, parts.chunk_computer,
        )  # fmt: skip
        self.conversations, self.access, self.costs, self.requests, self.scheduler, self._worker = (
            parts.conversations, parts.access, parts.costs, parts.requests, parts.scheduler, parts.worker,
        )  # fmt: skip
        self.writeback, self.speculations, self.prefiller, self.warming, self.decoding = (
            parts.writeback, parts.speculations, parts.prefiller, parts.warming, parts.decoding,
        )  # fmt: skip
        log.info("kvrag: decode %s", self.decoding.decoder.description)
        self._closed = False
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, config: EngineConfig | None = None, store: KVStore | None = None, **overrides
    ) -> Engine:
        """Load a model and build an engine.

        Args:
            model: ``None`` for the bundled SmolLM2-135M-Instruct, a local Hugging Face model
                directory, or a local ``.gguf`` file. Nothing is downloaded.
            config: an :class:`EngineConfig`; keyword ``overrides`` replace its settings (any setting by
                its flat name: ``recompute_ratio=0.3``, ``disk_tier=True``).
            store: a KV store to use instead of a new in-memory one.
        """
        config = (config or EngineConfig()).replace(**overrides)
        if model is not None:
            config = config.replace(model=str(model))
        check_engine_config(config)  # before the model loads: a bad name fails at once

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
                quantized_source=loaded.quantized,
            )

        return on_own_thread(build, threads=config.num_threads)

    @classmethod
    def from_model(
        cls, hf_model, tokenizer, *, config: EngineConfig | None = None, store: KVStore | None = None, **overrides
    ) -> Engine:
        """Build an engine over a transformers model and tokenizer already in memory.

        The engine computes in the model's own dtype (it never converts a model it is handed):
        ``dtype="auto"`` (the default) accepts it, an explicit ``dtype`` must be the weights'.
        """
        config = (config or EngineConfig()).replace(**overrides)
        check_engine_config(config)
        loading.check_architecture(hf_model.config)
        hf_model.eval()
        digest = loading.state_dict_digest(hf_model)
        build = lambda: cls(hf_model, tokenizer, config, weights_digest=digest, store=store)  # noqa: E731
        return on_own_thread(build, threads=config.num_threads)

    def count_tokens(self, text: str) -> int:
        """Tokens of a text on its own."""
        return len(self.prompt_tokenizer.tokenize(check_text("text", text)))

    def register(self, texts: Sequence[str], *, namespace: str | None = None) -> list[str]:
        """Record document texts for tenant ``namespace`` (its prompts given as one string are split at
        them); their content ids. Texts shorter than 32 characters are not worth caching: not kept."""
        return self.documents.register(check_chunks(texts), check_namespace(self.config, namespace))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """Render chat messages and ``tools`` (OpenAI function schemas) with the model's own chat template."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)

    def split_prompt(self, prompt: str, *, namespace: str | None = None) -> list[tuple[str, str]]:
        """The prompt as ``(kind, text)`` parts, ``chunk`` where a text the tenant registered occurs."""
        return self.documents.split(check_text("prompt", prompt), check_namespace(self.config, namespace))

    def record_retrieval(
        self, documents: Sequence[str | Sequence[str]], *, order: str = "retrieval", namespace: str | None = None
    ) -> list[int]:
        """Count one retrieval of ``documents`` in the tenant's chunk-access table (CRAFT); their prompt order.

        Call it once per retrieval (the retriever wrappers do), not per LLM call. Each document is its
        text, or the texts of the forms it may take in a prompt (counted as one document). ``order``:
        ``"retrieval"`` (as given) or ``"frequency"`` (the longest chunk sequence the tenant holds
        exactly first, then the most retrieved in the window; :meth:`AccessTable.order`). Returns
        indices into ``documents`` in the order to put them in the prompt.
        """
        return self.access.retrieval(check_namespace(self.config, namespace), documents, order)

    def chunk_access(self, namespace: str | None = None) -> AccessStats:
        """The tenant's chunk-access table now: window, retrievals counted, chunks, promoted, top counts."""
        return self.access.stats(check_namespace(self.config, namespace))

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

        With ``chunk_context="neighbor"`` (default) the list is computed as one stream in windows of up
        to ``warm_window_tokens``, each chunk behind the documents before it: close to how it will appear
        in prompts (a window whose chunks are all cached is skipped). ``order="given"`` computes the list
        as given (give the passages expected together, in retrieval order); ``"similar"`` (a whole corpus)
        first puts each passage next to the ones most like it (by ``embeddings`` [n, d], default a lexical
        similarity) and keeps a second variant of each, computed in reverse order (``warm_variants``).
        Each window is one job for the engine thread, queued like a request (a full queue raises
        :class:`~kvrag.errors.OverloadedError`; windows computed before stay stored). ``progress``: a
        progress bar, or a callback ``progress(windows done, windows)``.
        """
        self._check_open()
        namespace, chunks = check_namespace(self.config, namespace), check_chunks(chunks)
        return self.warming.warm(chunks, order=order, embeddings=embeddings, progress=progress, namespace=namespace)

    # -- requests ---------------------------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        sampling: SamplingParams | None = None,
        options: RequestOptions | None = None,
        **fields,
    ) -> Generation:
        """Generate a completion for ``prefix + chunks + suffix`` (or a whole ``prompt`` string, split at
        the registered documents).

        ``chunks`` are document texts in prompt order, their KV reused when cached; they are one
        retrieval, counted once in the chunk-access table. The request's options come as keywords or
        as ``options=`` (:class:`~kvrag.engine.options.RequestOptions`: ``max_new_tokens``,
        ``temperature``, ``top_p``, ``stop``, ``seed``, ``mode``, ``recompute_ratio``, ``selection``,
        ``quality``, ``conversation_id``, ``dedup``, ``namespace``, ``chunk_order``); ``sampling=`` a
        :class:`~kvrag.SamplingParams` instead of the sampling keywords.
        """
        stream = self.stream(chunks, prefix, suffix, prompt=prompt, sampling=sampling, options=options, **fields)
        for _ in stream:
            pass
        assert stream.generation is not None
        return stream.generation

    def stream(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        sampling: SamplingParams | None = None,
        options: RequestOptions | None = None,
        **fields,
    ) -> GenerationStream:
        """Like :meth:`generate`, but yields text pieces as they are decoded. The request is validated
        and queued before this returns (a full queue raises :class:`~kvrag.errors.OverloadedError`);
        ``.generation`` holds the result once the stream is exhausted; closing the stream early cancels
        the request and frees its KV. TTFT counts from this call (tokenising the prompt included)."""
        t0 = time.perf_counter()
        opts = RequestOptions.of(options, fields)
        chunks, retrieved = self.requests.order_chunks(chunks, prompt, opts)
        req = self._request(chunks, prefix, suffix, prompt, opts, sampling)
        if retrieved:  # a valid request's chunks are one retrieval: counted once, after validation
            self.access.record(req.namespace, retrieved)
        req.adopt = self.speculations.adopt(signature(req)) if req.conversation is None else None
        if req.adopt is not None:  # its prefill is done (or running): it starts before anything that computes
            ticket = Ticket(tokens=req.num_tokens, cached=req.num_tokens - 1, compute=1)
        else:
            ticket = self.prefiller.ticket(req)
        return GenerationStream(self._worker.stream(ticket, StreamJob(req, t0)))

    def speculate(
        self, chunks: Sequence[str], *, namespace: str | None = None, key: Hashable | None = None, dynamic: bool = True
    ) -> Speculation:
        """Compute the KV of candidate chunks the cache does not hold, while a staged search runs
        (RAGCache's speculative pipelining, chunk level; :mod:`kvrag.engine.serving.speculation`).

        The chunks are computed as :meth:`warm` computes them, as speculative background work: it starts
        only when no request waits, gives way when one arrives, and is kept as speculative store
        entries. ``key``: a newer speculation of the same key cancels this one (``None``: never
        replaced); ``dynamic=False`` queues it as ordinary work (the benchmarks' baseline).
        """
        self._check_open()
        namespace = check_namespace(self.config, namespace)
        return self.warming.speculate(check_chunks(chunks), namespace=namespace, key=key, dynamic=dynamic)

    def speculate_request(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        key: Hashable | None = None,
        dynamic: bool = True,
        options: RequestOptions | None = None,
        **fields,
    ) -> Speculation:
        """Prefill a request a search will probably end in, before it ends (prompt-level speculation).

        Takes the request as :meth:`stream` does. Its prefill runs as speculative work, its first token
        is sampled and its KV held; a later :meth:`stream` or :meth:`generate` of the identical request
        (same prompt tokens, mode, budget, sampling and tenant) adopts it, and its output is the one it
        would have computed. Its lookups are looks and its write-back waits for its adoption: a
        speculation that loses leaves the cache as it found it. A ``conversation_id`` is refused.
        """
        opts = RequestOptions.of(options, fields)
        if opts.conversation_id is not None:
            raise InvalidRequestError("a conversation's turn is not speculated: leave out conversation_id")
        chunks, _ = self.requests.order_chunks(chunks, prompt, opts)  # a speculation counts no retrieval
        req = self._request(chunks, prefix, suffix, prompt, opts)
        req.speculative = True

        def job(handle: Speculation, pause: Pause):
            return self.prefiller.begin(req, time.perf_counter(), pause)

        tokens, start = self.prefiller.ticket(req).compute, self.speculations.start
        return start("prompt", key, tokens, job, signature=signature(req), dynamic=dynamic, namespace=req.namespace)

    def end_conversation(self, conversation_id: str, *, namespace: str | None = None) -> bool:
        """Forget a conversation's kept KV and chunk set; False if it was not live."""
        conversation = check_conversation_id(conversation_id)
        key = self.requests.conversation_key(conversation, check_namespace(self.config, namespace))
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
        recompute_ratio: float | str | None = None,
        selection: str | None = None,
        chunk_order: str | None = None,
    ) -> ScoreResult:
        """Log-likelihood of ``continuation`` right after the prompt, under the chosen prefill mode
        (``chunk_order`` orders ``chunks`` as :meth:`generate` would; scoring counts no retrieval)."""
        cont = check_text("continuation", continuation)
        opts = RequestOptions(mode=mode, recompute_ratio=recompute_ratio, selection=selection, chunk_order=chunk_order)
        chunks, _ = self.requests.order_chunks(chunks, prompt, opts)
        req = self._request(chunks, prefix, suffix, prompt, opts, SamplingParams(max_new_tokens=0, temperature=0.0))
        t0, ids = time.perf_counter(), self.prefiller.continuation(req, cont)
        return self._worker.call(self.prefiller.ticket(req), lambda pause: self.prefiller.score(req, ids, t0, pause))

    def lookup(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        namespace: str | None = None,
    ) -> CacheLookup:
        """How much of this prompt the cache holds now, without loading or changing anything (key
        lookups only: never a hit or a use; a request made next may still find less)."""
        opts = RequestOptions(namespace=namespace)
        sampling = SamplingParams(max_new_tokens=0, temperature=0.0)
        return self.prefiller.lookup(self._request(chunks, prefix, suffix, prompt, opts, sampling))

    # -- the engine itself ------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """What this engine runs: model, family, compute dtype and why, device, threads, context
        window, the correctness gate's verdict (see :class:`~kvrag.engine.types.EngineInfo`)."""
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
            decode=self.decoding.description(),
            blend=describe_blend(self.config),
            malloc=self.malloc,
        )

    def queue_stats(self) -> dict:
        """The engine thread's load now: ``running``, ``waiting``, ``queued_tokens``, ``decode_steps``,
        and ``busy_s`` (seconds the engine thread has had work since the engine started)."""
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
        self.parts.close()
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this engine is closed")

    def _request(self, chunks, prefix, suffix, prompt, options: RequestOptions, sampling=None) -> Request:
        self._check_open()
        return self.requests.build(chunks, prefix, suffix, prompt, options, sampling)

    def _run_job(self, job, tokens: int, *, bounded: bool = True):
        """Run ``job(pause)`` on the engine thread, queued as ``tokens`` of compute; ``bounded=False``
        for internal work (write-back) that a full queue must never refuse."""
        return self._worker.call(Ticket(tokens=tokens, compute=tokens, bounded=bounded), job)

    def _run_internal(self, job, tokens: int):
        """:meth:`_run_job` for internal work: never refused."""
        return self._run_job(job, tokens, bounded=False)
