"""Tiny random models, a tokenizer and passages built offline in milliseconds: for the test suite
(tests/helpers.py re-exports them) and for benchmarks that need a model without a download
(``python -m benchmarks.gpu_smoke``)."""

from __future__ import annotations

import random

import torch

__all__ = ["WORDS", "make_tokenizer", "FAMILY_CONFIGS", "FAMILIES", "make_tiny_model", "make_docs"]

WORDS = (
    "river mountain castle library engine harbor museum garden bridge market village forest "
    "island desert valley tower palace temple school station college theatre stadium canal "
    "the of and in to was is by for with on at from as an a which that his her their it "
    "born founded built named located known famous first largest oldest river capital city "
    "king queen author painter composer scientist engineer general mayor bishop poet "
    "France Spain Italy Egypt Peru Japan Kenya Chile Norway Brazil London Paris Rome Cairo Lima "
    "1820 1901 1954 1776 1492 2001 seven twelve hundred north south east west"
).split()


def make_tokenizer():
    """A byte-level BPE tokenizer trained in a few milliseconds, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return hf


#: Per family, what its tiny test model sets beyond the shared small dimensions. Windows are
#: shorter than the test prompts (~300 tokens), so that sliding-window attention matters; Gemma 3
#: mixes sliding and global layers, each kind with its own RoPE.
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": dict(sliding_window=48),
    "qwen2": dict(use_sliding_window=True, sliding_window=48, max_window_layers=3),
    "qwen3": dict(head_dim=32),
    "gemma3_text": dict(
        head_dim=32,
        sliding_window=40,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def make_tiny_model(vocab_size: int, family: str = "llama", *, layers: int = 6, seed: int = 0, **overrides):
    """A random model of a family, built offline from ``AutoConfig.for_model``, small enough for
    fast tests. Weights are scaled so that attention is not uniform, and norms and biases (zero or
    one at init) are randomised so that a norm or bias applied wrongly shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.15,
    )
    if family == "llama":
        cfg["rope_theta"] = 10000.0
    cfg.update(FAMILY_CONFIGS[family])
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg)).eval()
    if family != "llama":  # the Llama fixture keeps the weights the older tests were tuned on
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    p.add_(torch.randn_like(p) * 0.2)
    model.config._attn_implementation = "sdpa"
    return model


def make_docs(n: int, words: int = 60, seed: int = 0) -> list[str]:
    """``n`` passages of ``words`` random words each (one chunk each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "\n" for _ in range(n)]
