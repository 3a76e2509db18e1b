"""Layer-wise access to a decoder model's weights, for every family in :mod:`kvrag.engine.model.families`.

The adapter reads the weights of a transformers model (no copy) and exposes the pieces the
runner needs to execute layers on any subset of tokens: embedding, Q/K/V projections (with their
biases and q/k norms), RoPE per layer, the attention window per layer, the rest of the layer
(output projection, norms, MLP) and the LM head. It follows transformers' numerics for each
family exactly (RMSNorm in float32, split-halves RoPE pairing, the family's attention scale) so
that a full prefill through it matches the model's own forward.

In bfloat16 on CPU that forward is transformers' bf16 forward bit for bit (measured on SmolLM2,
Gemma 3 270M's first 512 tokens and the tiny test models: same KV on every layer, same logits),
because the arithmetic is the same: RoPE angles and cos/sin in float32, rounded to the compute
dtype like transformers' rotary module does, the rotation in the compute dtype; RMSNorm in
float32; attention through SDPA, whose CPU kernels accumulate the softmax in float32, masked or
causal alike. Two exceptions round differently, equally far from a float32 forward: a
sliding-window layer past its window (kvrag attends block by block over the window, transformers
in one masked call) and CUDA (kvrag's Triton kernels compute in float32, round once). Rotating in float32
instead was measured: it leaves transformers' numerics (logits 1e-2 apart) without coming
measurably closer to a float32 forward. Cached keys are placed with the very same rotation
(:meth:`apply_rope`), so that exact reuse (prefix blocks, recompute ratio 1.0) reproduces the
full prefill's keys bit for bit; only :meth:`remove_rope`, which transformers has no counterpart
of, computes in float32.

Shapes: ``T`` tokens, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``E`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvrag.engine.model.families import check_architecture, layer_types, layer_windows
from kvrag.errors import UnsupportedModelError
from kvrag.kernels import rope_rotate

__all__ = ["ModelAdapter", "RopeTable", "Rotary"]

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


@dataclass(slots=True)
class _Layer:
    ln_attn: torch.Tensor  # input norm (before attention)
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln_mlp: torch.Tensor  # norm before the MLP
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None  # per-head norms before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    ln_attn_out: torch.Tensor | None = None  # norms of the attention and MLP outputs (Gemma)
    ln_mlp_out: torch.Tensor | None = None


@dataclass(slots=True)
class Rotary:
    """One RoPE: inverse frequencies [D/2] (float32) and the factor on cos/sin."""

    inv_freq: torch.Tensor
    scaling: float = 1.0


class RopeTable:
    """cos/sin [T, D] of some positions, one pair per RoPE of the model, looked up by layer."""

    __slots__ = ("pairs", "kinds")

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], kinds: list[int]) -> None:
        self.pairs = pairs
        self.kinds = kinds  # layer -> index into pairs

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] of this layer's RoPE."""
        return self.pairs[self.kinds[layer]]

    def __getitem__(self, rows) -> RopeTable:
        """The same table for a subset (index or slice) of its positions."""
        return RopeTable([(c[rows], s[rows]) for c, s in self.pairs], self.kinds)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _bias(linear) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def _weight(module) -> torch.Tensor | None:
    return module.weight.detach() if module is not None else None


