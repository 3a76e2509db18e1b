"""The at-rest format of a KV record: raw tensor bytes behind a small JSON header, with checksums.

Nothing read is ever unpickled or executed: the header is JSON (parsed, then checked field by
field), the body is raw little-endian tensor bytes of an allowed dtype. Layout::

    b"KVRAGKV1" | u32 header length | u32 CRC-32 of the header | header (JSON, UTF-8) | pad to 64
    token ids (int32)
    layer 0: K [Hkv, T, D] bytes, V [Hkv, T, D] bytes       <- one read per layer
    layer 1: ...
    stats tensors, in header order

The header carries the CRC-32 of the token ids, of each layer (K and V together) and of each
stats tensor, so a record can be streamed layer by layer and every layer is verified as it
arrives. CRC-32 guards against damage (bit rot, truncation, torn writes), not against an attacker
who can write the cache directory.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from kvrag.engine.dtypes import STORED_DTYPES, dtype_name
from kvrag.engine.store.base import DamagedEntryError, KVRecord, StoreKey

__all__ = ["MAGIC", "Header", "encode", "read_header", "read_layer_into", "read_record"]

MAGIC = b"KVRAGKV1"
FORMAT = 1
_PRELUDE = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER = 1 << 20  # 1 MiB: token ids and tensors are in the body, the header is small


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(dtype: str, shape) -> int:
    n = STORED_DTYPES[dtype].itemsize
    for s in shape:
        n *= s
    return n


def _bytes_view(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor (bfloat16 included, which numpy lacks)."""
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


@dataclass(slots=True)
class Header:
    """A parsed, validated header; offsets are computed here, never taken from the file."""

    namespace: str
    digest: str
    kind: str
    context: str
    meta: dict
    dtype: str
    shape: tuple[int, int, int, int]  # [L, Hkv, T, D]
    token_crc: int
    layer_crcs: list[int]
    stats: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, crc)
    body_offset: int
    size: int

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's K and V together."""
        _, h, t, d = self.shape
        return 2 * _nbytes(self.dtype, (h, t, d))

    @property
    def kv_nbytes(self) -> int:
        return self.shape[0] * self.layer_nbytes

    def layer_offset(self, layer: int) -> int:
        return self.body_offset + 4 * self.shape[2] + layer * self.layer_nbytes


def encode(key: StoreKey, record: KVRecord, dtype: torch.dtype) -> bytes:
    """The at-rest bytes of a record, K and V cast to ``dtype``."""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("kvrag's KV format is little-endian")
    k = record.k.detach().to("cpu", dtype).contiguous()
    v = record.v.detach().to("cpu", dtype).contiguous()
    ids = record.token_ids.to(torch.int32).contiguous()
    body: list[memoryview] = [_bytes_view(ids)]
    layer_crcs = []
    for layer in range(k.shape[0]):
        kb, vb = _bytes_view(k[layer]), _bytes_view(v[layer])
        layer_crcs.append(zlib.crc32(vb, zlib.crc32(kb)))
        body += [kb, vb]
    stats = []
    for name, t in record.stats.items():
        t = t.detach().to("cpu").contiguous()
        if dtype_name(t.dtype) is None:
            t = t.float()
        b = _bytes_view(t)
        stats.append([name, dtype_name(t.dtype), list(t.shape), zlib.crc32(b)])
        body.append(b)
    body_len = sum(len(b) for b in body)
    fields = {
        "format": FORMAT,
        "namespace": key.namespace,
        "key": key.digest,
        "kind": record.kind,
        "context": record.context,
        "meta": record.meta,
        "dtype": dtype_name(dtype),
        "shape": list(k.shape),
        "tokens_crc": zlib.crc32(body[0]),
        "layer_crcs": layer_crcs,
        "stats": stats,
    }
    # the total size is part of the header, so the header length must settle first
    fields["size"] = 0
    for _ in range(3):
        header = json.dumps(fields, separators=(",", ":")).encode()
        size = _align(_PRELUDE.size + len(header)) + body_len
        if fields["size"] == size:
            break
        fields["size"] = size
    header = json.dumps(fields, separators=(",", ":")).encode()
    start = _align(_PRELUDE.size + len(header))
    out = bytearray(start + body_len)
    out[: _PRELUDE.size] = _PRELUDE.pack(MAGIC, len(header), zlib.crc32(header))
    out[_PRELUDE.size : _PRELUDE.size + len(header)] = header
    pos = start
    for b in body:
        out[pos : pos + len(b)] = b
        pos += len(b)
    assert pos == len(out) == fields["size"]
    return bytes(out)


def _damaged(msg: str) -> DamagedEntryError:
    return DamagedEntryError(f"damaged KV entry: {msg}")


