"""Which cached tokens a ``blend`` prefill recomputes: one registry of selection strategies.

- ``probe`` (default, :mod:`.probe`): 16-token blocks ranked by a deep-layer probe's KV deviation.
- ``recency`` (:mod:`.recency`): the cached tokens nearest the question (what ``"auto"`` runs by
  default on chunks whose KV was computed in another context).

A strategy is a function of a :class:`BlendPass` registered under its name, with its parameters
class and how it spends ``"auto"`` (:func:`register_selection`), in the strategy's own file: the
registry is the one list of selections (:func:`registered_selections`); every module of this
package is imported with it, so a new strategy here is one new file. ``fusion.prefill`` looks a
strategy up with :func:`get_selection`; the engine checks names and parameters with
:func:`check_selection` and :func:`configured_params`. The wheel keeps the strategies a default or
a documented quality runs; research baselines (CacheBlend's ``hkvd``, Cache-Craft's ``focus`` and
``craft``, EPIC's ``epic``, ProphetKV's ``query``), ablations and oracles register from
``benchmarks/`` (``benchmarks.selections``) over the same API: :class:`BlendPass`, the probe's
:class:`ProbeParams`, :class:`BlockProbe` and :func:`probe_blocks`.
"""

import importlib
import pkgutil

from kvrag.engine.reuse.selection.base import (
    BlendPass,
    PrefillOptions,
    SelectionParams,
    Strategy,
    auto_kind,
    check_selection,
    configured_params,
    get_selection,
    params_class,
    register_selection,
    registered_selections,
    selection_params,
)
from kvrag.engine.reuse.selection.probe import BlockProbe, ProbeParams, probe_blocks, probe_sample
from kvrag.engine.reuse.selection.recency import recency_window

__all__ = [
    "BlendPass",
    "PrefillOptions",
    "Strategy",
    "SelectionParams",
    "register_selection",
    "get_selection",
    "check_selection",
    "registered_selections",
    "params_class",
    "selection_params",
    "configured_params",
    "auto_kind",
    "ProbeParams",
    "BlockProbe",
    "probe_sample",
    "probe_blocks",
    "recency_window",
]

# Every module of this package is imported: a strategy registers itself at the end of its own file,
# so adding one is adding that file (no list of modules here to keep in step).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
