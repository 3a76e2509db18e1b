"""The one configuration object of kvrag, its four groups of settings, and the sampling settings.

Everything a user can tune lives here, with its documented default: :class:`EngineConfig` holds
:class:`ComputeSettings`, :class:`ReuseSettings`, :class:`StoreSettings` and :class:`ServingSettings`
(each documents its fields), and ``Engine.from_pretrained`` takes any setting by name as a keyword.
This package imports without torch: names that need the engine (the selection strategies, the
eviction policies) are plain strings here, checked against their registries when the engine is built.

- :mod:`.settings`: the four groups, a field, its default and its check on one line.
- :mod:`.engine_config`: :class:`EngineConfig` (set and read flat or by group), :func:`parse_overrides`.
- :mod:`.sampling`: :class:`SamplingParams`; :mod:`.constraints`: :class:`Constraint` (its ``constraint``).
- :mod:`.values`: the names each choice accepts.
"""

# every public name of the package's modules, from their own __all__ (one list each)
from kvrag.config import constraints, engine_config, sampling, settings, values
from kvrag.config.constraints import *  # noqa: F403
from kvrag.config.engine_config import *  # noqa: F403
from kvrag.config.sampling import *  # noqa: F403
from kvrag.config.settings import *  # noqa: F403
from kvrag.config.values import *  # noqa: F403

__all__ = [*constraints.__all__, *engine_config.__all__, *settings.__all__, *sampling.__all__, *values.__all__]
