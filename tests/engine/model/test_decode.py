"""The engine's decode step: packed bf16 weights give the plain step's bits, and fall back where they cannot."""

from __future__ import annotations

import pytest
import torch

from kvrag.engine.model import packed as packed_module
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.batch import Decoder, DecodeRow, decode_step
from kvrag.engine.model.runner import KVBuffer, forward
from kvrag.kernels import reference
from tests.helpers import FAMILIES, as_dtype, make_tiny_model

# prompts longer than the tiny models' sliding windows (40-48): each layer's own window and RoPE
LENGTHS = (37, 90, 5, 121, 64, 9, 33, 100, 50, 12, 77)


def rows_for(adapter: ModelAdapter, prompts: list[torch.Tensor], steps: int) -> list[DecodeRow]:
    """A prefilled buffer per prompt (room for ``steps`` more tokens) and the row that appends token 7."""
    rows = []
    for ids in prompts:
        n = len(ids)
        buf = KVBuffer(adapter, n + steps)
        forward(adapter, buf, ids, torch.arange(n), n)
        rows.append(DecodeRow(buf, 7, n))
    return rows


def decode_both(adapter: ModelAdapter, decoder: Decoder, steps: int = 4) -> None:
    """Greedy steps of 11 ragged rows (two groups) through the plain step and through ``decoder``:
    the same logits and the same KV, bit for bit, at every step."""
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    plain, fast = rows_for(adapter, prompts, steps), rows_for(adapter, prompts, steps)
    for _ in range(steps):
        expected = decode_step(adapter, plain, decoder.group)
        got = decoder.step(fast)
        assert torch.equal(got, expected)
        for p, f in zip(plain, fast):
            end = p.pos + 1
            assert torch.equal(f.buf.k[:, :, :end], p.buf.k[:, :, :end])
            assert torch.equal(f.buf.v[:, :, :end], p.buf.v[:, :, :end])
            assert f.buf.length == p.buf.length == end
        for p, f, token in zip(plain, fast, expected.argmax(-1).tolist()):
            p.token = f.token = token
            p.pos += 1
            f.pos += 1


def decode_close(adapter: ModelAdapter, decoder: Decoder, steps: int = 4) -> None:
    """Greedy steps of 11 ragged rows through the plain step and through a float32 ``decoder``: logits
    within rounding (1e-4 of the largest) and the same tokens at every step."""
    torch.manual_seed(4)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    plain, fast = rows_for(adapter, prompts, steps), rows_for(adapter, prompts, steps)
    for _ in range(steps):
        expected, got = decode_step(adapter, plain, decoder.group), decoder.step(fast)
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        for rows in (plain, fast):
            for r, token in zip(rows, expected.argmax(-1).tolist()):
                r.token, r.pos = token, r.pos + 1


def packed_decoder(adapter: ModelAdapter) -> Decoder:
    """The packed decoder; the test is skipped where this machine cannot pack (no oneDNN, or a CPU
    without its bfloat16 kernels: no AVX512), and fails where it could but did not."""
    why = packed_module._packable(adapter)
    if why is not None:
        pytest.skip(f"no packed decode here: {why}")
    decoder = Decoder(adapter, 8)
    assert decoder.description.startswith("packed"), decoder.description
    return decoder


def any_decoder(adapter: ModelAdapter) -> Decoder:
    """The packed decoder where this machine packs, else the plain one (for what both paths must do)."""
    return Decoder(adapter, 8) if packed_module._packable(adapter) is not None else packed_decoder(adapter)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_bfloat16_decode_gives_the_plain_steps_bits(tiny_tokenizer, family):
    adapter = ModelAdapter(as_dtype(make_tiny_model(len(tiny_tokenizer), family), "bfloat16"))
    decode_both(adapter, packed_decoder(adapter))


