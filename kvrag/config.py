"""The one configuration object of kvrag.

Everything a user can tune lives here, with its documented default. ``Engine.from_pretrained``
accepts any field as a keyword argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import InvalidRequestError

__all__ = [
    "EngineConfig",
    "parse_overrides",
    "MODES",
    "SELECTIONS",
    "CHUNK_CONTEXTS",
    "DTYPE_NAMES",
    "AUTO",
    "KV_CODECS",
    "default_cache_dir",
]

#: Prefill modes. ``full``: recompute every token (the fidelity reference). ``prefix``: exact reuse
#: of the longest cached token prefix, the rest computed (what vLLM/SGLang prefix caching does).
#: ``blend``: CacheBlend fusion of cached chunk KV with HKVD recompute. ``reuse``: cached chunk KV
#: used as is (recompute ratio 0).
MODES = ("full", "prefix", "blend", "reuse")
#: Which cached tokens ``blend`` recomputes: CacheBlend's high-KV-deviation tokens by gradual
#: filtering; the blocks of chunk tokens a deep-layer probe finds most changed; the cached
#: tokens nearest the question (recomputed in full, no check layer); or the chunks the question
#: attends to, whole, then the probe's blocks (Cache-Craft's focused chunks); or Cache-Craft's own
#: per-chunk budget from the variants' fix overhead, tokens by their stored inter-attention; or the
#: first tokens of every cached chunk (EPIC's LegoLink, recomputed in full, no check layer); or the
#: probe's blocks in a random order (an ablation: what the probe's ranking buys over chance).
SELECTIONS = ("hkvd", "probe", "recency", "focus", "craft", "epic", "random")
#: What a chunk's KV is computed behind: a neighbouring document, or the sink token alone.
CHUNK_CONTEXTS = ("neighbor", "sink")
#: How chunk KV is held at rest in a tiered store (:mod:`kvrag.engine.store.codec`): ``plain`` in
#: ``disk_dtype``; ``int8``: 8-bit codes with scales (keys per channel, values per token).
KV_CODECS = ("plain", "int8")
_REMOTE_SCHEMES = ("redis", "rediss", "unix")

#: Dtypes of weights and KV, by name (their torch dtypes: :mod:`kvrag.engine.model.dtypes`).
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
        dtype: compute dtype of weights and KV (``float32``, ``bfloat16``, ``float16``), or ``"auto"``
            (the default): bfloat16 where the device computes it natively (CPUs with AMX or
            AVX512-BF16, CUDA GPUs with bf16), float32 elsewhere (:mod:`kvrag.engine.model.dtypes`).
        device: torch device; kvrag runs on CPU, CUDA tensors use the Triton kernels.
        cache_dir: where converted weights and the disk tier live; default per-user cache dir.
        max_context: context window in tokens; default the model's ``max_position_embeddings``.
        num_threads: torch intra-op threads; ``None`` leaves torch's default.
        mode: default prefill mode, one of :data:`MODES`.
        recompute_ratio: default share of cached chunk tokens whose KV is recomputed in ``blend``, or
            ``"auto"`` (the default): each request recomputes what it needs. With the ``probe``
            selection that is every probed block whose KV deviation reaches ``auto_threshold``, at
            most ``auto_max_ratio`` of the cached tokens: little when the chunks were computed in
            this very company (exact variants need nothing), more when they come from foreign
            company. Other selections, and models without a threshold, use ``auto_ratio``.
        auto_max_ratio: the most ``"auto"`` recomputes (a share of the cached chunk tokens).
        auto_threshold: the probe deviation from which ``"auto"`` recomputes a block; ``None`` takes
            the model's calibrated value (``python -m benchmarks calibrate``; the bundled model ships one).
        auto_ratio: the share ``"auto"`` recomputes where it cannot measure (no threshold known, or
            a selection without a probe).
        selection: which cached tokens ``blend`` recomputes: ``probe`` (default; cached chunks are cut
            into blocks of ``probe_stride`` tokens, a probe computes each block's middle token up
            to ``probe_layer``, and blocks are recomputed whole in order of that token's KV
            deviation there until the budget is spent), ``hkvd`` (CacheBlend's high-KV-deviation tokens,
            gradual filtering from ``check_layer``, all cached tokens ranked together),
            ``recency`` (the cached tokens nearest the question, recomputed in full; no check layer)
            or ``epic`` (EPIC's LegoLink: the budget split evenly over the cached chunks, each
            recomputing its first tokens in full, where a chunk computed elsewhere holds an
            attention sink of its own; no check layer). ``random`` is an ablation: the probe's passes
            and blocks, picked in a random order seeded by the prompt.
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
        remote_url: a Redis or Valkey server shared by processes and machines, the tier below
            memory and disk (``redis://host:6379/0``, ``rediss://`` for TLS, ``unix:///path``);
            ``None`` for none. The password comes from the URL (``redis://:PASSWORD@host``) or,
            if the URL has none, from the ``KVRAG_REMOTE_PASSWORD`` environment variable. Set the
            server's byte budget with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
            (docs/scale-out.md). Hits stream in layer by layer and are promoted to memory; chunks a
            request computed are written through by the write-back thread. An unreachable, slow or
            lying server never fails a request: its entries are misses, one warning is logged and
            the tier is retried with backoff. Needs ``pip install 'kvrag[remote]'``.
        remote_timeout_s: seconds a remote call may take (connect, each read or write) before the
            server counts as down.
        remote_ttl_s: seconds a remote entry lives after its last write or hit (``None``: until
            the server evicts it).
        kv_codec: how chunk KV is held at rest when the store has tiers (``plain``: in
            ``disk_dtype``; ``int8``: 8-bit codes with scales, ~1.9x smaller than fp16, for tiers
            that move bytes). The codec is applied once, when a chunk is first stored, and every
            tier (memory included) holds its result, so answers never depend on the tier that
            served a chunk. ``int8`` also turns a memory-only store into one that keeps codes.
            Exact-prefix blocks stay plain. ``auto`` (default): ``int8`` when ``remote_url`` is
            set (measured on the dev bench: answer drift +0.0003 nats/token against fp16, 1.9x
            fewer bytes to move; docs/scale-out.md), ``plain`` otherwise.
        prefetch: stream disk and remote hits layer by layer while the prefill computes (else read
            them whole first).
        loading_controller: in ``blend``, raise a request's recompute ratio while the extra
            recompute still hides under loading KV from a slower tier (CacheBlend §5.1); never
            lowers it. The ratio then depends on measured load speed, so turn it off for answers
            that must not depend on timing. The ratio used is in ``GenerationStats.recompute_ratio``.
        eviction_policy: which entry goes first when a tier is over budget: ``pgdsf`` (RAGCache's
            Greedy-Dual-Size-Frequency, with costs from the engine's own prefill times) or ``lru``.
            PGDSF is the default: on a Zipf stream over the dev passages it keeps more hits than
            LRU with the same budgets (``python -m benchmarks store-sim``).
        namespace: tenant of this engine's cache entries; namespaces never see each other's entries.
        chunk_context: what a chunk's KV is computed behind: ``neighbor`` (other documents — the
            ones before it in ``warm``'s list, its real context when a request computes it) or
            ``sink`` (alone behind the attention-sink token, as CacheBlend does). See
            :mod:`kvrag.engine.reuse.chunks`.
        warm_window_tokens: most tokens ``warm()`` computes in one pass, chunks and the context
            behind them (3/8 of it at most); a chunk is computed behind the window's chunks before it,
            so this bounds how deep in a stream a warmed chunk sits.
        warm_variants: variants of each chunk ``warm()`` computes: 1, or 2 (the list is computed
            again in reverse order, so each chunk also has a variant behind the documents after it:
            a request picks the one whose context it shares more, Cache-Craft's CFO; the second is
            kept ahead of need, in room no first variant holds). ``None`` (default): 2 for a corpus
            warmed with ``order="similar"``, 1 for ``order="given"``; never more than
            ``max_variants``. 2 costs 1.5-2x the warm's time and twice the warmed chunks' bytes.
        chunk_min_tokens: texts shorter than this are not worth caching as chunks; they are computed.
        max_variants: most variants of one chunk's KV kept, each computed in another context
            (Cache-Craft); a request uses the one whose context fits it best, an exact one when the
            prompt up to the chunk is the one it was computed in (RAGCache's knowledge tree). 1
            keeps a single KV per chunk.
        write_back: after a request, precompute and store the KV of chunks it missed.
        tree_refresh: after a request that reused chunk KV computed in other company (blended, not
            exact), compute its chunk sequence exactly when the engine thread is idle and keep each
            chunk as an exact variant (RAGCache's knowledge tree): the same lead and chunks come back
            (the question reworded, asked again, by another user) reused exactly, nothing recomputed,
            the full prefill's answer. Background work: it starts only when no request waits or
            runs, and gives way within half a layer to the next request that arrives (it starts
            over when the engine is idle again; given way three times, or more than four waiting,
            it is dropped). Needs ``write_back``; its bytes count against the store's budgets like
            any variant's.
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
            how many others run (:mod:`kvrag.engine.model.batch`).
        prefill_slice_s: while requests are decoding, a prefill (or ``warm`` window, or ``score``)
            runs at most about this long (plus half a layer) before their next decode step. Smaller
            keeps inter-token gaps short; larger finishes the prefill sooner.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    cache_dir: str | None = None
    max_context: int | None = None
    num_threads: int | None = None
    mode: str = "blend"
    recompute_ratio: float | str = "auto"
    auto_max_ratio: float = 0.3
    auto_threshold: float | None = None
    auto_ratio: float = 0.15
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
    remote_url: str | None = None
    remote_timeout_s: float = 1.0
    remote_ttl_s: float | None = 7 * 86400.0
    kv_codec: str = "auto"
    prefetch: bool = True
    loading_controller: bool = True
    eviction_policy: str = "pgdsf"
    namespace: str = "default"
    chunk_context: str = "neighbor"
    warm_window_tokens: int = 4096
    warm_variants: int | None = None
    chunk_min_tokens: int = 1
    max_variants: int = 4
    write_back: bool = True
    tree_refresh: bool = True
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
        if self.dtype != AUTO and self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"dtype must be 'auto' or one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.recompute_ratio = check_ratio(self.recompute_ratio)
        check_share("auto_max_ratio", self.auto_max_ratio)
        check_share("auto_ratio", self.auto_ratio)
        if self.auto_threshold is not None and (
            isinstance(self.auto_threshold, bool)
            or not isinstance(self.auto_threshold, (int, float))
            or not self.auto_threshold >= 0
        ):
            raise InvalidRequestError(f"auto_threshold must be a number >= 0 or None, got {self.auto_threshold!r}")
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
        if self.remote_url is not None:
            check_remote_url(self.remote_url)
        if isinstance(self.remote_timeout_s, bool) or not (
            isinstance(self.remote_timeout_s, (int, float)) and self.remote_timeout_s > 0
        ):
            raise InvalidRequestError(f"remote_timeout_s must be a number > 0, got {self.remote_timeout_s!r}")
        if self.remote_ttl_s is not None and (
            isinstance(self.remote_ttl_s, bool)
            or not isinstance(self.remote_ttl_s, (int, float))
            or self.remote_ttl_s <= 0
        ):
            raise InvalidRequestError(f"remote_ttl_s must be None or a number > 0, got {self.remote_ttl_s!r}")
        if self.kv_codec != "auto" and self.kv_codec not in KV_CODECS:
            raise InvalidRequestError(f"kv_codec must be 'auto' or one of {KV_CODECS}, got {self.kv_codec!r}")
        if self.eviction_policy not in _POLICIES:
            raise InvalidRequestError(f"eviction_policy must be one of {_POLICIES}, got {self.eviction_policy!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise InvalidRequestError("namespace must be a non-empty string")
        if self.max_context is not None and self.max_context < 2:
            raise InvalidRequestError("max_context must be >= 2")
        if isinstance(self.max_variants, bool) or not isinstance(self.max_variants, int) or self.max_variants < 1:
            raise InvalidRequestError("max_variants must be an integer >= 1")
        w = self.warm_variants
        if w is not None and (isinstance(w, bool) or w not in (1, 2) or w > self.max_variants):
            raise InvalidRequestError(f"warm_variants must be 1 or 2 and at most max_variants, got {w!r}")
        for name in ("write_back", "tree_refresh"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
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
            ("warm_window_tokens", 256),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")
        s = self.prefill_slice_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < float("inf"):
            raise InvalidRequestError(f"prefill_slice_s must be a number of seconds >= 0, got {s!r}")

    def warm_variants_for(self, order: str) -> int:
        """Variants of each chunk ``warm(order=...)`` computes (``warm_variants``, or its default)."""
        return self.warm_variants or min(2 if order == "similar" else 1, self.max_variants)

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

    def resolved_kv_codec(self) -> str:
        """The codec chunk KV is held in at rest (see ``kv_codec``): ``auto`` is ``int8`` with a remote
        tier, else ``plain``."""
        if self.kv_codec == "auto":
            return "int8" if self.remote_url else "plain"
        return self.kv_codec

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


#: ``recompute_ratio="auto"``: each request recomputes what it needs (see :class:`EngineConfig`).
AUTO = "auto"


def check_remote_url(url) -> str:
    """Validate a remote tier URL (``redis://``, ``rediss://`` or ``unix://``)."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"remote_url must be a redis:// URL string, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise InvalidRequestError(f"remote_url is not a valid URL: {e}") from None
    if parts.scheme not in _REMOTE_SCHEMES:
        raise InvalidRequestError(
            f"remote_url must start with redis://, rediss:// or unix://, got scheme {parts.scheme!r}"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise InvalidRequestError("remote_url names no host (redis://HOST:PORT/DB)")
    return url


def check_ratio(ratio: float | str) -> float | str:
    """Validate a recompute ratio: a number in [0, 1], or ``"auto"``."""
    if ratio == AUTO:
        return AUTO
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise InvalidRequestError(f"recompute_ratio must be a number in [0, 1] or 'auto', got {ratio!r}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise InvalidRequestError(f"recompute_ratio must be in [0, 1] or 'auto', got {ratio}")
    return float(ratio)


def check_share(name: str, value: float) -> float:
    """Validate a share (a number in [0, 1])."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise InvalidRequestError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def parse_overrides(pairs: Iterable[str]) -> dict:
    """Command-line ``FIELD=VALUE`` strings as :class:`EngineConfig` keyword overrides.

    A value is read as JSON when it parses (``true``, ``0.3``, ``[2.0, 1.5]``), else kept as the
    string; lists become tuples. Values are checked when the config is built.

    Raises:
        InvalidRequestError: a pair without ``=`` or with a name that is not an EngineConfig field.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in fields:
            raise InvalidRequestError(f"expected FIELD=VALUE with a field of EngineConfig, got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out
