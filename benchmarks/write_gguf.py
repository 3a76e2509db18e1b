"""``python -m benchmarks write-gguf``: a GGUF of a real model's shape with random weights.

    python -m benchmarks write-gguf --shape llama-8b --quant Q4_K \\
        --tokenizer-from /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --out llama-8b-q4_k.gguf

For memory and speed at sizes there are no weights for here (Llama-3.2-3B, Llama-3.1-8B, Qwen2.5-3B,
Qwen2.5-7B): the shape's hyperparameters (layers, hidden, heads, KV heads, intermediate, RoPE base,
norm epsilon, tied embeddings or not, Qwen2's Q/K/V biases), random weights, and the tokenizer and
chat template of another GGUF (every ``tokenizer.*`` field copied). The embedding and output matrices
have as many rows as that tokenizer has tokens, which may differ from the shape's own vocabulary
(the Qwen2 tokenizer's 151,936 for Llama 3's 128,256): both are printed. Answers from such a file mean
nothing; its load, memory and timings do.

The weights are drawn directly as quantized blocks (random codes, one fixed scale per tensor), so no
float copy of any tensor is made and writing streams tensor by tensor: the most held at once is one
tensor's quantized bytes. The scales give each matrix the standard deviation of a ``1/sqrt(fan_in)``
initialisation (the embedding too, so tied logits have a std of about 1; the residual outputs also divided by
``sqrt(2 * layers)``), so activations stay finite.
Formats: ``Q8_0``, ``Q4_0`` (32-weight blocks) and ``Q4_K`` (256-weight super-blocks), all three read
by gguf-py's dequantization (kvrag's converter) and by llama.cpp (Q4_0's 16 codes centre at -0.5: its
weights have a mean of -0.11 std). Norm weights are ones, biases small.
Not implemented by the shape: Llama 3.1's ``llama3`` RoPE scaling (the plain RoPE base is written).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Shape", "SHAPES", "QUANTS", "write_gguf", "main"]


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's shape as its config gives it (``vocab``: the model's own, before the tokenizer's)."""

    arch: str  # GGUF architecture: llama, qwen2
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    eps: float
    tied: bool
    bias: bool  # Q/K/V biases (Qwen2)
    context: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    # from each model's config.json on its hub page
    "llama-3b": Shape("llama", "Llama-3.2-3B (random)", 28, 3072, 24, 8, 8192, 128256, 5e5, 1e-5, True, False),
    "llama-8b": Shape("llama", "Llama-3.1-8B (random)", 32, 4096, 32, 8, 14336, 128256, 5e5, 1e-5, False, False),
    "qwen-3b": Shape("qwen2", "Qwen2.5-3B (random)", 36, 2048, 16, 2, 11008, 151936, 1e6, 1e-6, True, True),
    "qwen-7b": Shape("qwen2", "Qwen2.5-7B (random)", 28, 3584, 28, 4, 18944, 152064, 1e6, 1e-6, False, True),
    # a tiny one for tests (Q4_K's 256-weight blocks need rows of a multiple of 256)
    "qwen-tiny": Shape("qwen2", "tiny qwen2 (random)", 2, 256, 4, 2, 512, 0, 1e6, 1e-6, True, True, 2048),
    "llama-tiny": Shape("llama", "tiny llama (random)", 2, 256, 4, 2, 512, 0, 5e5, 1e-5, False, False, 2048),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Quant:
    """A block format: weights per block, bytes per block, the file type llama.cpp names the file by."""

    block: int
    size: int
    file_type: int
    spread: float  # standard deviation of the codes (the weights' std is this times the scale)


# codes uniform: int8 (-128..127) for Q8_0, (q - 8) for Q4_0, (q - 7.5) for Q4_K (sub-scale 1, min 7.5 d)
QUANTS = {"Q8_0": _Quant(32, 34, 7, 73.9), "Q4_0": _Quant(32, 18, 2, 4.61), "Q4_K": _Quant(256, 144, 15, 4.61)}


