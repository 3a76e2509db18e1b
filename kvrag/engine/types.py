"""Results returned by the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = [
    "EngineInfo",
    "ChunkInfo",
    "GenerationStats",
    "Generation",
    "GenerationStream",
    "WarmResult",
    "ScoreResult",
    "CacheLookup",
]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine runs (``Engine.info()``): worth printing once when a deployment starts.

    Attributes:
        model: the model's name (a bundled model's, or its directory's or file's).
        family: the model family kvrag implements it as (``llama``, ``qwen2``, ``gemma3``, ...).
        dtype: the compute dtype of weights and KV (``float32``, ``bfloat16``, ``float16``).
        dtype_reason: why that dtype: set explicitly, or what ``dtype="auto"`` detected (e.g.
            ``"auto: the CPU has amx_bf16/avx512_bf16"``), or a given model's own dtype.
        device: the torch device.
        threads: torch intra-op threads the engine thread computes with.
        context_window: prompt + generated tokens a request may hold.
        gate_ok: the correctness gate passed: ``blend`` and ``reuse`` may run.
        gate: the gate's verdict in one line, with each check's error against the reference,
            transformers' own error in this dtype (its floor) and the tolerance applied.
        decode: the decode step's path and why: ``packed`` (bf16 on a CPU: weights fused and
            prepacked once, the same bits as the plain path; with the time it took at start-up) or
            ``plain`` (the adapter's own layer functions), and the prompt-lookup drafts a greedy
            request checks per step (``config.draft_tokens``).
        blend: what ``blend`` recomputes by default: the selection and budget, and what runs on
            chunk KV from other company (``config.other_context_selection``).
        malloc: what the process's allocator does with a prefill's large temporaries (glibc's
            thresholds fixed by ``config.tune_malloc``, or why left unchanged).
    """

    model: str
    family: str
    dtype: str
    dtype_reason: str
    device: str
    threads: int
    context_window: int
    gate_ok: bool
    gate: str
    decode: str = ""
    blend: str = ""
    malloc: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class ChunkInfo:
    """One chunk of a request: where it sits, and where its KV came from."""

    start: int
    tokens: int
    hit: bool
    source: str  # "store" (cached KV, blended), "tree" (an exact variant), "prefix" (an exact prefix), "computed"
    tier: str = ""  # for "store"/"tree": where the KV came from ("memory", "disk", ...)
    fix: float | None = None  # the reused variant's cache fix overhead (0: exact; ~CCI: foreign company)
    overlap: float | None = None  # for "store": its variant's company still before it here (beta; 0: foreign)


