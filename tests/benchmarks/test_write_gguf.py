"""``python -m benchmarks write-gguf``: a random-weight GGUF of a given shape, written tensor by tensor,
that kvrag's converter reads (header, dequantized weights of the intended spread) and answers from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.write_gguf import QUANTS, SHAPES, main, write_gguf
from kvrag.engine.model import gguf as gguf_file
from tests.engine.model.test_gguf import write_tiny_gguf
from tests.helpers import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    """A GGUF carrying the tests' small tokenizer and chat template (its weights are not used)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.gguf"
    write_tiny_gguf(path)
    return path


@pytest.mark.parametrize("quant", sorted(QUANTS))
def test_the_file_has_the_shape_and_weights_of_the_intended_spread(tmp_path, tokenizer_gguf, quant):
    from gguf import GGUFReader, dequantize

    shape = SHAPES["llama-tiny"]
    out = tmp_path / f"tiny-{quant}.gguf"
    lines: list[str] = []
    info = write_gguf(shape, quant, tokenizer_gguf, out, log=lambda s, **_: lines.append(s))
    assert lines and lines[-1].startswith("write-gguf: ") and "(100%)" in lines[-1]  # it said its progress
    h = gguf_file.check_header(gguf_file.read_header(out))
    assert (h.architecture, h.model_type, h.layers, h.hidden, h.heads, h.kv_heads) == ("llama", "llama", 2, 256, 4, 2)
    assert h.vocab == info["vocab"] == len(make_tokenizer()) and h.quantized and h.chat_template
    assert info["parameters"] == h.parameters and info["file_bytes"] == out.stat().st_size
    tensors = {t.name: t for t in GGUFReader(str(out)).tensors}
    assert "output.weight" in tensors and "blk.0.attn_q.bias" not in tensors  # untied, no biases: llama
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type.name == quant
    w = dequantize(q.data, q.tensor_type)
    assert w.shape == (256, 256) and np.isfinite(w).all()
    assert abs(float(w.std()) * 16 - 1) < 0.05  # std 1/sqrt(256)
    assert abs(float(w.mean())) * 16 < (0.12 if quant == "Q4_0" else 0.02)  # Q4_0's codes centre at -0.5: 0.11 std


def test_a_written_shape_loads_in_kvrag_and_answers_blended(tmp_path, tokenizer_gguf):
    from kvrag import Engine

    out = tmp_path / "qwen-tiny.gguf"
    assert (
        main(["--shape", "qwen-tiny", "--quant", "Q4_K", "--tokenizer-from", str(tokenizer_gguf), "--out", str(out)])
        == 0
    )
    with Engine.from_pretrained(str(out), cache_dir=tmp_path / "cache", num_threads=1) as engine:
        assert "int4" in engine.info().decode  # a quantized source decodes in int4 weights
        chunks = ["the first passage says one thing", "the second passage says another"]
        first = engine.generate(chunks, "Read:", " Question? Answer:", max_new_tokens=4, ignore_eos=True)
        again = engine.generate(chunks[::-1], "Read:", " Question? Answer:", max_new_tokens=4, ignore_eos=True)
    assert len(first.token_ids) == len(again.token_ids) == 4
    assert again.stats.path == "blend" and again.stats.cached_tokens > 0


def test_a_bad_request_is_one_clear_error(tmp_path, tokenizer_gguf, capsys):
    narrow = dataclasses.replace(SHAPES["qwen-tiny"], hidden=128)
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256 weights; token_embd.weight has 128"):
        write_gguf(narrow, "Q4_K", tokenizer_gguf, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    assert main(["--shape", "qwen-tiny", "--tokenizer-from", str(tmp_path / "none.gguf"), "--out", "x.gguf"]) == 2
    assert "python -m benchmarks write-gguf:" in capsys.readouterr().err
