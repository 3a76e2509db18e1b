"""A request's arguments, validated once: one clear error per bad input."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.config import MODES, SELECTIONS, EngineConfig, check_ratio
from kvrag.engine.planner import Segment
from kvrag.errors import InvalidRequestError

__all__ = [
    "Request",
    "Sampling",
    "check_text",
    "check_chunks",
    "check_sampling",
    "check_mode",
    "check_selection",
    "check_dedup",
    "request_parts",
]


@dataclass(slots=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None


@dataclass(slots=True)
class Request:
    segments: list[Segment]
    ids: torch.Tensor  # [N]
    mode: str
    ratio: float
    sampling: Sampling
    selection: str = "probe"
    conversation: str | None = None
    deduplicated: int = 0
    conversation_spans: list | None = None


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


def check_mode(cfg: EngineConfig, mode: str | None, ratio: float | None) -> tuple[str, float]:
    mode = cfg.mode if mode is None else mode
    if mode not in MODES:
        raise InvalidRequestError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    ratio = cfg.recompute_ratio if ratio is None else check_ratio(ratio)
    return mode, (0.0 if mode == "reuse" else ratio)


def check_selection(cfg: EngineConfig, selection: str | None) -> str:
    selection = cfg.selection if selection is None else selection
    if selection not in SELECTIONS:
        raise InvalidRequestError(f"unknown selection {selection!r}; use one of {', '.join(SELECTIONS)}")
    return selection


def check_sampling(cfg: EngineConfig, max_new_tokens, temperature, top_p, stop, seed) -> Sampling:
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
    return Sampling(max_new, temperature, top_p, stops, cfg.seed if seed is None else seed)


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


def check_dedup(dedup) -> None:
    if dedup is not None and not isinstance(dedup, bool):
        raise InvalidRequestError(f"dedup must be True, False or None, got {dedup!r}")
