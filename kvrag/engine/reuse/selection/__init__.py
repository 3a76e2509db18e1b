"""Which cached tokens a ``blend`` prefill recomputes: one registry of selection strategies.

- ``probe`` (default, :mod:`.probe`): 16-token blocks ranked by a deep-layer probe's KV deviation.
- ``hkvd`` (:mod:`.hkvd`): CacheBlend's high-KV-deviation tokens by gradual filtering from layer 1.
- ``recency`` (:mod:`.recency`): the cached tokens nearest the question.
- ``focus`` (:mod:`.focus`): whole chunks the question attends to (Cache-Craft's focused chunks),
  then the probe's most deviated blocks.
- ``craft`` (:mod:`.craft`): Cache-Craft's per-chunk budget from the fix overhead, tokens ranked
  by the attention statistics stored with the variant.
- ``epic`` (:mod:`.epic`): the first tokens of every cached chunk (EPIC's LegoLink).
- ``query`` (:mod:`.query`): the blocks the question attends to most over the cached KV, on every
  layer (ProphetKV's query-driven recompute).

A strategy is a function of a :class:`BlendPass` registered under its name, with its parameters
class and how it spends ``"auto"`` (:func:`register_selection`), in the strategy's own file: the
registry is the one list of selections (:func:`registered_selections`); every module of this
package is imported with it, so a new strategy here is one new file. ``fusion.prefill`` looks a
strategy up with :func:`get_selection`; the engine checks names and parameters with
:func:`check_selection` and :func:`configured_params`. Ablations and research baselines (the probe's
blocks in a random order, oracles) register from ``benchmarks/``.
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
from kvrag.engine.reuse.selection.epic import epic_shares, epic_tokens
from kvrag.engine.reuse.selection.hkvd import HKVDParams, HKVDSelector, keep_schedule
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
    "HKVDParams",
    "HKVDSelector",
    "keep_schedule",
    "ProbeParams",
    "BlockProbe",
    "probe_sample",
    "probe_blocks",
    "recency_window",
    "epic_shares",
    "epic_tokens",
]

# Every module of this package is imported: a strategy registers itself at the end of its own file,
# so adding one is adding that file (no list of modules here to keep in step).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
