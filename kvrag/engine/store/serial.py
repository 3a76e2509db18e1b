"""The at-rest format of a KV record: raw tensor bytes behind a small JSON header, with checksums.

Nothing read is ever unpickled or executed: the header is JSON (parsed, then checked field by
field), the body is raw little-endian tensor bytes of an allowed dtype. Layout::

    b"KVRAGKV1" | u32 header length | u32 CRC-32 of the header | header (JSON, UTF-8) | pad to 64
    token ids (int32)
    layer 0: K [Hkv, T, D] bytes, V [Hkv, T, D] bytes       <- one read per layer
    layer 1: ...
    stats tensors, in header order

A layer is K then V in the at-rest dtype, or, with the 8-bit codec (header ``codec``), the
codec's parts (codes, then scales: :mod:`kvrag.engine.store.codec`); the header names the codec,
and its layout follows from the codec and the shape. The header carries the CRC-32 of the token
ids, of each layer (all its parts together) and of each stats tensor, so a record can be streamed
layer by layer and every layer is verified as it arrives. CRC-32 guards against damage (bit rot,
truncation, torn writes), not against an attacker who can write the cache directory or the server.

Entries are read through a *source* with ``read_into(views, offset)``: a file descriptor (the disk
tier) or ranges of a remote value (the remote tier); both return exactly the bytes asked for or
raise :class:`DamagedEntryError`.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from kvrag.engine.model.dtypes import STORED_DTYPES, dtype_name
from kvrag.engine.store.base import DamagedEntryError, KVRecord, StoreKey
from kvrag.engine.store.codec import Codec, PlainCodec, codec_from_header

__all__ = [
    "MAGIC",
    "Header",
    "Entry",
    "FileSource",
    "encode",
    "read_header",
    "read_layer_into",
    "read_layer_parts",
    "read_record",
]

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
    codec: Codec
    shape: tuple[int, int, int, int]  # [L, Hkv, T, D]
    token_crc: int
    layer_crcs: list[int]
    stats: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, crc)
    body_offset: int
    size: int

    @property
    def layer_parts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part of one layer (K and V, or the codec's parts)."""
        _, h, t, d = self.shape
        return self.codec.layout(h, t, d)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's parts together."""
        _, h, t, d = self.shape
        return self.codec.layer_nbytes(h, t, d)

    @property
    def kv_nbytes(self) -> int:
        return self.shape[0] * self.layer_nbytes

    def layer_offset(self, layer: int) -> int:
        return self.body_offset + 4 * self.shape[2] + layer * self.layer_nbytes


def encode(key: StoreKey, record, codec: Codec | torch.dtype) -> bytes:
    """The at-rest bytes of a record: K and V through ``codec`` (a dtype means plain K/V in it).

    A record that already holds the codec's parts (a :class:`~kvrag.engine.store.codec.CodedRecord`)
    is written as it is, never coded again.
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("kvrag's KV format is little-endian")
    if not isinstance(codec, Codec):
        codec = PlainCodec(codec)
    ids = record.token_ids.to(torch.int32).contiguous()
    body: list[memoryview] = [_bytes_view(ids)]
    layer_crcs = []
    for parts in codec.parts_of(record):
        views = [_bytes_view(p.detach().to("cpu").contiguous()) for p in parts]
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        layer_crcs.append(crc)
        body += views
    stats = []
    for name, t in record.stats.items():
        t = t.detach().to("cpu").contiguous()
        if dtype_name(t.dtype) is None:
            t = t.float()
        b = _bytes_view(t)
        stats.append([name, dtype_name(t.dtype), list(t.shape), zlib.crc32(b)])
        body.append(b)
    body_len = sum(len(b) for b in body)
    L, h, d = record.kv_shape
    fields = {
        "format": FORMAT,
        "namespace": key.namespace,
        "key": key.digest,
        "kind": record.kind,
        "context": record.context,
        "meta": record.meta,
        "dtype": codec.dtype_name if isinstance(codec, PlainCodec) else "uint8",
        "shape": [L, h, record.num_tokens, d],
        "tokens_crc": zlib.crc32(body[0]),
        "layer_crcs": layer_crcs,
        "stats": stats,
    }
    if not isinstance(codec, PlainCodec):
        fields["codec"] = codec.name  # absent: plain (what every entry before the codec was)
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


class FileSource:
    """Reads of an open entry file (``pread``: no shared file position, safe across threads)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read_into(self, views: list[memoryview], offset: int) -> None:
        want = sum(len(b) for b in views)
        got = os.preadv(self.fd, views, offset)
        if got != want:  # a short read of a regular file means it shrank under us
            raise _damaged(f"short read ({got} of {want} bytes)")


def _source(src):
    return FileSource(src) if isinstance(src, int) else src


