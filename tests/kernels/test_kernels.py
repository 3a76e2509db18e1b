"""Triton kernels against their PyTorch references, run in Triton's interpreter on CPU tensors.

Triton picks its interpreter at import, so tests/conftest.py sets ``TRITON_INTERPRET=1`` for the session
on a machine without CUDA (nothing else launches Triton kernels there). Budget: ~30 s on 2 cores.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

import kvrag.kernels as K
from kvrag.kernels import reference as R
from kvrag.kernels._checks import check_launchable, check_writable

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
def tk() -> types.SimpleNamespace:
    """kvrag's Triton wrappers, with their kernels in Triton's interpreter."""
    if torch.cuda.is_available():
        pytest.skip("interpreter parity runs on CPU-only machines; on a GPU run python -m kvrag.kernels.bench_gpu")
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.max, InterpretedFunction):
        pytest.fail("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it before any import)")
    rope, attn, dev = (importlib.import_module(name) for name in TRITON_MODULES)
    return types.SimpleNamespace(
        rope_rotate=rope.rope_rotate_triton,
        rope_rerotate_=rope.rope_rerotate_triton_,
        attention=attn.attention_triton,
        kv_deviation=dev.kv_deviation_triton,
    )


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


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
    x = rand(t, 3, d, dtype=dtype).transpose(0, 1)  # [3, T, D] strided, as the engine's q/k views
    cos, sin = tables(torch.arange(t) * 5 + 11, d, dtype)
    got = tk.rope_rotate(x, cos, sin)
    want = R.rope_rotate_ref(x.float(), cos.float(), sin.float()).to(dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("from_raw", [True, False])
def test_rope_rerotate_in_place_matches_reference(tk, dtype, from_raw):
    t, d = 29, 128
    buf = rand(2, 50, d, dtype=dtype, seed=1)
    old = None if from_raw else torch.arange(t, dtype=torch.int32) * 3
    new = torch.arange(t) + 20_011  # far positions: the angle reduction must stay accurate
    scaling = 1.25 if from_raw else 1.0
    want = buf.clone()
    R.rope_rerotate_ref_(want[:, 7 : 7 + t], old, new, inv_freq(d), scaling)
    got = buf.clone()
    view = got[:, 7 : 7 + t]  # in place through a strided view of a larger buffer
    assert tk.rope_rerotate_(view, old, new, inv_freq(d), scaling) is view
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[:, :7], buf[:, :7]) and torch.equal(got[:, 7 + t :], buf[:, 7 + t :])


def test_rerotation_composes_and_matches_the_model_tables(tk):
    """Raw keys placed at p, then moved p -> q, equal raw keys placed at q; and placing raw keys
    equals rotating them with the model-style cos/sin tables."""
    d, t = 64, 19
    raw = rand(2, t, d, seed=2)
    p, q = torch.arange(t) + 3, torch.arange(t) * 2 + 100
    moved = tk.rope_rerotate_(tk.rope_rerotate_(raw.clone(), None, p, inv_freq(d)), p, q, inv_freq(d))
    direct = tk.rope_rerotate_(raw.clone(), None, q, inv_freq(d))
    torch.testing.assert_close(moved, direct, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(direct, R.rope_rotate_ref(raw, *tables(q, d, torch.float32)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(K.rope_rerotate_(raw.clone(), None, q, inv_freq(d)), direct, rtol=1e-5, atol=1e-5)


def test_rope_empty_and_bad_inputs(tk):
    x = torch.zeros(2, 0, 16)
    assert tk.rope_rotate(x, torch.zeros(0, 16), torch.zeros(0, 16)).shape == (2, 0, 16)
    assert tk.rope_rerotate_(x, None, torch.zeros(0, dtype=torch.long), inv_freq(16)) is x
    with pytest.raises(ValueError, match="must have shape"):
        tk.rope_rotate(torch.zeros(2, 5, 16), torch.zeros(4, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="even"):
        tk.rope_rotate(torch.zeros(2, 5, 15), torch.zeros(5, 15), torch.zeros(5, 15))
    with pytest.raises(TypeError, match="dtype"):
        tk.rope_rerotate_(torch.zeros(2, 5, 16), None, torch.zeros(5), inv_freq(16))
    with pytest.raises(ValueError, match="D/2"):
        tk.rope_rerotate_(torch.zeros(2, 5, 16), None, torch.arange(5), inv_freq(32))
    with pytest.raises(ValueError, match="overlapping"):
        tk.rope_rerotate_(torch.zeros(1, 5, 16).expand(3, 5, 16), None, torch.arange(5), inv_freq(16))


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
    s, d = 83, 64  # odd length, several key blocks
    q_pos = _selection("scattered", s)
    q = rand(q_pos.numel(), heads, d, dtype=dtype, seed=3).transpose(0, 1)  # strided [H, Tq, D]
    k, v = rand(kv_heads, s, d, dtype=dtype, seed=4), rand(kv_heads, s, d, dtype=dtype, seed=5)
    got = tk.attention(q, q_pos, k, v, d**-0.5)
    want = R.attention_ref(q.float(), q_pos, k.float(), v.float(), d**-0.5).to(dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("kind", ["tail", "all", "decode", "first", "empty"])
@pytest.mark.parametrize("d", [16, 128])
def test_attention_selections_and_head_dims(tk, kind, d):
    s = 70 if d == 16 else 45
    q_pos = _selection(kind, s)
    q = rand(4, q_pos.numel(), d, seed=6)
    k, v = rand(2, s, d, seed=7), rand(2, s, d, seed=8)
    got = tk.attention(q, q_pos, k, v, 0.3)
    torch.testing.assert_close(got, R.attention_ref(q, q_pos, k, v, 0.3), **TOL[torch.float32])


def test_attention_many_row_blocks_and_int32_positions(tk):
    s, d = 150, 32
    q_pos = torch.sort(torch.randperm(s, generator=torch.Generator().manual_seed(9))[:70]).values
    q, k, v = rand(2, 70, d, seed=10), rand(1, s, d, seed=11), rand(1, s, d, seed=12)
    got = tk.attention(q, q_pos.to(torch.int32), k, v, 0.2, block_m=16, block_n=32)
    torch.testing.assert_close(got, R.attention_ref(q, q_pos, k, v, 0.2), **TOL[torch.float32])


def test_attention_bad_inputs(tk):
    q, k = torch.zeros(4, 3, 16), torch.zeros(3, 10, 16)
    pos = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tk.attention(q, pos, k, k, 1.0)
    with pytest.raises(ValueError, match="one position per query row"):
        tk.attention(q, pos[:2], k[:2], k[:2], 1.0)
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        tk.attention(q, torch.tensor([1, 2, 10]), k[:2], k[:2], 1.0)
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
    buf_k, buf_v = rand(3, 60, 64, dtype=dtype, seed=13), rand(3, 60, 64, dtype=dtype, seed=14)
    pos = torch.tensor([0, 4, 5, 9, 17, 23, 31, 40, 41, 42, 55])  # odd count, gathered like the selector
    k_new = buf_k[:, pos] + rand(3, pos.numel(), 64, dtype=dtype, seed=15) * 0.1
    v_new = buf_v[:, pos] + rand(3, pos.numel(), 64, dtype=dtype, seed=16) * 0.1
    got = tk.kv_deviation(k_new, buf_k[:, pos], v_new, buf_v[:, pos], what)
    want = R.kv_deviation_ref(k_new, buf_k[:, pos], v_new, buf_v[:, pos], what)
    assert got.dtype == torch.float32 and got.shape == (pos.numel(),)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(K.topk(got, 4), R.topk_ref(want, 4))


def test_kv_deviation_strided_empty_and_bad_inputs(tk):
    a, b = rand(7, 2, 16, seed=17).transpose(0, 1), rand(2, 7, 16, seed=18)  # [2, 7, 16], one strided
    torch.testing.assert_close(tk.kv_deviation(a, b, a, b, "k"), R.kv_deviation_ref(a, b, a, b, "k"))
    empty = torch.zeros(2, 0, 16)
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


def test_cpu_tensors_use_the_references_by_default(tk):
    x = torch.zeros(1, 2, 16)
    assert not K._triton_for(x)
    with K.use_backend("triton"):
        assert K._triton_for(x)
    assert not K._triton_for(x)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with K.use_backend("cuda"):
            pass


def test_uninterpreted_kernel_on_cpu_is_refused_clearly(tk):
    check_launchable(torch.device("cuda"), object())
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(torch.device("cpu"), object())
    check_writable("k", torch.zeros(2, 3, 4)[:, 1:])


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


def test_engine_outputs_unchanged_through_triton_kernels(tk, tiny_model, tiny_tokenizer, docs, monkeypatch):
    """The tiny engine generates the same greedy tokens with every kernel on the Triton path
    (interpreted) as on the references, in full and blend modes."""
    from kvrag import Engine
    from tests.helpers import PREFIX, SUFFIX

    calls: dict[str, int] = {}
    for name in TRITON_MODULES:
        mod = importlib.import_module(name)
        for fn_name in [n for n in mod.__all__ if n.endswith(("_triton", "_triton_"))]:

            def counted(*a, _fn=getattr(mod, fn_name), _name=fn_name, **kw):  # noqa: B008 - bind per loop
                calls[_name] = calls.get(_name, 0) + 1
                return _fn(*a, **kw)

            monkeypatch.setattr(mod, fn_name, counted)

    def run(backend: str) -> list[list[int]]:
        engine = Engine.from_model(tiny_model, tiny_tokenizer, max_new_tokens=4)
        try:
            with K.use_backend(backend):
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
    # what the engine calls today went through Triton (it does not call rope_rerotate_ yet)
    assert {"rope_rotate_triton", "attention_triton", "kv_deviation_triton"} <= set(calls)


# -- GPU benchmark script ---------------------------------------------------------------------


def test_kernels_compile_for_a_gpu_target(tmp_path):
    """Interpretation checks the arithmetic; this checks the compiler takes the kernels for a real
    GPU (sm_80, down to a cubin with the ptxas inside the triton wheel). A fresh cache forces it."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-W", "ignore", "-m", "kvrag.kernels.compile_check", "--arch", "80", "--head-dim", "64"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "6 kernel builds compiled" in done.stdout


