"""The four groups of engine settings: what a field means, its default and its check, side by side.

Each group is a frozen dataclass; its fields name their checks (:mod:`kvrag.checks`), run when one
is built. What users set comes first in each group, then the advanced settings (their defaults fit
most uses). Names that need the engine (selections, eviction policies) are plain strings here,
checked against their registries when the engine is built: this module imports without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvrag.checks import Checked, flag, integer, number, one_of, setting, share, text
from kvrag.config.sampling import DEFAULT_SAMPLING, SamplingParams, engine_sampling
from kvrag.config.values import (
    AUTO,
    CHUNK_CONTEXTS,
    DTYPE_NAMES,
    KV_CODECS,
    MODES,
    OTHER_CONTEXT_RATIO,
    WEIGHT_FORMATS,
    check_quality,
    check_ratio,
    check_remote_url,
)
from kvrag.errors import InvalidRequestError

__all__ = ["ComputeSettings", "ReuseSettings", "StoreSettings", "ServingSettings"]


def _selection_params(name: str, params) -> dict[str, object] | None:
    """``selection_params`` as a dict with sorted string keys (lists as tuples), or ``None``; the values
    are the strategy's to check (:func:`kvrag.engine.reuse.selection.selection_params`)."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise InvalidRequestError(f"{name} must be a mapping of parameter names to values, or None, got {params!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in sorted(params.items())}


def _ratio(name: str, value):
    return check_ratio(value)


def _quality(name: str, value):
    return check_quality(value)


def _remote_url(name: str, value):
    return None if value is None else check_remote_url(value)


@dataclass(frozen=True, slots=True)
class ComputeSettings(Checked):
    """The model and where it computes (``EngineConfig.compute``).

    Attributes:
        model: ``None``: the bundled SmolLM2-135M-Instruct; a bundled model's name (``gemma-3-270m``,
            with ``kvrag[gemma]``), a local Hugging Face model directory, a hub id already in the Hugging
            Face cache (``"org/name"``, offline) or a local ``.gguf`` file.
            Families: Llama (Llama 2/3, SmolLM2), Mistral, Qwen2, Qwen3 and Gemma 3; nothing is downloaded.
        dtype: of weights and KV: ``"auto"``, bfloat16 where the device computes it natively, else float32
            (why: :meth:`Engine.info`); or one of :data:`~kvrag.config.DTYPE_NAMES`, used as given.
        device: torch device (``cpu``); CUDA uses the Triton kernels. ``Engine.from_model`` computes
            where the model's weights are.
        num_threads: torch intra-op threads, set when the engine is built and on its thread whenever it
            starts; ``None``: torch's count when the engine is built.
        tune_malloc: a CPU engine on Linux/glibc raises malloc's mmap and trim thresholds for the process,
            so a prefill's temporaries reuse freed memory (:mod:`kvrag.engine.model.host`).
        max_context: context window in tokens; ``None``: the model's ``max_position_embeddings``.
        weights: the decode step's weights: ``"plain"`` (the compute dtype's), ``"int8"`` or ``"int4"``
            (weight-only quantized: a step streams 2x or 4x fewer bytes; prefill keeps the plain ones),
            or ``"auto"``: ``"int4"`` for a model that came quantized (a GGUF), else ``"plain"``
            (:func:`kvrag.engine.model.quantized.decode_weights`; figures: docs/results.md). A GGUF's
            quantized decode weights are kept under ``cache_dir`` beside its conversion (0.6-0.9x the file).
    """

    model: str | None = setting(None)  # checked when the engine loads it
    dtype: str = setting("auto", one_of(DTYPE_NAMES, also=(AUTO,)))
    device: str = setting("cpu")  # checked by torch when the engine is built
    num_threads: int | None = setting(None, integer(1, also=(None,)))
    tune_malloc: bool = setting(True, flag())
    max_context: int | None = setting(None, integer(2, also=(None,)))
    weights: str = setting("auto", one_of(WEIGHT_FORMATS, also=(AUTO,)))


