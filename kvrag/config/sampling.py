"""How a request decodes (:class:`SamplingParams`), and the engine's defaults of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvrag.checks import Checked, flag, integer, is_int, number, setting
from kvrag.errors import InvalidRequestError

__all__ = [
    "SamplingParams",
    "DEFAULT_SAMPLING",
    "SAMPLING_FIELDS",
    "engine_sampling",
    "MAX_STOP_STRINGS",
    "MAX_STOP_CHARS",
]

#: Most stop strings a request may give (OpenAI takes 4): each costs the decode loop a little per
#: token, and its setup a little per character (:class:`~kvrag.engine.model.sampling.TextStream`).
MAX_STOP_STRINGS = 64
#: Most characters of one stop string.
MAX_STOP_CHARS = 256


def _stop(name: str, stop):
    if stop is None:
        return None
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {_short(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{name} takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequestError(f"{name}: each string has at most {MAX_STOP_CHARS} characters, got one of {longest}")
    return tuple(stops)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _seed(name: str, seed):
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**64):
        raise InvalidRequestError(f"{name} must be an integer in [-2**63, 2**64) (torch's range), got {seed!r}")
    return seed


@dataclass(frozen=True, slots=True)
class SamplingParams(Checked):
    """How a request decodes. ``None`` fields take the engine's defaults (``EngineConfig.sampling``).

    Pass one to :meth:`~kvrag.Engine.generate` / :meth:`~kvrag.Engine.stream` as ``sampling=``
    (or the same names as keywords)::

        engine.generate(chunks=docs, suffix=question, sampling=SamplingParams(max_new_tokens=32))

    The engine's own defaults are one of these too: ``EngineConfig(sampling=SamplingParams(max_new_tokens=32))``.

    Attributes:
        max_new_tokens: most tokens generated (an integer >= 0).
        temperature: 0 for greedy decoding; > 0 samples (with ``top_p``).
        top_p: nucleus sampling threshold in (0, 1], used when ``temperature`` > 0.
        stop: stop strings (one string or several, at most :data:`MAX_STOP_STRINGS` of at most
            :data:`MAX_STOP_CHARS` characters each); the text is cut before the first one found.
        seed: sampling seed (``None``: nondeterministic when sampling).
        ignore_eos: decode ``max_new_tokens`` whatever end-of-sequence token comes (a benchmark's
            fixed-length answers, as vLLM's and llama.cpp's ``ignore_eos``); stop strings still stop.
    """

    max_new_tokens: int | None = setting(None, integer(0, also=(None,)))
    temperature: float | None = setting(None, number(0.0, finite=True, also=(None,)))
    top_p: float | None = setting(None, number(0.0, 1.0, open_low=True, also=(None,)))
    stop: str | tuple[str, ...] | list[str] | None = setting(None, _stop)
    seed: int | None = setting(None, _seed)
    ignore_eos: bool | None = setting(None, flag(also=(None,)))

    def resolved(self, defaults: SamplingParams) -> SamplingParams:
        """Every ``None`` field taken from ``defaults`` (the engine's ``config.sampling``); ``stop`` a tuple."""
        return SamplingParams(
            max_new_tokens=defaults.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            stop=(defaults.stop if self.stop is None else self.stop) or (),
            seed=defaults.seed if self.seed is None else self.seed,
            ignore_eos=bool(defaults.ignore_eos if self.ignore_eos is None else self.ignore_eos),
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


#: The engine's default decoding (``EngineConfig.sampling``): 64 tokens, greedy (``ignore_eos`` None: stops at one).
DEFAULT_SAMPLING = SamplingParams(max_new_tokens=64, temperature=0.0, top_p=1.0, seed=None)
#: The fields of :class:`SamplingParams`, in order.
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def engine_sampling(name: str, value) -> SamplingParams:
    """The check of ``EngineConfig.sampling``: a SamplingParams or a mapping of its fields, unset
    fields from :data:`DEFAULT_SAMPLING` (so a config's defaults are always complete)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(SAMPLING_FIELDS))
        if unknown:
            raise InvalidRequestError(
                f"{name} has no field(s) {', '.join(map(str, unknown))}; its fields: {', '.join(SAMPLING_FIELDS)}"
            )
        value = SamplingParams(**value)
    if not isinstance(value, SamplingParams):
        raise InvalidRequestError(
            f"{name} must be a SamplingParams (or a mapping of its fields), got {type(value).__name__}"
        )
    given = {f: getattr(value, f) for f in SAMPLING_FIELDS if getattr(value, f) is not None}
    return dataclasses.replace(DEFAULT_SAMPLING, **given)