def test_a_packed_decode_step_of_a_row_does_not_depend_on_the_others(tiny_tokenizer):
    adapter = ModelAdapter(as_dtype(make_tiny_model(len(tiny_tokenizer)), "bfloat16"))
    decoder = packed_decoder(adapter)
    torch.manual_seed(1)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    alone = [decoder.step([row])[0] for row in rows_for(adapter, prompts, 1)]
    batched = decoder.step(rows_for(adapter, prompts, 1))
    assert all(torch.equal(batched[i], alone[i]) for i in range(len(prompts)))


def test_float32_packs_where_onednn_is_and_stays_within_rounding_of_the_plain_step(tiny_tokenizer):
    """float32 products through oneDNN are not MKL's bit for bit, but within rounding: logits within
    1e-4 of the plain step's at every step, the same greedy tokens, the same row whatever the others."""
    adapter = ModelAdapter(make_tiny_model(len(tiny_tokenizer)))
    decoder = packed_decoder(adapter)
    assert decoder.description.startswith("packed: ") and "float32: within 1e-4" in decoder.description
    decode_close(adapter, decoder)
    torch.manual_seed(4)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    alone = [decoder.step([row])[0] for row in rows_for(adapter, prompts, 1)]
    batched = decoder.step(rows_for(adapter, prompts, 1))
    assert all(torch.equal(batched[i], alone[i]) for i in range(len(prompts)))


def test_a_float32_packing_off_by_more_than_rounding_keeps_the_plain_path(tiny_tokenizer, monkeypatch):
    adapter = ModelAdapter(make_tiny_model(len(tiny_tokenizer)))
    packed_decoder(adapter)  # packs here
    call = packed_module.PackedLinear.__call__
    monkeypatch.setattr(packed_module.PackedLinear, "__call__", lambda self, x: call(self, x) * (1 + 1e-3))
    decoder = Decoder(adapter, 8)
    assert decoder.weights is None
    assert decoder.description == "plain: a packed product differs from F.linear (layer 0 q/k/v)"


def test_bfloat16_rows_stay_as_near_the_float32_model_as_a_float32_copy_of_the_keys_did(tiny_tokenizer):
    """A bf16 row attends straight over its bf16 keys and values (no float32 copy of them): its logits
    are no further from the float32 model's than those of the same step with the row's queries, keys
    and values converted to float32 first (the decoder's path before; the conversion is exact)."""
    model = make_tiny_model(len(tiny_tokenizer))
    exact = ModelAdapter(model)
    adapter = ModelAdapter(as_dtype(model, "bfloat16"))
    torch.manual_seed(3)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    truth = decode_step(exact, rows_for(exact, prompts, 1), 8)
    direct = (decode_step(adapter, rows_for(adapter, prompts, 1), 8) - truth).abs().mean().item()
    one_row = reference.one_row
    in_float32 = lambda q, k, v, scale: one_row(q.float(), k.float(), v.float(), scale).to(q.dtype)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "one_row", in_float32)
        converted = (decode_step(adapter, rows_for(adapter, prompts, 1), 8) - truth).abs().mean().item()
    assert direct <= 1.1 * converted, (direct, converted)


def test_a_packed_product_that_differs_keeps_the_plain_path(tiny_tokenizer, monkeypatch):
    adapter = ModelAdapter(as_dtype(make_tiny_model(len(tiny_tokenizer)), "bfloat16"))
    packed_decoder(adapter)  # packs here
    call = packed_module.PackedLinear.__call__
    monkeypatch.setattr(packed_module.PackedLinear, "__call__", lambda self, x: call(self, x) * 1.25)
    decoder = Decoder(adapter, 8)
    assert decoder.weights is None
    assert decoder.description.split("; ")[0] == "plain: a packed product differs from F.linear (layer 0 q/k/v)"
    decode_both(adapter, decoder, steps=1)  # and it decodes, through the plain step