@dataclass(frozen=True, slots=True)
class ReuseSettings(Checked):
    """How a prefill reuses cached KV (``EngineConfig.reuse``).

    Attributes:
        mode: the default prefill: ``blend`` (cached chunk KV fused, a selection of its tokens
            recomputed), ``full`` (every token: the reference), ``prefix`` or ``reuse`` (:data:`~kvrag.config.MODES`).
        recompute_ratio: share of cached chunk tokens ``blend`` recomputes (1.0 is the full prefill), or
            ``"auto"``: each request recomputes what it needs, at most ``auto_max_ratio``.
        quality: the dial of ``"auto"``: ``"fast"``, ``"balanced"`` or ``"faithful"``, the share each blended
            chunk recomputes by the context its KV was computed in (:data:`~kvrag.config.QUALITY_SHARES`).
        selection: which cached tokens ``blend`` recomputes, a registered name: ``probe`` (default) or
            ``recency`` (:mod:`kvrag.engine.reuse.selection`; ``benchmarks/`` registers research ones).
        selection_params: the selection's parameters by name (``None``: its defaults), checked by its
            parameters class when the engine is built (``probe``: ``probe_layer``, ``probe_stride``, ``deviation``).

    Advanced attributes:
        auto_max_ratio: the most ``"auto"`` recomputes, a share of the cached chunk tokens.
        auto_threshold: the probe deviation from which ``"auto"`` recomputes a block; ``None``: the one
            ``kvrag calibrate`` measured, if any (none ships; chosen on the dev set: docs/results.md).
        auto_ratio: the share ``"auto"`` recomputes at ``quality="balanced"`` where it cannot measure
            (no threshold known, or a selection without a probe).
        other_context_selection: with the default selection and ``"auto"``, what runs on chunk KV computed
            in another context; ``None``: ``selection`` always (chosen on the dev set: docs/results.md).
        other_context_ratio: the share ``other_context_selection`` recomputes of such a chunk at ``"balanced"``;
            ``kvrag calibrate``'s shares replace it unless set to another value.
        other_context_overlap: the share of a chunk's own context (Cache-Craft's beta) below which its KV
            counts as computed in another context (chosen on the dev set: docs/results.md).
        prefix_cache: keep and reuse the KV of exact prompt prefixes (system prompt, instructions).
        prefix_block_tokens: block size of the exact prefix cache, in tokens.
        deterministic: a prefill with nothing blended (``full``, exact reuse) runs its rows in fixed slices
            aligned at absolute positions, so a prompt answered from exactly stored KV gets the full
            prefill's tokens and logits bit for bit (:mod:`kvrag.engine.reuse.slices`); off by default: a
            full prefill in slices is slower (docs/results.md, "Exact reuse"), and without it exact reuse
            in bf16 rounds differently from one pass (drift ~0.02 nats/token).
        deterministic_slice_tokens: the slices' size in tokens (a multiple of ``prefix_block_tokens``
            keeps prefix blocks whole in a slice); KV stored under another size is not reused exactly.
        chunk_context: what a chunk's KV is computed behind: ``neighbor`` (the documents before it) or
            ``sink`` (the attention-sink token alone, as CacheBlend does; :mod:`kvrag.engine.reuse.chunks`).
        chunk_min_tokens: texts shorter than this are computed, never cached as chunks.
        max_variants: most variants of one chunk's KV, each computed in another context (Cache-Craft);
            a request uses the one whose context fits best; 1 keeps one.
        warm_window_tokens: most tokens ``warm()`` computes in one pass, chunks and the context behind
            them; it bounds how deep in a stream a warmed chunk sits.
        warm_variants: variants of each chunk ``warm()`` computes: 1, or 2 (the list again in reverse:
            Cache-Craft's CFO); ``None``: 2 for ``order="similar"``, else 1; never above ``max_variants``.
        write_back: after a request, compute and store the KV of the chunks it missed.
        tree_refresh: when the engine is idle, compute exactly the chunk sequences requests blended and
            keep them as exact variants (RAGCache's knowledge tree); needs ``write_back``.
        chunk_access_window: retrievals CRAFT's chunk-access table counts per namespace (``None``: all);
            the counts order ``order="frequency"`` and gate ``tree_refresh``.
        promotion_threshold: CRAFT's tau: ``tree_refresh`` keeps the leading chunks whose counts reach
            it; 1 refreshes every sequence (the trade-off: docs/results.md).
        max_conversations: conversations whose KV is kept between turns, all tenants together; past
            it, the least recently used of the tenant holding the most is dropped (docs/tenants.md);
            0 keeps none.
        conversation_dedup: in a conversation, drop chunks an earlier turn already placed (CRAFT);
            per call ``dedup=``.
        loading_controller: in ``blend``, raise a request's ratio while the extra recompute hides under
            KV loading from a slower tier (CacheBlend §5.1); off for answers that never depend on timing.
        cost_model: price each plan and serve a request whose reuse cannot beat a full prefill as one
            (:mod:`kvrag.engine.reuse.paths`); the path then depends on timing.
    """

    mode: str = setting("blend", one_of(MODES))
    recompute_ratio: float | str = setting(AUTO, _ratio)
    quality: str = setting("balanced", _quality)
    selection: str = setting("probe", text(what="the name of a selection strategy"))
    selection_params: Mapping[str, object] | None = setting(None, _selection_params)
    auto_max_ratio: float = setting(0.3, share())
    auto_threshold: float | None = setting(None, number(0.0, also=(None,)))
    auto_ratio: float = setting(0.15, share())
    other_context_selection: str | None = setting(
        "recency", text(what="the name of a selection strategy", also=(None,))
    )
    other_context_ratio: float = setting(OTHER_CONTEXT_RATIO, share())
    other_context_overlap: float = setting(0.25, share())
    prefix_cache: bool = setting(True, flag())
    prefix_block_tokens: int = setting(16, integer(1))
    deterministic: bool = setting(False, flag())
    deterministic_slice_tokens: int = setting(256, integer(1))
    chunk_context: str = setting("neighbor", one_of(CHUNK_CONTEXTS))
    chunk_min_tokens: int = setting(1, integer(0))
    max_variants: int = setting(4, integer(1))
    warm_window_tokens: int = setting(4096, integer(256))
    warm_variants: int | None = setting(None, integer(1, also=(None,)))
    write_back: bool = setting(True, flag())
    tree_refresh: bool = setting(True, flag())
    chunk_access_window: int | None = setting(1000, integer(1, also=(None,), note="None: unbounded"))
    promotion_threshold: int = setting(2, integer(1))
    max_conversations: int = setting(8, integer(0))
    conversation_dedup: bool = setting(True, flag())
    loading_controller: bool = setting(True, flag())
    cost_model: bool = setting(True, flag())

    def _check_together(self) -> None:
        w = self.warm_variants
        if w is not None and (w > 2 or w > self.max_variants):
            raise InvalidRequestError(f"warm_variants must be 1 or 2 and at most max_variants, got {w!r}")

    def __hash__(self) -> int:  # the generated one cannot: selection_params is a dict
        params = self.selection_params
        rest = (getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "selection_params")
        return hash((tuple(params.items()) if params else params, *rest))


