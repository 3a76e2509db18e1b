"""Remote KV tier: a Redis or Valkey server shared by processes and machines (redis-py client).

**Layout.** A record is kvrag's at-rest format (:mod:`serial`: JSON header, raw tensor bytes,
CRC-32 per layer; never pickle) under the key ``kvrag:kv1:<repr>:<namespace>:<digest>``. The
digest is :func:`~kvrag.engine.store.base.chunk_key`'s: SHA-256 over the namespace (tenant), the
model fingerprint, the chunk context label and the token ids; ``<repr>`` names the at-rest
representation (``f16``, ``q8k64``, ...), so processes with other codecs never read each other's
entries. A value up to ``part_bytes`` is one key. A larger one is split: the key holds the first
``part_bytes`` bytes (the header among them) and ``<key>:<i>:<header crc>`` the rest. Parts are
written first, the head last with ``SET NX``: a reader that finds a head finds its parts, and a
key is never overwritten while it exists.

**Reads stream.** A lookup fetches the head's first 64 KiB (prelude, header, token ids) and its
length in one round trip; the layers are byte ranges (``GETRANGE``), read one by one by the
prefetcher while the prefill runs, exactly like disk hits.

**Verification on every hit**: the header's checksum and fields, its namespace and digest equal to
the key's, the token ids' checksum and their equality with the request's, each layer's checksum
as it arrives. A damaged or foreign value is a miss: deleted, counted, warned about once.

**Faults.** Every call has a socket timeout. A connection error or a timeout marks the server
down: one warning, then every lookup is a miss and every write is skipped without touching the
network until a backoff passes (1 s, doubling to 30 s); the next call then tries again, and the
first that succeeds brings the tier back (logged). A layer read that fails mid-stream fails its
record and the engine plans the request again without it. The remote tier is a cache, never the
source of truth: a request never fails because of it.

**Budget.** The server's: ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (docs/scale-out.md).
Entries get a TTL (refreshed on every hit); a write the server refuses (out of memory under
``noeviction``) is skipped. A local index remembers keys this process wrote or hit, so that
``contains`` needs no round trip for them for a while.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from urllib.parse import urlsplit, urlunsplit

import torch

from kvrag.engine.store import serial
from kvrag.engine.store.base import DamagedEntryError, KVStore, StoreKey
from kvrag.engine.store.bookkeeping import Bookkeeping
from kvrag.engine.store.codec import AtRest
from kvrag.errors import StoreError

log = logging.getLogger(__name__)

__all__ = ["RemoteStore", "RemoteUnavailableError", "PASSWORD_ENV", "KEY_PREFIX", "redact"]

#: Environment variable holding the server's password when the URL carries none.
PASSWORD_ENV = "KVRAG_REMOTE_PASSWORD"
#: Prefix of every key kvrag writes (the format version is part of it).
KEY_PREFIX = f"kvrag:kv{serial.FORMAT}"
PART_BYTES = 64 * 1024 * 1024
_HEAD_BYTES = 64 * 1024
_INDEX_SIZE = 65536
_INDEX_FRESH_S = 30.0
_BACKOFF = (1.0, 30.0)


class RemoteUnavailableError(DamagedEntryError):
    """The server could not be reached (or answered too slowly) while an entry was read.

    Not damage: the entry is not deleted or counted as damaged, only missed."""


class _VanishedError(DamagedEntryError):
    """The value changed length between two reads (evicted or expired while streaming)."""


def redact(url: str) -> str:
    """The URL without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class _Source:
    """Byte ranges of one stored value (split into parts) for :mod:`serial`'s readers."""

    def __init__(self, store: RemoteStore, rkey: str, head: bytes, part_bytes: int, length: int) -> None:
        self.store, self.rkey, self.head, self.part_bytes = store, rkey, head, part_bytes
        self.length = length  # of the first part, read with the head: reads past it are truncation
        self.tag = f"{int.from_bytes(head[12:16], 'little'):08x}" if len(head) >= 16 else "0"

    def part_key(self, i: int) -> str:
        return self.rkey if i == 0 else f"{self.rkey}:{i}:{self.tag}"

    def read_into(self, views: list[memoryview], offset: int) -> None:
        want = sum(len(v) for v in views)
        if offset < self.part_bytes and min(offset + want, self.part_bytes) > self.length:
            raise DamagedEntryError(f"damaged KV entry: truncated ({self.length} bytes stored)")
        if offset + want <= len(self.head):
            data = memoryview(self.head)[offset : offset + want]
        else:
            data = memoryview(self.store._range(self, offset, want))
        if len(data) != want:
            raise _VanishedError(f"damaged KV entry: short read ({len(data)} of {want} bytes)")
        pos = 0
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)


