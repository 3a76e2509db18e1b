"""The one configuration object of kvrag, its four groups of settings, and the sampling settings.

Everything a user can tune lives here, with its documented default: :class:`EngineConfig` holds
:class:`ComputeSettings`, :class:`ReuseSettings`, :class:`StoreSettings` and :class:`ServingSettings`
(each documents its fields), and ``Engine.from_pretrained`` takes any setting by name as a keyword.
This package imports without torch: names that need the engine (the selection strategies, the
eviction policies) are plain strings here, checked against their registries when the engine is built.

- :mod:`.settings`: the four groups, a field, its default and its check on one line.
- :mod:`.engine_config`: :class:`EngineConfig` (set and read flat or by group), :func:`parse_overrides`.
- :mod:`.sampling`: :class:`SamplingParams`. :mod:`.values`: the names each choice accepts.
"""

from kvrag.config.engine_config import (
    FLAT_FIELDS,
    GROUPS,
    RENAMED,
    EngineConfig,
    check_field_names,
    parse_overrides,
)

# transition: removed once the engine reads the new names
from kvrag.config.sampling import DEFAULT_SAMPLING, SamplingParams
from kvrag.config.settings import ComputeSettings, ReuseSettings, ServingSettings, StoreSettings
from kvrag.config.values import (
    AUTO,
    CHUNK_CONTEXTS,
    DTYPE_NAMES,
    KV_CODECS,
    MODES,
    OTHER_CONTEXT_RATIO,
    QUALITIES,
    QUALITY_SHARES,
    check_quality,
    check_ratio,
    check_remote_url,
    check_share,
    default_cache_dir,
)

__all__ = [
    "EngineConfig",
    "ComputeSettings",
    "ReuseSettings",
    "StoreSettings",
    "ServingSettings",
    "SamplingParams",
    "DEFAULT_SAMPLING",
    "FLAT_FIELDS",
    "GROUPS",
    "RENAMED",
    "parse_overrides",
    "check_field_names",
    "MODES",
    "CHUNK_CONTEXTS",
    "DTYPE_NAMES",
    "AUTO",
    "QUALITIES",
    "QUALITY_SHARES",
    "OTHER_CONTEXT_RATIO",
    "check_quality",
    "check_ratio",
    "check_share",
    "check_remote_url",
    "KV_CODECS",
    "default_cache_dir",
]
