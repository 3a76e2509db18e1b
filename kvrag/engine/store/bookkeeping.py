"""What the tiers that read bytes (disk, remote) share: counters, warn-once messages, ``get``."""

from __future__ import annotations

import logging

from kvrag.engine.store.base import DamagedEntryError

__all__ = ["Bookkeeping"]

log = logging.getLogger("kvrag.engine.store")


class Bookkeeping:
    """Mixin: ``_count`` and ``_warn_once`` over ``self._lock``, ``self._stats`` and ``self._warned``;
    ``get`` through the tier's ``open`` and ``discard``."""

    def get(self, key, token_ids=None):
        """The whole record (every layer read and verified), or ``None`` (a miss or damage: dropped)."""
        return self._read(key, self.open(key, token_ids))

    def peek(self, key, token_ids=None):
        """``get`` as a look: no hit or miss counted, the entry's rank untouched."""
        return self._read(key, self.open(key, token_ids, quiet=True))

    def _read(self, key, entry):
        if entry is None:
            return None
        try:
            return entry.read_record()
        except (DamagedEntryError, OSError) as e:
            self.discard(key, e)
            return None
        finally:
            entry.close()

    def meta(self, key):
        """The record's ``meta`` from its verified header alone (no hit counted), or ``None``."""
        entry = self.open(key, quiet=True)
        if entry is None:
            return None
        try:
            return dict(entry.header.meta)
        finally:
            entry.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _warn_once(self, kind: str, msg: str) -> None:
        """Log ``msg`` the first time a problem of this ``kind`` shows up, never again."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning("kvrag: %s (further such warnings are suppressed)", msg)
