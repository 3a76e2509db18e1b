"""Which cached tokens a ``blend`` prefill recomputes: one registry of selection strategies.

- ``probe`` (default, :mod:`.probe`): 16-token blocks ranked by a deep-layer probe's KV deviation.
- ``hkvd`` (:mod:`.hkvd`): CacheBlend's high-KV-deviation tokens by gradual filtering from layer 1.
- ``recency`` (:mod:`.recency`): the cached tokens nearest the question.
- ``focus`` (:mod:`.focus`): whole chunks the question attends to (Cache-Craft's focused chunks),
  then the probe's most deviated blocks.
- ``craft`` (:mod:`.craft`): Cache-Craft's per-chunk budget from the fix overhead, tokens ranked
  by the attention statistics stored with the variant.
- ``epic`` (:mod:`.epic`): the first tokens of every cached chunk (EPIC's LegoLink).
- ``random`` (:mod:`.random_blocks`): the probe's blocks in a random order (an ablation).

A strategy is a function of a :class:`BlendPass` registered under its name
(:func:`register_selection`); ``fusion.prefill`` looks it up with :func:`get_selection`.
"""

from kvrag.engine.reuse.selection import craft as _craft  # noqa: F401  (registers "craft")
from kvrag.engine.reuse.selection import epic as _epic  # noqa: F401  (registers "epic")
from kvrag.engine.reuse.selection import focus as _focus  # noqa: F401  (registers "focus")
from kvrag.engine.reuse.selection import hkvd as _hkvd  # noqa: F401  (registers "hkvd")
from kvrag.engine.reuse.selection import probe as _probe  # noqa: F401  (registers "probe")
from kvrag.engine.reuse.selection import random_blocks as _random  # noqa: F401  (registers "random")
from kvrag.engine.reuse.selection import recency as _recency  # noqa: F401  (registers "recency")
from kvrag.engine.reuse.selection.base import (
    BlendPass,
    Strategy,
    auto_kind,
    get_selection,
    register_selection,
    registered_selections,
)
from kvrag.engine.reuse.selection.epic import epic_shares, epic_tokens
from kvrag.engine.reuse.selection.hkvd import HKVDSelector, keep_schedule
from kvrag.engine.reuse.selection.probe import BlockProbe, probe_blocks, probe_sample
from kvrag.engine.reuse.selection.recency import recency_window

__all__ = [
    "BlendPass",
    "Strategy",
    "register_selection",
    "get_selection",
    "registered_selections",
    "auto_kind",
    "HKVDSelector",
    "keep_schedule",
    "BlockProbe",
    "probe_sample",
    "probe_blocks",
    "recency_window",
    "epic_shares",
    "epic_tokens",
]
