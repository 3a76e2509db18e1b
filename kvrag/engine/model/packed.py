"""Decode-step weights: fused and prepacked once for oneDNN (bfloat16 and float32 on CPU).

A decode step reads every weight of the model to produce one token per running sequence, so on a
CPU it is bound by how fast the linear layers stream their weights. In bfloat16, ``F.linear``
hands each call to oneDNN, which first reorders the weight into its blocked layout; for the few
rows of a decode step that reorder costs about as much as the product itself.
:class:`DecodeWeights` packs each layer's weights once, with Q/K/V fused into one product and
gate/up into another (fewer, larger calls).

In bfloat16 nothing changes numerically: a product with a prepacked weight runs oneDNN's same
kernel on the same blocked layout, and a fused product computes each output column as its unfused
one does. This is checked, not assumed: :meth:`DecodeWeights.build` compares every packed product
of every layer with the plain ``F.linear`` products on the decode step's own shape (``rows`` rows),
bit for bit, and returns ``None`` (the plain path) if one differs.

In float32 ``F.linear`` goes to MKL, not oneDNN, and for a decode step's few rows MKL streams the
weights slowly on some CPUs (an AVX2-only EPYC), so float32 weights are prepacked for oneDNN too.
oneDNN's float32 sums are not MKL's bit for bit (they differ in the last bits), so in float32 the
check is that every packed product is within :data:`FLOAT32_TOLERANCE` of the plain one (a wrong
packing is off by the whole value) and that a row's result does not depend on the other rows of the
product. Decoding is then the packed path's on every request of the engine (full, blend, reuse
alike), so ratio 1.0 still gives the full prefill's tokens; it is not the plain step's bits.

Packing is unavailable where it is not a CPU, not bfloat16 or float32, a torch without oneDNN's
linear ops, or (bfloat16) a CPU without oneDNN's bfloat16 kernels. The packed copies take as many
bytes again as the linear weights (270 MB for SmolLM2 in bfloat16, 540 MB in float32).

``torch.compile`` of the decode step was measured instead and ran slower than this eager step.
Measurements: docs/results.md ("Decode rates") and docs/journal/figures-from-code.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrag.engine.model.adapter import ModelAdapter

log = logging.getLogger(__name__)

__all__ = ["PackedLinear", "PackedLayer", "DecodeWeights", "FLOAT32_TOLERANCE", "cat_bias"]

#: In float32, a packed product may differ from ``F.linear``'s by this share of the largest output
#: (rounding of another summation order is ~1e-6 of it; a wrong packing is of the order of 1).
FLOAT32_TOLERANCE = 1e-4


class PackedLinear:
    """``x @ W.T + b`` through a weight prepacked once for oneDNN (for about ``rows`` rows)."""

    __slots__ = ("packed", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(slots=True)
class PackedLayer:
    """One layer's linear weights for decoding: Q/K/V and gate/up fused, each prepacked."""

    qkv: PackedLinear  # [H*D + 2*Hkv*D] outputs: q, then k, then v
    o: PackedLinear
    gate_up: PackedLinear  # [2*I] outputs: gate, then up
    down: PackedLinear