@dataclass(frozen=True, slots=True)
class StoreSettings(Checked):
    """Where cached KV lives: memory, disk and a remote server, with their budgets (``EngineConfig.store``).

    Attributes:
        memory_budget_bytes: byte budget of the memory tier; ``"auto"``: a quarter of the machine's (or
            container's) memory, at most half of what is free (:mod:`kvrag.engine.store.budget`). Shared
            by the tenants by the fair rule (:mod:`kvrag.engine.store.tenants`).
        disk_tier: keep a persistent disk tier under ``cache_dir``, shared by the processes using it; off,
            so that a library does not fill the user's home unasked.
        cache_dir: where converted weights, calibration and the disk tier live; ``None``:
            :func:`~kvrag.config.default_cache_dir`.
        disk_budget_bytes: byte budget of the disk tier, entries and their index.
        remote_url: a Redis or Valkey server shared by processes and machines, below memory and disk
            (``redis://``, ``rediss://``, ``unix://``; docs/scale-out.md; ``kvrag[remote]``); ``None``: none.
        namespace: tenant of the engine's cache entries; namespaces never see each other's entries. A
            request may name another.

    Advanced attributes:
        kv_codec: how chunk KV is held at rest, in every tier: ``plain`` or ``int8``
            (:data:`~kvrag.config.KV_CODECS`); ``auto``: ``int8`` with a remote tier (fewer bytes), else ``plain``.
        disk_dtype: dtype of plain KV at rest with a disk or remote tier (``float16`` halves float32's bytes;
            ``float32`` keeps the KV exact).
        remote_timeout_s: seconds a remote call may take before the server counts as down.
        remote_ttl_s: seconds a remote entry lives after its last write or hit; ``None``: until evicted.
        prefetch: stream disk and remote hits in layer by layer while the prefill computes.
        eviction_policy: which entry goes first over budget: ``pgdsf`` (RAGCache's, priced by this engine's
            prefill times) or ``lru`` (:mod:`kvrag.engine.store.policy`).
    """

    memory_budget_bytes: int | str = setting(AUTO, integer(0, also=(AUTO,)))
    disk_tier: bool = setting(False, flag())
    cache_dir: str | None = setting(None)  # a path, made when the store is built
    disk_budget_bytes: int = setting(20 * 1024**3, integer(0))
    remote_url: str | None = setting(None, _remote_url)
    namespace: str = setting("default", text())
    kv_codec: str = setting(AUTO, one_of(KV_CODECS, also=(AUTO,)))
    disk_dtype: str = setting("float16", one_of(DTYPE_NAMES))
    remote_timeout_s: float = setting(1.0, number(0.0, open_low=True))
    remote_ttl_s: float | None = setting(7 * 86400.0, number(0.0, open_low=True, also=(None,)))
    prefetch: bool = setting(True, flag())
    # checked against the store's policies when the store is built (kvrag.engine.store.policy)
    eviction_policy: str = setting("pgdsf", text(what="the name of a policy"))


