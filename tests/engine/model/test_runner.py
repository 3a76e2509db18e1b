"""The layer loop (:func:`kvrag.engine.model.runner.forward`): what it reads back from the device."""

from __future__ import annotations

import pytest
import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer, KVCapture, Rows, forward
from kvrag.engine.reuse.attention_stats import Tap
from tests.helpers import make_tiny_model

READS = ("__int__", "__index__", "__bool__", "__float__", "item", "tolist")


@pytest.fixture
def reads(monkeypatch):
    """Every read of a tensor's values into Python during the test (on a GPU each one waits for all
    queued kernels), by method name."""
    seen: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def _model(tokenizer, family):
    adapter = ModelAdapter(make_tiny_model(len(tokenizer), family))
    torch.manual_seed(3)
    return adapter, torch.randint(5, 500, (130,))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("cached", [0, 30, 100], ids=["prefill", "short-prefix", "long-prefix"])
def test_a_pass_over_consecutive_rows_reads_their_positions_once(tiny_tokenizer, family, cached, reads):
    """A prefill, or the rest of a prompt after cached KV, with every chunk's KV captured: one read of
    the rows' first and last position for all layers (sliding-window layers too), not several per
    layer; the KV is that of a full prefill (to rounding: a suffix's attention is another call)."""
    adapter, ids = _model(tiny_tokenizer, family)
    n = ids.numel()
    spans = ((0, 40), (40, 90), (90, n))
    expected_buf, expected_caps = KVBuffer(adapter, n), [KVCapture(adapter, a, b) for a, b in spans]
    forward(adapter, expected_buf, ids, torch.arange(n), n, capture=expected_caps)
    buf = KVBuffer(adapter, n)
    if cached:
        buf.k[:, :, :cached], buf.v[:, :, :cached] = expected_buf.k[:, :, :cached], expected_buf.v[:, :, :cached]
    caps = [KVCapture(adapter, a, b) for a, b in spans]
    reads.clear()
    forward(adapter, buf, ids[cached:], torch.arange(cached, n), n, capture=caps)
    assert reads == ["tolist"]
    torch.testing.assert_close(buf.k, expected_buf.k)
    torch.testing.assert_close(buf.v, expected_buf.v)
    for cap, expected in zip(caps, expected_caps):  # the positions this pass computed
        computed = slice(max(cap.start, cached) - cap.start, None)
        torch.testing.assert_close(cap.k[:, :, computed], expected.k[:, :, computed])
        torch.testing.assert_close(cap.v[:, :, computed], expected.v[:, :, computed])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_scattered_rows_are_looked_up_once_per_capture(tiny_tokenizer, family, reads, monkeypatch):
    """Rows scattered through cached KV (a blend's recompute): the host reads the rows' span once and
    each capture finds its rows once for all layers (the reference attention's own reads for its
    masks aside: on a GPU those rows go to the Triton kernel, told the span)."""
    adapter, ids = _model(tiny_tokenizer, family)
    n = ids.numel()
    buf = KVBuffer(adapter, n)
    forward(adapter, buf, ids, torch.arange(n), n)
    pos = torch.tensor([3, 17, 18, 50, 51, 52, 99, 120, 129])
    of = Rows.of
    made: list[Rows] = []
    monkeypatch.setattr(Rows, "of", classmethod(lambda cls, p: made.append(of(p)) or made[-1]))

    def pass_reads(captures) -> int:
        reads.clear()
        forward(adapter, buf, ids[pos], pos, n, capture=captures)
        return len(reads)

    without = pass_reads([])
    with_two = pass_reads([KVCapture(adapter, 0, 40), KVCapture(adapter, 40, n)])
    assert with_two - without == 2  # one look per capture, not one per capture and layer
    assert made == [Rows(3, 129, False), Rows(3, 129, False)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_tap_finds_its_positions_among_a_pass_rows_once(tiny_tokenizer, family, reads):
    """Cache-Craft's statistics tap the queries of sampled positions in every layer: it matches them
    with the pass's rows once (no read of the device per layer), and keeps the queries a full pass keeps."""
    adapter, ids = _model(tiny_tokenizer, family)
    n = ids.numel()
    sampled = [5, 21, 37, 64, 100, 128]
    whole = Tap(sampled, adapter.n_layers)
    forward(adapter, KVBuffer(adapter, n), ids, torch.arange(n), n, taps=[whole])
    buf, tap = KVBuffer(adapter, n), Tap(sampled, adapter.n_layers)
    forward(adapter, buf, ids[:50], torch.arange(50), 50, taps=[tap])  # two passes: the positions split
    reads.clear()
    forward(adapter, buf, ids[50:], torch.arange(50, n), n, taps=[tap])
    assert reads == ["tolist"]
    assert tap.complete()
    for got, expected in zip(tap.q, whole.q):
        torch.testing.assert_close(got, expected)
