"""Selections the benchmarks register for themselves: research baselines and ablations, not product choices.

kvrag's selection registry (:mod:`kvrag.engine.reuse.selection`) is the one list of selections; the
wheel registers only those a default or a documented quality runs (``probe``, ``recency``). What
the benchmarks compare against registers here, each module at the end of its own file, when this
package is imported: :mod:`benchmarks.methods` imports it, and so ``import benchmarks``,
``python -m benchmarks`` and every method spec (``hkvd@0.15``) have them. They exist only in a
process that runs the benchmarks (a ``kvrag serve`` started on its own does not know them).

- ``hkvd`` (:mod:`.hkvd`): CacheBlend's high-KV-deviation tokens by gradual filtering from layer 1.
- ``focus`` (:mod:`.focus`): whole chunks the question attends to (Cache-Craft's focused chunks),
  then the probe's most deviated blocks.
- ``craft`` (:mod:`.craft`): Cache-Craft's per-chunk budget from the fix overhead, tokens ranked
  by the attention statistics stored with the variant.
- ``epic`` (:mod:`.epic`): the first tokens of every cached chunk (EPIC's LegoLink).
- ``query`` (:mod:`.query`): the blocks the question attends to most over the cached KV, on every
  layer (ProphetKV's query-driven recompute).
- ``random`` (:mod:`.random`): the probe's blocks in a random order (an ablation).

The research harnesses' oracles (:mod:`benchmarks.research`) register when those are imported.
"""

from benchmarks.selections.craft import craft_budgets
from benchmarks.selections.epic import epic_shares, epic_tokens
from benchmarks.selections.focus import focused_chunks
from benchmarks.selections.hkvd import HKVDParams, HKVDSelector, keep_schedule
from benchmarks.selections.query import QueryParams, question_blocks
from benchmarks.selections.random import random_blocks, random_order

__all__ = [
    "HKVDParams",
    "HKVDSelector",
    "keep_schedule",
    "epic_shares",
    "epic_tokens",
    "focused_chunks",
    "craft_budgets",
    "QueryParams",
    "question_blocks",
    "random_order",
    "random_blocks",
]
