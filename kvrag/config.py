"""The one configuration object of kvrag.

Everything a user can tune lives here, with its documented default. ``Engine.from_pretrained``
accepts any field as a keyword argument.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import InvalidRequestError

__all__ = ["EngineConfig", "MODES", "SELECTIONS", "CHUNK_CONTEXTS", "DTYPE_NAMES", "default_cache_dir"]

#: Prefill modes. ``full``: recompute every token (the fidelity reference). ``prefix``: exact reuse
#: of the longest cached token prefix, the rest computed (what vLLM/SGLang prefix caching does).
#: ``blend``: CacheBlend fusion of cached chunk KV with HKVD recompute. ``reuse``: cached chunk KV
#: used as is (recompute ratio 0).
MODES = ("full", "prefix", "blend", "reuse")
#: Which cached tokens ``blend`` recomputes: CacheBlend's high-KV-deviation tokens by gradual
#: filtering; the blocks of chunk tokens a deep-layer probe finds most changed; or the cached
#: tokens nearest the question (recomputed in full, no check layer).
SELECTIONS = ("hkvd", "probe", "recency")
#: What a chunk's KV is computed behind: a neighbouring document, or the sink token alone.
CHUNK_CONTEXTS = ("neighbor", "sink")

#: Dtypes of weights and KV, by name (their torch dtypes: :mod:`kvrag.engine.dtypes`).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_DEVIATIONS = ("k", "v", "kv")
_POLICIES = ("lru", "pgdsf")


def default_cache_dir() -> Path:
    """Per-user cache directory: ``$KVRAG_CACHE_DIR``, else the platform's user cache dir."""
    env = os.environ.get("KVRAG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrag"))


