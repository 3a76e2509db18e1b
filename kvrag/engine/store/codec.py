"""How K and V are held at rest: a plain dtype, or an 8-bit code with scales.

A codec says what one layer of a record is made of at rest (its *parts*: tensors of a dtype and a
shape) and how to turn K/V into parts and back. The at-rest format (:mod:`serial`) stores a
layer's parts one after the other under one checksum; the tiers never look inside them.

- :class:`PlainCodec`: K and V cast to ``float16``, ``bfloat16`` or ``float32`` (two parts).
- :class:`Int8Codec`: asymmetric 8-bit codes with scales, KIVI-style (Liu et al. 2024): keys are
  quantized *per channel* over groups of ``group`` tokens (a key channel's outliers are steady
  along the tokens, so a channel shares one range), values *per token* (over the head dim). Six
  parts per layer: K codes, V codes ``uint8`` [Hkv, T, D]; K scale and minimum ``float16``
  [Hkv, ceil(T/group), D]; V scale and minimum ``float16`` [Hkv, T]. About 1.06 bytes per element
  with 64 dims and groups of 64, 1.9x smaller than fp16 (CacheGen's 3.5-4.3x adds entropy coding
  and fewer bits on deep layers: not done here).

A request's answer must not depend on which tier served a chunk. So the 8-bit round trip happens
once, when a record is first stored (:meth:`Int8Codec.at_rest`): the memory tier then holds the
codes themselves (a :class:`CodedRecord`, decoded layer by layer as the prefill reads it), and the
disk and remote tiers store those very codes. Codes are never re-quantized; every tier decodes
the same bytes with the same arithmetic, so every tier yields the same floats.
"""

from __future__ import annotations

import torch

from kvrag.config import KV_CODECS as CODECS
from kvrag.engine.model.dtypes import FLOAT_DTYPES, dtype_name, torch_dtype
from kvrag.engine.store.base import KVRecord

__all__ = [
    "Codec",
    "PlainCodec",
    "Int8Codec",
    "CodedRecord",
    "AtRest",
    "make_codec",
    "codec_from_header",
    "CODECS",
]

_SCALE = torch.float16  # scales and minimums at rest


