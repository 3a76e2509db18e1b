"""GGUF files: the header read first, then the weights converted tensor by tensor.

:func:`read_header` reads what a GGUF file says of itself (architecture, shapes, vocabulary, chat
template) without touching its tensors, so an unsupported model is refused (:func:`check_header`)
before any work. :func:`convert` then dequantizes one tensor at a time (gguf-py's own
dequantization, transformers' name map and per-family fix-ups: llama's q/k permutation, Gemma's
norm offset) straight into the compute dtype and writes safetensors shards as it goes: the most it
holds is one shard of converted weights and one tensor in float32, never the whole model in float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvrag.engine.model.families import SUPPORTED_MODEL_TYPES
from kvrag.errors import ModelNotFoundError, UnsupportedModelError

log = logging.getLogger(__name__)

__all__ = ["GGUFHeader", "read_header", "check_header", "convert", "CONVERTER_VERSION", "SHARD_BYTES"]

#: Part of a conversion's cache key: a new converter never reads an old one's output.
CONVERTER_VERSION = 2

#: Converted weights are written in shards of about this many bytes (what conversion holds at once).
SHARD_BYTES = 512 << 20

#: GGUF architectures kvrag implements, and transformers' ``model_type`` of each (llama.cpp files a
#: Mistral model under ``llama``: its ``general.name`` tells).
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


#: GGML tensor types that are plain floats (everything else is a quantized format).
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file says of its model, read without its tensors.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (llama.cpp's name: ``llama``, ``qwen2``, ...).
        model_type: transformers' ``model_type`` kvrag builds it as (``""`` when unsupported).
        name: ``general.name``, if any.
        layers, hidden, heads, kv_heads, vocab, context: the model's shape.
        tensors: number of tensors; ``tensor_bytes``: their bytes in the file (quantized).
        parameters: weights in all tensors.
        chat_template: the file carries a chat template.
        quantized: its matrices are stored quantized (not as 16- or 32-bit floats).
    """

    path: Path
    architecture: str
    model_type: str
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    tensors: int
    tensor_bytes: int
    parameters: int
    chat_template: bool
    quantized: bool

    def bytes_in(self, dtype: torch.dtype) -> int:
        """The weights' bytes once converted to ``dtype``."""
        return self.parameters * torch.empty((), dtype=dtype).element_size()

    def describe(self) -> str:
        return (
            f"{self.name or self.path.name}: {self.architecture}, {self.layers} layers, hidden {self.hidden}, "
            f"{self.heads} heads ({self.kv_heads} KV), vocabulary {self.vocab}, "
            f"{self.parameters / 1e9:.2f}B weights in {self.tensor_bytes / 2**30:.2f} GiB"
        )


def _field(reader, key: str, default=None):
    from transformers.modeling_gguf_pytorch_utils import read_field

    value = read_field(reader, key)
    if not value:
        return default
    return value[0] if len(value) == 1 else value


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:  # not a GGUF file, or a truncated one
        raise ModelNotFoundError(f"{path} is not a readable GGUF file: {exc}") from None


def read_header(path: str | Path) -> GGUFHeader:
    """The model a GGUF file holds, from its metadata and tensor table (no tensor data is read)."""
    path = Path(path)
    reader = _reader(path)
    arch = str(_field(reader, "general.architecture", ""))
    name = str(_field(reader, "general.name", "") or "")
    model_type = _MODEL_TYPES.get("mistral" if arch == "llama" and "mistral" in name.lower() else arch, "")
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    return GGUFHeader(
        path=path,
        architecture=arch,
        model_type=model_type if model_type in SUPPORTED_MODEL_TYPES else "",
        name=name,
        layers=int(_field(reader, f"{arch}.block_count", 0) or 0),
        hidden=int(_field(reader, f"{arch}.embedding_length", 0) or 0),
        heads=int(_field(reader, f"{arch}.attention.head_count", 0) or 0),
        kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", 0) or 0),
        vocab=len(tokens) if isinstance(tokens, list) else 0,
        context=int(_field(reader, f"{arch}.context_length", 0) or 0),
        tensors=len(reader.tensors),
        tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        chat_template="tokenizer.chat_template" in reader.fields,
        quantized=any(len(t.shape) == 2 and t.tensor_type.name not in _FLOAT_TYPES for t in reader.tensors),
    )


def check_header(header: GGUFHeader) -> GGUFHeader:
    """``header`` if kvrag implements its model; else one clear error, before any conversion."""
    if not header.model_type:
        supported = ", ".join(sorted(_MODEL_TYPES))
        raise UnsupportedModelError(
            f"{header.path.name} holds a {header.architecture or 'unnamed'!r} model; kvrag implements the GGUF "
            f"architectures {supported} (nothing was converted)"
        )
    if not (header.layers and header.hidden and header.heads and header.vocab):
        raise UnsupportedModelError(f"{header.path.name}: its header does not give the model's shape")
    return header


def convert(
    header: GGUFHeader,
    target: Path,
    dtype: torch.dtype,
    *,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write the model of a checked GGUF file into the folder ``target`` as a transformers model in
    ``dtype``: config, tokenizer and safetensors shards. ``progress(n)`` is told the file bytes done."""
    from gguf import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    gguf = header.path
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    config = AutoConfig.from_pretrained(str(gguf.parent), **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = gguf.stem
    with torch.device("meta"):  # the names and shapes of the weights, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    wanted = {k for k in skeleton.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    reader = _reader(gguf)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    held = total = 0

    def flush() -> None:
        nonlocal held
        if not shard:
            return
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(target / file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()
        held = 0

    for tensor in reader.tensors:
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name, tensor_key_mapping=names
        )
        name = names.get(result.name)
        if name is not None and name in wanted:
            data = np.require(result.weights, requirements="W")  # a tensor stored unquantized is a view of the file
            weights = torch.from_numpy(data).reshape(shapes[name]).to(dtype)  # float32 -> dtype, one tensor
            shard[name] = weights
            held += weights.nbytes
            total += weights.nbytes
            if held >= SHARD_BYTES:
                flush()
        if progress is not None:
            progress(int(tensor.n_bytes))
    flush()
    missing = sorted(wanted - weight_map.keys())
    if missing:
        raise UnsupportedModelError(f"converting {gguf.name} found no weights for {missing[:5]} (and the rest)")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.dtype = dtype
    config.save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(str(target))
