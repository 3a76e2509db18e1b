"""GGUF loading: the header is read and checked before any work, and the tensor-by-tensor
conversion gives transformers' own dequantization, on a tiny quantized GGUF the test writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvrag.engine.model import gguf as gguf_file
from kvrag.engine.model import loading
from kvrag.errors import ModelNotFoundError, UnsupportedModelError
from tests.helpers import make_tokenizer

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 4, 2


def write_tiny_gguf(path: Path, arch: str = "qwen2", quant: str = "Q8_0", seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny Qwen2-shaped model as a GGUF file: its tokenizer (the tests' byte-level BPE, chat
    template included) and random weights, the 2-D ones quantized; returns the float32 weights written."""
    import gguf

    tok = make_tokenizer()
    vocab = len(tok)
    data = json.loads(tok.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    written: dict[str, np.ndarray] = {}

    def add(name: str, *shape: int, norm: bool = False) -> None:
        x = (1 + 0.1 * rng.standard_normal(shape) if norm else 0.15 * rng.standard_normal(shape)).astype(np.float32)
        written[name] = x
        if len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    add("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN, norm=True)
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_q.bias", HIDDEN)
        add(f"blk.{i}.attn_k.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        add(f"blk.{i}.attn_k.bias", HIDDEN * KV_HEADS // HEADS)
        add(f"blk.{i}.attn_v.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        add(f"blk.{i}.attn_v.bias", HIDDEN * KV_HEADS // HEADS)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN, norm=True)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    add("output_norm.weight", HIDDEN, norm=True)
    add("output.weight", vocab, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_tiny_gguf(path)
    return path


def test_the_header_says_what_the_file_holds_without_reading_its_tensors(tiny_gguf):
    h = gguf_file.check_header(gguf_file.read_header(tiny_gguf))
    assert (h.architecture, h.model_type, h.name) == ("qwen2", "qwen2", "tiny")
    assert (h.layers, h.hidden, h.heads, h.kv_heads, h.vocab) == (
        LAYERS,
        HIDDEN,
        HEADS,
        KV_HEADS,
        len(make_tokenizer()),
    )
    assert h.chat_template and h.quantized and h.tensors == 2 + 12 * LAYERS + 1
    assert h.bytes_in(torch.bfloat16) == 2 * h.parameters and "qwen2, 2 layers" in h.describe()


def test_an_unsupported_architecture_is_refused_before_any_conversion(tmp_path):
    path = tmp_path / "tiny-phi2.gguf"
    write_tiny_gguf(path, arch="phi2")
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=r"'phi2' model; kvrag implements .*qwen2.*nothing was converted"):
        loading.load_model(str(path), "bfloat16", "cpu", cache)
    assert time.perf_counter() - t0 < 10
    assert not (cache / "models").exists()  # no conversion started, nothing written
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF file"):
        gguf_file.read_header(tmp_path / "junk.gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conversion_is_transformers_dequantization_tensor_by_tensor(tiny_gguf, tmp_path, dtype, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, _, quantized = loading._convert_gguf(tiny_gguf, tmp_path, dtype)
    assert quantized  # its matrices are Q8_0
    ours = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        ours.update(load_file(str(shard)))
    config = AutoConfig.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(tiny_gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(theirs) and ours
    for name, tensor in theirs.items():
        assert ours[name].dtype == dtype and torch.equal(ours[name], tensor.to(dtype)), name
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    read = []
    monkeypatch.setattr(loading.gguf_file, "read_header", lambda path: read.append(path))
    again, _, quantized = loading._convert_gguf(tiny_gguf, tmp_path, dtype)  # cached: the same folder, not redone
    assert again == directory and quantized and not read  # nor the header read again: the record says
    monkeypatch.undo()
    record = directory / "kvrag-convert.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "quantized"}))
    assert loading._convert_gguf(tiny_gguf, tmp_path, dtype)[2]  # a record from before the flag: the header says
    assert json.loads(record.read_text())["quantized"] is True  # once: the record keeps it


def test_a_converted_gguf_runs_in_the_engine_and_blends_exactly_at_ratio_one(tiny_gguf, tmp_path):
    from kvrag import Engine
    from tests.helpers import PREFIX, SUFFIX, make_docs

    with Engine.from_pretrained(str(tiny_gguf), cache_dir=str(tmp_path), dtype="float32") as engine:
        assert engine.info().family == "qwen2" and engine.info().gate_ok
        docs = make_docs(3, seed=11)
        full = engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=6)
        engine.warm(docs[::-1])
        blend = engine.generate(docs, PREFIX, SUFFIX, recompute_ratio=1.0, max_new_tokens=6)
        assert blend.token_ids == full.token_ids
