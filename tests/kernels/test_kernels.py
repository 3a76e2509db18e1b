"""Triton kernels against their PyTorch references, on the device the kernels run on.

On a machine with a GPU the kernels are compiled and run on CUDA tensors; without one they run on
CPU tensors in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` for the session
there). Either way the oracle is the same: the PyTorch reference on CPU copies of the inputs.
The ``triton_device`` fixture (tests/conftest.py) picks the device. Budget: ~30 s on 2 CPU cores.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvrag.kernels as K
from kvrag.kernels import reference as R
from kvrag.kernels._checks import check_launchable

ROOT = Path(__file__).resolve().parents[2]
TRITON_MODULES = ("kvrag.kernels.triton_rope", "kvrag.kernels.triton_attention", "kvrag.kernels.triton_deviation")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernels compute in float32 and round once; references in the dtype or float32. Tolerances are
# a couple of units in the last place of each dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


@pytest.fixture(scope="module")
def tk(triton_device) -> types.SimpleNamespace:
    """kvrag's Triton wrappers, and the device whose tensors they are given."""
    rope, attn, dev = (importlib.import_module(name) for name in TRITON_MODULES)
    return types.SimpleNamespace(
        device=triton_device,
        rope_rotate=rope.rope_rotate_triton,
        attention=attn.attention_triton,
        kv_deviation=dev.kv_deviation_triton,
    )


def rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def cpu(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of the kernel's inputs, for the reference (the oracle runs on CPU everywhere)."""
    return [t.cpu() for t in tensors]


def inv_freq(d: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def tables(pos: torch.Tensor, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    f = pos.float()[:, None] * inv_freq(d)[None]
    emb = torch.cat((f, f), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# -- RoPE -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotate_matches_reference(tk, dtype):
    t, d = 37, 64
    x = rand(t, 3, d, dtype=dtype, device=tk.device).transpose(0, 1)  # [3, T, D] strided, as the engine's q/k views
    cos, sin = (c.to(tk.device) for c in tables(torch.arange(t) * 5 + 11, d, dtype))
    got = tk.rope_rotate(x, cos, sin)
    x_, cos_, sin_ = cpu(x, cos, sin)
    want = R.rope_rotate_ref(x_.float(), cos_.float(), sin_.float()).to(dtype)
    assert got.device == x.device
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rope_reference_is_transformers_formula_bit_for_bit(dtype):
    t, d = 37, 64
    x = rand(t, 3, d, dtype=dtype, seed=3).transpose(0, 1)  # [3, T, D] strided
    cos, sin = tables(torch.arange(t) * 7 + 3, d, dtype)
    rotate_half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    theirs = x * cos + rotate_half * sin  # transformers' apply_rotary_pos_emb
    assert torch.equal(R.rope_rotate_ref(x, cos, sin), theirs)
    buf = torch.full((3, t + 9, d), float("nan"), dtype=dtype)
    out = R.rope_rotate_into_ref(buf[:, 4 : 4 + t], x, cos, sin)  # into a strided view of a buffer
    assert torch.equal(out, theirs) and torch.equal(buf[:, 4 : 4 + t], theirs)
    assert buf[:, :4].isnan().all() and buf[:, 4 + t :].isnan().all()
    assert torch.equal(K.rope_rotate_into(torch.empty_like(x), x, cos, sin), theirs)


def test_rope_empty_and_bad_inputs(tk):
    def z(*shape):
        return torch.zeros(*shape, device=tk.device)

    assert tk.rope_rotate(z(2, 0, 16), z(0, 16), z(0, 16)).shape == (2, 0, 16)
    with pytest.raises(ValueError, match="must have shape"):
        tk.rope_rotate(z(2, 5, 16), z(4, 16), z(4, 16))
    with pytest.raises(ValueError, match="even"):
        tk.rope_rotate(z(2, 5, 15), z(5, 15), z(5, 15))
    with pytest.raises(TypeError, match="dtype"):
        tk.rope_rotate(z(2, 5, 16).long(), z(5, 16), z(5, 16))


# -- attention --------------------------------------------------------------------------------


def _selection(kind: str, s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(s)
    if kind == "scattered":
        return torch.sort(torch.randperm(s, generator=g)[: s // 3]).values
    if kind == "tail":
        return torch.arange(s // 2, s)
    if kind == "all":
        return torch.arange(s)
    if kind == "decode":
        return torch.tensor([s - 1])
    if kind == "first":
        return torch.tensor([0, 1, s // 2])
    return torch.empty(0, dtype=torch.long)  # empty


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
def test_attention_gqa_matches_reference(tk, dtype, heads, kv_heads):
    s, d, dev = 83, 64, tk.device  # odd length, several key blocks
    q_pos = _selection("scattered", s).to(dev)
    q = rand(q_pos.numel(), heads, d, dtype=dtype, seed=3, device=dev).transpose(0, 1)  # strided [H, Tq, D]
    k, v = rand(kv_heads, s, d, dtype=dtype, seed=4, device=dev), rand(kv_heads, s, d, dtype=dtype, seed=5, device=dev)
    got = tk.attention(q, q_pos, k, v, d**-0.5)
    q_, pos_, k_, v_ = cpu(q, q_pos, k, v)
    want = R.attention_ref(q_.float(), pos_, k_.float(), v_.float(), d**-0.5).to(dtype)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("kind", ["tail", "all", "decode", "first", "empty"])
@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("window", [None, 9])
def test_attention_selections_and_head_dims(tk, kind, d, window):
    s, dev = (70 if d == 16 else 45), tk.device
    q_pos = _selection(kind, s).to(dev)
    q = rand(4, q_pos.numel(), d, seed=6, device=dev)
    k, v = rand(2, s, d, seed=7, device=dev), rand(2, s, d, seed=8, device=dev)
    got = tk.attention(q, q_pos, k, v, 0.3, window=window)
    want = R.attention_ref(*cpu(q, q_pos, k, v), 0.3, window=window)
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


def test_attention_many_row_blocks_and_int32_positions(tk):
    s, d, dev = 150, 32, tk.device
    q_pos = torch.sort(torch.randperm(s, generator=torch.Generator().manual_seed(9))[:70]).values
    q, k, v = (
        rand(2, 70, d, seed=10, device=dev),
        rand(1, s, d, seed=11, device=dev),
        rand(1, s, d, seed=12, device=dev),
    )
    got = tk.attention(q, q_pos.to(dev, torch.int32), k, v, 0.2, block_m=16, block_n=32)
    q_, k_, v_ = cpu(q, k, v)
    torch.testing.assert_close(got.cpu(), R.attention_ref(q_, q_pos, k_, v_, 0.2), **TOL[torch.float32])


def test_attention_bad_inputs(tk):
    q, k = torch.zeros(4, 3, 16, device=tk.device), torch.zeros(3, 10, 16, device=tk.device)
    pos = torch.tensor([1, 2, 3], device=tk.device)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tk.attention(q, pos, k, k, 1.0)
    with pytest.raises(ValueError, match="one position per query row"):
        tk.attention(q, pos[:2], k[:2], k[:2], 1.0)
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        tk.attention(q, torch.tensor([1, 2, 10], device=tk.device), k[:2], k[:2], 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        tk.attention(q.half(), pos, k[:2], k[:2], 1.0)
    with pytest.raises(TypeError, match="q_pos has dtype"):
        tk.attention(q, pos.float(), k[:2], k[:2], 1.0)
    with pytest.raises(ValueError, match="same shape"):
        tk.attention(q, pos, k[:2], k[:1], 1.0)


# -- deviation and top-k ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what", ["k", "v", "kv"])
def test_kv_deviation_matches_reference(tk, dtype, what):
    dev = tk.device
    buf_k, buf_v = rand(3, 60, 64, dtype=dtype, seed=13, device=dev), rand(3, 60, 64, dtype=dtype, seed=14, device=dev)
    pos = torch.tensor([0, 4, 5, 9, 17, 23, 31, 40, 41, 42, 55], device=dev)  # odd count, gathered like the selector
    k_new = buf_k[:, pos] + rand(3, pos.numel(), 64, dtype=dtype, seed=15, device=dev) * 0.1
    v_new = buf_v[:, pos] + rand(3, pos.numel(), 64, dtype=dtype, seed=16, device=dev) * 0.1
    got = tk.kv_deviation(k_new, buf_k[:, pos], v_new, buf_v[:, pos], what)
    want = R.kv_deviation_ref(*cpu(k_new, buf_k[:, pos], v_new, buf_v[:, pos]), what)
    assert got.dtype == torch.float32 and got.shape == (pos.numel(),) and got.device == k_new.device
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(K.topk(got, 4).cpu(), R.topk_ref(want, 4))


def test_kv_deviation_strided_empty_and_bad_inputs(tk):
    dev = tk.device
    a, b = rand(7, 2, 16, seed=17, device=dev).transpose(0, 1), rand(2, 7, 16, seed=18, device=dev)  # one strided
    torch.testing.assert_close(tk.kv_deviation(a, b, a, b, "k").cpu(), R.kv_deviation_ref(*cpu(a, b, a, b), "k"))
    empty = torch.zeros(2, 0, 16, device=dev)
    assert tk.kv_deviation(empty, empty, empty, empty).shape == (0,)
    assert tk.kv_deviation(a, b, None, None, "k").shape == (7,)  # V unused for "k"
    with pytest.raises(ValueError, match="unknown deviation"):
        tk.kv_deviation(a, b, a, b, "q")
    with pytest.raises(ValueError, match="share one shape"):
        tk.kv_deviation(a, b[:, :5], a, b, "kv")


def test_topk_empty_and_oversized():
    scores = torch.tensor([0.5, 3.0, 1.0, 3.0])
    assert K.topk(scores, 0).numel() == 0
    assert K.topk(scores, 10).tolist() == [0, 1, 2, 3]
    assert K.topk(scores, 2).tolist() == [1, 3]


# -- dispatch ---------------------------------------------------------------------------------


def test_dispatch_sends_cuda_tensors_to_triton_and_cpu_tensors_to_the_references(tk):
    x = torch.zeros(1, 2, 16)
    assert not K._triton_for(x)
    assert K._triton_for(x.to(tk.device)) == (tk.device.type == "cuda")
    with K.use_backend("triton"):
        assert K._triton_for(x)
    with K.use_backend("reference"):
        assert not K._triton_for(x.to(tk.device))
    assert not K._triton_for(x)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with K.use_backend("cuda"):
            pass


def test_uninterpreted_kernel_on_cpu_is_refused_clearly(tk):
    check_launchable(torch.device("cuda"), object())
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(torch.device("cpu"), object())


@pytest.mark.slow
def test_package_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvrag, kvrag.kernels as K\n"
        "assert not K.triton_available()\n"
        "q = torch.randn(2, 3, 16); kv = torch.randn(1, 5, 16)\n"
        "out = K.attention(q, torch.tensor([1, 2, 4]), kv, kv, 0.25)\n"
        "assert out.shape == (2, 3, 16)\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules if sys.modules[m])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- the engine through the dispatch layer ----------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_engine_outputs_unchanged_through_triton_kernels(tk, family, tiny_tokenizer, docs, monkeypatch):
    """The tiny engine, on the kernels' device, generates the same greedy tokens with every kernel
    on the Triton path as on the references, in full and blend modes; Gemma 3 brings sliding
    windows shorter than the prompt and a RoPE per layer kind."""
    from kvrag import Engine, SamplingParams
    from tests.helpers import PREFIX, SUFFIX, make_tiny_model

    tiny_model = make_tiny_model(len(tiny_tokenizer), family)

    calls: dict[str, int] = {}
    for name in TRITON_MODULES:
        mod = importlib.import_module(name)
        for fn_name in [n for n in mod.__all__ if n.endswith("_triton")]:

            def counted(*a, _fn=getattr(mod, fn_name), _name=fn_name, **kw):  # noqa: B008 - bind per loop
                calls[_name] = calls.get(_name, 0) + 1
                return _fn(*a, **kw)

            monkeypatch.setattr(mod, fn_name, counted)
    # the session's model stays on CPU for the other tests
    model = tiny_model if tk.device.type == "cpu" else copy.deepcopy(tiny_model).to(tk.device)

    def run(backend: str) -> list[list[int]]:
        # the engine is built inside the backend too: its self-test runs the kernels (on a GPU, the
        # default backend would send them to Triton)
        with K.use_backend(backend):
            engine = Engine.from_model(model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
            try:
                engine.warm(docs[:2])
                full = engine.generate(docs[:2], PREFIX, SUFFIX, mode="full")
                blend = engine.generate(docs[:2], PREFIX, SUFFIX, mode="blend", recompute_ratio=0.3)
                engine.flush()
            finally:
                engine.close()
        assert blend.stats.cached_tokens > 0  # the fused path (cached keys, scattered rows) ran
        return [full.token_ids, blend.token_ids]

    reference = run("reference")
    assert calls == {}
    assert run("triton") == reference
    # every kernel the engine calls went through Triton (rope_rotate places the cached keys)
    assert set(calls) == {"rope_rotate_triton", "attention_triton", "kv_deviation_triton"}


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_target(tmp_path):
    """Interpretation checks the arithmetic; this checks the compiler takes the kernels for a real
    GPU (sm_80, down to a cubin with the ptxas inside the triton wheel). A fresh cache forces it."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "benchmarks.kernels_compile_check",
        "--arch",
        "80",
        "--head-dim",
        "64",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 kernel builds compiled" in done.stdout


def test_rows_covering_most_positions_take_one_causal_pass():
    """A blend's few scattered rows run in masked blocks; rows covering most of the sequence (one
    chunk of six cached) in one causal pass over every position up to the last row."""
    n = 3900
    few = torch.tensor([b * 16 + i for b in range(0, n // 16, 6) for i in range(16)])  # 1 block in 6
    most = torch.cat((torch.arange(0, 600), torch.arange(1200, n)))  # a 600-token chunk cached
    assert not R._one_causal_pass(few, 0, int(few[-1]), R.QUERY_BLOCK)
    assert R._one_causal_pass(most, 0, int(most[-1]), R.QUERY_BLOCK)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 64, 100])
def test_consecutive_rows_block_ends_come_from_their_span(rows):
    """Consecutive rows: each block's last position from the span, as reading the positions gives."""
    for first in (0, 5, 700):
        pos = torch.arange(first, first + rows)
        for block in (16, 32):
            expected = pos[block - 1 :: block].tolist() + ([] if rows % block == 0 else [first + rows - 1])
            assert R.block_ends(pos, first, first + rows - 1, block) == expected


@pytest.mark.parametrize("first", [0, 1, 7, 30, 31, 50])
@pytest.mark.parametrize("window", [None, 1, 9, 40])
def test_attention_reference_paths_match_dense_softmax(first, window):
    """Every path of the reference (square causal, padded tail, masked blocks, one causal pass over
    rows with gaps, sliding windows, decoding in a window) against plain math."""
    s, d = 61, 16
    gapped = torch.arange(first, s)[(torch.arange(first, s) < 40) | (torch.arange(first, s) >= 48)]  # a cached chunk
    for q_pos in (torch.arange(first, s), _selection("scattered", s)[_selection("scattered", s) >= first], gapped):
        q = rand(6, q_pos.numel(), d, seed=13)
        k, v = rand(2, s, d, seed=14), rand(2, s, d, seed=15)
        kk, vv = k.repeat_interleave(3, dim=0), v.repeat_interleave(3, dim=0)
        scores = (q @ kk.transpose(1, 2)) * 0.25
        keys = torch.arange(s)[None, :]
        hidden = keys > q_pos[:, None]
        if window is not None:  # row at p sees keys (p - window, p]
            hidden |= keys <= q_pos[:, None] - window
        want = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ vv
        got = R.attention_ref(q, q_pos, k, v, 0.25, block=8, window=window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        masks: dict = {}  # kept across calls with the same rows (the layers of a pass): same output
        first_call = R.attention_ref(q, q_pos, k, v, 0.25, block=8, masks=masks, window=window)
        assert torch.equal(R.attention_ref(q, q_pos, k, v, 0.25, block=8, masks=masks, window=window), first_call)
        torch.testing.assert_close(first_call, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_row_folds_each_kv_heads_queries_and_stays_within_rounding(window, dtype):
    """A decode row (the keys' last position; the window's slice taken first) with each KV head's
    queries as rows of one fused call: query head h reads KV head h // G, within the output's
    rounding of a float64 softmax (bf16: 1e-2; float32: 1e-5), in the inputs' dtype."""
    s, d = 61, 16
    q, k, v = (rand(*shape, seed=seed).to(dtype) for shape, seed in (((6, 1, d), 21), ((2, s, d), 22), ((2, s, d), 23)))
    q_pos = torch.tensor([s - 1])
    kk, vv = k.double().repeat_interleave(3, dim=0), v.double().repeat_interleave(3, dim=0)
    lo = 0 if window is None else s - window
    truth = torch.softmax((q.double() @ kk[:, lo:].transpose(1, 2)) * 0.25, dim=-1) @ vv[:, lo:]
    got = R.attention_ref(q, q_pos, k, v, 0.25, window=window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), truth, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_after_cached_keys_merge_two_fused_calls_within_rounding(dtype):
    """A deterministic prefill's slice (rows after cached keys, ``split_tail``): a maskless call over
    the keys before them and a causal one over their own, merged by their log-sum-exp, within the
    output's rounding of a float64 softmax (bf16: 1e-2; float32: 1e-5), the same bits every call.
    Without ``split_tail`` such rows keep the paths that give one pass's bits (ratio 1.0, prefix hits)."""
    s, t, d = 300, 40, 16
    q, k, v = (rand(*shape, seed=seed).to(dtype) for shape, seed in (((6, t, d), 31), ((2, s, d), 32), ((2, s, d), 33)))
    q_pos = torch.arange(s - t, s)
    kk, vv = k.double().repeat_interleave(3, dim=0), v.double().repeat_interleave(3, dim=0)
    scores = (q.double() @ kk.transpose(1, 2)) * 0.25
    truth = torch.softmax(scores.masked_fill(torch.arange(s)[None, :] > q_pos[:, None], float("-inf")), dim=-1) @ vv
    got = R.attention_ref(q, q_pos, k, v, 0.25, split_tail=True)
    assert got.dtype == dtype and got.shape == q.shape and torch.equal(got, R.tail_attention(q, k, v, 0.25))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), truth, rtol=tol, atol=tol)


def test_auto_backend_keeps_contiguous_rows_on_fused_attention():
    """On a GPU, ``auto`` sends only scattered rows to the Triton attention: a prefill or a decode
    step (the keys' last rows, global layer) goes to PyTorch's fused attention, which is faster there."""
    from kvrag.kernels import _contiguous_tail

    assert _contiguous_tail(torch.arange(10), 10, 10, None)  # a whole prefill
    assert _contiguous_tail(torch.tensor([41]), 1, 42, None)  # a decode step
    assert _contiguous_tail(torch.arange(30, 42), 12, 42, None)  # rows after a cached prefix
    assert not _contiguous_tail(torch.tensor([3, 9, 41]), 3, 42, None)  # a blend's scattered rows
    assert not _contiguous_tail(torch.arange(30, 40), 10, 42, None)  # not the last rows
    assert not _contiguous_tail(torch.arange(10), 10, 10, 4)  # sliding-window layer: the kernel's masks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_do_not_depend_on_the_prompts_length_or_split(dtype):
    """From :data:`~kvrag.kernels.reference.ALIGNED_MIN_KEYS` keys on a CPU, a row's attention is a
    function of its position and the keys before it: a full pass's rows equal a shorter pass's (the
    prefix another prompt computed) and the rows after any cached prefix (a 1-3 row tail included),
    bit for bit; and within a float64 softmax's rounding of the truth."""
    h, hkv, d = 6, 2, 16
    s = 1500
    q, k, v = (
        rand(*shape, seed=seed).to(dtype) for shape, seed in (((h, s, d), 41), ((hkv, s, d), 42), ((hkv, s, d), 43))
    )
    full = R.attention_ref(q, torch.arange(s), k, v, 0.25)
    for short in (1030, 1025, 1100):  # a shorter prompt's pass: its last blocks cut elsewhere
        got = R.attention_ref(q[:, :short], torch.arange(short), k[:, :short], v[:, :short], 0.25)
        assert torch.equal(got, full[:, :short]), short
    for first in (1499, 1498, 1497, 1470, 1200, 900, 400):  # rows after cached keys
        got = R.attention_ref(q[:, first:], torch.arange(first, s), k, v, 0.25)
        assert torch.equal(got, full[:, first:]), first
    kk, vv = k.double().repeat_interleave(3, dim=0), v.double().repeat_interleave(3, dim=0)
    scores = (q.double() @ kk.transpose(1, 2)) * 0.25
    truth = (
        torch.softmax(scores.masked_fill(torch.arange(s)[None, :] > torch.arange(s)[:, None], float("-inf")), -1) @ vv
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.double(), truth, rtol=tol, atol=tol)