class Codec:
    """One layer of K/V at rest as a list of tensors ("parts")."""

    #: header name of the codec
    name = "plain"
    #: short tag naming the at-rest representation (part of remote keys and disk names)
    tag = ""

    def layout(self, heads: int, tokens: int, dim: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of each part of one layer."""
        raise NotImplementedError

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """Parts of one layer from K and V [Hkv, T, D] (contiguous CPU tensors)."""
        raise NotImplementedError

    def decode_layer(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, T, D] of one layer from its parts."""
        raise NotImplementedError

    def layer_nbytes(self, heads: int, tokens: int, dim: int) -> int:
        n = 0
        for dtype, shape in self.layout(heads, tokens, dim):
            size = dtype.itemsize
            for s in shape:
                size *= s
            n += size
        return n

    def at_rest(self, record) -> KVRecord:
        """The record as every tier will hold it (computed once, when it is first stored)."""
        raise NotImplementedError

    def record(self, token_ids, parts: list[torch.Tensor], *, kind, context, meta, stats, tier="memory"):
        """A record over whole-record parts ([L, ...] each), as read back from a tier."""
        raise NotImplementedError

    def parts_of(self, record) -> list[list[torch.Tensor]]:
        """Per layer, the parts to write for ``record`` (its own codes when it has them)."""
        if isinstance(record, CodedRecord) and record.codec.name == self.name:
            return [[p[layer] for p in record.parts] for layer in range(record.num_layers)]
        return [self.encode_layer(*record.layer(layer)) for layer in range(record.num_layers)]


class PlainCodec(Codec):
    """K and V cast to one floating dtype."""

    name = "plain"

    def __init__(self, dtype: str | torch.dtype = "float16") -> None:
        self.dtype = torch_dtype(dtype, argument="plain KV at rest") if isinstance(dtype, str) else dtype
        if dtype_name(self.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"plain KV at rest is float16, bfloat16 or float32, not {self.dtype}")
        self.dtype_name = dtype_name(self.dtype)
        self.tag = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[self.dtype_name]

    def layout(self, heads, tokens, dim):
        return [(self.dtype, (heads, tokens, dim))] * 2

    def encode_layer(self, k, v):
        return [k.detach().to("cpu", self.dtype).contiguous(), v.detach().to("cpu", self.dtype).contiguous()]

    def decode_layer(self, parts):
        return parts[0], parts[1]

    def at_rest(self, record) -> KVRecord:
        if record.k.dtype == self.dtype and record.v.dtype == self.dtype and record.tier == "memory":
            return record
        return KVRecord(
            record.token_ids,
            record.k.to(self.dtype),
            record.v.to(self.dtype),
            kind=record.kind,
            context=record.context,
            meta=record.meta,
            stats=record.stats,
        )

    def record(self, token_ids, parts, *, kind, context, meta, stats, tier="memory"):
        return KVRecord(token_ids, parts[0], parts[1], kind=kind, context=context, meta=meta, stats=stats, tier=tier)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 8-bit codes of ``x`` with one (scale, minimum) per slice along ``dim``."""
    lo = x.amin(dim=dim, keepdim=True).to(_SCALE)
    hi = x.amax(dim=dim, keepdim=True)
    # a hair wider than the range, so that rounding the scale to fp16 never leaves the top out
    # (and no smaller than fp16's smallest normal number: subnormal scales lose their precision)
    step = ((hi - lo.float()) / 255.0 * (1 + 2**-9)).clamp_min(torch.finfo(_SCALE).tiny)
    scale = step.to(_SCALE)
    # the codes are computed against the fp16 scale and minimum that are stored, so decoding
    # them reproduces the nearest representable level, not a level of a scale never kept
    q = torch.round((x - lo.float()) / scale.float()).clamp_(0, 255).to(torch.uint8)
    return q, scale, lo


def _dequantize_(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 codes) turned into ``x * scale + lo`` in place (scale and minimum broadcast)."""
    return x.mul_(scale.float()).add_(lo.float())


class Int8Codec(Codec):
    """Keys per channel (groups of ``group`` tokens), values per token; fp16 scales and minimums.

    Decoded K/V are ``float32``.
    """

    def __init__(self, group: int = 64) -> None:
        if group < 1:
            raise ValueError("group must be >= 1")
        self.group = group
        self.name = f"int8-k{group}-v"
        self.tag = f"q8k{group}"

    def _groups(self, tokens: int) -> int:
        return (tokens + self.group - 1) // self.group

    def layout(self, heads, tokens, dim):
        g = self._groups(tokens)
        return [
            (torch.uint8, (heads, tokens, dim)),
            (torch.uint8, (heads, tokens, dim)),
            (_SCALE, (heads, g, dim)),
            (_SCALE, (heads, g, dim)),
            (_SCALE, (heads, tokens)),
            (_SCALE, (heads, tokens)),
        ]

    def encode_layer(self, k, v):
        k = k.detach().to("cpu", torch.float32)
        v = v.detach().to("cpu", torch.float32)
        h, t, d = k.shape
        g = self._groups(t)
        pad = g * self.group - t
        # pad with each channel's last value: it does not widen the last group's range
        kp = torch.cat([k, k[:, -1:].expand(h, pad, d)], dim=1) if pad else k
        kq, ks, kl = _quantize(kp.view(h, g, self.group, d), dim=2)  # [H, G, group, D], [H, G, 1, D]
        vq, vs, vl = _quantize(v, dim=2)  # [H, T, D], [H, T, 1]
        return [
            kq.view(h, g * self.group, d)[:, :t].contiguous(),
            vq.contiguous(),
            ks.view(h, g, d).contiguous(),
            kl.view(h, g, d).contiguous(),
            vs.view(h, t).contiguous(),
            vl.view(h, t).contiguous(),
        ]

    def decode_layer(self, parts):
        kq, vq, ks, kl, vs, vl = parts
        h, t, d = kq.shape
        # in place, scales broadcast over their group (no [H, T, D] copy of them): this runs on the
        # prefill's critical path, once per layer and chunk hit
        k = kq.float()
        whole = t // self.group  # groups of ``group`` tokens; a shorter last one follows
        body = k[:, : whole * self.group].view(h, whole, self.group, d)
        _dequantize_(body, ks[:, :whole, None], kl[:, :whole, None])
        _dequantize_(k[:, whole * self.group :], ks[:, whole:], kl[:, whole:])
        v = _dequantize_(vq.float(), vs.unsqueeze(-1), vl.unsqueeze(-1))
        return k, v

    def at_rest(self, record):
        if isinstance(record, CodedRecord) and record.codec.name == self.name:
            return record
        per_layer = self.parts_of(record)
        parts = [torch.stack([layer[i] for layer in per_layer]) for i in range(len(per_layer[0]))]
        return CodedRecord(
            self,
            record.token_ids,
            parts,
            kind=record.kind,
            context=record.context,
            meta=record.meta,
            stats=record.stats,
        )

    def record(self, token_ids, parts, *, kind, context, meta, stats, tier="memory"):
        return CodedRecord(self, token_ids, parts, kind=kind, context=context, meta=meta, stats=stats, tier=tier)


class CodedRecord:
    """A record held as codec parts ([L, ...] each); duck-types :class:`KVRecord`.

    ``layer(l)`` decodes one layer (what the prefill asks for); ``k``/``v`` decode every layer.
    """

    def __init__(
        self, codec: Codec, token_ids, parts, *, kind="chunk", context="sink", meta=None, stats=None, tier="memory"
    ):
        self.codec = codec
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        self.parts = list(parts)
        self.kind, self.context = kind, context
        self.meta = dict(meta or {})
        self.stats = dict(stats or {})
        self.tier = tier
        if self.parts[0].shape[2] != self.token_ids.shape[0]:
            raise ValueError(f"KV covers {self.parts[0].shape[2]} tokens but token_ids has {self.token_ids.shape[0]}")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.parts[0].shape[0])

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        L, h, _, d = self.parts[0].shape
        return int(L), int(h), int(d)

    @property
    def nbytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.parts) + self.token_ids.numel() * 8
        return n + sum(t.numel() * t.element_size() for t in self.stats.values())

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decode_layer([p[layer] for p in self.parts])

    @property
    def k(self) -> torch.Tensor:
        return torch.stack([self.layer(i)[0] for i in range(self.num_layers)])

    @property
    def v(self) -> torch.Tensor:
        return torch.stack([self.layer(i)[1] for i in range(self.num_layers)])

    def clone(self) -> CodedRecord:
        """A copy with parts and meta of its own, still as codes: a store of the same codec keeps
        them as they are (decoding and encoding again would round twice)."""
        return CodedRecord(
            self.codec,
            self.token_ids.clone(),
            [p.clone() for p in self.parts],
            kind=self.kind,
            context=self.context,
            meta=dict(self.meta),
            stats={n: t.clone() for n, t in self.stats.items()},
            tier=self.tier,
        )

    def matches(self, token_ids) -> bool:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        return ids.shape == self.token_ids.shape and bool(torch.equal(ids, self.token_ids))


