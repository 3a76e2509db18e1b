"""Model families: what each one does differently from Llama, one table entry per family.

The layer-wise adapter (:mod:`kvrag.engine.model.adapter`) implements Llama's decoder layer and reads the
differences from a :class:`Family` (gpt-fast's config-table style). What a family does not say
here comes from the weights themselves (q/k/v and output biases are used when the checkpoint has
them) or from the config (per-layer attention windows and RoPE, read by :func:`layer_types`,
:func:`layer_windows` and :func:`rope_parameters`).

Every entry follows transformers' numerics for that model exactly (``models/<family>/modeling_*.py``):

========== ====== ============ ============== ============= ===================================
family     q/k    RMSNorm      norms around   activation    embeddings, attention scale
           norm                blocks
========== ====== ============ ============== ============= ===================================
llama      no     ``w·x``      no             SiLU          plain, ``head_dim ** -0.5``
mistral    no     ``w·x``      no             SiLU          plain (every layer sliding if set)
qwen2      no     ``w·x``      no             SiLU          plain (q/k/v biases)
qwen3      yes    ``w·x``      no             SiLU          plain
gemma3     yes    ``(1+w)·x``  yes (4 norms)  GeLU-tanh     ``× √hidden``, ``query_pre_attn_scalar ** -0.5``
========== ====== ============ ============== ============= ===================================

RoPE pairs split halves (dimension ``i`` with ``i + D/2``) in every family here. Gemma 3 gives
sliding-window layers and global layers their own RoPE (θ 10k and 1M): the adapter keeps one
table per layer type.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrag.errors import UnsupportedModelError

__all__ = [
    "Family",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ACTIVATIONS",
    "family_of",
    "check_architecture",
    "layer_types",
    "layer_windows",
    "rope_parameters",
]

#: Activations implemented exactly (transformers' ACT2FN names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: RoPE variants with position-independent frequencies, implemented exactly.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class Family:
    """What a model family changes in Llama's decoder layer.

    Attributes:
        name: the family's name in messages.
        model_types: transformers ``model_type`` values it covers.
        activation: the MLP activation (the config must name this one).
        norm_offset: RMSNorm scales by ``norm_offset + w``, in float32 before the cast back
            (Gemma, 1.0); 0.0 is Llama's ``w * x.to(dtype)``.
        qk_norm: an RMSNorm over each head's queries and keys before RoPE.
        sandwich_norms: norms after attention and before/after the MLP (Gemma's pre/post norms).
        embed_scale: embeddings times ``sqrt(hidden)`` (rounded to the weights' dtype first).
        attn_scalar: config field whose ``** -0.5`` scales attention (None: ``head_dim``).
        note: what the name covers, for messages.
    """

    name: str
    model_types: tuple[str, ...]
    activation: str = "silu"
    norm_offset: float = 0.0
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    attn_scalar: str | None = None
    note: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), note="Llama 2/3, SmolLM"),
    Family("mistral", ("mistral",)),
    Family("qwen2", ("qwen2",), note="q/k/v biases"),
    Family("qwen3", ("qwen3",), qk_norm=True),
    Family(
        "gemma3",
        ("gemma3_text",),
        activation="gelu_pytorch_tanh",
        norm_offset=1.0,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        attn_scalar="query_pre_attn_scalar",
        note="text models",
    ),
)
_BY_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
#: Every ``model_type`` the engine implements exactly.
SUPPORTED_MODEL_TYPES = tuple(_BY_TYPE)


def _supported() -> str:
    return ", ".join(f"{mt} ({f.note})" if f.note else mt for mt, f in _BY_TYPE.items())


def family_of(config) -> Family:
    """The family of a transformers config; an unknown ``model_type`` lists the supported ones."""
    mt = getattr(config, "model_type", None)
    family = _BY_TYPE.get(mt)
    if family is None:
        raise UnsupportedModelError(f"model type {mt!r} is not supported; kvrag implements {_supported()}")
    return family


def _activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def check_architecture(config) -> Family:
    """Refuse what the engine does not implement exactly, naming what is supported; the family."""
    family = family_of(config)
    act = _activation(config)
    if act != family.activation:
        raise UnsupportedModelError(
            f"activation {act!r} is not supported for {family.name}; kvrag implements {family.activation!r}"
        )
    for ltype, rope in rope_parameters(config).items():
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rtype!r} ({ltype}) is not supported exactly (its frequencies depend on the sequence "
                f"length); kvrag implements {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
    unknown = sorted(set(layer_types(config)) - set(_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not supported; kvrag implements {_LAYER_TYPES}")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("MLP biases are not supported")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise UnsupportedModelError(f"pretraining_tp={config.pretraining_tp} is not supported")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        raise UnsupportedModelError("logit soft-capping is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention is not supported (kvrag reuses causal KV)")
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    return family


def layer_types(config) -> list[str]:
    """``full_attention`` / ``sliding_attention`` per layer (Mistral: every layer slides if it has a window)."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    window = getattr(config, "sliding_window", None)
    sliding = bool(window) and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * n


def layer_windows(config) -> list[int | None]:
    """Per layer, the attention window (a row at position p sees keys (p - w, p]) or None (global)."""
    window = getattr(config, "sliding_window", None)
    return [int(window) if t == "sliding_attention" and window else None for t in layer_types(config)]


def rope_parameters(config) -> dict[str, dict]:
    """RoPE parameters per layer type present (transformers 5 ``rope_parameters``, per type or
    shared, or the legacy ``rope_scaling`` / ``rope_theta`` fields)."""
    types = sorted(set(layer_types(config)))
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        if any(t in rp for t in _LAYER_TYPES):  # Gemma 3: one entry per layer type
            return {t: dict(rp.get(t) or {}) for t in types}
        return {t: dict(rp) for t in types}
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    legacy.setdefault("rope_type", legacy.get("type", "default"))
    legacy.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return {t: dict(legacy) for t in types}