class RemoteStore(Bookkeeping, KVStore):
    """KV records on a Redis/Valkey server.

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path.sock``.
            Without a password in the URL, :data:`PASSWORD_ENV` is used if set.
        dtype: plain at-rest dtype (``float16``, ``bfloat16``, ``float32``).
        codec: ``plain`` or ``int8`` (:mod:`kvrag.engine.store.codec`).
        timeout: seconds a call may take (connect, and each socket read or write).
        ttl: seconds an entry lives on the server after its last write or hit (``None``: until the
            server evicts it).
        part_bytes: values larger than this are split into parts.
    """

    def __init__(
        self,
        url: str,
        *,
        dtype: str = "float16",
        codec: str = "plain",
        timeout: float = 1.0,
        ttl: float | None = 7 * 86400,
        part_bytes: int = PART_BYTES,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover - redis is a dependency of kvrag[remote]
            raise StoreError("the remote KV tier needs the redis client: pip install 'kvrag[remote]'") from e
        self.url = url
        self.at_rest = AtRest(codec, dtype)
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.part_bytes = int(part_bytes)
        self.prefix = f"{KEY_PREFIX}:{self.at_rest.tag}:"
        self._refused = redis.ResponseError
        kw = {}
        if urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
            kw["password"] = os.environ[PASSWORD_ENV]
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),  # a failed call is a miss now, not three slow tries
                **kw,
            )
        except ValueError as e:
            raise StoreError(f"bad remote KV tier URL {redact(url)}: {e}") from e
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._down_until: float | None = None
        self._backoff = 0.0
        self.backoff = _BACKOFF  # (first, most) seconds between tries while the server is down
        self._index: OrderedDict[str, float] = OrderedDict()  # key -> when it was last known present
        self._stats = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "damaged": 0,
            "vanished": 0,
            "errors": 0,
            "outages": 0,
            "write_errors": 0,
            "skipped": 0,
            "written_bytes": 0,
            "read_bytes": 0,
        }
        self._try(self._client.ping)  # warn now if the server is not there (the engine still starts)

    # -- faults ---------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the server is considered down (until the backoff passes)."""
        with self._lock:
            return self._down_until is None or time.monotonic() >= self._down_until

    def _fault(self, e: Exception) -> None:
        with self._lock:
            first = self._down_until is None
            self._backoff = self.backoff[0] if first else min(self.backoff[1], self._backoff * 2)
            self._down_until = time.monotonic() + self._backoff
            self._stats["errors"] += 1
            if first:
                self._stats["outages"] += 1
            self._index.clear()  # a server that comes back may have lost everything
        try:  # idle pooled connections may be stale now: the next try opens fresh ones
            self._client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001
            pass
        if first:
            log.warning(
                "kvrag: remote KV tier at %s is unreachable (%s: %s); serving from local tiers and "
                "computing, retrying with backoff",
                redact(self.url),
                type(e).__name__,
                e,
            )

    def retry_now(self) -> bool:
        """Forget the backoff and try the server now; True if it answers."""
        with self._lock:
            if self._down_until is not None:
                self._down_until = 0.0
        return bool(self._try(self._client.ping))

    def _call(self, fn, *args, **kw):
        """Run a client call; raise :class:`RemoteUnavailableError` (after marking the server down)
        if it fails or the server is down."""
        with self._lock:
            faults = self._stats["errors"]  # a success speaks for the server only if no fault came meanwhile
        if not self.available:
            raise RemoteUnavailableError(f"remote KV tier at {redact(self.url)} is down")
        try:
            out = fn(*args, **kw)
        except self._refused:  # the server answered with an error: not an outage
            raise
        except Exception as e:  # noqa: BLE001 - refused connections, timeouts, a socket closed under us
            self._fault(e)
            raise RemoteUnavailableError(f"remote KV tier: {type(e).__name__}: {e}") from None
        with self._lock:
            if self._stats["errors"] != faults:  # began before another call found the server gone: says nothing of now
                return out
            was_down = self._down_until is not None
            self._down_until, self._backoff = None, 0.0
        if was_down:
            log.warning("kvrag: remote KV tier at %s is reachable again", redact(self.url))
        return out

    def _try(self, fn, *args, **kw):
        try:
            return self._call(fn, *args, **kw)
        except (RemoteUnavailableError, self._refused):
            return None

    # -- keys and the local index ---------------------------------------------------------------

    def rkey(self, key: StoreKey) -> str:
        """The server key of a store key."""
        return f"{self.prefix}{key.namespace}:{key.digest}"

    def _seen(self, rkey: str) -> None:
        with self._lock:
            self._index[rkey] = time.monotonic()
            self._index.move_to_end(rkey)
            while len(self._index) > _INDEX_SIZE:
                self._index.popitem(last=False)

    def _forget(self, rkey: str) -> None:
        with self._lock:
            self._index.pop(rkey, None)

    def _range(self, src: _Source, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of a stored value, across its parts (one round trip)."""
        pipe = self._client.pipeline(transaction=False)
        pos, end = offset, offset + n
        while pos < end:
            i, start = divmod(pos, src.part_bytes)
            stop = min(src.part_bytes, start + end - pos)
            pipe.getrange(src.part_key(i), start, stop - 1)
            pos += stop - start
        try:
            data = b"".join(self._call(pipe.execute))
        except self._refused as e:  # e.g. WRONGTYPE: the key now holds something kvrag never wrote
            raise DamagedEntryError(f"damaged KV entry: the server refused a range read ({e})") from None
        self._count("read_bytes", len(data))
        return data

    # -- the interface ----------------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        rkey = self.rkey(key)
        with self._lock:
            seen = self._index.get(rkey)
        if seen is not None and time.monotonic() - seen < _INDEX_FRESH_S:
            return True
        found = bool(self._try(self._client.exists, rkey))
        if found:
            self._seen(rkey)
        return found

    def open(self, key: StoreKey, token_ids=None, *, quiet: bool = False) -> serial.Entry | None:
        """The entry's verified header and token ids, or ``None`` (miss, down, or damaged: dropped).
        ``quiet``: a look at the header, not a use (no hit or miss counted)."""
        entry = self._open(key, token_ids)
        if not quiet:
            self._count("hits" if entry is not None else "misses")
        return entry

    def _open(self, key: StoreKey, token_ids=None) -> serial.Entry | None:
        rkey = self.rkey(key)
        pipe = self._client.pipeline(transaction=False)
        pipe.getrange(rkey, 0, _HEAD_BYTES - 1)
        pipe.strlen(rkey)
        if self.ttl_ms:
            pipe.pexpire(rkey, self.ttl_ms)  # a hit keeps the entry alive
        try:
            head, length = self._call(pipe.execute)[:2]
        except RemoteUnavailableError:
            return None
        except self._refused as e:  # WRONGTYPE: a foreign value under a kvrag key
            self.discard(key, DamagedEntryError(f"damaged KV entry: not a string value ({e})"))
            return None
        if not head:
            self._forget(rkey)
            return None
        src = _Source(self, rkey, bytes(head), self.part_bytes, int(length))
        try:
            h = serial.read_header(src, None)
            if length != min(h.size, self.part_bytes):
                raise DamagedEntryError(f"damaged KV entry: size mismatch ({length} bytes stored, header {h.size})")
            if h.namespace != key.namespace or h.digest != key.digest:
                raise DamagedEntryError("damaged KV entry: it belongs to another key")
            ids = serial.read_tokens(src, h)
        except RemoteUnavailableError:
            return None
        except DamagedEntryError as e:
            self.discard(key, e)
            return None
        if token_ids is not None:
            want = torch.as_tensor(token_ids, dtype=torch.long)
            if want.shape != ids.shape or not torch.equal(want, ids):  # a collision or another variant
                return None
        if self.ttl_ms and h.size > self.part_bytes:
            pipe = self._client.pipeline(transaction=False)
            for i in range(1, (h.size + self.part_bytes - 1) // self.part_bytes):
                pipe.pexpire(src.part_key(i), self.ttl_ms)
            self._try(pipe.execute)
        self._seen(rkey)
        return serial.Entry(key, src, h, ids, "remote")

    def discard(self, key: StoreKey, error) -> None:
        """Drop an entry that read back wrong: count it, warn once, delete it so it is rewritten.

        A read that failed because the server went away is not damage: nothing is dropped."""
        if isinstance(error, RemoteUnavailableError):
            return
        rkey = self.rkey(key)
        self._forget(rkey)
        if isinstance(error, _VanishedError):  # evicted or expired while it streamed in
            self._count("vanished")
            return
        self._count("damaged")
        self._warn_once("damaged", f"remote KV entry {key} is unusable and is treated as a miss: {error}")
        self._try(self._client.delete, rkey)

    def put(
        self, key: StoreKey, record, *, frequency: int = 1, cost: float | None = None, speculative: bool = False
    ) -> bool:
        """Write a record unless the key exists; False if it was not written (down, refused).

        The server evicts by its own policy: ``frequency``, ``cost`` and ``speculative`` are not used."""
        if not self.available:
            self._count("skipped")
            return False
        record = self.at_rest(record)
        data = memoryview(serial.encode(key, record, self.at_rest.codec_of(record)))
        rkey, size, part = self.rkey(key), len(data), self.part_bytes
        tag = f"{int.from_bytes(data[12:16], 'little'):08x}"
        pipe = self._client.pipeline(transaction=False)
        for i in range(1, (size + part - 1) // part):  # the tail parts first, the head last
            pipe.set(f"{rkey}:{i}:{tag}", data[i * part : (i + 1) * part], px=self.ttl_ms)
        pipe.set(rkey, data[:part], nx=True, px=self.ttl_ms)
        try:
            written = self._call(pipe.execute, raise_on_error=True)[-1]
        except RemoteUnavailableError:
            self._count("skipped")
            return False
        except self._refused as e:  # e.g. OOM under maxmemory-policy noeviction
            self._count("write_errors")
            self._warn_once("write", f"the remote KV tier refused a write ({e}); the entry stays local")
            return False
        if written:
            self._count("puts")
            self._count("written_bytes", size)
        self._seen(rkey)
        return True

    def remove(self, key: StoreKey) -> bool:
        rkey = self.rkey(key)
        self._forget(rkey)
        return bool(self._try(self._client.delete, rkey))

    def clear(self) -> None:
        """Delete every kvrag entry on the server (every namespace and process, as the disk tier's
        ``clear`` empties its shared directory)."""
        with self._lock:
            self._index.clear()
        try:
            batch = []
            for k in self._call(self._client.scan_iter, match=f"{KEY_PREFIX}:*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self._call(self._client.unlink, *batch)
                    batch = []
            if batch:
                self._call(self._client.unlink, *batch)
        except RemoteUnavailableError:
            pass
        except self._refused:
            pass
        except Exception as e:  # noqa: BLE001 - the scan iterator fails lazily, outside _call
            self._fault(e)

    def stats(self) -> dict:
        """Counters: hits, misses, puts, damaged (read back wrong: dropped), vanished (evicted while
        streaming), errors (failed calls), outages, write_errors (refused), skipped (writes while
        down), written_bytes, read_bytes; ``available``, ``url`` (no password), ``key_prefix``."""
        with self._lock:
            out = dict(self._stats)
        out.update(available=self.available, url=redact(self.url), key_prefix=self.prefix)
        return out

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