@dataclass(slots=True)
class EngineConfig:
    """Engine settings.

    Attributes:
        model: ``None`` for the bundled SmolLM2-135M-Instruct, or a local Hugging Face model
            directory, or a local ``.gguf`` file (Llama family: Llama, Mistral, Qwen2, SmolLM).
        dtype: compute dtype of weights and KV (``float32``, ``bfloat16``, ``float16``).
        device: torch device; kvrag runs on CPU, CUDA tensors use the Triton kernels.
        cache_dir: where converted weights and the disk tier live; default per-user cache dir.
        max_context: context window in tokens; default the model's ``max_position_embeddings``.
        num_threads: torch intra-op threads; ``None`` leaves torch's default.
        mode: default prefill mode, one of :data:`MODES`.
        recompute_ratio: default share of cached chunk tokens whose KV is recomputed in ``blend``.
        selection: which cached tokens ``blend`` recomputes: ``probe`` (default; cached chunks are cut
            into blocks of ``probe_stride`` tokens, a probe computes each block's middle token up
            to ``probe_layer``, and blocks are recomputed whole in order of that token's KV
            deviation there until the budget is spent), ``hkvd`` (CacheBlend's high-KV-deviation tokens,
            gradual filtering from ``check_layer``, all cached tokens ranked together) or
            ``recency`` (the cached tokens nearest the question, recomputed in full; no check layer).
        probe_layer: the layer the ``probe`` selection compares; ``None``: a quarter of the depth
            plus one (layer 8 of SmolLM2's 30).
        probe_stride: the block size of the ``probe`` selection (one token sampled per block).
        check_layer: the layer on which HKVD selection starts (every token's KV is recomputed there
            and compared with the cached KV). Layer 0's KV does not depend on context, so 1.
        filter_schedule: gradual filtering (CacheBlend §4.3). Entry ``i`` is the share of cached
            tokens kept after layer ``check_layer + i``, as a multiple of the recompute ratio; the
            schedule ends at the ratio itself. ``(2.0, 1.5)`` keeps 2r after the check layer, 1.5r
            after the next one and r from then on.
        deviation: what the per-token KV deviation compares: ``k``, ``v`` or ``kv`` (sum of both).
        prefix_block_tokens: block size of the exact prefix cache (tokens).
        prefix_cache: keep and reuse the KV of exact prompt prefixes (system prompt, instructions).
        memory_budget_bytes: byte budget of the in-memory KV tier.
        disk_tier: keep a persistent disk tier under ``cache_dir`` (``<cache_dir>/kv``, the
            per-user cache directory when ``cache_dir`` is unset), shared by every process that
            uses that directory. Off by default: an embedded library does not fill the user's
            home with gigabytes unasked, and tests and notebooks leave nothing behind; turn it on
            for KV that survives restarts and outgrows memory.
        disk_budget_bytes: byte budget of the disk tier (entry files plus their index).
        disk_dtype: dtype of KV at rest with a disk tier, in memory and on disk alike, so that a
            chunk reads back the same from either (``float16`` halves the bytes of ``float32``;
            ``float32`` keeps the KV exact). Without a disk tier, memory keeps the compute dtype.
        prefetch: stream disk hits layer by layer while the prefill computes (else read them whole first).
        loading_controller: in ``blend``, raise a request's recompute ratio while the extra
            recompute still hides under loading KV from a slower tier (CacheBlend §5.1); never
            lowers it. The ratio then depends on measured load speed, so turn it off for answers
            that must not depend on timing. The ratio used is in ``GenerationStats.recompute_ratio``.
        eviction_policy: which entry goes first when a tier is over budget: ``pgdsf`` (RAGCache's
            Greedy-Dual-Size-Frequency, with costs from the engine's own prefill times) or ``lru``.
            PGDSF is the default: on a Zipf stream over the dev passages it keeps more hits than
            LRU with the same budgets (``kvrag bench store-sim``).
        namespace: tenant of this engine's cache entries; namespaces never see each other's entries.
        chunk_context: what a chunk's KV is computed behind: ``neighbor`` (other documents — the
            ones before it in ``warm``'s list, its real context when a request computes it) or
            ``sink`` (alone behind the attention-sink token, as CacheBlend does). See
            :mod:`kvrag.engine.chunks`.
        chunk_min_tokens: texts shorter than this are not worth caching as chunks; they are computed.
        write_back: after a request, precompute and store the KV of chunks it missed.
        max_new_tokens: default generation length.
        temperature: default sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold used when temperature > 0.
        seed: default sampling seed (``None`` = nondeterministic).
        max_conversations: live conversations whose KV is kept between turns (least recently used
            dropped first; 0 keeps none). Each keeps ~``tokens x 46 KB`` (SmolLM2, fp32).
        conversation_dedup: in a conversation, drop chunks that an earlier turn already placed in
            the context (CRAFT's conversation-scoped deduplication); per call ``dedup=``.
        max_running: requests decoding at once (the one prefilling included); each holds its KV,
            up to ``(prompt + max_new_tokens) x kv_bytes_per_token`` (~46 KB a token on SmolLM2 in
            float32), so running KV stays under ``max_running x context window x 46 KB``. Others wait.
        max_queued: requests (and ``score``/``warm`` jobs) waiting to start; one more raises
            :class:`~kvrag.errors.OverloadedError`.
        max_queued_tokens: prompt tokens of the waiting requests together; a request that would pass
            it raises :class:`~kvrag.errors.OverloadedError` (one alone in the queue is always taken).
        starvation_window: among waiting requests the one with the highest cached/compute ratio
            starts first (RAGCache's cache-aware order); one that later arrivals have passed this
            many times starts next. 0 is first come, first served.
        decode_group: rows of one batched decode pass: running requests advance together, padded to
            this many rows (more take several passes), so that a request's tokens do not depend on
            how many others run (:mod:`kvrag.engine.batch`).
        prefill_slice_s: while requests are decoding, a prefill (or ``warm`` window, or ``score``)
            runs at most about this long (plus half a layer) before their next decode step. Smaller
            keeps inter-token gaps short; larger finishes the prefill sooner.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    cache_dir: str | None = None
    max_context: int | None = None
    num_threads: int | None = None
    mode: str = "blend"
    recompute_ratio: float = 0.15
    selection: str = "probe"
    check_layer: int = 1
    filter_schedule: tuple[float, ...] = (2.0, 1.5)
    deviation: str = "kv"
    probe_layer: int | None = None
    probe_stride: int = 16
    prefix_block_tokens: int = 16
    prefix_cache: bool = True
    memory_budget_bytes: int = 2 * 1024**3
    disk_tier: bool = False
    disk_budget_bytes: int = 20 * 1024**3
    disk_dtype: str = "float16"
    prefetch: bool = True
    loading_controller: bool = True
    eviction_policy: str = "pgdsf"
    namespace: str = "default"
    chunk_context: str = "neighbor"
    chunk_min_tokens: int = 1
    write_back: bool = True
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_conversations: int = 8
    conversation_dedup: bool = True
    max_running: int = 8
    max_queued: int = 64
    max_queued_tokens: int = 131072
    starvation_window: int = 32
    decode_group: int = 8
    prefill_slice_s: float = 0.1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_ratio(self.recompute_ratio)
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise InvalidRequestError(f"chunk_context must be one of {CHUNK_CONTEXTS}, got {self.chunk_context!r}")
        if self.selection not in SELECTIONS:
            raise InvalidRequestError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.deviation not in _DEVIATIONS:
            raise InvalidRequestError(f"deviation must be one of {_DEVIATIONS}, got {self.deviation!r}")
        if self.check_layer < 1:
            raise InvalidRequestError("check_layer must be >= 1 (layer 0's KV does not depend on context)")
        if self.probe_layer is not None and (isinstance(self.probe_layer, bool) or self.probe_layer < 1):
            raise InvalidRequestError("probe_layer must be >= 1 (layer 0's KV does not depend on context)")
        if isinstance(self.probe_stride, bool) or not isinstance(self.probe_stride, int) or self.probe_stride < 1:
            raise InvalidRequestError("probe_stride must be an integer >= 1")
        self.filter_schedule = tuple(float(x) for x in self.filter_schedule)
        if any(x < 1.0 for x in self.filter_schedule) or list(self.filter_schedule) != sorted(
            self.filter_schedule, reverse=True
        ):
            raise InvalidRequestError("filter_schedule must be non-increasing multiples >= 1.0")
        if self.prefix_block_tokens < 1:
            raise InvalidRequestError("prefix_block_tokens must be >= 1")
        if self.memory_budget_bytes < 0:
            raise InvalidRequestError("memory_budget_bytes must be >= 0")
        if self.disk_budget_bytes < 0:
            raise InvalidRequestError("disk_budget_bytes must be >= 0")
        if self.disk_dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"disk_dtype must be one of {DTYPE_NAMES}, got {self.disk_dtype!r}")
        if self.eviction_policy not in _POLICIES:
            raise InvalidRequestError(f"eviction_policy must be one of {_POLICIES}, got {self.eviction_policy!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise InvalidRequestError("namespace must be a non-empty string")
        if self.max_context is not None and self.max_context < 2:
            raise InvalidRequestError("max_context must be >= 2")
        if self.max_new_tokens < 0:
            raise InvalidRequestError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if (
            isinstance(self.max_conversations, bool)
            or not isinstance(self.max_conversations, int)
            or self.max_conversations < 0
        ):
            raise InvalidRequestError("max_conversations must be an integer >= 0")
        for name, least in (
            ("max_running", 1),
            ("max_queued", 1),
            ("max_queued_tokens", 1),
            ("starvation_window", 0),
            ("decode_group", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")
        s = self.prefill_slice_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < float("inf"):
            raise InvalidRequestError(f"prefill_slice_s must be a number of seconds >= 0, got {s!r}")

    def replace(self, **changes) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def resolved_probe_layer(self, n_layers: int) -> int:
        """The layer the ``probe`` selection compares, for a model of ``n_layers`` layers."""
        layer = self.probe_layer if self.probe_layer is not None else n_layers // 4 + 1
        return max(1, min(layer, n_layers - 1))

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


def check_ratio(ratio: float) -> float:
    """Validate a recompute ratio (a number in [0, 1])."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise InvalidRequestError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise InvalidRequestError(f"recompute_ratio must be in [0, 1], got {ratio}")
    return float(ratio)
