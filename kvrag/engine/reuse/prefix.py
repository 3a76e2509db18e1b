"""Exact prefix reuse: KV of prompt prefixes kept as a hash chain of token blocks.

A prompt's tokens are cut into blocks of ``block`` tokens from position 0. Block ``i``'s key chains
the previous key with the block's tokens, so a key stands for the whole prefix up to that block
(like vLLM's prefix caching; the chain is a radix tree over blocks). A partial last block is kept
too, at segment boundaries, so a system prompt whose length is not a multiple of the block size is
still reused whole. Records hold keys without RoPE, like chunk records, and are placed back at the
same positions, so the reused KV is exactly what was computed.

A prompt's **tail** (what follows its last document chunk: the question, the assistant header) is
kept apart, named by every token before it, with the hidden state of the prompt's last token: a
prompt asked again whose KV before the tail is exact (prefix blocks, exact chunk variants, the
text between chunks: kept alike, ``kind="gap"``, named by every token before it) computes nothing
more, and its first token comes from the same hidden state as the first time.
"""

from __future__ import annotations

import hashlib

import torch

from kvrag.engine.reuse.slices import mark, marked
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey, token_bytes

__all__ = ["PrefixCache"]


class PrefixCache:
    """Lookup and insertion of exact prefix blocks in a :class:`KVStore`."""

    def __init__(self, store: KVStore, fingerprint: str, block: int) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.block = block

    def _root(self, namespace: str) -> str:
        """The chain's root: a tenant's prefixes never meet another tenant's."""
        return hashlib.sha256(f"kvrag-prefix\0{namespace}\0{self.fingerprint}".encode()).hexdigest()

    def _child(self, parent: str, tokens: list[int]) -> str:
        h = hashlib.sha256(bytes.fromhex(parent))
        h.update(len(tokens).to_bytes(4, "little"))
        h.update(token_bytes(tokens))
        return h.hexdigest()

    def lookup(
        self,
        ids: list[int],
        boundaries: list[int],
        limit: int,
        *,
        namespace: str,
        quiet: bool = False,
        slice_tokens: int = 0,
    ) -> tuple[int, list[tuple[int, KVRecord]]]:
        """Longest cached exact prefix of ``ids``, at most ``limit`` tokens (``quiet``: looks, not
        uses: :meth:`~kvrag.engine.store.base.KVStore.peek`). ``slice_tokens`` > 0 (``deterministic``):
        the prefix ends at the first block not computed in slices of that size
        (:func:`~kvrag.engine.reuse.slices.marked`).

        Returns:
            (length, [(start, record), ...]) with records covering [0, length) in order.
        """
        fetch = self.store.peek if quiet else self.store.get
        found: list[tuple[int, KVRecord]] = []
        parent, pos = self._root(namespace), 0
        while pos + self.block <= limit:
            tokens = ids[pos : pos + self.block]
            digest = self._child(parent, tokens)
            rec = fetch(StoreKey(namespace, digest), tokens)
            if rec is None or rec.meta.get("parent") != parent or not _fits(rec, slice_tokens):
                break
            found.append((pos, rec))
            parent, pos = digest, pos + self.block
        # a partial block ending at a segment boundary
        for b in sorted((b for b in boundaries if pos < b < pos + self.block and b <= limit), reverse=True):
            tokens = ids[pos:b]
            digest = self._child(parent, tokens)
            rec = fetch(StoreKey(namespace, digest), tokens)
            if rec is not None and rec.meta.get("parent") == parent and _fits(rec, slice_tokens):
                found.append((pos, rec))
                pos = b
                break
        return pos, found

    def cached_length(self, ids: list[int], limit: int, *, namespace: str) -> int:
        """How many leading tokens of ``ids`` (at most ``limit``) have full blocks in store: key
        lookups only, nothing loaded (a scheduler's estimate; :meth:`lookup` is the real thing)."""
        parent, pos = self._root(namespace), 0
        while pos + self.block <= limit:
            parent = self._child(parent, ids[pos : pos + self.block])
            if not self.store.contains(StoreKey(namespace, parent)):
                break
            pos += self.block
        return pos

    def insert(
        self,
        ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        end: int,
        boundaries: list[int],
        *,
        namespace: str,
        slices: tuple[int, ...] | None = None,
    ) -> int:
        """Store blocks of the exact prefix [0, end) that are not stored yet (or stored without the
        mark of ``slices``: replaced).

        ``k``/``v`` [L, Hkv, end - start, D] hold the pre-RoPE KV of positions [start, end); blocks
        before ``start`` are assumed stored (they were reused). ``slices``: the capture's
        :attr:`~kvrag.engine.model.runner.KVCapture.slices`, kept in each record's meta
        (:mod:`kvrag.engine.reuse.slices`). Returns the number of new records.
        """
        parent, pos, written = self._root(namespace), 0, 0
        while pos + self.block <= end:
            tokens = ids[pos : pos + self.block]
            digest = self._child(parent, tokens)
            if pos >= start:
                written += self._put(StoreKey(namespace, digest), parent, tokens, k, v, pos - start, slices)
            parent, pos = digest, pos + self.block
        tail = [b for b in boundaries if pos < b <= end and b - pos < self.block]
        if tail and pos >= start:
            b = max(tail)
            tokens = ids[pos:b]
            key = StoreKey(namespace, self._child(parent, tokens))
            written += self._put(key, parent, tokens, k, v, pos - start, slices)
        return written

    def tail_key(self, before: str, tokens: list[int], namespace: str, kind: str = "tail") -> StoreKey:
        """Where a tail's (or, ``kind="gap"``, text between chunks') KV is stored: behind the tokens
        whose digest is ``before`` (:class:`~kvrag.engine.reuse.variants.ExactDigest`), in a tenant's chain."""
        h = hashlib.sha256(f"kvrag-{kind}\0".encode() + bytes.fromhex(self._root(namespace)) + before.encode())
        h.update(token_bytes(tokens))
        return StoreKey(namespace, h.hexdigest())

    def lookup_tail(
        self,
        before: str,
        tokens: list[int],
        *,
        namespace: str,
        quiet: bool = False,
        kind: str = "tail",
        slice_tokens: int = 0,
    ) -> KVRecord | None:
        """The tail ``tokens`` held behind ``before`` with its last hidden state (``kind="gap"``: text
        between chunks, no hidden state), or None (``slice_tokens``: as :meth:`lookup`'s)."""
        key = self.tail_key(before, tokens, namespace, kind)
        if not self.store.contains(key):  # a request's tail is new more often than not: no miss counted
            return None
        rec = (self.store.peek if quiet else self.store.get)(key, tokens)
        if rec is None or rec.kind != kind or (kind == "tail" and "last_hidden" not in rec.stats):
            return None
        if not _fits(rec, slice_tokens):
            return None
        return rec

    def insert_gap(
        self,
        before: str,
        tokens: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        namespace: str,
        slices: tuple[int, ...] | None = None,
    ) -> int:
        """Keep the pre-RoPE KV ``k``/``v`` [L, Hkv, T, D] of text between chunks, computed exactly
        behind ``before`` (``slices``: as :meth:`insert`'s, text held without their mark replaced). Returns
        the number of new records (0 or 1)."""
        return self._insert_behind("gap", before, tokens, k, v, namespace, slices, {})

    def insert_tail(
        self,
        before: str,
        tokens: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        last_hidden: torch.Tensor,
        *,
        namespace: str,
        slices: tuple[int, ...] | None = None,
    ) -> int:
        """Keep a tail's pre-RoPE KV ``k``/``v`` [L, Hkv, T, D], computed exactly behind ``before``, and
        the prompt's last hidden state [1, E] (``slices``: as :meth:`insert`'s, a tail held without
        their mark replaced). Returns the number of new records (0 or 1)."""
        stats = {"last_hidden": last_hidden.float()}
        return self._insert_behind("tail", before, tokens, k, v, namespace, slices, stats)

    def _insert_behind(self, kind: str, before: str, tokens: list[int], k, v, namespace: str, slices, stats) -> int:
        """Keep a ``kind`` record (a tail, text between chunks) named by ``before`` and its ``tokens``."""
        key = self.tail_key(before, tokens, namespace, kind)
        if not self._replaces(key, slices):
            return 0
        meta = {"before": before} if slices is None else mark({"before": before}, *slices)
        rec = KVRecord(token_ids=torch.tensor(tokens), k=k, v=v, kind=kind, context="exact", meta=meta, stats=stats)
        return int(self.store.put(key, rec))

    def _replaces(self, key: StoreKey, slices: tuple[int, ...] | None) -> bool:
        """Whether a record computed so (``slices``) goes under ``key``: nothing is there, or what is
        there was not computed in slices of that size (it is removed: this one replaces it)."""
        if not self.store.contains(key):
            return True
        if slices is None or marked(self.store.meta(key), slices[0]):
            return False
        self.store.remove(key)
        return True

    def _put(self, key: StoreKey, parent: str, tokens: list[int], k, v, offset: int, slices=None) -> int:
        if not self._replaces(key, slices):
            return 0
        n = len(tokens)
        rec = KVRecord(
            token_ids=torch.tensor(tokens),
            k=k[:, :, offset : offset + n].clone(),
            v=v[:, :, offset : offset + n].clone(),
            kind="prefix",
            context="exact",
            meta={"parent": parent} if slices is None else mark({"parent": parent}, *slices),
        )
        return int(self.store.put(key, rec))


def _fits(rec: KVRecord, slice_tokens: int) -> bool:
    """Whether a record's KV may be reused exactly: always, or (``slice_tokens`` > 0) computed in such slices."""
    return not slice_tokens or marked(rec.meta, slice_tokens)
