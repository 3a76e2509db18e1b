"""Layer-wise prefetch of KV from a slower tier, and the loading controller.

A disk or remote hit becomes a :class:`StreamedRecord`: its header and token ids are verified at lookup, its
layers arrive in the background (a :class:`Prefetcher` thread reads layer-major across every
record in flight: layer 0 of each, then layer 1, ...) while the fused prefill computes. The
prefill asks for layer ``l`` just before it runs layer ``l``; if that layer is not in yet, the
prefill thread reads it itself rather than wait, so a busy or slow loader never stalls compute
longer than the read. Each layer is checked against its checksum as it arrives; a damaged layer
fails the record (:class:`DamagedEntryError`) and the engine plans the request again.

Cache-Craft (§3.4.2) bounds the read-ahead to ``Lp = (L-1)(1 - T_prefill/T_load) + 1`` layers
because its buffer is scarce GPU memory. Here the buffer is host memory that the record is
promoted into anyway, so the loader reads ahead without bound. CacheBlend's loading controller
(§5.1) is :class:`LoadingController`: with each tier's measured throughput (every streamed record
carries its tier's meter) it raises the recompute ratio up to where recompute hides under
loading, never below the configured ratio.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from kvrag.engine.store import serial
from kvrag.engine.store.base import DamagedEntryError, KVRecord

log = logging.getLogger(__name__)

__all__ = ["StreamedRecord", "Prefetcher", "ThroughputMeter", "LoadingController"]

_PENDING, _LOADING, _READY = 0, 1, 2


class ThroughputMeter:
    """Bytes and seconds of reads from a tier; throughput as their ratio (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.seconds = 0.0
        self.records = 0

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds

    def throughput(self) -> float | None:
        """Bytes per second, or ``None`` before the first read."""
        with self._lock:
            return self.bytes / self.seconds if self.seconds > 0 and self.bytes > 0 else None

    def stats(self) -> dict:
        tp = self.throughput()
        with self._lock:
            return {"bytes": self.bytes, "seconds": self.seconds, "records": self.records, "throughput_bytes_per_s": tp}


class StreamedRecord:
    """A record whose layers are still arriving. Duck-types :class:`KVRecord`.

    ``layer(l)`` returns once layer ``l`` is in (reading it on the caller's thread if nobody has
    started it); ``k``/``v`` wait for every layer. Both raise :class:`DamagedEntryError` if any
    layer failed verification. ``tier`` is the entry's (``disk`` or ``remote``).
    """

    def __init__(self, entry: serial.Entry, meter: ThroughputMeter, on_done: Callable[[StreamedRecord, bool], None]):
        h = entry.header
        self.key = entry.key
        self.tier = entry.tier
        self.meter = meter
        self.token_ids = entry.token_ids
        self.kind, self.context, self.meta = h.kind, h.context, h.meta
        self.stats = entry.read_stats()  # small; needed before any layer
        self._entry = entry
        self._codec = h.codec
        self._parts = serial.empty_parts(h)  # [L, ...] per part: K and V, or codes and scales
        self._state = [_PENDING] * h.shape[0]
        self._ready = 0
        self._reading = 0  # layers being read right now (the file stays open until they finish)
        self._closed = False
        self._error: DamagedEntryError | None = None  # published failure: readers raise it
        self.failure: DamagedEntryError | None = None  # first failure, set before the entry is dropped
        self._cond = threading.Condition()
        self._meter, self._on_done = meter, on_done

    # -- the KVRecord surface -----------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self._state)

    @property
    def nbytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self._parts) + self.token_ids.numel() * 8
        return n + sum(t.numel() * t.element_size() for t in self.stats.values())

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim), known from the header before any layer is read."""
        L, h, _, d = self._entry.header.shape
        return int(L), int(h), int(d)

    @property
    def done(self) -> bool:
        return self._ready == len(self._state) or self._error is not None

    def matches(self, token_ids) -> bool:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        return ids.shape == self.token_ids.shape and bool(torch.equal(ids, self.token_ids))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure(layer)
        return self._codec.decode_layer([p[layer] for p in self._parts])

    @property
    def k(self) -> torch.Tensor:
        return self.to_record().k

    @property
    def v(self) -> torch.Tensor:
        return self.to_record().v

    def wait(self) -> None:
        """Block until every layer is in (reading the missing ones here)."""
        for layer in range(len(self._state)):
            self._ensure(layer)

    def pending_bytes(self) -> int:
        """Bytes of layers not read yet."""
        with self._cond:
            left = sum(1 for s in self._state if s != _READY)
        return left * self._entry.header.layer_nbytes

    def pending_seconds(self) -> float | None:
        """Seconds the layers not read yet should take at the tier's measured throughput."""
        tp = self.meter.throughput()
        return None if tp is None else self.pending_bytes() / tp

    def to_record(self) -> KVRecord:
        """An in-memory record sharing the loaded tensors (after every layer is in)."""
        self.wait()
        kw = dict(kind=self.kind, context=self.context, meta=self.meta, stats=self.stats)
        return self._codec.record(self.token_ids, self._parts, **kw)

    # -- loading ----------------------------------------------------------------------------------

    def _ensure(self, layer: int) -> None:
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                state = self._state[layer]
                if state == _READY:
                    return
                if state == _PENDING and self.failure is None:
                    self._state[layer] = _LOADING
                    self._reading += 1
                    break
                self._cond.wait()  # another thread reads it, or a failure is being published
        self._load(layer)
        with self._cond:
            while self._state[layer] != _READY:
                if self._error is not None:
                    raise self._error
                self._cond.wait()

    def claim_next(self) -> int | None:
        """For the loader: claim the first layer nobody is reading yet."""
        with self._cond:
            if self.failure is not None:
                return None
            for i, s in enumerate(self._state):
                if s == _PENDING:
                    self._state[i] = _LOADING
                    self._reading += 1
                    return i
        return None

    def next_layer(self) -> int:
        """Index of the first layer not claimed (the loader's layer-major order key)."""
        with self._cond:
            if self.failure is not None:
                return len(self._state)
            return next((i for i, s in enumerate(self._state) if s == _PENDING), len(self._state))

    def _load(self, layer: int) -> None:
        t0 = time.perf_counter()
        error = None
        try:
            self._entry.read_layer_parts(layer, [p[layer] for p in self._parts])
        except DamagedEntryError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - an I/O error (file gone, disk failing, server down) fails it too
            error = DamagedEntryError(f"reading layer {layer} failed: {e}")
        self._meter.add(self._entry.header.layer_nbytes, time.perf_counter() - t0)
        first_failure = False
        if error is not None:
            with self._cond:
                first_failure = self.failure is None
                if first_failure:
                    self.failure = error
            if first_failure:  # drop the entry everywhere before anyone sees the failure and re-plans
                self._report(False)
        complete = False
        with self._cond:
            self._reading -= 1
            if first_failure:
                self._error = error  # later failures wait for the first one to be published
            elif error is None:
                self._state[layer] = _READY
                self._ready += 1
                complete = self._ready == len(self._state) and self.failure is None
            close = self.done and self._reading == 0 and not self._closed
            self._closed = self._closed or close
            self._cond.notify_all()
        if close:
            self._entry.close()
        if complete:
            self._report(True)

    def _report(self, ok: bool) -> None:
        try:
            self._on_done(self, ok)
        except Exception:  # noqa: BLE001 - a failed promotion costs a future hit, nothing more
            log.warning("kvrag: finishing the load of %s failed", self.key, exc_info=True)