def test_bench_gpu_refuses_without_cuda(capsys):
    from kvrag.kernels import bench_gpu

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench_gpu.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bench_gpu_cases_check_and_time_in_the_interpreter(tk, capsys):
    """The GPU script's parity checks and timing loop, at a tiny shape on CPU (interpreted)."""
    from kvrag.kernels import bench_gpu

    cpu = torch.device("cpu")
    cases = bench_gpu.cases(heads=4, kv_heads=2, head_dim=32, seq=40, ratio=0.2, dtype=torch.float16, device=cpu)
    rows = bench_gpu.run(cases, cpu, reps=1, warmup=0)
    assert [r["case"] for r in rows] == [c.name for c in cases] and all(r["triton_ms"] > 0 for r in rows)
    assert "attention scattered (Tq=8)" in capsys.readouterr().out


@pytest.mark.parametrize("first", [0, 1, 7, 30, 31, 50])
def test_attention_reference_paths_match_dense_softmax(first):
    """Every path of the reference (square causal, padded tail, masked blocks) against plain math."""
    s, d = 61, 16
    for q_pos in (torch.arange(first, s), _selection("scattered", s)[_selection("scattered", s) >= first]):
        q = rand(6, q_pos.numel(), d, seed=13)
        k, v = rand(2, s, d, seed=14), rand(2, s, d, seed=15)
        kk, vv = k.repeat_interleave(3, dim=0), v.repeat_interleave(3, dim=0)
        scores = (q @ kk.transpose(1, 2)) * 0.25
        scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos[:, None], float("-inf"))
        want = torch.softmax(scores, dim=-1) @ vv
        torch.testing.assert_close(R.attention_ref(q, q_pos, k, v, 0.25, block=8), want, rtol=1e-5, atol=1e-5)
        masks: dict = {}  # kept across calls with the same rows (the layers of a pass): same output
        first_call = R.attention_ref(q, q_pos, k, v, 0.25, block=8, masks=masks)
        assert torch.equal(R.attention_ref(q, q_pos, k, v, 0.25, block=8, masks=masks), first_call)
        torch.testing.assert_close(first_call, want, rtol=1e-5, atol=1e-5)
