"""A request's arguments, validated once: one clear error per bad input."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from kvrag.config import MODES, EngineConfig, SamplingParams, check_ratio
from kvrag.engine.reuse.segments import Segment
from kvrag.engine.reuse.selection import check_selection as registered
from kvrag.errors import InvalidRequestError

__all__ = [
    "Request",
    "RequestArgs",
    "check_request_args",
    "check_text",
    "check_chunks",
    "check_mode",
    "check_selection",
    "check_dedup",
    "check_namespace",
    "request_parts",
]


@dataclass(slots=True, kw_only=True)
class Request:
    """A validated request, ready to plan."""

    segments: list[Segment]
    ids: torch.Tensor  # [N]
    mode: str
    ratio: float | str  # a share, or "auto"
    sampling: SamplingParams  # resolved: no None fields
    selection: str = "probe"
    foreign_switch: bool = False  # no selection named, ratio "auto": other company runs config.foreign_selection
    quality: str = "balanced"  # the dial of ratio "auto" (EngineConfig.quality)
    namespace: str = "default"  # the tenant: cache entries and conversations of others are never seen
    conversation: str | None = None  # the conversation's key (its id, scoped to the namespace)
    deduplicated: int = 0
    conversation_spans: list | None = None
    follow: Any = None  # the kept turn of the conversation its prompt continues (reuse.conversations.Continuation)
    priced: bool = True  # the cost model may lower its path (off for a measurement of its mode: calibration)
    # speculation (serving.speculation): a speculative prefill's request (its lookups are looks, not
    # uses: access counters skip it), and the speculation a final request adopts
    speculative: bool = False
    adopt: Any = None


class RequestArgs(TypedDict, total=False):
    """The keyword arguments of :meth:`~kvrag.Engine.generate` and :meth:`~kvrag.Engine.stream`.

    Every one is optional; ``None`` takes the engine config's default.

    Attributes:
        prompt: instead of prefix/chunks/suffix, the whole prompt as one string; registered
            document texts found in it (see :meth:`~kvrag.Engine.register`) are treated as chunks.
        sampling: a :class:`~kvrag.SamplingParams`; or give its fields as the keywords below (not both).
        max_new_tokens: generation length limit.
        temperature: 0 for greedy decoding; > 0 samples (with ``top_p``).
        top_p: nucleus sampling threshold.
        stop: stop string(s); the text is cut before the first one.
        seed: sampling seed.
        mode: ``full``, ``prefix``, ``blend`` or ``reuse`` (:data:`kvrag.config.MODES`).
        recompute_ratio: share of cached chunk tokens recomputed in ``blend`` (0..1), or ``"auto"``.
        selection: which cached tokens ``blend`` recomputes, a registered selection
            (:func:`~kvrag.engine.reuse.selection.registered_selections`).
        quality: the dial of ``recompute_ratio="auto"``: ``fast``, ``balanced`` or ``faithful``
            (:data:`kvrag.config.QUALITIES`; default ``config.quality``).
        conversation_id: a turn of this conversation: the KV of its previous turn (prompt +
            answer) is reused where the new prompt repeats it (exact prefix, and shifted history
            runs in blend/reuse), and this turn is kept for the next one
            (:mod:`kvrag.engine.reuse.conversations`). ``mode="full"`` and ratio 1.0 reuse nothing.
            A call whose prompt does not continue a kept turn (a chat engine's condense or summary
            call) reuses none of the conversation's KV and is kept beside its main turn, not over it.
        dedup: drop chunks that an earlier turn of the conversation already placed in the prompt
            (CRAFT); default ``config.conversation_dedup``. Only with ``conversation_id``.
        namespace: the tenant whose cache this request uses (default ``config.namespace``):
            chunk KV, prefix blocks and conversations of one namespace are never seen by another.
        chunk_order: how ``chunks`` are put into the prompt: ``retrieval`` (default: as given) or
            ``frequency`` (CRAFT: most retrieved lately first; :mod:`kvrag.engine.reuse.access`).
    """

    prompt: str | None
    sampling: SamplingParams | None
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: str | Sequence[str] | None
    seed: int | None
    mode: str | None
    recompute_ratio: float | str | None
    selection: str | None
    quality: str | None
    conversation_id: str | None
    dedup: bool | None
    namespace: str | None
    chunk_order: str | None


_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "stop", "seed")


def check_request_args(args: dict) -> dict:
    """Request keywords as ``Engine._request`` takes them: names checked, sampling fields folded into
    one :class:`SamplingParams`."""
    unknown = sorted(set(args) - set(RequestArgs.__annotations__))
    if unknown:
        raise InvalidRequestError(
            f"unknown argument(s) {', '.join(unknown)}; requests take {', '.join(RequestArgs.__annotations__)}"
        )
    out = {k: v for k, v in args.items() if k not in _SAMPLING_FIELDS}
    out["sampling"] = SamplingParams.of(args.get("sampling"), **{k: args.get(k) for k in _SAMPLING_FIELDS})
    return out


def check_text(name: str, value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


def check_chunks(chunks) -> list[str]:
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


def check_mode(cfg: EngineConfig, mode: str | None, ratio: float | str | None) -> tuple[str, float | str]:
    mode = cfg.mode if mode is None else mode
    if mode not in MODES:
        raise InvalidRequestError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    ratio = cfg.recompute_ratio if ratio is None else check_ratio(ratio)
    return mode, (0.0 if mode == "reuse" else ratio)


def check_selection(cfg: EngineConfig, selection: str | None) -> str:
    """The request's selection (default ``cfg.selection``), registered (the registry is the one list)."""
    return registered(cfg.selection if selection is None else selection)


def request_parts(chunks, prefix, suffix, prompt, split_prompt) -> list[tuple[str, str]]:
    """The request as ("text" | "chunk", text) parts: from prefix/chunks/suffix, or from a whole
    ``prompt`` split by ``split_prompt`` (registered documents become chunks)."""
    chunks = check_chunks(chunks)
    prefix, suffix = check_text("prefix", prefix), check_text("suffix", suffix)
    if prompt is not None:
        if chunks or prefix or suffix:
            raise InvalidRequestError("give either prompt= or prefix/chunks/suffix, not both")
        return split_prompt(prompt)
    return [("text", prefix)] + [("chunk", c) for c in chunks] + [("text", suffix)]


def check_namespace(cfg: EngineConfig, namespace) -> str:
    if namespace is None:
        return cfg.namespace
    if not isinstance(namespace, str) or not namespace or "\0" in namespace:
        raise InvalidRequestError(f"namespace must be a non-empty string, got {namespace!r}")
    return namespace


def check_dedup(dedup) -> None:
    if dedup is not None and not isinstance(dedup, bool):
        raise InvalidRequestError(f"dedup must be True, False or None, got {dedup!r}")
