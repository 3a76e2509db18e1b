"""Decode-step weights in 8 or 4 bits: weight-only quantized linear layers for a CPU.

A decode step reads every weight of the model once per token, so on a CPU its time is the bytes it
streams. :class:`Int8Linear` keeps a weight as int8 with one bfloat16 scale per output channel
(symmetric: ``w ≈ scale * q``); :class:`Int4Linear` as 4-bit codes in groups along the input with a
scale and a zero per group (``w ≈ scale * (q - 8) + zero``, gpt-fast's layout). Their products are
torch's own CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), with bfloat16
activations. Where kvrag's own int4 × int8 kernel builds (:mod:`kvrag.kernels.int4_cpu`: integer dot
products, the activations quantized to int8 per group of 32 inside the call), ``int4`` is
:class:`Int4x8Linear` instead: the same 4-bit grid (``w = scale * q + low``), fp16 scales, its own
layout; only the activations' rounding differs. All compute each output row from its own input row
only (checked when the weights are built: :meth:`QuantizedWeights.build`), so a decode step runs
exactly its rows, never padded rows: a row's result does not depend on what else runs, which is
what padding bought the plain path.

Prefill keeps the compute dtype's weights (a prefill is compute-bound, where the plain products
win); only decode steps read these. They are built from the loaded weights (any source: a GGUF's
dequantized weights, a Hugging Face checkpoint), so they are a second rounding of a quantized GGUF;
the fidelity this costs is measured against the plain decode (docs/results.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.packed import PackedLayer, cat_bias
from kvrag.kernels.int4_cpu import int4_kernel, pack_int4

log = logging.getLogger(__name__)

__all__ = [
    "Int8Linear",
    "Int4Linear",
    "Int4x8Linear",
    "QuantizedWeights",
    "QUANTIZED_FORMATS",
    "INT4_GROUP",
    "cache_file",
    "decode_weights",
]

#: Version of the cached decode weights' layout (:func:`cache_file`).
CACHE_VERSION = 1

#: Weight formats of the decode step besides the compute dtype's own.
QUANTIZED_FORMATS = ("int8", "int4")

#: Input features per 4-bit group (its own scale and zero).
INT4_GROUP = 32


def decode_weights(setting: str, quantized_source: bool) -> str:
    """The decode step's weight format for ``EngineConfig.weights``: as set, or for ``"auto"`` ``int4``
    where the model came quantized (a GGUF's Q4_K, Q8_0, ...: its weights lie on a coarse grid
    already, so 4-bit decode weights cost little; measured: docs/results.md), else ``plain`` (a
    float checkpoint's weights are not quantized behind the user's back). Where the 4-bit kernels
    do not run, the decoder keeps the packed step and says why."""
    if setting != "auto":
        return setting
    return "int4" if quantized_source else "plain"


class Int8Linear:
    """``x @ W.T + b`` with ``W`` as int8 codes and a bfloat16 scale per output channel."""

    __slots__ = ("codes", "scales", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        codes, scales = [], []
        for w in _row_chunks(weight):  # float32 temporaries of a chunk of rows at a time
            scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            codes.append(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            scales.append(scale)
        self.codes = torch.cat(codes)  # [N, K]
        self.scales = torch.cat(scales).to(torch.bfloat16)  # [N]
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)
        return y if self.bias is None else y + self.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None) -> Int8Linear:
        self = cls.__new__(cls)
        self.codes, self.scales, self.bias, self.out_features = t["codes"], t["scales"], bias, int(t["codes"].shape[0])
        return self

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class Int4Linear:
    """``x @ W.T + b`` with ``W`` in 4-bit codes, :data:`INT4_GROUP` inputs per scale and zero."""

    __slots__ = ("packed", "scales_zeros", "bias", "out_features", "group")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP) -> None:
        n, k = weight.shape
        if k % group or n % 16:
            raise ValueError(f"4-bit packing needs inputs in groups of {group} and outputs by 16, got [{n}, {k}]")
        packed, scales, zeros = [], [], []
        for w in _row_chunks(weight):  # float32 temporaries of a chunk of rows at a time
            w = w.reshape(w.shape[0], k // group, group)
            low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
            scale = ((high - low) / 15).clamp(min=1e-8)
            codes = torch.round((w - low) / scale).clamp(0, 15).to(torch.int32).reshape(-1, k)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))  # rows pack alone
            scales.append(scale.squeeze(-1))
            zeros.append((low + 8 * scale).squeeze(-1))  # w = scale * (q - 8) + zero
        self.packed = torch.cat(packed)
        scale, zero = torch.cat(scales), torch.cat(zeros)  # [N, K / group]
        self.scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = bias
        self.out_features = int(n)
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group, self.scales_zeros)
        return y if self.bias is None else y + self.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_zeros": self.scales_zeros}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None, group: int = INT4_GROUP) -> Int4Linear:
        self = cls.__new__(cls)
        self.packed, self.scales_zeros, self.bias, self.group = t["packed"], t["scales_zeros"], bias, group
        self.out_features = int(t["scales_zeros"].shape[1])  # [K / group, N, 2]
        return self

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int4x8Linear:
    """``x @ W.T + b`` with ``W`` in 4-bit codes, :data:`INT4_GROUP` inputs per fp16 scale and low end
    (``w = scale * q + low``), run by kvrag's int4 × int8 kernel (:mod:`kvrag.kernels.int4_cpu`)."""

    __slots__ = ("codes", "scales", "lows", "bias", "out_features", "kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP) -> None:
        kernel, why = int4_kernel()
        if kernel is None:
            raise ValueError(f"kvrag's int4 kernel is not available: {why}")
        n, k = weight.shape
        if k % group or group != INT4_GROUP:
            raise ValueError(f"4-bit packing needs inputs in groups of {INT4_GROUP}, got [{n}, {k}]")
        codes, scales, lows = [], [], []
        for w in _row_chunks(weight):  # float32 temporaries of a chunk of rows at a time
            w = w.reshape(w.shape[0], k // group, group)
            low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
            fp16 = torch.finfo(torch.float16).max
            # the codes are chosen against the fp16 scale and low the kernel reads
            low = low.clamp(-fp16, fp16).half().float()
            scale = ((high - low) / 15).clamp(max=fp16).half().float()
            q = torch.where(scale > 0, torch.round((w - low) / scale.clamp(min=1e-30)), torch.zeros_like(w))
            codes.append(pack_int4(q.clamp(0, 15).reshape(-1, k)))
            scales.append(scale.squeeze(-1).half())
            lows.append(low.squeeze(-1).half())
        self.codes, self.scales, self.lows = torch.cat(codes), torch.cat(scales), torch.cat(lows)
        self.bias, self.out_features, self.kernel = bias, int(n), kernel
        kernel.check(self.codes, self.scales, self.lows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = self.kernel.mm(x2, self.codes, self.scales, self.lows, checked=True)  # checked once when made
        y = y.reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "lows": self.lows}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None) -> Int4x8Linear:
        kernel, why = int4_kernel()
        if kernel is None:
            raise ValueError(f"kvrag's int4 kernel is not available: {why}")
        self = cls.__new__(cls)
        self.codes, self.scales, self.lows = t["codes"], t["scales"], t["lows"]
        self.bias, self.out_features, self.kernel = bias, int(t["codes"].shape[0]), kernel
        kernel.check(self.codes, self.scales, self.lows)  # a cache file's tensors: refused here, then built again
        return self

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.lows.nbytes


#: Output rows quantized at a time (bounds the float32 temporaries: ~64 MiB for a 4096-wide weight).
_CHUNK_ROWS = 4096


def _row_chunks(weight: torch.Tensor):
    """The weight's rows in float32, a chunk of :data:`_CHUNK_ROWS` at a time."""
    for first in range(0, weight.shape[0], _CHUNK_ROWS):
        yield weight[first : first + _CHUNK_ROWS].float()


def _quantizable(adapter: ModelAdapter, fmt: str) -> str | None:
    """Why the decode weights cannot be ``fmt`` here, or None."""
    if fmt not in QUANTIZED_FORMATS:
        return f"unknown weight format {fmt!r}"
    if adapter.device.type != "cpu":
        return f"device {adapter.device.type} (the weight-only kernels here are torch's CPU ones)"
    if adapter.dtype != torch.bfloat16:
        return f"{str(adapter.dtype).removeprefix('torch.')} compute (the kernels take bfloat16 activations)"
    op = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, op) and not (fmt == "int4" and int4_kernel()[0] is not None):
        return f"this torch has no {op}"
    return None