def _int(x, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise _damaged(f"bad integer field {x!r}")
    return x


def _str(x) -> str:
    if type(x) is not str or len(x) > 4096:
        raise _damaged("bad string field")
    return x


def _shape(x, ndim: int | None = None) -> tuple[int, ...]:
    if type(x) is not list or (ndim is not None and len(x) != ndim) or len(x) > 8:
        raise _damaged("bad shape")
    return tuple(_int(s, 0, 1 << 31) for s in x)


def read_header(fd: int, file_size: int) -> Header:
    """Read and validate the header of the entry open as ``fd`` (raises DamagedEntryError)."""
    pre = os.pread(fd, _PRELUDE.size, 0)
    if len(pre) != _PRELUDE.size:
        raise _damaged("truncated prelude")
    magic, hlen, hcrc = _PRELUDE.unpack(pre)
    if magic != MAGIC:
        raise _damaged("not a kvrag KV entry (bad magic)")
    if hlen > _MAX_HEADER or _PRELUDE.size + hlen > file_size:
        raise _damaged("bad header length")
    raw = os.pread(fd, hlen, _PRELUDE.size)
    if len(raw) != hlen or zlib.crc32(raw) != hcrc:
        raise _damaged("header checksum mismatch")
    try:
        f = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(f"header is not JSON ({e})") from None
    if type(f) is not dict or f.get("format") != FORMAT:
        raise _damaged("unknown header format")
    dtype = _str(f.get("dtype"))
    if dtype not in ("float16", "bfloat16", "float32"):
        raise _damaged(f"dtype {dtype!r} not allowed")
    shape = _shape(f.get("shape"), 4)
    crcs = f.get("layer_crcs")
    if type(crcs) is not list or len(crcs) != shape[0]:
        raise _damaged("bad layer checksums")
    meta = f.get("meta")
    if type(meta) is not dict:
        raise _damaged("bad meta")
    stats = []
    raw_stats = f.get("stats")
    if type(raw_stats) is not list:
        raise _damaged("bad stats")
    for item in raw_stats:
        if type(item) is not list or len(item) != 4:
            raise _damaged("bad stats entry")
        name, sdtype, sshape, scrc = item
        if _str(sdtype) not in STORED_DTYPES:  # the body holds nothing else
            raise _damaged(f"stats dtype {sdtype!r} not allowed")
        stats.append((_str(name), sdtype, _shape(sshape), _int(scrc, 0, 0xFFFFFFFF)))
    h = Header(
        namespace=_str(f.get("namespace")),
        digest=_str(f.get("key")),
        kind=_str(f.get("kind")),
        context=_str(f.get("context")),
        meta=meta,
        dtype=dtype,
        shape=shape,  # type: ignore[arg-type]
        token_crc=_int(f.get("tokens_crc"), 0, 0xFFFFFFFF),
        layer_crcs=[_int(c, 0, 0xFFFFFFFF) for c in crcs],
        stats=stats,
        body_offset=_align(_PRELUDE.size + hlen),
        size=_int(f.get("size")),
    )
    expected = h.body_offset + 4 * shape[2] + h.kv_nbytes + sum(_nbytes(d, s) for _, d, s, _ in stats)
    if h.size != expected or file_size != expected:
        raise _damaged(f"size mismatch (file {file_size}, header {h.size}, layout {expected}): truncated or extended")
    return h


def _pread_exact(fd: int, bufs: list[memoryview], offset: int) -> None:
    want = sum(len(b) for b in bufs)
    got = os.preadv(fd, bufs, offset)
    if got != want:  # a short read of a regular file means it shrank under us
        raise _damaged(f"short read ({got} of {want} bytes)")


def read_tokens(fd: int, h: Header) -> torch.Tensor:
    """[T] int64 token ids, verified."""
    ids = torch.empty(h.shape[2], dtype=torch.int32)
    view = _bytes_view(ids)
    _pread_exact(fd, [view], h.body_offset)
    if zlib.crc32(view) != h.token_crc:
        raise _damaged("token ids checksum mismatch")
    return ids.long()


def read_layer_into(fd: int, h: Header, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Read layer ``layer`` into ``k``/``v`` ([Hkv, T, D], contiguous, at-rest dtype) and verify it."""
    kb, vb = _bytes_view(k), _bytes_view(v)
    _pread_exact(fd, [kb, vb], h.layer_offset(layer))
    if zlib.crc32(vb, zlib.crc32(kb)) != h.layer_crcs[layer]:
        raise _damaged(f"layer {layer} checksum mismatch")


def read_stats(fd: int, h: Header) -> dict[str, torch.Tensor]:
    out = {}
    pos = h.layer_offset(h.shape[0])
    for name, dtype, shape, crc in h.stats:
        t = torch.empty(shape, dtype=STORED_DTYPES[dtype])
        view = _bytes_view(t)
        _pread_exact(fd, [view], pos)
        if zlib.crc32(view) != crc:
            raise _damaged(f"stats {name!r} checksum mismatch")
        out[name] = t
        pos += len(view)
    return out


def read_record(fd: int, h: Header, token_ids: torch.Tensor) -> KVRecord:
    """The whole record (every layer verified)."""
    k = torch.empty(h.shape, dtype=STORED_DTYPES[h.dtype])
    v = torch.empty(h.shape, dtype=STORED_DTYPES[h.dtype])
    for layer in range(h.shape[0]):
        read_layer_into(fd, h, layer, k[layer], v[layer])
    return KVRecord(token_ids, k, v, kind=h.kind, context=h.context, meta=h.meta, stats=read_stats(fd, h), tier="disk")