class Prefetcher:
    """One background thread that reads the layers of streamed records, layer-major."""

    def __init__(self) -> None:
        self._active: list[StreamedRecord] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, rec: StreamedRecord) -> None:
        with self._cond:
            if self._closed:
                return
            self._active.append(rec)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvrag-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    self._active = [r for r in self._active if not r.done]
                    pending = [r for r in self._active if r.next_layer() < r.num_layers]
                    if pending:
                        break
                    if not self._active:  # exit when idle: see BackgroundWriter on idle torch threads
                        self._thread = None
                        return
                    # records whose last layers are being read by their consumers finish on their own
                    self._cond.wait(0.05)
                # layer-major across records: whoever is furthest behind goes first
                rec = min(pending, key=StreamedRecord.next_layer)
            layer = rec.claim_next()
            if layer is not None:
                rec._load(layer)  # failures are recorded on the record itself

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
        for rec in list(self._active):  # finish what is in flight on this thread
            try:
                rec.wait()
            except DamagedEntryError:
                pass


class LoadingController:
    """CacheBlend's loading controller (§5.1): pick the recompute ratio that hides under loading.

    ``T_recompute(r) = r x T_prefill`` and ``T_load = bytes / throughput`` (throughput measured on
    this machine's reads); the ratio is ``max(configured, T_load / T_prefill)``, at most 1.
    """

    def __init__(self, meter: ThroughputMeter) -> None:
        self.meter = meter
        self.last: dict = {}

    def ratio(self, configured: float, load_bytes: int, t_prefill: float | None) -> float:
        """The recompute ratio for a request that still has ``load_bytes`` to read.

        Args:
            configured: the request's ratio (the floor).
            load_bytes: bytes of cached KV still to be read from slower tiers.
            t_prefill: estimated seconds of a full prefill of the prompt (``None`` if unknown).
        """
        tp = self.meter.throughput()
        if load_bytes <= 0 or tp is None or not t_prefill:
            self.last = {"ratio": configured, "t_load": 0.0, "t_prefill": t_prefill}
            return configured
        return self.ratio_for_time(configured, load_bytes / tp, t_prefill)

    def ratio_for_records(self, configured: float, records, t_prefill: float | None) -> float:
        """Like :meth:`ratio`, for records still streaming in, each from its own tier at that
        tier's measured throughput (disk and remote differ by an order of magnitude)."""
        t_load = 0.0
        for rec in records:
            pending = getattr(rec, "pending_seconds", None)
            t = pending() if pending is not None else None
            if t is None and hasattr(rec, "pending_bytes"):  # no throughput of its tier yet: this meter's
                tp = self.meter.throughput()
                t = rec.pending_bytes() / tp if tp else None
            t_load += t or 0.0
        if t_load <= 0 or not t_prefill:
            self.last = {"ratio": configured, "t_load": t_load, "t_prefill": t_prefill}
            return configured
        return self.ratio_for_time(configured, t_load, t_prefill)

    def ratio_for_time(self, configured: float, t_load: float, t_prefill: float) -> float:
        """The ratio when the pending loads take ``t_load`` seconds."""
        r = min(1.0, max(configured, t_load / t_prefill))
        self.last = {"ratio": r, "t_load": t_load, "t_prefill": t_prefill}
        return r