def _int4_linear() -> tuple[type, str]:
    """The 4-bit linear that runs here, and what to say of its kernel: kvrag's where it builds."""
    kernel, why = int4_kernel()
    if kernel is not None:
        return Int4x8Linear, why
    return Int4Linear, f"torch's int4 kernel: kvrag's is not built here ({why})"


class QuantizedWeights:
    """Every layer's linear weights (Q/K/V and gate/up fused) and the LM head in ``fmt``; the same
    interface as :class:`~kvrag.engine.model.packed.DecodeWeights`, and rows never padded."""

    row_invariant = True  # a row's output depends on its own input row only (checked in build)

    def __init__(self, layers: list[PackedLayer], lm_head, fmt: str) -> None:
        self.layers, self.lm_head, self.format = layers, lm_head, fmt

    @property
    def nbytes(self) -> int:
        linears = [x for p in self.layers for x in (p.qkv, p.o, p.gate_up, p.down)]
        return sum(x.nbytes for x in linears) + self.lm_head.nbytes

    @classmethod
    def build(cls, adapter: ModelAdapter, fmt: str, cache: Path | None = None) -> tuple[QuantizedWeights | None, str]:
        """The decode weights in ``fmt`` (``int8`` or ``int4``), or ``None`` and why not.

        ``cache``: a file (:func:`cache_file`) they are read from when it exists, else written to
        once built (reading them back takes a fraction of quantizing them again: docs/journal/real-models.md):
        the same tensors either way."""
        why = _quantizable(adapter, fmt)
        if why is not None:
            return None, why
        make, kernel = (Int8Linear, "torch's int8 kernel") if fmt == "int8" else _int4_linear()
        biases = [(cat_bias(w.bq, w.bk, w.bv), w.bo) for w in adapter.layers]
        try:
            with torch.inference_mode():
                weights, source = _read(cache, make, biases, fmt), "read from the cache"
                if weights is None:
                    layers = [
                        PackedLayer(
                            qkv=make(torch.cat((w.wq, w.wk, w.wv)), qkv_bias),
                            o=make(w.wo, o_bias),
                            gate_up=make(torch.cat((w.w_gate, w.w_up)), None),
                            down=make(w.w_down, None),
                        )
                        for w, (qkv_bias, o_bias) in zip(adapter.layers, biases)
                    ]
                    weights, source = cls(layers, make(adapter.lm_head_weight, None), fmt), "quantized"
                    if cache is not None:
                        _write(cache, weights)
                bad = weights._mixes_rows(adapter)
        except (RuntimeError, ValueError) as e:  # an op missing or refusing these shapes
            log.debug("kvrag: decode weights not quantized", exc_info=True)
            return None, f"{fmt} failed ({type(e).__name__}: {e})"
        if bad is not None:
            return None, f"{fmt}: a row's product depends on the other rows ({bad})"
        size = f"{weights.nbytes / 2**20:.0f} MiB, {source}"
        return weights, f"{fmt} weight-only, Q/K/V and gate/up fused, {kernel} ({size})"

    def _mixes_rows(self, adapter: ModelAdapter) -> str | None:
        """The first product whose row 0 differs between 1 row and 8 rows (each of the shapes once)."""
        gen = torch.Generator().manual_seed(0)
        first = self.layers[0]
        for name, linear in (("q/k/v", first.qkv), ("gate/up", first.gate_up), ("LM head", self.lm_head)):
            x = torch.randn(8, adapter.hidden_size, generator=gen).to(adapter.dtype)
            if not torch.equal(linear(x[:1]), linear(x)[:1]):
                return name
        return None


