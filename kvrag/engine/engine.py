"""The :class:`Engine` facade: the one public API that tests, benchmarks and integrations use."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvrag.config import MODES, EngineConfig, check_ratio
from kvrag.engine import loading
from kvrag.engine.conversations import Conversations, check_conversation_id
from kvrag.engine.fusion import PrefillResult, extend, prefill
from kvrag.engine.model import ModelAdapter
from kvrag.engine.planner import Plan, Planner, Segment
from kvrag.engine.registry import ChunkRegistry
from kvrag.engine.runner import KVBuffer, KVCapture, forward
from kvrag.engine.sampling import TextStream, sample
from kvrag.engine.store.base import KVRecord, KVStore
from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.types import ChunkInfo, Generation, GenerationStats, GenerationStream, ScoreResult, WarmResult
from kvrag.errors import ContextLengthError, InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["Engine"]


@dataclass(slots=True)
class _Request:
    segments: list[Segment]
    ids: torch.Tensor
    mode: str
    ratio: float
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    conversation: str | None = None
    deduplicated: int = 0
    conversation_spans: list | None = None


def _check_text(name: str, value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _check_chunks(chunks) -> list[str]:
    if chunks is None:
        return []
    if isinstance(chunks, (str, bytes)):
        raise InvalidRequestError("chunks must be a list of strings, not a single string")
    if not isinstance(chunks, Sequence) and not hasattr(chunks, "__iter__"):
        raise InvalidRequestError(f"chunks must be a list of strings, got {type(chunks).__name__}")
    out = []
    for i, c in enumerate(chunks):
        if not isinstance(c, str):
            raise InvalidRequestError(f"chunk {i} is {type(c).__name__}; chunks must be strings (document text)")
        out.append(c)
    return out


class _Writer:
    """Runs write-back jobs (chunk precompute, prefix blocks) off the request's critical path."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvrag-writeback", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed write-back only costs a future hit
                log.warning("kvrag: write-back failed", exc_info=True)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)


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
        self.store: KVStore = store if store is not None else MemoryStore(config.memory_budget_bytes)
        window = self.adapter.max_positions
        self.context_window = min(window, config.max_context) if config.max_context else window
        bos = tokenizer.bos_token_id
        sink = bos if bos is not None else tokenizer.eos_token_id
        self.sink_ids = [int(sink)] if sink is not None else []
        self.planner = Planner(
            tokenizer, self.store, self.fingerprint, config.namespace, config.prefix_block_tokens, self.sink_ids
        )
        self.eos_ids = self._eos_ids()
        self.registry = ChunkRegistry()
        self.conversations = Conversations(self.adapter, config.max_conversations)
        self._lock = threading.RLock()
        self._writer = _Writer()
        self._pending: set = set()
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
            loaded.hf_model, loaded.tokenizer, config, weights_digest=loaded.weights_digest, name=loaded.name, store=store
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

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(getattr(self.hf_model, "generation_config", None), "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    # -- public API -------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """Tokens of a text on its own."""
        return len(self.planner.tokenize(_check_text("text", text)))

    def register(self, texts: Sequence[str]) -> list[str]:
        """Record document texts so that prompts given as one string are split at them.

        Returns the texts' content ids. Texts shorter than 32 characters are not worth caching
        and are not registered.
        """
        return self.registry.register(_check_chunks(texts))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages (``[{"role", "content"}]``) with the model's own chat template."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def split_prompt(self, prompt: str) -> list[tuple[str, str]]:
        """The prompt as ``(kind, text)`` parts, ``chunk`` where a registered text occurs."""
        return self.registry.split(_check_text("prompt", prompt))

    def warm(self, chunks: Sequence[str]) -> WarmResult:
        """Precompute and store the KV of chunks (each alone, behind the attention sink)."""
        self._check_open()
        chunks = _check_chunks(chunks)
        t0 = time.perf_counter()
        computed = cached = tokens = 0
        for text in chunks:
            ids = self.planner.tokenize(text)
            if not ids:
                continue
            if len(ids) + len(self.sink_ids) >= self.context_window:
                raise ContextLengthError(len(ids) + len(self.sink_ids), self.context_window, "a single chunk")
            tokens += len(ids)
            key = self.planner.chunk_key(ids)
            if self.store.contains(key):
                cached += 1
                continue
            with self._lock:
                self.store.put(key, self._precompute(ids))
            computed += 1
        return WarmResult(computed, cached, tokens, time.perf_counter() - t0)

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
            conversation_id: a turn of this conversation: the KV of its previous turn (prompt +
                answer) is reused where the new prompt repeats it (exact prefix, and shifted
                history runs in blend/reuse), and this turn is kept for the next one. See
                :mod:`kvrag.engine.conversations`. ``mode="full"`` and ratio 1.0 reuse nothing.
            dedup: drop chunks that an earlier turn of the conversation already placed in the
                prompt (CRAFT); default ``config.conversation_dedup``. Only with ``conversation_id``.
        """
        stream = self.stream(
            chunks, prefix, suffix, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            stop=stop, seed=seed, mode=mode, recompute_ratio=recompute_ratio, conversation_id=conversation_id,
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
        conversation_id: str | None = None,
        dedup: bool | None = None,
    ) -> GenerationStream:
        """Like :meth:`generate`, but yields text pieces as they are decoded.

        The request is validated before this returns; ``.generation`` holds the result once the
        stream is exhausted.
        """
        req = self._request(
            chunks, prefix, suffix, max_new_tokens, temperature, top_p, stop, seed, mode, recompute_ratio, prompt,
            conversation_id, dedup,
        )
        return GenerationStream(self._run(req))

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
    ) -> ScoreResult:
        """Log-likelihood of ``continuation`` right after the prompt, under the chosen prefill mode."""
        cont = _check_text("continuation", continuation)
        req = self._request(chunks, prefix, suffix, 0, 0.0, 1.0, None, None, mode, recompute_ratio, prompt)
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
        stats = self._stats(plan, res, time.perf_counter() - t0)
        return ScoreResult(float(sum(per_token)), len(cont_ids), per_token, stats)

    def flush(self) -> None:
        """Wait until background write-back (KV of chunks seen for the first time) is stored."""
        self._writer.flush()

    def close(self) -> None:
        """Finish pending write-back and release the store."""
        if self._closed:
            return
        self._writer.flush()
        self._writer.close()
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
        self, chunks, prefix, suffix, max_new_tokens, temperature, top_p, stop, seed, mode, ratio, prompt=None,
        conversation_id=None, dedup=None,
    ) -> _Request:
        self._check_open()
        cfg = self.config
        chunks = _check_chunks(chunks)
        prefix, suffix = _check_text("prefix", prefix), _check_text("suffix", suffix)
        if prompt is not None:
            if chunks or prefix or suffix:
                raise InvalidRequestError("give either prompt= or prefix/chunks/suffix, not both")
            parts = self.split_prompt(prompt)
        else:
            parts = [("text", prefix)] + [("chunk", c) for c in chunks] + [("text", suffix)]
        conversation = check_conversation_id(conversation_id)
        if dedup is not None and not isinstance(dedup, bool):
            raise InvalidRequestError(f"dedup must be True, False or None, got {dedup!r}")
        deduplicated = 0
        if conversation is not None and (cfg.conversation_dedup if dedup is None else dedup):
            parts, deduplicated = self.conversations.dedup(conversation, parts)
        mode = cfg.mode if mode is None else mode
        if mode not in MODES:
            raise InvalidRequestError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        ratio = cfg.recompute_ratio if ratio is None else check_ratio(ratio)
        if mode == "reuse":
            ratio = 0.0
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got {max_new!r}")
        temperature = cfg.temperature if temperature is None else float(temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {temperature}")
        top_p = cfg.top_p if top_p is None else float(top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        else:
            stops = list(stop)
            if not all(isinstance(s, str) for s in stops):
                raise InvalidRequestError("stop must be a string or a list of strings")
        with self._lock:  # the tokenizer memo is shared
            segments, ids = self.planner.segment(parts)
        n = int(ids.shape[0])
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give a prefix, chunks or a suffix with some text")
        if n >= self.context_window:
            raise ContextLengthError(n, self.context_window)
        seed = cfg.seed if seed is None else seed
        return _Request(segments, ids, mode, ratio, max_new, temperature, top_p, stops, seed, conversation, deduplicated)

    def _prefill(self, req: _Request, capacity: int) -> tuple[Plan, PrefillResult]:
        cfg = self.config
        use_prefix = cfg.prefix_cache and req.mode != "full"
        plan = self.planner.plan(req.segments, req.ids, req.mode, req.ratio, use_prefix)
        if req.conversation is not None and req.mode != "full" and not (req.mode == "blend" and req.ratio >= 1.0):
            req.conversation_spans = self.conversations.attach(plan, req.conversation)
        capture_end = 0
        if use_prefix and not (req.mode == "blend" and req.ratio >= 1.0):
            # prefix mode keeps the whole exact prompt (as vLLM does); the others keep the text
            # before the first chunk (system prompt, instructions), which every request repeats.
            capture_end = plan.exact_end() if req.mode == "prefix" else min(plan.exact_end(), plan.first_chunk_start())
        res = prefill(
            self.adapter, plan, capacity,
            check_layer=cfg.check_layer, filter_schedule=cfg.filter_schedule, deviation=cfg.deviation,
            selection_score=cfg.extra.get("selection_score", "deviation"),
            capture_end=capture_end, capture_block=cfg.prefix_block_tokens,
        )
        return plan, res

    def _stats(self, plan: Plan, res: PrefillResult, prefill_s: float) -> GenerationStats:
        n = plan.num_tokens
        infos = [ChunkInfo(c.start, c.length, c.hit, c.source) for c in plan.chunks]
        full_work = n * self.adapter.n_layers
        return GenerationStats(
            mode=plan.mode,
            recompute_ratio=plan.ratio,
            prompt_tokens=n,
            cached_tokens=plan.cached_tokens,
            prefix_tokens=plan.prefix_len,
            recomputed_tokens=res.recomputed_tokens,
            computed_tokens=res.computed_tokens,
            compute_fraction=res.trace.token_layers / full_work if full_work else 0.0,
            chunk_hits=sum(c.hit for c in plan.chunks),
            chunk_misses=sum(not c.hit for c in plan.chunks),
            chunks=infos,
            prefill_s=prefill_s,
        )

    def _run(self, req: _Request) -> Iterator[str]:
        t0 = time.perf_counter()
        n = int(req.ids.shape[0])
        budget = min(req.max_new_tokens, self.context_window - n)
        generator = None
        if req.temperature > 0 and req.seed is not None:
            generator = torch.Generator().manual_seed(int(req.seed))
        with self._lock:
            plan, res = self._prefill(req, capacity=n + max(budget, 0))
            logits = self.adapter.logits(res.last_hidden)[0]
        token = sample(logits, req.temperature, req.top_p, generator)
        ttft = time.perf_counter() - t0
        stats = self._stats(plan, res, ttft)
        stats.conversation_spans = list(req.conversation_spans or [])
        stats.conversation_tokens = sum(b - a for a, b in stats.conversation_spans)
        stats.deduplicated_chunks = req.deduplicated
        self._schedule_writeback(plan, res.capture)
        text = TextStream(self.tokenizer, req.stop)
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
            token = sample(logits, req.temperature, req.top_p, generator)
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

    # -- write-back ---------------------------------------------------------------------------------

    def _precompute(self, ids: list[int]) -> KVRecord:
        """KV of a chunk computed alone behind the attention-sink token (whose KV is dropped)."""
        s = len(self.sink_ids)
        full = torch.tensor(self.sink_ids + list(ids), dtype=torch.long)
        n = int(full.shape[0])
        buf = KVBuffer(self.adapter, n)
        cap = KVCapture(self.adapter, s, n)
        forward(self.adapter, buf, full, torch.arange(n), n, capture=cap)
        return KVRecord(torch.tensor(ids), cap.k, cap.v, kind="chunk", context=self.planner.sink_label)

    def _schedule_writeback(self, plan: Plan, capture: KVCapture | None) -> None:
        if capture is not None:
            ids = plan.ids.tolist()
            boundaries = plan.boundaries
            self._writer.submit(
                lambda: self.planner.prefix_cache.insert(ids, capture.k, capture.v, capture.start, capture.end, boundaries)
            )
        if not self.config.write_back or plan.mode not in ("blend", "reuse"):
            return
        for use in plan.chunks:
            if use.hit or use.key in self._pending:
                continue
            seg = plan.segments[use.index]
            if len(seg.ids) < self.config.chunk_min_tokens:
                continue
            self._pending.add(use.key)
            self._writer.submit(lambda key=use.key, ids=list(seg.ids): self._write_chunk(key, ids))

    def _write_chunk(self, key, ids: list[int]) -> None:
        try:
            if not self.store.contains(key):
                with self._lock:
                    record = self._precompute(ids)
                self.store.put(key, record)
        finally:
            self._pending.discard(key)