class AtRest:
    """What a store does to a record before it keeps it: chunks through the codec, the rest plain.

    Exact-prefix blocks (``kind="prefix"``) stay plain even with the 8-bit codec: they are small,
    and prefix reuse promises the KV that was computed. The conversion is idempotent (a record
    already at rest passes through), so every tier may apply it.

    Args:
        codec: ``plain`` or ``int8``.
        dtype: the plain at-rest dtype (``float16``, ``bfloat16``, ``float32``); ``None``: plain
            records are kept as computed, in the compute dtype (a store of the memory tier alone,
            where nothing needs one dtype across tiers).
    """

    def __init__(self, codec: str = "plain", dtype: str | torch.dtype | None = "float16") -> None:
        self.plain = None if dtype is None else PlainCodec(dtype)
        self.codec = self.plain if codec == "plain" else make_codec(codec)
        #: names the representation in keys and entry names (stores of other codecs never mix)
        self.tag = "" if self.codec is None else self.codec.tag

    @property
    def name(self) -> str:
        """The codec's header name; ``plain`` for records kept as computed."""
        return "plain" if self.codec is None else self.codec.name

    def __call__(self, record):
        codec = self.codec if record.kind == "chunk" else self.plain
        return record if codec is None else codec.at_rest(record)

    def codec_of(self, record) -> Codec:
        """The codec a record at rest is written with (tiers that write bytes have a plain dtype)."""
        return record.codec if isinstance(record, CodedRecord) else self.plain


def make_codec(name: str = "plain", dtype: str | torch.dtype = "float16") -> Codec:
    """The codec named by ``EngineConfig.kv_codec`` (``plain`` uses ``dtype``)."""
    if name == "plain":
        return PlainCodec(dtype)
    if name == "int8":
        return Int8Codec()
    raise ValueError(f"unknown KV codec {name!r}; use one of {', '.join(CODECS)}")


def codec_from_header(name: str, dtype: str) -> Codec | None:
    """The codec a stored header names, or ``None`` if it names none kvrag knows."""
    if name == "plain":
        return PlainCodec(dtype) if dtype in FLOAT_DTYPES else None
    if name.startswith("int8-k") and name.endswith("-v"):
        group = name[len("int8-k") : -len("-v")]
        if group.isdigit() and 1 <= int(group) <= 1 << 16 and name == f"int8-k{int(group)}-v":
            return Int8Codec(int(group))
    return None