@dataclass(frozen=True, slots=True)
class ServingSettings(Checked):
    """How requests are decoded and scheduled (``EngineConfig.serving``).

    Attributes:
        sampling: how requests decode unless they say otherwise: a :class:`~kvrag.config.SamplingParams`
            or a mapping of its fields, unset ones from :data:`~kvrag.config.DEFAULT_SAMPLING` (64 tokens, greedy).
        max_running: requests decoding at once, the one prefilling included; each holds its KV, so this
            bounds the KV of running requests.
        max_queued: requests (and ``score``/``warm`` jobs) waiting to start; one more raises
            :class:`~kvrag.errors.OverloadedError`.
        max_queued_tokens: prompt tokens of the waiting requests together; past it
            :class:`~kvrag.errors.OverloadedError` (a request alone in the queue is always taken).

    Advanced attributes:
        starvation_window: waiting requests start by cached/compute ratio (RAGCache); one passed this
            many times starts next; 0: first come, first served.
        decode_group: rows of one batched decode pass; running requests are padded to it, so that a
            request's tokens do not depend on how many others run (:mod:`kvrag.engine.model.batch`).
        draft_tokens: most prompt-lookup drafts a decode step checks (0: none); ``None``: the device's
            default, which the engine's config then holds; the tokens are the same either way
            (:mod:`kvrag.engine.serving.drafts`).
        prefill_slice_s: while requests decode, a prefill runs about this long at most before their next
            step: smaller keeps gaps between tokens short, larger finishes the prefill sooner.
        thread_linger_s: seconds an idle engine thread waits for more work before it exits (a new one
            starts with the next request); ``None``: the thread starts when the engine is built and stays
            until ``close()`` (``kvrag serve`` sets it, so that its HTTP threads can run at a lower
            priority than the engine's: :mod:`kvrag.engine.serving.worker`).
    """

    sampling: SamplingParams = setting(DEFAULT_SAMPLING, engine_sampling)
    max_running: int = setting(8, integer(1))
    max_queued: int = setting(64, integer(1))
    max_queued_tokens: int = setting(131072, integer(1))
    starvation_window: int = setting(32, integer(0))
    decode_group: int = setting(8, integer(1))
    draft_tokens: int | None = setting(None, integer(0, also=(None,)))
    prefill_slice_s: float = setting(0.1, number(0.0, finite=True))
    thread_linger_s: float | None = setting(1.0, number(0.0, finite=True, also=(None,)))
