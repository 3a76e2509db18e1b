"""Deterministic prefill: rows computed in fixed slices aligned at absolute positions.

A prefill's GEMMs and attention round differently with another number of rows or keys (bf16 most of
all): a prompt answered from cached exact KV plus a pass over the rest would not give the bits of one
full pass. With ``slice_tokens = S`` every exact prefill (``full``, and ``prefix``/``reuse`` with
nothing blended) runs its rows in slices ``[kS, (k+1)S)`` (the last one shorter), each slice a pass
of all its rows over the keys ``[0, slice end)``. A position's KV is then a function of the tokens
before it and of its slice's shape only: the same in a full prefill and in any prompt with the same
tokens up to that slice's end where the slice was also full-size (masked keys add exact zeros).

A record of exact KV (a prefix block, an exact chunk variant, the text between two chunks, a prompt's
tail) carries the slice size it was computed under, the position up to which its KV is such for any
prompt (:func:`mark`): the end of the last full slice of the prompt that computed it, and that
prompt's length: its positions past that end, in its last, partial slice, are what a prompt of the
same length computes there (the same tokens before each position, the same slice). A prefill reuses
a slice only when cached KV so marked covers every position of it, and computes every other slice
whole (:func:`plan_slices`), so its bits are the full prefill's. Running them is
:mod:`kvrag.engine.reuse.fusion`'s (this module decides over records: no model).

Exact KV without the mark (a blend's one pass computed it; an engine without ``deterministic``) holds
the right tokens, not these bits: under ``deterministic`` the planner takes it for not held, and KV
computed in slices replaces it in the store (a request's prefill in slices, the knowledge tree's
refresh), so the same prompt again reuses its slices instead of computing them while its plan says exact.
"""

from __future__ import annotations

import torch

from kvrag.engine.store.base import KVRecord

__all__ = ["META_KEY", "mark", "marked", "canonical_end", "plan_slices"]

#: The record meta field holding ``[slice_tokens, end]`` or ``[slice_tokens, end, total]``: its KV at
#: positions below ``end`` is what a prefill in slices of ``slice_tokens`` computes there, and below
#: ``total`` what such a prefill of a ``total``-token prompt computes there.
META_KEY = "slices"


def mark(meta: dict, slice_tokens: int, end: int, total: int | None = None) -> dict:
    """``meta`` with the mark of KV computed in slices of ``slice_tokens``, canonical below ``end``
    (below ``total`` for a prompt of ``total`` tokens: the prompt that computed it was that long)."""
    found = [int(slice_tokens), int(end)] + ([] if total is None else [int(total)])
    return {**meta, META_KEY: found}


def marked(meta: dict | None, slice_tokens: int) -> bool:
    """Whether a record's ``meta`` carries the mark of KV computed in slices of ``slice_tokens``."""
    found = (meta or {}).get(META_KEY)
    return isinstance(found, (list, tuple)) and len(found) in (2, 3) and found[0] == slice_tokens


def canonical_end(rec: KVRecord, start: int, slice_tokens: int, n: int | None = None) -> int:
    """The end of the positions of ``rec`` (placed at ``start`` in a prompt of ``n`` tokens) whose KV a
    prefill in slices of ``slice_tokens`` would compute bit for bit (``start`` if none: unmarked, or
    another size)."""
    if not marked(rec.meta, slice_tokens):
        return start
    found = rec.meta[META_KEY]
    end = int(found[2]) if len(found) == 3 and n is not None and int(found[2]) == n else int(found[1])
    return max(start, min(start + rec.num_tokens, end))


def plan_slices(n: int, slice_tokens: int, canonical: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """The slices ``(start, end, reused)`` of an ``n``-token prompt: ``reused`` when the ``canonical``
    spans ``[a, b)`` (cached KV a sliced prefill computes bit for bit) cover every position of it."""
    covered = torch.zeros(n, dtype=torch.bool)
    for a, b in canonical:
        covered[a:b] = True
    out = []
    for a in range(0, n, slice_tokens):
        b = min(n, a + slice_tokens)
        out.append((a, b, bool(covered[a:b].all())))
    return out