_PARTS = ("qkv", "o", "gate_up", "down")


def cache_file(cache_dir: Path, fingerprint: str, fmt: str) -> Path:
    """Where the decode weights in ``fmt`` of the model with ``fingerprint`` are kept: keyed also by
    torch's version and the CPU capability its kernels were built for (the packed layout is theirs),
    or for kvrag's int4 kernel by its own layout (the same on every CPU it builds on)."""
    if fmt == "int4" and _int4_linear()[0] is Int4x8Linear:
        return cache_dir / "models" / f"decode-{fingerprint[:32]}-int4x8-g{INT4_GROUP}-v{CACHE_VERSION}.safetensors"
    capability = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.replace("+", "_")
    name = f"decode-{fingerprint[:32]}-{fmt}-g{INT4_GROUP}-torch{version}-{capability}-v{CACHE_VERSION}.safetensors"
    return cache_dir / "models" / name


def _read(cache: Path | None, make, biases, fmt: str) -> QuantizedWeights | None:
    """The weights a :func:`_write` left in ``cache``, or None (none there, or unreadable: built again)."""
    if cache is None or not cache.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(cache), framework="pt") as f:  # each tensor copied into memory of its own: the
            t = {k: f.get_tensor(k).clone() for k in f.keys()}  # file's offsets lack the alignment kernels assume
        parts = lambda prefix: {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(prefix + ".")}  # noqa: E731
        layers = [
            PackedLayer(
                qkv=make.from_tensors(parts(f"{i}.qkv"), qkv_bias),
                o=make.from_tensors(parts(f"{i}.o"), o_bias),
                gate_up=make.from_tensors(parts(f"{i}.gate_up"), None),
                down=make.from_tensors(parts(f"{i}.down"), None),
            )
            for i, (qkv_bias, o_bias) in enumerate(biases)
        ]
        return QuantizedWeights(layers, make.from_tensors(parts("lm_head"), None), fmt)
    except Exception:  # damaged in any way (safetensors raises its own errors): quantize again
        log.warning("kvrag: the cached decode weights in %s are unreadable; quantizing again", cache, exc_info=True)
        return None


def _write(cache: Path, weights: QuantizedWeights) -> None:
    """Keep ``weights`` in ``cache`` (written whole or not at all; a read-only cache only costs the time)."""
    from safetensors.torch import save_file

    tensors = {f"lm_head.{k}": v for k, v in weights.lm_head.tensors().items()}
    for i, layer in enumerate(weights.layers):
        for part in _PARTS:
            tensors.update({f"{i}.{part}.{k}": v for k, v in getattr(layer, part).tensors().items()})
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".decode-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, cache)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:  # a full or read-only disk, or safetensors' own error: only the next load's time is lost
        log.warning("kvrag: could not keep the decode weights in %s", cache, exc_info=True)