class ModelAdapter:
    """Per-layer functions over a transformers model of a supported family."""

    def __init__(self, hf_model) -> None:
        cfg = hf_model.config
        self.family = check_architecture(cfg)
        self.config = cfg
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.hidden_size = int(cfg.hidden_size)
        self.eps = float(cfg.rms_norm_eps)
        scalar = getattr(cfg, self.family.attn_scalar) if self.family.attn_scalar else self.head_dim
        self.scale = float(scalar) ** -0.5
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        self.act = _ACTIVATIONS[self.family.activation]
        base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model.model
        self.embed_weight = hf_model.get_input_embeddings().weight.detach()
        self.lm_head_weight = hf_model.get_output_embeddings().weight.detach()
        self.norm_weight = base.norm.weight.detach()
        self.dtype = self.embed_weight.dtype
        self.device = self.embed_weight.device
        # transformers keeps the scale as a float32 scalar and rounds it to the weights' dtype
        self.embed_scale = torch.tensor(self.hidden_size**0.5).to(self.dtype) if self.family.embed_scale else None
        self.layers = [self._layer(layer) for layer in base.layers]
        #: per layer: the attention window (keys (p - w, p] of a row at p) or None (global)
        self.windows: list[int | None] = layer_windows(cfg)
        self.rotaries, self.rope_kinds = self._rotaries(base, cfg)
        # sliding-window layers are exact at any length: the window does not bound the context
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 2048))

    def _layer(self, layer) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        sandwich = self.family.sandwich_norms
        return _Layer(
            ln_attn=layer.input_layernorm.weight.detach(),
            wq=a.q_proj.weight.detach(),
            bq=_bias(a.q_proj),
            wk=a.k_proj.weight.detach(),
            bk=_bias(a.k_proj),
            wv=a.v_proj.weight.detach(),
            bv=_bias(a.v_proj),
            wo=a.o_proj.weight.detach(),
            bo=_bias(a.o_proj),
            # Gemma's post_attention_layernorm normalises the attention output; Llama's is the MLP's input norm
            ln_mlp=(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight.detach(),
            w_gate=m.gate_proj.weight.detach(),
            w_up=m.up_proj.weight.detach(),
            w_down=m.down_proj.weight.detach(),
            q_norm=_weight(a.q_norm) if self.family.qk_norm else None,
            k_norm=_weight(a.k_norm) if self.family.qk_norm else None,
            ln_attn_out=layer.post_attention_layernorm.weight.detach() if sandwich else None,
            ln_mlp_out=layer.post_feedforward_layernorm.weight.detach() if sandwich else None,
        )

    @staticmethod
    def _rotaries(base, cfg) -> tuple[list[Rotary], list[int]]:
        """The RoPE of each layer type, exactly as the model's rotary module has them, and per layer
        the index of its RoPE. Gemma 3 keeps ``<type>_inv_freq`` per layer type; the others one."""
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None:
            raise UnsupportedModelError(f"{type(base).__name__} has no rotary embedding module")
        types = layer_types(cfg)
        names = sorted(set(types))
        rotaries = []
        for t in names:
            prefix = f"{t}_" if hasattr(rotary, f"{t}_inv_freq") else ""
            inv = getattr(rotary, f"{prefix}original_inv_freq", None)
            inv = getattr(rotary, f"{prefix}inv_freq") if inv is None else inv
            scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
            rotaries.append(Rotary(inv.detach().float().clone(), scaling))
        return rotaries, [names.index(t) for t in types]

    # -- per-token pieces -------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers, in the compute dtype."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.embed_weight.element_size()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, E]."""
        h = F.embedding(ids, self.embed_weight)
        return h if self.embed_scale is None else h * self.embed_scale

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim, in float32, with the family's weight style."""
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.family.norm_offset:  # Gemma: (x * (1 + w)) in float32, then the cast
            return (x32 * (self.family.norm_offset + weight.float())).to(dtype)
        return weight * x32.to(dtype)

    def rope(self, positions: torch.Tensor) -> RopeTable:
        """positions [T] -> cos/sin [T, D] of every RoPE of the model, in the compute dtype (as
        transformers does); ``table.layer(l)`` is layer l's pair."""
        pairs = []
        pos = positions.to(torch.float32)[:, None]
        for r in self.rotaries:
            emb = pos * r.inv_freq.to(positions.device)[None, :]
            emb = torch.cat((emb, emb), dim=-1)
            pairs.append(((emb.cos() * r.scaling).to(self.dtype), (emb.sin() * r.scaling).to(self.dtype)))
        return RopeTable(pairs, self.rope_kinds)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, E] -> input norm -> q [H, T, D], k [Hkv, T, D], v [Hkv, T, D], all without RoPE."""
        w = self.layers[layer]
        x = self.rms_norm(h, w.ln_attn)
        t = x.shape[0]
        q = F.linear(x, w.wq, w.bq).view(t, self.n_heads, self.head_dim).transpose(0, 1)
        k = F.linear(x, w.wk, w.bk).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = F.linear(x, w.wv, w.bv).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        if w.q_norm is not None:
            q, k = self.rms_norm(q, w.q_norm), self.rms_norm(k, w.k_norm)
        return q, k, v

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [heads, T, D] rotated to the positions of cos/sin [T, D]."""
        return rope_rotate(x, cos, sin)

    def remove_rope(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Keys k [Hkv, T, D] that carry RoPE at the positions of cos/sin [T, D] (their layer's
        table, as :meth:`rope` made it) back to keys without RoPE.

        The exact inverse of the rotation :meth:`apply_rope` applied, computed in float32 and
        rounded once: the table's (c, s) pairs, rounded to the compute dtype, are not quite a
        rotation (c² + s² is not 1, nor the RoPE scaling's square), so the inverse divides by
        c² + s². In bfloat16 that halves the round trip's error against rotating back in bf16
        (measured 4.3e-3 vs 8.6e-3 relative on random keys); in float32 it changes nothing visible.
        """
        x, c, s = k.float(), cos.float(), sin.float()
        back = (x * c - _rotate_half(x) * s) / (c * c + s * s)
        return back.to(k.dtype)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention output [H, T, D]: o_proj, (norm), residual, norm, MLP, (norm), residual."""
        w = self.layers[layer]
        t = attn.shape[1]
        a = F.linear(attn.transpose(0, 1).reshape(t, self.n_heads * self.head_dim), w.wo, w.bo)
        if w.ln_attn_out is not None:
            a = self.rms_norm(a, w.ln_attn_out)
        h = h + a
        x = self.rms_norm(h, w.ln_mlp)
        m = F.linear(self.act(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)
        if w.ln_mlp_out is not None:
            m = self.rms_norm(m, w.ln_mlp_out)
        return h + m

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [T, E] -> final norm -> logits [T, V] in float32 (callers pass only the rows they need)."""
        return F.linear(self.rms_norm(h, self.norm_weight), self.lm_head_weight).float()
