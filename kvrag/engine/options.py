"""A request's options, defined once: what :meth:`Engine.generate` takes besides the prompt.

The integrations and the server map their arguments to :class:`RequestOptions` (their per-call
argument tables and the server's extension fields are built from :data:`OPTION_DOCS`), so a new
option is added here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvrag.config import MODES, QUALITIES, Constraint, SamplingParams, check_quality, check_ratio
from kvrag.engine.reuse.access import check_chunk_order
from kvrag.errors import InvalidRequestError

__all__ = ["RequestOptions", "OPTION_DOCS", "SAMPLING_OPTIONS", "REUSE_OPTIONS"]

#: Each option and what it does, in one line (the integrations' field descriptions, the server's
#: OpenAPI document and :class:`RequestOptions`' docstring read it).
OPTION_DOCS: Mapping[str, str] = MappingProxyType(
    {
        "max_new_tokens": "Most tokens generated; None = the engine's default.",
        "temperature": "0 = greedy; > 0 samples (with top_p); None = the engine's default (greedy).",
        "top_p": "Nucleus sampling threshold in (0, 1]; None = the engine's default.",
        "stop": "Stop strings; the output is cut before the first one found.",
        "seed": "Sampling seed (None: nondeterministic when sampling).",
        "ignore_eos": "Decode max_new_tokens whatever end-of-sequence token comes (fixed-length answers).",
        "constraint": "What the output must look like: a kvrag.Constraint (a JSON schema, any JSON object, a regex "
        "or a grammar), enforced token by token; None = free text.",
        "mode": f"Prefill mode, one of {', '.join(MODES)}; None = the engine's default (blend). full reuses nothing.",
        "recompute_ratio": "Share of cached chunk tokens blend recomputes (0..1), or 'auto' (each request "
        "recomputes what it needs); None = the engine's default (auto).",
        "selection": "Which cached tokens blend recomputes, a registered selection (probe, recency, ...); "
        "None = the engine's default.",
        "quality": f"The dial of recompute_ratio='auto', one of {', '.join(QUALITIES)}: how much blend recomputes "
        "of chunks whose KV was computed in another context; None = the engine's default (balanced).",
        "conversation_id": "A turn of this conversation: the KV of its previous turn is reused and this turn kept.",
        "dedup": "In a conversation, drop chunks an earlier turn already placed in the prompt (CRAFT).",
        "namespace": "The tenant whose cache the request uses; None = the engine's.",
        "chunk_order": "How chunks= are put in the prompt: retrieval (as given) or frequency (CRAFT).",
    }
)

#: The options that are :class:`~kvrag.SamplingParams` fields.
SAMPLING_OPTIONS = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "ignore_eos", "constraint")
#: The options that say how a prompt's cached KV is reused.
REUSE_OPTIONS = ("mode", "recompute_ratio", "selection", "quality", "conversation_id", "dedup")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOptions:
    """The options of one request; every one optional (``None``: the engine config's default).

    Pass them as keywords of :meth:`~kvrag.Engine.generate` (``engine.generate(chunks=..., mode="full")``)
    or as one value (``options=RequestOptions(mode="full")``). Values are checked when the value
    is made: a bad one raises :class:`~kvrag.errors.InvalidRequestError` naming it. What each option
    does: :data:`OPTION_DOCS`.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | tuple[str, ...] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    constraint: Constraint | None = None
    mode: str | None = None
    recompute_ratio: float | str | None = None
    selection: str | None = None
    quality: str | None = None
    conversation_id: str | None = None
    dedup: bool | None = None
    namespace: str | None = None
    chunk_order: str | None = None

    def __post_init__(self) -> None:
        sampling = self.sampling()  # checks the sampling fields; stop becomes a tuple
        object.__setattr__(self, "stop", sampling.stop)
        if self.mode is not None and self.mode not in MODES:
            raise InvalidRequestError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.recompute_ratio is not None:
            object.__setattr__(self, "recompute_ratio", check_ratio(self.recompute_ratio))
        if self.selection is not None and (not isinstance(self.selection, str) or not self.selection):
            raise InvalidRequestError(f"selection must be the name of a selection strategy, got {self.selection!r}")
        if self.quality is not None:
            check_quality(self.quality)
        if self.dedup is not None and not isinstance(self.dedup, bool):
            raise InvalidRequestError(f"dedup must be True, False or None, got {self.dedup!r}")
        if self.chunk_order is not None:
            check_chunk_order(self.chunk_order)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: RequestOptions | None = None, fields: Mapping[str, Any] | None = None) -> RequestOptions:
        """``options`` with the keyword ``fields`` that are not ``None`` on top (either may be absent).

        Raises:
            InvalidRequestError: a name that is not an option (the message lists them), or a bad value.
        """
        fields = dict(fields or {})
        unknown = sorted(set(fields) - set(cls.names()))
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(unknown)}; requests take {', '.join(cls.names())}"
            )
        if options is not None and not isinstance(options, RequestOptions):
            raise InvalidRequestError(f"options must be a RequestOptions, got {type(options).__name__}")
        given = {k: v for k, v in fields.items() if v is not None}
        if options is None:
            return cls(**given)
        return dataclasses.replace(options, **given) if given else options

    def sampling(self) -> SamplingParams:
        """The sampling options as a :class:`~kvrag.SamplingParams` (``None`` fields: the engine's defaults)."""
        return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_OPTIONS})

    def given(self) -> dict[str, Any]:
        """The options set (not ``None``), by name."""
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}