def _blocks(rows: int, cols: int, quant: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """A ``rows x cols`` matrix of ``quant`` blocks with random codes and weights of about ``std``: uint8,
    one row of bytes per matrix row (what gguf's writer takes for a quantized tensor)."""
    q = QUANTS[quant]
    n = rows * cols // q.block
    b = np.frombuffer(rng.bytes(n * q.size), dtype=np.uint8).reshape(n, q.size).copy()
    d = np.array([std / q.spread], dtype=np.float16).view(np.uint8)
    b[:, 0:2] = d  # Q8_0 / Q4_0: d, then the codes
    if quant == "Q4_K":  # d, dmin = 7.5 d, 12 bytes of 6-bit sub-scales and mins (all 1), then 4-bit codes
        b[:, 2:4] = np.array([7.5 * std / q.spread], dtype=np.float16).view(np.uint8)
        b[:, 4:12] = 0x01
        b[:, 12:16] = 0x11
    return b.reshape(rows, cols // q.block * q.size)


def _tokenizer_fields(source: Path) -> tuple[list[tuple[str, object, object, object]], int]:
    """Every ``tokenizer.*`` field of ``source`` as (key, value, type, array item type); its token count."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    fields, tokens = [], 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY and len(field.types) > 1 else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            tokens = len(value)
        fields.append((key, value, kind, sub))
    if not tokens:
        raise ValueError(f"{source} carries no tokenizer (tokenizer.ggml.tokens)")
    return fields, tokens


def _tensors(shape: Shape, vocab: int):
    """(name, rows, cols or None for a vector, std) of every tensor, in the order llama.cpp writes them."""
    h, kv, f, L = shape.hidden, shape.kv_heads * shape.head_dim, shape.ffn, shape.layers
    out_std = 1 / np.sqrt(2 * L)
    yield "token_embd.weight", vocab, h, 1 / np.sqrt(h)
    for i in range(L):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", h, None, 1.0
        yield p + "attn_q.weight", h, h, 1 / np.sqrt(h)
        yield p + "attn_k.weight", kv, h, 1 / np.sqrt(h)
        yield p + "attn_v.weight", kv, h, 1 / np.sqrt(h)
        if shape.bias:
            yield p + "attn_q.bias", h, None, 0.02
            yield p + "attn_k.bias", kv, None, 0.02
            yield p + "attn_v.bias", kv, None, 0.02
        yield p + "attn_output.weight", h, h, out_std / np.sqrt(h)
        yield p + "ffn_norm.weight", h, None, 1.0
        yield p + "ffn_gate.weight", f, h, 1 / np.sqrt(h)
        yield p + "ffn_up.weight", f, h, 1 / np.sqrt(h)
        yield p + "ffn_down.weight", h, f, out_std / np.sqrt(f)
    yield "output_norm.weight", h, None, 1.0
    if not shape.tied:
        yield "output.weight", vocab, h, 1 / np.sqrt(h)


def write_gguf(shape: Shape, quant: str, tokenizer_from: Path, out: Path, *, seed: int = 0, log=print) -> dict:
    """Write ``shape`` with random ``quant`` weights and ``tokenizer_from``'s tokenizer to ``out``,
    tensor by tensor (module docstring); returns what was written (file bytes, weights, vocabulary)."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    fields, vocab = _tokenizer_fields(tokenizer_from)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    q = QUANTS[quant]
    specs = list(_tensors(shape, vocab))
    for name, _, cols, _ in specs:  # refused before anything is written
        if cols is not None and cols % q.block:
            raise ValueError(f"{quant} needs rows of a multiple of {q.block} weights; {name} has {cols}")
    w = gguf.GGUFWriter(str(out), shape.arch)
    w.add_name(shape.name)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_file_type(q.file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, kind, sub in fields:
        w.add_key_value(key, value, kind, sub)
    total = 0
    for name, rows, cols, _ in specs:
        if cols is None:
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            nbytes = rows * cols // q.block * q.size
            w.add_tensor_info(name, (rows, cols // q.block * q.size), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        total += rows * 4 if cols is None else rows * cols // q.block * q.size
    try:
        _write(w, specs, quant, total, seed, log)
    except BaseException:
        w.close()
        out.unlink(missing_ok=True)  # no half-written file is left behind
        raise
    w.close()
    return {"file_bytes": out.stat().st_size, "parameters": sum(r * (c or 1) for _, r, c, _ in specs),
            "vocab": vocab, "shape_vocab": shape.vocab}  # fmt: skip


def _write(w, specs: list, quant: str, total: int, seed: int, log) -> None:
    """The header, then each tensor drawn and written in turn (a progress line every 5%)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    done, shown, t0 = 0, -1, time.perf_counter()
    for name, rows, cols, std in specs:
        if cols is None:
            data = np.full(rows, std, np.float32) if name.endswith("norm.weight") else rng.normal(0, std, rows)
            w.write_tensor_data(np.asarray(data, dtype=np.float32))
            done += rows * 4
        else:
            data = _blocks(rows, cols, quant, float(std), rng)
            w.write_tensor_data(data)
            done += data.nbytes
        del data
        if done * 20 // total > shown:  # a line every 5%
            shown = done * 20 // total
            rate = done / max(time.perf_counter() - t0, 1e-9)
            log(f"write-gguf: {done / 2**30:.2f} of {total / 2**30:.2f} GiB ({100 * done // total}%), "
                f"{(total - done) / rate:.0f} s left", flush=True)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks write-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--quant", default="Q4_K", choices=sorted(QUANTS))
    p.add_argument("--tokenizer-from", required=True, help="a GGUF whose tokenizer and chat template are copied")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    shape = SHAPES[a.shape]
    t0 = time.perf_counter()
    try:
        info = write_gguf(shape, a.quant, Path(a.tokenizer_from), Path(a.out), seed=a.seed)
    except (ValueError, OSError) as exc:
        print(f"python -m benchmarks write-gguf: {exc}", file=sys.stderr)
        return 2
    print(
        f"{a.out}: {shape.name}, {a.quant}, {info['parameters'] / 1e9:.2f}B weights, "
        f"{info['file_bytes'] / 2**30:.2f} GiB; vocabulary {info['vocab']} (the tokenizer's; the shape's own "
        f"{shape.vocab or 'n/a'}); {time.perf_counter() - t0:.0f} s"
    )
    return 0
