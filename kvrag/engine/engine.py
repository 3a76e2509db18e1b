"""The :class:`Engine` facade: the one public API that tests, benchmarks and integrations use."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from kvrag.config import EngineConfig
from kvrag.engine import loading
from kvrag.engine.chunks import MAX_STREAM_TOKENS, ChunkComputer, context_label
from kvrag.engine.conversations import Conversations, check_conversation_id
from kvrag.engine.costs import CostFeedback
from kvrag.engine.fusion import PrefillResult, extend, generation_stats, prefill
from kvrag.engine.model import ModelAdapter
from kvrag.engine.planner import Plan, Planner
from kvrag.engine.registry import ChunkRegistry
from kvrag.engine.requests import (
    Request,
    check_chunks,
    check_dedup,
    check_mode,
    check_sampling,
    check_selection,
    check_text,
    request_parts,
)
from kvrag.engine.sampling import TextStream, sample
from kvrag.engine.store.base import DamagedEntryError, KVStore
from kvrag.engine.store.tiered import build_store
from kvrag.engine.types import Generation, GenerationStream, ScoreResult, WarmResult
from kvrag.engine.writeback import WriteBack
from kvrag.errors import ContextLengthError, InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["Engine"]


class Engine:
    """An embedded PyTorch engine that reuses the KV cache of document chunks.

    Build it with :meth:`from_pretrained` (the bundled SmolLM2-135M-Instruct by default) or
    :meth:`from_model` (transformers objects already in memory). Calls are thread-safe: requests
    interleave at layer-pass granularity under one lock.
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
    ) -> None:
        self.config = config
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model_name = name or str(getattr(hf_model.config, "name_or_path", "") or "model")
        self.adapter = ModelAdapter(hf_model)
        self.fingerprint = loading.fingerprint_model(weights_digest, tokenizer, config.dtype)
        self.store: KVStore = store if store is not None else build_store(config)
        self.costs = CostFeedback(self.store, self.adapter.n_layers, config.loading_controller)
        window = self.adapter.max_positions
        self.context_window = min(window, config.max_context) if config.max_context else window
        bos = tokenizer.bos_token_id
        sink = bos if bos is not None else tokenizer.eos_token_id
        self.sink_ids = [int(sink)] if sink is not None else []
        self.planner = Planner(
            tokenizer,
            self.store,
            self.fingerprint,
            config.namespace,
            config.prefix_block_tokens,
            context_label(config.chunk_context, self.sink_ids),
        )
        self.chunk_computer = ChunkComputer(
            self.adapter, self.planner.tokenize, self.sink_ids, config.chunk_context, self.context_window
        )
        self.planner.kv_shape = (self.adapter.n_layers, self.adapter.n_kv_heads, self.adapter.head_dim)
        self.eos_ids = loading.eos_ids(tokenizer, hf_model)
        self.registry = ChunkRegistry()
        self.conversations = Conversations(self.adapter, config.max_conversations)
        self._lock = threading.RLock()
        self.writeback = WriteBack(config, self.store, self.planner, self.chunk_computer, self._lock)
        self._closed = False
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
        loaded = loading.load_model(config.model, config.dtype, config.device, config.resolved_cache_dir())
        return cls(
            loaded.hf_model,
            loaded.tokenizer,
            config,
            weights_digest=loaded.weights_digest,
            name=loaded.name,
            store=store,
        )

    @classmethod
    def from_model(
        cls, hf_model, tokenizer, *, config: EngineConfig | None = None, store: KVStore | None = None, **overrides
    ) -> Engine:
        """Build an engine over a transformers model and tokenizer already in memory."""
        config = (config or EngineConfig()).replace(**overrides)
        loading.check_architecture(hf_model.config)
        hf_model.eval()
        return cls(hf_model, tokenizer, config, weights_digest=loading.state_dict_digest(hf_model), store=store)

    # -- public API -------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """Tokens of a text on its own."""
        return len(self.planner.tokenize(check_text("text", text)))

    def register(self, texts: Sequence[str]) -> list[str]:
        """Record document texts so that prompts given as one string are split at them.

        Returns the texts' content ids. Texts shorter than 32 characters are not worth caching
        and are not registered.
        """
        return self.registry.register(check_chunks(texts))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages (``[{"role", "content"}]``) with the model's own chat template."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def split_prompt(self, prompt: str) -> list[tuple[str, str]]:
        """The prompt as ``(kind, text)`` parts, ``chunk`` where a registered text occurs."""
        return self.registry.split(check_text("prompt", prompt))

    def warm(self, chunks: Sequence[str]) -> WarmResult:
        """Precompute and store the KV of chunks that are not cached yet.

        With ``chunk_context="neighbor"`` (default) the list is computed as one stream in this order
        (windows of up to ``MAX_STREAM_TOKENS``; a window is skipped when all its chunks are
        cached), each chunk behind the documents before it, the first behind the list's last ones:
        closer to how they will appear inside prompts. Requests from other threads wait while a
        window computes (one prefill of up to ``MAX_STREAM_TOKENS`` tokens). With ``"sink"`` each
        chunk is computed alone behind the attention-sink token (CacheBlend).
        """
        self._check_open()
        chunks = check_chunks(chunks)
        t0 = time.perf_counter()
        docs = [ids for ids in (self.planner.tokenize(t) for t in chunks) if ids]
        limit = self.chunk_computer.max_chunk_tokens(self.context_window)
        for ids in docs:
            if len(ids) > limit:
                raise ContextLengthError(len(ids), limit, "a single chunk behind its context")
        keys = [self.planner.chunk_key(ids) for ids in docs]
        unique, seen = [], set()  # the first occurrence of each chunk
        for i, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                unique.append(i)
        window_tokens = min(MAX_STREAM_TOKENS, self.context_window)
        computed = 0
        with self.store.pinned(keys):  # a batch never evicts its own members
            # windows are cut from the whole list, cached chunks included: what was cached never moves them
            for window in self.chunk_computer.windows([docs[i] for i in unique], window_tokens):
                members = [unique[w] for w in window]
                missing = {i for i in members if not self.store.contains(keys[i])}
                if not missing:
                    continue
                first, inside = members[0], {keys[i] for i in members}
                ring = [*range(first + 1, len(docs)), *range(first)]  # round the list, ending just before it
                before = [docs[j] for j in ring if keys[j] not in inside]  # never a copy of a member
                with self._lock:
                    records = self.chunk_computer.compute_window([docs[i] for i in members], before)
                for i, record in zip(members, records):
                    if i in missing:
                        self.store.put(keys[i], record)
                computed += len(missing)
        return WarmResult(computed, len(docs) - computed, sum(len(d) for d in docs), time.perf_counter() - t0)

    def generate(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        *,
        prompt: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        mode: str | None = None,
        recompute_ratio: float | None = None,
        selection: str | None = None,
        conversation_id: str | None = None,
        dedup: bool | None = None,
    ) -> Generation:
        """Generate a completion for ``prefix + chunks + suffix``.

        Args:
            chunks: document texts, in prompt order; their KV is reused when cached.
            prefix: text before the chunks (system prompt, instructions, chat template head).
            suffix: text after the chunks (the question, the chat template's assistant header).
            prompt: instead of prefix/chunks/suffix, the whole prompt as one string; registered
                document texts found in it (see :meth:`register`) are treated as chunks.
            max_new_tokens: generation length limit (default from the config).
            temperature: 0 for greedy decoding; > 0 samples (with ``top_p``).
            stop: stop string(s); the text is cut before the first one.
            seed: sampling seed.
            mode: ``full``, ``prefix``, ``blend`` or ``reuse`` (default from the config).
            recompute_ratio: share of cached chunk tokens recomputed in ``blend`` (0..1).
            selection: which cached tokens ``blend`` recomputes, ``probe``, ``hkvd`` or ``recency``
                (default from the config; see :class:`~kvrag.config.EngineConfig`).
            conversation_id: a turn of this conversation: the KV of its previous turn (prompt +
                answer) is reused where the new prompt repeats it (exact prefix, and shifted
                history runs in blend/reuse), and this turn is kept for the next one. See
                :mod:`kvrag.engine.conversations`. ``mode="full"`` and ratio 1.0 reuse nothing.
            dedup: drop chunks that an earlier turn of the conversation already placed in the
                prompt (CRAFT); default ``config.conversation_dedup``. Only with ``conversation_id``.
        """
        stream = self.stream(
            chunks,
            prefix,
            suffix,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            mode=mode,
            recompute_ratio=recompute_ratio,
            selection=selection,
            conversation_id=conversation_id,
            dedup=dedup,
        )
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
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        mode: str | None = None,
        recompute_ratio: float | None = None,
        selection: str | None = None,
        conversation_id: str | None = None,
        dedup: bool | None = None,
    ) -> GenerationStream:
        """Like :meth:`generate`, but yields text pieces as they are decoded.

        The request is validated before this returns; ``.generation`` holds the result once the
        stream is exhausted. Its TTFT counts from this call (segmenting and tokenising the prompt
        included).
        """
        t0 = time.perf_counter()
        req = self._request(
            chunks,
            prefix,
            suffix,
            max_new_tokens,
            temperature,
            top_p,
            stop,
            seed,
            mode,
            recompute_ratio,
            prompt,
            conversation_id,
            dedup,
            selection,
        )
        return GenerationStream(self._run(req, t0))

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's kept KV and chunk set; False if it was not live."""
        return self.conversations.end(check_conversation_id(conversation_id))

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
    ) -> ScoreResult:
        """Log-likelihood of ``continuation`` right after the prompt, under the chosen prefill mode."""
        cont = check_text("continuation", continuation)
        req = self._request(
            chunks, prefix, suffix, 0, 0.0, 1.0, None, None, mode, recompute_ratio, prompt, selection=selection
        )
        cont_ids = self.planner.tokenize(cont)
        if not cont_ids:
            raise InvalidRequestError("continuation is empty")
        n = int(req.ids.shape[0])
        if n + len(cont_ids) > self.context_window:
            raise ContextLengthError(n + len(cont_ids), self.context_window, "prompt + continuation")
        t0 = time.perf_counter()
        with self._lock:
            plan, res = self._prefill(req, capacity=n + len(cont_ids))
            logits = [self.adapter.logits(res.last_hidden)]
            if len(cont_ids) > 1:
                logits.append(extend(self.adapter, res.buf, torch.tensor(cont_ids[:-1]), n))
            logp = torch.log_softmax(torch.cat(logits), dim=-1)
        per_token = logp[torch.arange(len(cont_ids)), torch.tensor(cont_ids)].tolist()
        stats = generation_stats(plan, res, self.adapter.n_layers, time.perf_counter() - t0)
        return ScoreResult(float(sum(per_token)), len(cont_ids), per_token, stats)

    def flush(self) -> None:
        """Wait until background write-back (KV of chunks seen for the first time) is stored."""
        self.writeback.flush()

    def close(self) -> None:
        """Finish pending write-back and release the store."""
        if self._closed:
            return
        self.writeback.close()
        self.store.close()
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this engine is closed")

    def _request(
        self,
        chunks,
        prefix,
        suffix,
        max_new_tokens,
        temperature,
        top_p,
        stop,
        seed,
        mode,
        ratio,
        prompt=None,
        conversation_id=None,
        dedup=None,
        selection=None,
    ) -> Request:
        self._check_open()
        cfg = self.config
        parts = request_parts(chunks, prefix, suffix, prompt, self.split_prompt)
        conversation = check_conversation_id(conversation_id)
        check_dedup(dedup)
        deduplicated = 0
        if conversation is not None and (cfg.conversation_dedup if dedup is None else dedup):
            parts, deduplicated = self.conversations.dedup(conversation, parts)
        mode, ratio = check_mode(cfg, mode, ratio)
        selection = check_selection(cfg, selection)
        sampling = check_sampling(cfg, max_new_tokens, temperature, top_p, stop, seed)
        with self._lock:  # the tokenizer memo is shared
            segments, ids = self.planner.segment(parts)
        n = int(ids.shape[0])
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give a prefix, chunks or a suffix with some text")
        if n >= self.context_window:
            raise ContextLengthError(n, self.context_window)
        return Request(segments, ids, mode, ratio, sampling, selection, conversation, deduplicated)

    def _prefill(self, req: Request, capacity: int) -> tuple[Plan, PrefillResult]:
        cfg = self.config
        use_prefix = cfg.prefix_cache and req.mode != "full"
        attempts, limit = 0, 1
        while True:
            # each failed attempt drops the damaged entry it met, so a request is planned again at
            # most once per cached entry it uses; past that (entries keep failing) it runs in full
            mode = req.mode if attempts < limit else "full"
            plan = self.planner.plan(req.segments, req.ids, mode, req.ratio, use_prefix and mode != "full")
            if attempts == 0:
                limit = len(plan.chunk_records) + len(plan.prefix_records) + 1
            attempts += 1
            if req.conversation is not None and mode != "full" and not (mode == "blend" and req.ratio >= 1.0):
                req.conversation_spans = self.conversations.attach(plan, req.conversation)
            self.costs.adjust(plan)
            capture_end = 0
            if use_prefix and mode != "full" and not (plan.mode == "blend" and plan.ratio >= 1.0):
                # prefix mode keeps the whole exact prompt (as vLLM does); the others keep the text
                # before the first chunk (system prompt, instructions), which every request repeats.
                capture_end = plan.exact_end() if mode == "prefix" else min(plan.exact_end(), plan.first_chunk_start())
            t0 = time.perf_counter()
            try:
                res = prefill(
                    self.adapter,
                    plan,
                    capacity,
                    check_layer=cfg.check_layer,
                    filter_schedule=cfg.filter_schedule,
                    deviation=cfg.deviation,
                    selection=req.selection,
                    capture_end=capture_end,
                    capture_block=cfg.prefix_block_tokens,
                    capture_chunks=self.writeback.captures(plan),
                    probe_layer=cfg.resolved_probe_layer(self.adapter.n_layers),
                    probe_stride=cfg.probe_stride,
                )
            except DamagedEntryError:  # found while streaming; the store dropped it: plan again
                if mode == "full":
                    raise
                log.debug("kvrag: a cached entry was damaged; re-planning the request", exc_info=True)
                continue
            self.costs.observe(plan, res.trace.token_layers, time.perf_counter() - t0)
            return plan, res

    def _run(self, req: Request, t0: float) -> Iterator[str]:
        n = int(req.ids.shape[0])
        sp = req.sampling
        budget = min(sp.max_new_tokens, self.context_window - n)
        generator = None
        if sp.temperature > 0 and sp.seed is not None:
            generator = torch.Generator().manual_seed(int(sp.seed))
        with self._lock:
            plan, res = self._prefill(req, capacity=n + max(budget, 0))
            logits = self.adapter.logits(res.last_hidden)[0]
        token = sample(logits, sp.temperature, sp.top_p, generator)
        ttft = time.perf_counter() - t0
        stats = generation_stats(plan, res, self.adapter.n_layers, ttft)
        stats.conversation_spans = list(req.conversation_spans or [])
        stats.conversation_tokens = sum(b - a for a, b in stats.conversation_spans)
        stats.deduplicated_chunks = req.deduplicated
        self.writeback.schedule(plan, res)
        text = TextStream(self.tokenizer, sp.stop)
        finish = "length"
        pos = n
        generated: list[int] = []
        buf = res.buf
        while len(generated) < budget:
            if token in self.eos_ids:
                finish = "stop"
                break
            generated.append(token)
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                finish = "stop"
                break
            if len(generated) >= budget:
                break
            with self._lock:
                logits = extend(self.adapter, buf, torch.tensor([token]), pos)[0]
            pos += 1
            token = sample(logits, sp.temperature, sp.top_p, generator)
        tail = text.flush()
        if tail:
            yield tail
        if req.conversation is not None:
            chunk_texts = [s.text for s in plan.segments if s.kind == "chunk"]
            with self._lock:
                self.conversations.record(req.conversation, req.ids.tolist() + generated, buf, chunk_texts)
        total = time.perf_counter() - t0
        stats.completion_tokens = len(generated)
        stats.decode_s = total - ttft
        return Generation(text.text, generated, finish, ttft, total, stats)