def _read(src, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    src.read_into([memoryview(buf)], offset)
    return bytes(buf)


def read_header(src, file_size: int | None) -> Header:
    """Read and validate the header of an entry (raises DamagedEntryError).

    Args:
        src: an open file descriptor or a source (``read_into(views, offset)``).
        file_size: the entry's size in bytes; ``None`` if the source cannot tell (the caller then
            checks ``Header.size`` itself).
    """
    src = _source(src)
    pre = _read(src, _PRELUDE.size, 0)
    magic, hlen, hcrc = _PRELUDE.unpack(pre)
    if magic != MAGIC:
        raise _damaged("not a kvrag KV entry (bad magic)")
    if hlen > _MAX_HEADER or (file_size is not None and _PRELUDE.size + hlen > file_size):
        raise _damaged("bad header length")
    raw = _read(src, hlen, _PRELUDE.size)
    if zlib.crc32(raw) != hcrc:
        raise _damaged("header checksum mismatch")
    try:
        f = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(f"header is not JSON ({e})") from None
    if type(f) is not dict or f.get("format") != FORMAT:
        raise _damaged("unknown header format")
    dtype = _str(f.get("dtype"))
    codec = codec_from_header(_str(f.get("codec", "plain")), dtype)
    if codec is None:
        raise _damaged(f"codec {f.get('codec', 'plain')!r} with dtype {dtype!r} not allowed")
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
        codec=codec,
        shape=shape,  # type: ignore[arg-type]
        token_crc=_int(f.get("tokens_crc"), 0, 0xFFFFFFFF),
        layer_crcs=[_int(c, 0, 0xFFFFFFFF) for c in crcs],
        stats=stats,
        body_offset=_align(_PRELUDE.size + hlen),
        size=_int(f.get("size")),
    )
    expected = h.body_offset + 4 * shape[2] + h.kv_nbytes + sum(_nbytes(d, s) for _, d, s, _ in stats)
    if h.size != expected or (file_size is not None and file_size != expected):
        raise _damaged(f"size mismatch (file {file_size}, header {h.size}, layout {expected}): truncated or extended")
    return h


def read_tokens(src, h: Header) -> torch.Tensor:
    """[T] int64 token ids, verified."""
    ids = torch.empty(h.shape[2], dtype=torch.int32)
    view = _bytes_view(ids)
    _source(src).read_into([view], h.body_offset)
    if zlib.crc32(view) != h.token_crc:
        raise _damaged("token ids checksum mismatch")
    return ids.long()


def read_layer_parts(src, h: Header, layer: int, parts: list[torch.Tensor]) -> None:
    """Read layer ``layer`` into ``parts`` (contiguous, as :attr:`Header.layer_parts`) and verify it."""
    views = [_bytes_view(p) for p in parts]
    _source(src).read_into(views, h.layer_offset(layer))
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    if crc != h.layer_crcs[layer]:
        raise _damaged(f"layer {layer} checksum mismatch")


def read_layer_into(src, h: Header, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Read a plain entry's layer ``layer`` into ``k``/``v`` ([Hkv, T, D], at-rest dtype) and verify it."""
    read_layer_parts(src, h, layer, [k, v])


def read_stats(src, h: Header) -> dict[str, torch.Tensor]:
    src = _source(src)
    out = {}
    pos = h.layer_offset(h.shape[0])
    for name, dtype, shape, crc in h.stats:
        t = torch.empty(shape, dtype=STORED_DTYPES[dtype])
        view = _bytes_view(t)
        src.read_into([view], pos)
        if zlib.crc32(view) != crc:
            raise _damaged(f"stats {name!r} checksum mismatch")
        out[name] = t
        pos += len(view)
    return out


def empty_parts(h: Header) -> list[torch.Tensor]:
    """Buffers for every layer's parts ([L, ...] each), to read an entry into."""
    return [torch.empty((h.shape[0], *shape), dtype=dtype) for dtype, shape in h.layer_parts]


def read_record(src, h: Header, token_ids: torch.Tensor, tier: str = "disk") -> KVRecord:
    """The whole record (every layer verified)."""
    parts = empty_parts(h)
    for layer in range(h.shape[0]):
        read_layer_parts(src, h, layer, [p[layer] for p in parts])
    kw = dict(kind=h.kind, context=h.context, meta=h.meta, stats=read_stats(src, h), tier=tier)
    return h.codec.record(token_ids, parts, **kw)


class Entry:
    """An open, header-verified entry of a tier: read its layers or the whole record.

    The prefetcher streams any entry (disk or remote) through this surface. Close when done.

    Args:
        key: its store key.
        src: where its bytes are read from (``read_into(views, offset)``).
        header: its verified header.
        token_ids: its verified token ids.
        tier: the tier it is read from (``disk``, ``remote``).
        close: what closing it releases (an open file), if anything.
    """

    def __init__(self, key: StoreKey, src, header: Header, token_ids: torch.Tensor, tier: str, close=None) -> None:
        self.key, self.src, self.header, self.token_ids, self.tier = key, src, header, token_ids, tier
        self._close = close

    @property
    def nbytes(self) -> int:
        return self.header.size

    def read_layer_parts(self, layer: int, parts: list[torch.Tensor]) -> None:
        read_layer_parts(self.src, self.header, layer, parts)

    def read_stats(self) -> dict[str, torch.Tensor]:
        return read_stats(self.src, self.header)

    def read_record(self):
        return read_record(self.src, self.header, self.token_ids, tier=self.tier)

    def close(self) -> None:
        if self._close is not None:
            self._close()