def cat_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    """The biases of fused products, concatenated (None: none has one)."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):  # a family with a bias on some projections only: not fused here
        raise ValueError("mixed biases")
    return torch.cat(biases)


def _packable(adapter: ModelAdapter) -> str | None:
    """Why the decode weights cannot be packed here, or None."""
    if adapter.device.type != "cpu":
        return f"device {adapter.device.type} (oneDNN packing is for CPU)"
    if adapter.dtype not in (torch.bfloat16, torch.float32):
        return f"{str(adapter.dtype).removeprefix('torch.')} (packing is checked for bfloat16 and float32)"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch has no oneDNN linear packing"
    if adapter.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bfloat16 kernels (they need AVX512 or AVX-NE-CONVERT)"
    return None


class DecodeWeights:
    """Every layer's :class:`PackedLayer` and the packed LM head; build with :meth:`build`."""

    def __init__(self, layers: list[PackedLayer], lm_head: PackedLinear, rows: int) -> None:
        self.layers = layers
        self.lm_head = lm_head
        self.rows = rows

    @classmethod
    def build(cls, adapter: ModelAdapter, rows: int) -> tuple[DecodeWeights | None, str]:
        """Packed weights for decode steps of ``rows`` rows, or ``None`` and why not.

        Each packed product is compared with the plain products on ``rows`` random rows: in
        bfloat16 a single differing bit keeps the plain path; in float32 a product further than
        :data:`FLOAT32_TOLERANCE` from the plain one, or one whose row changes with the other rows.
        """
        why = _packable(adapter)
        if why is not None:
            return None, why
        try:
            with torch.inference_mode():
                weights = cls._pack(adapter, rows)
                bad = weights._differs_from_plain(adapter)
        except (RuntimeError, ValueError) as e:  # an op missing or refusing these shapes: plain path
            log.debug("kvrag: decode weights not packed", exc_info=True)
            return None, f"packing failed ({type(e).__name__})"
        if bad is not None:
            return None, f"a packed product differs from F.linear ({bad})"
        if adapter.dtype == torch.float32:
            return weights, (
                "fused Q/K/V and gate/up, prepacked for oneDNN "
                f"(float32: within {FLOAT32_TOLERANCE:.0e} of MKL's sums)".replace("e-0", "e-")
            )
        return weights, "fused Q/K/V and gate/up, prepacked for oneDNN"

    @classmethod
    def _pack(cls, adapter: ModelAdapter, rows: int) -> DecodeWeights:
        layers = []
        for w in adapter.layers:
            layers.append(
                PackedLayer(
                    qkv=PackedLinear(torch.cat((w.wq, w.wk, w.wv)), cat_bias(w.bq, w.bk, w.bv), rows),
                    o=PackedLinear(w.wo, w.bo, rows),
                    gate_up=PackedLinear(torch.cat((w.w_gate, w.w_up)), None, rows),
                    down=PackedLinear(w.w_down, None, rows),
                )
            )
        return cls(layers, PackedLinear(adapter.lm_head_weight, None, rows), rows)

    def _differs_from_plain(self, adapter: ModelAdapter) -> str | None:
        """The first product that is not bit-identical to its plain ``F.linear`` counterpart (float32:
        not within :data:`FLOAT32_TOLERANCE` of it, or not independent of the product's other rows)."""
        gen = torch.Generator().manual_seed(0)
        exact = adapter.dtype != torch.float32

        def rand(features: int) -> torch.Tensor:
            return torch.randn(self.rows, features, generator=gen).to(adapter.dtype)

        def same(packed: PackedLinear, x: torch.Tensor, plain: torch.Tensor) -> bool:
            got = packed(x)
            if exact:
                return torch.equal(got, plain)
            if (got - plain).abs().max() > FLOAT32_TOLERANCE * plain.abs().max():
                return False
            other = torch.cat((x[:1], rand(x.shape[1])[1:]))  # row 0 beside other rows: the same bits
            return torch.equal(packed(other)[:1], got[:1])

        for i, (w, p) in enumerate(zip(adapter.layers, self.layers)):
            x = rand(adapter.hidden_size)
            plain = torch.cat((F.linear(x, w.wq, w.bq), F.linear(x, w.wk, w.bk), F.linear(x, w.wv, w.bv)), dim=-1)
            if not same(p.qkv, x, plain):
                return f"layer {i} q/k/v"
            a = rand(w.wo.shape[1])
            if not same(p.o, a, F.linear(a, w.wo, w.bo)):
                return f"layer {i} output projection"
            if not same(p.gate_up, x, torch.cat((F.linear(x, w.w_gate), F.linear(x, w.w_up)), dim=-1)):
                return f"layer {i} gate/up"
            m = rand(w.w_down.shape[1])
            if not same(p.down, m, F.linear(m, w.w_down)):
                return f"layer {i} down projection"
        x = rand(adapter.hidden_size)
        if not same(self.lm_head, x, F.linear(x, adapter.lm_head_weight)):
            return "LM head"
        return None