def test_packing_that_fails_keeps_the_plain_path(tiny_tokenizer, monkeypatch):
    adapter = ModelAdapter(as_dtype(make_tiny_model(len(tiny_tokenizer)), "bfloat16"))

    def refuse(*args):
        raise RuntimeError("no such op")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    monkeypatch.setattr(packed_module, "_packable", lambda adapter: None)  # any machine reaches the op
    decoder = Decoder(adapter, 8)
    assert decoder.weights is None and decoder.description.split("; ")[0] == "plain: packing failed (RuntimeError)"


@pytest.mark.model
def test_the_bundled_model_decodes_packed_as_the_plain_step(smol_engine):
    """bf16: the plain step's bits; float32 (a CPU without bf16 units): within rounding, same tokens."""
    why = packed_module._packable(smol_engine.adapter)
    if why is not None:
        pytest.skip(f"no packed decode here: {why}")
    decoder = Decoder(smol_engine.adapter, smol_engine.config.decode_group, weights="plain")
    assert decoder.description.startswith("packed")
    if smol_engine.adapter.dtype == torch.float32:
        decode_close(smol_engine.adapter, decoder, steps=3)
    else:
        decode_both(smol_engine.adapter, decoder, steps=3)


@pytest.mark.model
def test_the_bundled_gguf_decodes_in_4_bits_by_default_where_the_kernels_run(smol_engine):
    """``weights="auto"``: the bundled model came quantized (its GGUF is Q4_1), so decode steps read 4-bit
    weights where torch's kernels for them run (a CPU in bf16), else the packed step says why not."""
    decode = smol_engine.info().decode
    if smol_engine.adapter.dtype == torch.bfloat16:
        assert decode.startswith(("quantized: int4", "packed: int4 refused")), decode
    else:
        assert decode.startswith(("packed: int4 refused", "plain: int4 refused")), decode


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_decode_step_reads_no_position_from_the_device(tiny_tokenizer, family, monkeypatch):
    """Each row's position is a host int: attention is told it (on a GPU a read from the position
    tensor waits for every queued kernel, once per row and layer). Sliding-window layers too."""
    import kvrag.kernels as K
    from kvrag.kernels import reference

    adapter = ModelAdapter(make_tiny_model(len(tiny_tokenizer), family))
    torch.manual_seed(2)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS[:5]]
    told, read = rows_for(adapter, prompts, 1), rows_for(adapter, prompts, 1)  # prefills read positions
    expected = decode_step(adapter, read, 8)

    def refuse(q_pos):
        raise AssertionError("a position was read from the tensor")

    monkeypatch.setattr(reference, "positions_span", refuse)
    monkeypatch.setattr(K, "positions_span", refuse)
    assert torch.equal(decode_step(adapter, told, 8), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequences_draft_rows_give_the_bits_of_its_steps_one_by_one(tiny_tokenizer, family):
    """A step of two sequences, each with its token's row and two draft rows after it (rows of one
    buffer in one pass): every row's logits equal those of the same tokens decoded one step at a time."""
    adapter = ModelAdapter(as_dtype(make_tiny_model(len(tiny_tokenizer), family), "bfloat16"))
    decoder = any_decoder(adapter)
    torch.manual_seed(2)
    prompts = [torch.randint(5, 500, (n,)) for n in (90, 37)]
    tokens = [[7, 11, 13], [17, 19, 23]]
    together = rows_for(adapter, prompts, 3)
    rows = [DecodeRow(r.buf, t[0], r.pos) for r, t in zip(together, tokens)]
    rows += [DecodeRow(r.buf, t[j], r.pos + j) for r, t in zip(together, tokens) for j in (1, 2)]
    got = decoder.step(rows)
    for s, (row, t) in enumerate(zip(rows_for(adapter, prompts, 3), tokens)):
        for j in range(3):
            alone = decoder.step([DecodeRow(row.buf, t[j], row.pos + j)])[0]
            at = s if j == 0 else 2 + 2 * s + (j - 1)
            assert torch.equal(got[at], alone)
