"""``EngineConfig``: the four groups of settings in one object, each setting also set and read by its name."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvrag.config.sampling import SAMPLING_FIELDS
from kvrag.config.settings import ComputeSettings, ReuseSettings, ServingSettings, StoreSettings
from kvrag.config.values import QUALITY_SHARES, check_quality, default_cache_dir
from kvrag.errors import InvalidRequestError

__all__ = ["EngineConfig", "GROUPS", "FLAT_FIELDS", "RENAMED", "check_field_names", "parse_overrides"]

#: The groups of :class:`EngineConfig`, by field name.
GROUPS = MappingProxyType(
    {"compute": ComputeSettings, "reuse": ReuseSettings, "store": StoreSettings, "serving": ServingSettings}
)
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
_DEFAULTS = {group: cls() for group, cls in GROUPS.items()}
#: Every setting's own name (``config.recompute_ratio``, ``EngineConfig(recompute_ratio=...)``), group by group.
FLAT_FIELDS = tuple(_GROUP_OF)

#: Settings renamed, old name -> new: the old names are still taken as keywords (``EngineConfig``,
#: ``replace``, :func:`parse_overrides`), with a ``DeprecationWarning`` naming the new one.
RENAMED = MappingProxyType(
    {
        "foreign_selection": "other_context_selection",
        "foreign_ratio": "other_context_ratio",
        "foreign_overlap": "other_context_overlap",
    }
)

#: Fields EngineConfig had before and where they went, so that old code gets one error saying
#: where to write them instead of "unexpected keyword".
_MOVED_FIELDS = {
    **dict.fromkeys(("max_new_tokens", "temperature", "top_p", "seed"), "sampling"),
    **dict.fromkeys(("probe_layer", "probe_stride", "check_layer", "filter_schedule", "deviation"), "selection_params"),
}
_KNOWN = frozenset((*FLAT_FIELDS, *GROUPS, *RENAMED))


def _new_name(old: str, stacklevel: int) -> str:
    """The new name of a renamed setting, with a ``DeprecationWarning`` (``stacklevel``: the frame it
    points at, as seen by the caller of this function)."""
    new = RENAMED[old]
    warnings.warn(f"EngineConfig's {old} is now {new}", DeprecationWarning, stacklevel=stacklevel + 1)
    return new


def _new_names(settings: dict, stacklevel: int) -> dict:
    """``settings`` with each renamed setting under its new name, a warning for each old one."""
    old = [name for name in settings if name in RENAMED]
    if not old:
        return settings
    settings = dict(settings)
    for name in old:
        if RENAMED[name] in settings:
            raise TypeError(f"{name} is the old name of {RENAMED[name]}: give {RENAMED[name]} alone")
        settings[_new_name(name, stacklevel + 1)] = settings.pop(name)
    return settings


@dataclass(slots=True, init=False)  # immutable by hand (__setattr__): frozen=True's raises TypeError on a flat name
class EngineConfig:
    """Every engine setting, in four groups; each setting is also set and read by its own name.

    The groups, each documenting its fields (``help(kvrag.ReuseSettings)``): what users set first,
    then the advanced settings, whose defaults fit most uses (the figures behind them: docs/results.md).

    - ``compute`` (:class:`~kvrag.config.ComputeSettings`), the model and where it computes: ``model``,
      ``dtype``, ``weights``, ``device``, ``num_threads``, ``tune_malloc``, ``max_context``.
    - ``reuse`` (:class:`~kvrag.config.ReuseSettings`), how a prefill reuses cached KV: ``mode``,
      ``recompute_ratio``, ``quality``, ``selection``, ``selection_params``; advanced: ``auto_max_ratio``,
      ``auto_threshold``, ``auto_ratio``, ``other_context_selection``, ``other_context_ratio``,
      ``other_context_overlap``, ``prefix_cache``, ``prefix_block_tokens``, ``deterministic``,
      ``deterministic_slice_tokens``, ``chunk_context``,
      ``chunk_min_tokens``, ``max_variants``, ``warm_window_tokens``, ``warm_variants``, ``write_back``,
      ``tree_refresh``, ``chunk_access_window``, ``promotion_threshold``, ``max_conversations``,
      ``conversation_dedup``, ``loading_controller``, ``cost_model``.
    - ``store`` (:class:`~kvrag.config.StoreSettings`), where cached KV lives: ``memory_budget_bytes``,
      ``disk_tier``, ``cache_dir``, ``disk_budget_bytes``, ``remote_url``, ``namespace``; advanced:
      ``kv_codec``, ``disk_dtype``, ``remote_timeout_s``, ``remote_ttl_s``, ``prefetch``, ``eviction_policy``.
    - ``serving`` (:class:`~kvrag.config.ServingSettings`), how requests decode and queue: ``sampling``,
      ``max_running``, ``max_queued``, ``max_queued_tokens``; advanced: ``starvation_window``,
      ``decode_group``, ``draft_tokens``, ``prefill_slice_s``, ``thread_linger_s``.

    Set a setting by its name or a whole group, or both: a setting named alone wins over its group's::

        EngineConfig(recompute_ratio=0.3, disk_tier=True)
        EngineConfig(reuse=ReuseSettings(mode="full"), namespace="team-a")
        config.replace(max_running=4)  # a copy, checked again
        Engine.from_pretrained(model, recompute_ratio=0.3)  # the same names as keywords

    and on a command line ``--config recompute_ratio=0.3 --config sampling.max_new_tokens=32``
    (:func:`~kvrag.config.parse_overrides`). Read one by its name or through its group:
    ``config.recompute_ratio`` is ``config.reuse.recompute_ratio``; :data:`~kvrag.config.FLAT_FIELDS`
    names them all and :meth:`flat` gives every value by name. A config is immutable, hashable and
    equal to another with the same values.

    Each value is checked when the config is built: one :class:`~kvrag.errors.InvalidRequestError`
    names the setting. An unknown name is a ``TypeError`` (a former field's says where it went). The
    old names ``foreign_selection``, ``foreign_ratio`` and ``foreign_overlap`` are taken, with a
    ``DeprecationWarning``, for ``other_context_selection``, ``other_context_ratio`` and ``other_context_overlap``.

    Attributes:
        compute: :class:`~kvrag.config.ComputeSettings`.
        reuse: :class:`~kvrag.config.ReuseSettings`.
        store: :class:`~kvrag.config.StoreSettings`.
        serving: :class:`~kvrag.config.ServingSettings`.
    """

    compute: ComputeSettings
    reuse: ReuseSettings
    store: StoreSettings
    serving: ServingSettings

    def __init__(
        self,
        *,
        compute: ComputeSettings | None = None,
        reuse: ReuseSettings | None = None,
        store: StoreSettings | None = None,
        serving: ServingSettings | None = None,
        **settings,
    ) -> None:
        settings = _new_names(settings, stacklevel=2)
        check_field_names(settings)
        given = {"compute": compute, "reuse": reuse, "store": store, "serving": serving}
        for name, cls in GROUPS.items():
            group = given[name]
            if group is not None and not isinstance(group, cls):
                raise InvalidRequestError(f"{name} must be a {cls.__name__}, got {type(group).__name__}")
            changes = {k: v for k, v in settings.items() if _GROUP_OF[k] == name}
            if group is None:
                group = cls(**changes) if changes else _DEFAULTS[name]
            elif changes:
                group = dataclasses.replace(group, **changes)
            object.__setattr__(self, name, group)

    def __getattr__(self, name: str):
        """A setting read by its own name: ``config.namespace`` is ``config.store.namespace``."""
        group = _GROUP_OF.get(name)
        if group is None:
            raise AttributeError(f"'EngineConfig' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __setattr__(self, name: str, value) -> None:
        raise dataclasses.FrozenInstanceError(f"an EngineConfig is immutable: config.replace({name}=...) makes a copy")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"an EngineConfig is immutable: cannot delete {name}")

    def __hash__(self) -> int:
        return hash((self.compute, self.reuse, self.store, self.serving))

    def __getstate__(self) -> tuple:
        return (self.compute, self.reuse, self.store, self.serving)

    def __setstate__(self, state: tuple) -> None:
        for name, group in zip(GROUPS, state):
            object.__setattr__(self, name, group)

    def __dir__(self) -> list[str]:
        return [*object.__dir__(self), *FLAT_FIELDS]

    def flat(self) -> dict[str, object]:
        """Every setting by its own name, in :data:`FLAT_FIELDS` order."""
        return {name: getattr(getattr(self, group), name) for name, group in _GROUP_OF.items()}

    def replace(self, **changes) -> EngineConfig:
        """A copy with some settings (by name) or groups changed, checked again.

        Raises:
            TypeError: a name that is no setting (one that moved says where to: ``max_new_tokens`` is
                ``sampling=SamplingParams(max_new_tokens=...)`` now).
        """
        changes = _new_names(changes, stacklevel=2)
        groups = {name: changes.pop(name, getattr(self, name)) for name in GROUPS}
        return EngineConfig(**groups, **changes)

    def warm_variants_for(self, order: str) -> int:
        """Variants of each chunk ``warm(order=...)`` computes (``warm_variants``, or its default)."""
        reuse = self.reuse
        return reuse.warm_variants or min(2 if order == "similar" else 1, reuse.max_variants)

    def quality_shares(self, quality: str | None = None) -> tuple[float, float]:
        """(own context, other context) shares ``"auto"`` recomputes at ``quality`` (default
        :attr:`quality`; :data:`~kvrag.config.QUALITY_SHARES`, ``"balanced"``: ``auto_ratio`` and
        ``other_context_ratio``)."""
        reuse = self.reuse
        quality = check_quality(reuse.quality if quality is None else quality)
        return QUALITY_SHARES.get(quality, (reuse.auto_ratio, reuse.other_context_ratio))

    def resolved_kv_codec(self) -> str:
        """The codec chunk KV is held in at rest (see ``kv_codec``): ``auto`` is ``int8`` with a remote
        tier, else ``plain``."""
        store = self.store
        if store.kv_codec == "auto":
            return "int8" if store.remote_url else "plain"
        return store.kv_codec

    def resolved_cache_dir(self) -> Path:
        cache_dir = self.store.cache_dir
        return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def check_field_names(names: Iterable[str]) -> None:
    """Raise unless every name is a setting of :class:`EngineConfig` (or a group, or an old name);
    a name that moved says where to.

    Raises:
        TypeError: the unknown names, sorted; for former fields, ``sampling=SamplingParams(...)`` or
            ``selection_params={...}``.
    """
    unknown = sorted(set(names) - _KNOWN)
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


def parse_overrides(pairs: Iterable[str]) -> dict:
    """Command-line ``FIELD=VALUE`` strings as :class:`EngineConfig` keyword overrides.

    A value is read as JSON when it parses (``true``, ``0.3``, ``[2.0, 1.5]``), else kept as the
    string; lists become tuples. Two fields hold several settings, each written on its own with a
    dot: ``sampling.max_new_tokens=32`` (a field of :class:`~kvrag.config.SamplingParams`) and
    ``selection_params.probe_layer=12`` (a parameter of the selection strategy); they come back as
    one mapping per field. An old name (``foreign_ratio``) comes back under its new one, with a
    ``DeprecationWarning``. Values are checked when the config (and, for the selection's parameters,
    the engine) is built.

    Raises:
        InvalidRequestError: a pair without ``=``, a name that is not a setting of EngineConfig (a
            former one, e.g. ``max_new_tokens``, says where it went), or a ``sampling.`` name that is
            not a field of SamplingParams.
    """
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if sep and key in RENAMED:
            key = _new_name(key, stacklevel=2)
        field, dot, sub = key.partition(".")
        if not sep or field not in _GROUP_OF or (dot and field not in ("sampling", "selection_params")):
            moved = _MOVED_FIELDS.get(key)
            hint = f"; {key} is {moved}.{key} now" if moved and sep else ""
            raise InvalidRequestError(
                "expected FIELD=VALUE with a field of EngineConfig (or sampling.FIELD=VALUE, "
                f"selection_params.NAME=VALUE), got {pair!r}{hint}"
            )
        if field == "sampling" and dot and sub not in SAMPLING_FIELDS:
            raise InvalidRequestError(
                f"{pair!r}: sampling has no field {sub!r}; its fields: {', '.join(SAMPLING_FIELDS)}"
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
