"""Disk KV tier: a diskcache directory of raw-bytes entries, bounded by bytes, shared by processes.

diskcache keeps an SQLite index (safe under threads and processes) and one file per entry. Its
default disk layer pickles values and unpickles what it reads; :class:`SafeDisk` replaces it so
that keys are plain strings, values are bytes written to files, and anything else found in the
index (a pickled key or value, a value kept inline) is refused, never loaded. The bytes are
:mod:`kvrag.engine.store.serial`'s format, verified on read.

Crash safety comes from diskcache's order of work: an entry's file is written completely before
the index row that points at it is committed, so a process killed mid-write leaves at most an
orphan file that no key reaches. Anything else that reads back wrong (a torn or damaged file) fails
its checksum and is a miss.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import stat
import threading
import time
from pathlib import Path

import diskcache
import torch

from kvrag.engine.model.dtypes import torch_dtype
from kvrag.engine.store import serial
from kvrag.engine.store.base import DamagedEntryError, KVRecord, KVStore, StoreKey
from kvrag.engine.store.bookkeeping import Bookkeeping
from kvrag.engine.store.codec import AtRest
from kvrag.errors import StoreError

__all__ = ["SafeDisk", "DiskStore", "DiskEntry", "UnsafeEntryError"]


class UnsafeEntryError(DamagedEntryError):
    """The index holds something kvrag never writes (a pickled key or value): refused, not loaded."""


class SafeDisk(diskcache.Disk):
    """diskcache's disk layer for raw bytes only: never pickles, never unpickles."""

    def __init__(self, directory, min_file_size=0, pickle_protocol=0):
        super().__init__(directory, min_file_size=0, pickle_protocol=pickle_protocol)

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"kvrag disk keys are strings, got {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        if not raw or type(key) is not str:
            raise UnsafeEntryError("refusing a non-raw key in the index (would need unpickling)")
        return key

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"kvrag disk values are bytes, got {type(value).__name__}")
        filename, full_path = self.filename(key, value)
        try:
            self._write(full_path, iter((value,)), "xb")
        except BaseException:
            # a full disk leaves a partial file behind: remove it, nothing points at it
            with contextlib.suppress(OSError):
                os.remove(full_path)
            raise
        return len(value), diskcache.core.MODE_BINARY, filename, None

    def fetch(self, mode, filename, value, read):
        if mode != diskcache.core.MODE_BINARY or not _is_entry_name(filename):
            raise UnsafeEntryError(f"refusing an index entry of mode {mode} (kvrag writes only raw files)")
        # no symlinks, nothing but a regular file (a planted FIFO would block the reader)
        fd = os.open(os.path.join(self._directory, filename), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeEntryError("refusing an entry that is not a regular file")
        return os.fdopen(fd, "rb")

    def remove(self, file_path):
        if _is_entry_name(file_path):  # never follow a planted path out of the directory
            super().remove(file_path)


_ENTRY_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


def _is_entry_name(name) -> bool:
    """diskcache's file names: ``xx/yy/<28 hex>.val`` under the directory."""
    return type(name) is str and _ENTRY_NAME.fullmatch(name.replace(os.sep, "/")) is not None


class DiskEntry(serial.Entry):
    """An open, header-verified entry file (closing it closes the file)."""

    def __init__(self, key: StoreKey, fh, header: serial.Header, token_ids: torch.Tensor) -> None:
        self.fd = fh.fileno()
        super().__init__(key, serial.FileSource(self.fd), header, token_ids, "disk", fh.close)


class DiskStore(Bookkeeping, KVStore):
    """A byte-bounded diskcache directory of KV entries; the lowest rank goes first.

    An entry's rank lives in the index (``access_time``), so every process sharing the directory
    evicts by the same order. ``lru``: the time of the last use. ``pgdsf``: RAGCache's priority,
    ``clock + frequency x cost`` (the frequency in ``access_count``, the cost per token in ``tag``,
    the clock in the settings table, raised to each victim's rank). A use is a disk hit, or the
    memory tier dropping its copy (the swap-out: data stays, the rank moves), so chunks kept hot in
    memory keep their disk copy too. Processes sharing a directory should use the same policy.

    Args:
        directory: the cache directory (created if needed; may be shared by processes).
        budget_bytes: most bytes on disk (entry files plus the index).
        dtype: dtype of K and V at rest (``float16``, ``bfloat16`` or ``float32``).
        policy: ``lru`` or ``pgdsf``.
        timeout: seconds to wait for the index lock before giving up (a miss or a skipped write).
        codec: ``plain`` (K/V in ``dtype``) or ``int8`` (:mod:`kvrag.engine.store.codec`). Entries of
            another representation live under other names, so processes sharing a directory with
            different codecs never serve each other's.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        budget_bytes: int,
        dtype: str = "float16",
        policy: str = "lru",
        timeout: float = 10.0,
        codec: str = "plain",
    ):
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.dtype = torch_dtype(dtype)
        self.at_rest = AtRest(codec, dtype)
        # plain keeps today's names (an existing cache stays valid); a codec gets a suffix
        self._suffix = "" if codec == "plain" else f"~{self.at_rest.tag}"
        self.policy = "pgdsf" if policy == "pgdsf" else "lru"
        self._cost_sum, self._cost_n = 0.0, 0
        try:
            self._cache = diskcache.Cache(
                str(self.directory),
                timeout=timeout,
                disk=SafeDisk,
                size_limit=self.budget_bytes,
                eviction_policy="none",
                cull_limit=0,
                statistics=False,
            )
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open the disk KV tier at {self.directory}: {e}") from e
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._stats = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "damaged": 0,
            "write_errors": 0,
            "skipped": 0,
            "written_bytes": 0,
        }

    # -- helpers ----------------------------------------------------------------------------------

    def _name(self, key: StoreKey) -> str:
        return f"{key.namespace}/{key.digest}{self._suffix}"

    def discard(self, key: StoreKey, reason: str) -> None:
        """Drop a damaged entry: count it, warn once, and remove it so that it is recomputed.

        Two readers may find the same damage at once (the prefetch thread and the prefill
        thread); only the one whose delete removed the row counts it.
        """
        try:
            removed = self._cache.delete(self._name(key), retry=True)
        except Exception:  # noqa: BLE001 - a failed cleanup only leaves a miss behind
            removed = True
        if removed:
            self._count("damaged")
            self._warn_once("damaged", f"disk KV entry {key} is unusable and is treated as a miss: {reason}")

    # -- the interface ------------------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        try:
            return self._name(key) in self._cache
        except (sqlite3.Error, diskcache.Timeout):
            return False

    def open(self, key: StoreKey, token_ids=None, *, quiet: bool = False) -> DiskEntry | None:
        """The entry's verified header and an open file, or ``None`` (miss, or damaged: dropped).
        ``quiet``: a look at the header, not a use (no hit or miss counted, its rank untouched)."""
        entry = self._open(key, token_ids)
        if not quiet:
            self._count("hits" if entry is not None else "misses")
            if entry is not None:
                self._rank(key, hit=True)
        return entry

    def _open(self, key: StoreKey, token_ids=None) -> DiskEntry | None:
        try:
            fh = self._cache.get(self._name(key), read=True)
        except (sqlite3.Error, diskcache.Timeout, OSError) as e:
            self._warn_once("io", f"disk KV tier lookup failed ({e}); treated as a miss")
            return None
        except DamagedEntryError as e:  # refused by SafeDisk (pickled key or value in the index)
            self.discard(key, str(e))
            return None
        if fh is None:
            if self.contains(key):  # a row whose file vanished: drop the row, or it misses forever
                self.discard(key, "its file is missing")
            return None
        try:
            fd = fh.fileno()
            header = serial.read_header(fd, os.fstat(fd).st_size)
            if header.namespace != key.namespace or header.digest != key.digest:
                raise DamagedEntryError("entry belongs to another key")
            ids = serial.read_tokens(fd, header)
        except (DamagedEntryError, OSError) as e:
            fh.close()
            self.discard(key, str(e))
            return None
        if token_ids is not None:
            want = torch.as_tensor(token_ids, dtype=torch.long)
            if want.shape != ids.shape or not torch.equal(want, ids):
                fh.close()  # a hash collision or another variant: a miss, not damage
                return None
        return DiskEntry(key, fh, header, ids)

    def put(
        self,
        key: StoreKey,
        record: KVRecord,
        *,
        frequency: int = 1,
        cost: float | None = None,
        speculative: bool = False,
    ) -> bool:
        """Write a record (``frequency`` and ``cost`` per token seed its PGDSF rank; ``speculative``,
        kept ahead of need, ranks as never used: frequency 0, the first to go under PGDSF)."""
        if speculative:
            frequency = 0
        record = self.at_rest(record)
        data = serial.encode(key, record, self.at_rest.codec_of(record))
        if len(data) > self.budget_bytes:
            self._count("skipped")
            return False
        name = self._name(key)
        try:
            self._make_room(len(data))
            self._cache.set(name, data, retry=True)
            self._make_room(0)  # another process may have written meanwhile
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            # a full disk (ENOSPC, EFBIG, SQLITE_FULL) or a lock held too long: skip and go on
            self._count("write_errors")
            self._warn_once(
                "write",
                f"could not write to the disk KV tier at {self.directory} ({e}); the entry stays in memory only",
            )
            return False
        self._count("puts")
        self._count("written_bytes", len(data))
        self._rank(key, frequency=frequency, cost=cost)
        return True

    def _make_room(self, size: int) -> None:
        """Evict least recently used entries until ``size`` more bytes fit the budget.

        By row id, not by key, so that rows kvrag never wrote (a planted pickled key) go too.
        diskcache's own culling removes ten rows at a time; this removes exactly what is needed.
        """
        cache = self._cache
        if cache.volume() + size <= self.budget_bytes:
            return
        files = []
        with cache.transact(retry=True):
            clock = self._clock()
            while cache.volume() + size > self.budget_bytes:
                rows = cache._sql(
                    "SELECT rowid, filename, access_time FROM Cache ORDER BY access_time LIMIT 1"
                ).fetchall()
                if not rows:
                    break
                cache._sql("DELETE FROM Cache WHERE rowid = ?", (rows[0][0],))
                files.append(rows[0][1])
                if self.policy == "pgdsf" and isinstance(rows[0][2], (int, float)):
                    clock = max(clock, float(rows[0][2]))  # RAGCache formula 2
            if self.policy == "pgdsf":
                cache._sql("INSERT OR REPLACE INTO Settings (key, value) VALUES ('kvrag_clock', ?)", (clock,))
        for name in files:  # after the commit, as diskcache does
            if name:
                cache._disk.remove(name)
        self._count("evictions", len(files))

    def _clock(self) -> float:
        rows = self._cache._sql("SELECT value FROM Settings WHERE key = 'kvrag_clock'").fetchall()
        return float(rows[0][0]) if rows and isinstance(rows[0][0], (int, float)) else 0.0

    def _rank(self, key: StoreKey, *, hit: bool = False, frequency: int = 1, cost: float | None = None) -> bool:
        """Move an entry's rank: a disk hit (``hit``), a write or a memory tier's swap-out.
        False if the entry is not there."""
        name = self._name(key)
        try:
            if self.policy == "lru":
                cur = self._cache._sql("UPDATE Cache SET access_time = ? WHERE key = ?", (time.time(), name))
            elif hit:
                cur = self._cache._sql(
                    "UPDATE Cache SET access_count = access_count + 1,"
                    " access_time = ? + (access_count + 1) * COALESCE(tag, ?) WHERE key = ?",
                    (self._clock(), self.default_cost, name),
                )
            else:
                cur = self._cache._sql(
                    "UPDATE Cache SET access_count = MAX(access_count, ?), tag = COALESCE(?, tag),"
                    " access_time = ? + MAX(access_count, ?) * COALESCE(?, tag, ?) WHERE key = ?",
                    (frequency, cost, self._clock(), frequency, cost, self.default_cost, name),
                )
            return cur.rowcount > 0
        except (sqlite3.Error, diskcache.Timeout):  # the rank only orders evictions
            return True

    def touch(self, key: StoreKey, frequency: int = 1, cost: float | None = None) -> bool:
        """The memory tier dropped its copy: the entry was used up to now (and this often, at
        this cost). False if the disk no longer has it."""
        return self._rank(key, frequency=frequency, cost=cost)

    @property
    def default_cost(self) -> float:
        """Cost per token of an entry whose cost is unknown: the mean of those seen (1.0 before)."""
        return self._cost_sum / self._cost_n if self._cost_n else 1.0

    def record_cost(self, keys, seconds_per_token: float) -> None:
        if seconds_per_token > 0:
            with self._lock:
                self._cost_sum += seconds_per_token
                self._cost_n += 1

    def remove(self, key: StoreKey) -> bool:
        try:
            return bool(self._cache.delete(self._name(key), retry=True))
        except (sqlite3.Error, diskcache.Timeout, OSError):
            return False

    def clear(self) -> None:
        self._cache.clear(retry=True)

    def volume(self) -> int:
        """Bytes on disk: entry files plus the index."""
        return int(self._cache.volume())

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
        try:
            out.update(entries=len(self._cache), bytes=self.volume())
        except (sqlite3.Error, diskcache.Timeout):
            pass
        out.update(budget_bytes=self.budget_bytes, directory=str(self.directory))
        return out

    def close(self) -> None:
        self._cache.close()

    def __len__(self) -> int:
        return len(self._cache)