@dataclass(slots=True)
class GenerationStats:
    """What a request did.

    Attributes:
        mode: the prefill mode the request asked for.
        path: how its prefill ran: ``full`` (every token computed), ``prefix`` (only exact KV
            reused: an exact prefix, exact chunk variants), ``blend`` or ``reuse``. A request whose
            reuse cannot beat a full prefill (nothing cached, or too little: the engine's cost
            model) runs ``full`` or ``prefix``, and still writes back what it computed.
        path_reason: why that path (``requested``, ``nothing cached``, or the cost model's
            prediction, e.g. ``blend predicted 1.12 of a full prefill``).
        recompute_ratio: share of the blended cached tokens recomputed (``blend``): the ratio asked
            for, or with ``recompute_ratio="auto"`` the share the request measured it needed.
        auto: the budget was measured per request (``recompute_ratio="auto"`` with a probe).
        selection: the selection the ``blend`` path ran (``""`` on another path); with the default
            selection and ``recompute_ratio="auto"``, ``config.other_context_selection`` for a prompt whose
            blended chunks' KV was computed in other company (their company overlap, Cache-Craft's
            beta averaged over the blended tokens, below ``config.other_context_overlap``).
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens whose KV came from the cache (exact prefix + chunk hits).
        prefix_tokens: prompt tokens reused from the exact prefix cache.
        exact_tokens: prompt tokens whose KV was reused exactly (exact prefix + exact chunk variants,
            RAGCache's knowledge-tree hits); ``cached_tokens - exact_tokens`` were blended.
        recomputed_tokens: cached chunk tokens whose KV was recomputed through the last layer.
        computed_tokens: prompt tokens computed through the last layer (uncached text, question,
            recomputed chunk tokens).
        compute_fraction: token-layers computed / token-layers of a full prefill.
        chunk_hits / chunk_misses: chunks whose KV was / was not reused.
        chunks_found: chunks whose KV the cache held, reused or not (``path`` ``full`` computes them).
        chunks: per chunk, in prompt order.
        conversation_tokens: prompt tokens whose KV came from the conversation's previous turn
            (exact prefix + shifted history runs; included in ``cached_tokens``).
        conversation_spans: the prompt positions ``[a, b)`` those tokens occupy.
        deduplicated_chunks: chunk occurrences dropped from the prompt because an earlier turn of
            the conversation placed them and that copy is still in the prompt; counts the history
            too (its turns were deduplicated the same way, so it matches the kept KV).
        completion_tokens: tokens generated.
        decode_steps: decode passes the request took after its first token.
        draft_tokens / draft_accepted: prompt-lookup drafts checked in its decode steps, and those
            that matched the model's own greedy pick (each one a token emitted without a step of
            its own; :mod:`kvrag.engine.serving.drafts`). How many are checked follows the decode
            passes the engine has timed, so these (and ``decode_steps``) vary from run to run; the
            tokens do not.
        prefill_s: seconds from the request to the first token (same as ``Generation.ttft_s``).
        decode_s: seconds spent after the first token.
    """

    mode: str
    recompute_ratio: float
    prompt_tokens: int
    path: str = ""
    path_reason: str = ""
    auto: bool = False
    selection: str = ""
    cached_tokens: int = 0
    prefix_tokens: int = 0
    exact_tokens: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    compute_fraction: float = 1.0
    chunk_hits: int = 0
    chunk_misses: int = 0
    chunks_found: int = 0
    chunks: list[ChunkInfo] = field(default_factory=list)
    conversation_tokens: int = 0
    conversation_spans: list[tuple[int, int]] = field(default_factory=list)
    deduplicated_chunks: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GenerationStats:
        """The inverse of :meth:`to_dict` (stats sent as JSON by ``kvrag serve``); unknown keys are ignored."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["chunks"] = [ChunkInfo(**c) for c in known.get("chunks", [])]
        known["conversation_spans"] = [(int(a), int(b)) for a, b in known.get("conversation_spans", [])]
        return cls(**known)


@dataclass(slots=True)
class Generation:
    """A finished generation.

    Attributes:
        text: the generated text (cut before a stop string).
        token_ids: generated token ids (without the end-of-sequence token).
        finish_reason: ``stop`` (end of sequence or a stop string) or ``length``.
        ttft_s: time to first token, seconds.
        total_s: time of the whole request, seconds.
        stats: what the request did.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    ttft_s: float
    total_s: float
    stats: GenerationStats


class GenerationStream:
    """Iterator over generated text pieces; ``generation`` holds the result once exhausted."""

    def __init__(self, gen) -> None:
        self._gen = gen
        self.generation: Generation | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.generation = stop.value
            raise

    def close(self) -> None:
        """Stop generating (frees the request's KV)."""
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(slots=True)
class WarmResult:
    """What ``Engine.warm`` did: chunks newly computed, chunks already cached, tokens covered, and
    second variants computed (``warm_variants=2``)."""

    computed: int
    cached: int
    tokens: int
    seconds: float
    variants: int = 0


@dataclass(slots=True)
class ScoreResult:
    """Log-likelihood of a continuation after a prompt."""

    logprob: float  # sum over the continuation's tokens (natural log)
    tokens: int
    token_logprobs: list[float]
    stats: GenerationStats


@dataclass(slots=True)
class CacheLookup:
    """How much of a prompt the cache holds now (``Engine.lookup``: key lookups, nothing loaded).

    Attributes:
        prompt_tokens: tokens in the prompt.
        prefix_tokens: leading tokens held exactly in the prefix cache.
        chunks: the prompt's chunks.
        chunks_stored: of those, chunks with at least one stored KV (past the exact prefix).
        chunk_tokens_stored: the tokens of those chunks.
    """

    prompt_tokens: int
    prefix_tokens: int
    chunks: int
    chunks_stored: int
    chunk_tokens_stored: int

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV a request would find (the last token is always computed)."""
        return min(self.prompt_tokens - 1, self.prefix_tokens + self.chunk_tokens_stored)
