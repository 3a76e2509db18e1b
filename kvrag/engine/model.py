"""Layer-wise access to a Llama-family model's weights.

The adapter reads the weights of a transformers model (no copy) and exposes the pieces the
runner needs to execute layers on any subset of tokens: embedding, RMSNorm, Q/K/V projections,
RoPE, output projection, MLP and the LM head. It follows transformers' Llama numerics exactly
(RMSNorm in float32, split-halves RoPE pairing, ``head_dim ** -0.5`` scaling) so that a full
prefill through it matches the model's own forward.

Shapes: ``T`` tokens, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``E`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrag.engine.loading import check_architecture, sliding_window
from kvrag.errors import UnsupportedModelError
from kvrag.kernels import rope_rotate

__all__ = ["ModelAdapter"]


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _bias(linear) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


class ModelAdapter:
    """Per-layer functions over a transformers Llama/Mistral/Qwen2 model."""

    def __init__(self, hf_model) -> None:
        cfg = hf_model.config
        check_architecture(cfg)
        self.config = cfg
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.hidden_size = int(cfg.hidden_size)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model.model
        self.embed_weight = hf_model.get_input_embeddings().weight.detach()
        self.lm_head_weight = hf_model.get_output_embeddings().weight.detach()
        self.norm_weight = base.norm.weight.detach()
        self.dtype = self.embed_weight.dtype
        self.device = self.embed_weight.device
        self.layers: list[_Layer] = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight.detach(),
                    wq=a.q_proj.weight.detach(),
                    bq=_bias(a.q_proj),
                    wk=a.k_proj.weight.detach(),
                    bk=_bias(a.k_proj),
                    wv=a.v_proj.weight.detach(),
                    bv=_bias(a.v_proj),
                    wo=a.o_proj.weight.detach(),
                    bo=_bias(a.o_proj),
                    ln2=layer.post_attention_layernorm.weight.detach(),
                    w_gate=m.gate_proj.weight.detach(),
                    w_up=m.up_proj.weight.detach(),
                    w_down=m.down_proj.weight.detach(),
                )
            )
        self.inv_freq, self.rope_scaling = self._rope_init(base, cfg)
        max_pos = int(getattr(cfg, "max_position_embeddings", 2048))
        window = sliding_window(cfg)
        # With a sliding window, attention is plain causal attention up to the window size.
        self.max_positions = min(max_pos, window) if window else max_pos

    @staticmethod
    def _rope_init(base, cfg) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and cos/sin scaling, exactly as the model's own rotary module has them."""
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None and hasattr(rotary, "inv_freq"):
            inv = getattr(rotary, "original_inv_freq", rotary.inv_freq)
            return inv.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0))
        raise UnsupportedModelError(f"{type(base).__name__} has no rotary embedding module")

    # -- per-token pieces -------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers, in the compute dtype."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.embed_weight.element_size()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, E]."""
        return F.embedding(ids, self.embed_weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, D], in the compute dtype (as transformers does)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.rope_scaling
        sin = emb.sin() * self.rope_scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, E] -> input norm -> q [H, T, D], k [Hkv, T, D], v [Hkv, T, D], all without RoPE."""
        w = self.layers[layer]
        x = self.rms_norm(h, w.ln1)
        t = x.shape[0]
        q = F.linear(x, w.wq, w.bq).view(t, self.n_heads, self.head_dim).transpose(0, 1)
        k = F.linear(x, w.wk, w.bk).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = F.linear(x, w.wv, w.bv).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        return q, k, v

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [heads, T, D] rotated to the positions of cos/sin [T, D]."""
        return rope_rotate(x, cos, sin)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention output [H, T, D]: o_proj, residual, norm, MLP, residual."""
        w = self.layers[layer]
        t = attn.shape[1]
        h = h + F.linear(attn.transpose(0, 1).reshape(t, self.n_heads * self.head_dim), w.wo, w.bo)
        x = self.rms_norm(h, w.ln2)
        return h + F.linear(F.silu(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [T, E] -> final norm -> logits [T, V] in float32."""
        return F.linear(self.rms_norm(h, self.norm_weight), self.lm_head_weight).float()
