"""The values settings take: the names each choice accepts, and the checks other modules share."""

from __future__ import annotations

import os
from pathlib import Path

from kvrag.checks import is_number, share
from kvrag.errors import InvalidRequestError

__all__ = [
    "MODES",
    "CHUNK_CONTEXTS",
    "KV_CODECS",
    "DTYPE_NAMES",
    "WEIGHT_FORMATS",
    "AUTO",
    "QUALITIES",
    "QUALITY_SHARES",
    "OTHER_CONTEXT_RATIO",
    "default_cache_dir",
    "check_quality",
    "check_ratio",
    "check_share",
    "check_remote_url",
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
#: Dtypes of weights and KV, by name (their torch dtypes: :mod:`kvrag.engine.model.dtypes`).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: Weight formats of the decode step: the compute dtype's own (``plain``), or weight-only 8 or 4 bits.
WEIGHT_FORMATS = ("plain", "int8", "int4")
#: ``recompute_ratio="auto"``: each request recomputes what it needs (see :class:`~kvrag.config.ReuseSettings`).
AUTO = "auto"

#: The quality dial of ``recompute_ratio="auto"`` (``EngineConfig.quality``, a request's ``quality=``).
QUALITIES = ("fast", "balanced", "faithful")
#: (own context, other context): the share of a blended chunk's tokens ``"auto"`` recomputes when the
#: chunk's KV was computed in the context it has in this prompt, and when computed behind other passages
#: (``"balanced"``: ``auto_ratio`` and ``other_context_ratio``). Chosen on the dev set: docs/results.md.
QUALITY_SHARES = {"fast": (0.10, 0.10), "faithful": (0.30, 0.60)}
#: ``other_context_ratio``'s default: the share of a chunk whose KV was computed in another context that
#: ``"auto"`` recomputes at ``quality="balanced"`` on a model without calibrated shares (chosen on the
#: dev set: docs/results.md).
OTHER_CONTEXT_RATIO = 0.13

_REMOTE_SCHEMES = ("redis", "rediss", "unix")


def default_cache_dir() -> Path:
    """Per-user cache directory: ``$KVRAG_CACHE_DIR``, else the platform's user cache dir."""
    env = os.environ.get("KVRAG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrag"))


def check_quality(value) -> str:
    """``value`` if it names a quality of :data:`QUALITIES`, else one clear error that lists them."""
    if value not in QUALITIES:
        raise InvalidRequestError(f"quality must be one of {', '.join(map(repr, QUALITIES))}, got {value!r}")
    return value


def check_ratio(ratio: float | str) -> float | str:
    """Validate a recompute ratio: a number in [0, 1] (as a float), or ``"auto"``."""
    if ratio == AUTO:
        return AUTO
    if not is_number(ratio):
        raise InvalidRequestError(f"recompute_ratio must be a number in [0, 1] or 'auto', got {ratio!r}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise InvalidRequestError(f"recompute_ratio must be in [0, 1] or 'auto', got {ratio}")
    return float(ratio)


def check_share(name: str, value: float) -> float:
    """Validate a share (a number in [0, 1]), as a float."""
    return share()(name, value)


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
