"""GPU benchmark of kvrag's Triton kernels against their PyTorch references.

Run on a machine with a CUDA GPU and Triton::

    python -m benchmarks kernels                      # SmolLM2-135M shapes, float16
    python -m benchmarks kernels --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --seq 2048 8192
    python -m benchmarks kernels --sweep              # also try attention launch configs

Every case first checks the Triton result against the reference on the same inputs (it stops on a
mismatch), then times both interleaved (CUDA events, median of ``--reps``) and prints the ratio
``reference / triton`` (> 1: Triton is faster). On a machine without CUDA it refuses and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrag.kernels import reference as R

__all__ = ["Case", "cases", "run", "main"]

TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
}
SWEEP = [(bm, bn, w, st) for bm in (32, 64, 128) for bn in (32, 64) for w in (4, 8) for st in (2, 3)]


@dataclass
class Case:
    """One comparison: ``ref()`` and ``tri()`` return the same result (checked once, then timed)."""

    name: str
    ref: Callable[[], object]
    tri: Callable[[], object]
    tolerance: dict


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def cuda_ms(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_ms(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cuda_ms if device.type == "cuda" else cpu_ms


def cases(
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq: int,
    ratio: float,
    dtype: torch.dtype,
    device: torch.device,
    attention_kwargs: dict | None = None,
) -> list[Case]:
    """The kernel cases at one shape: KV [kv_heads, seq, head_dim]; ``ratio`` of the rows selected."""
    from kvrag.kernels.triton_attention import attention_triton
    from kvrag.kernels.triton_deviation import kv_deviation_triton
    from kvrag.kernels.triton_rope import rope_rotate_triton

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    d, tol = head_dim, TOL[dtype]
    inv = (1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(device)
    pos = torch.arange(seq, device=device) + 17
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_raw, k, v = rnd(kv_heads, seq, d), rnd(kv_heads, seq, d), rnd(kv_heads, seq, d)
    n_sel = max(1, int(seq * ratio))
    sel = torch.sort(torch.randperm(seq, generator=g)[:n_sel]).values.to(device)
    scale = d**-0.5
    akw = attention_kwargs or {}
    out = [
        # placing cached keys (stored without RoPE) at their positions in the prompt
        Case(
            "rope_rotate", lambda: R.rope_rotate_ref(k_raw, cos, sin), lambda: rope_rotate_triton(k_raw, cos, sin), tol
        ),
    ]
    for label, q_pos in (
        ("attention scattered", sel),
        ("attention prefill", torch.arange(seq, device=device)),
        ("attention decode", torch.tensor([seq - 1], device=device)),
    ):
        q = rnd(heads, q_pos.numel(), d)
        out.append(
            Case(
                f"{label} (Tq={q_pos.numel()})",
                lambda q=q, q_pos=q_pos: R.attention_ref(q, q_pos, k, v, scale),
                lambda q=q, q_pos=q_pos: attention_triton(q, q_pos, k, v, scale, **akw),
                tol,
            )
        )
    k_new, v_new = rnd(kv_heads, n_sel, d), rnd(kv_heads, n_sel, d)
    k_old, v_old = k[:, sel], v[:, sel]
    out.append(
        Case(
            f"kv_deviation (T={n_sel})",
            lambda: R.kv_deviation_ref(k_new, k_old, v_new, v_old, "kv"),
            lambda: kv_deviation_triton(k_new, k_old, v_new, v_old, "kv"),
            dict(rtol=1e-4, atol=1e-3),
        )
    )
    return out


def run(case_list: list[Case], device: torch.device, reps: int, warmup: int = 3, label: str = "") -> list[dict]:
    """Check each case's parity, then time reference and Triton interleaved; print and return rows."""
    timer = _timer(device)
    rows = []
    for case in case_list:
        torch.testing.assert_close(
            case.tri(), case.ref(), **case.tolerance, msg=lambda m, name=case.name: f"{name}: {m}"
        )
        for _ in range(warmup):
            case.ref(), case.tri()
        ref_ms, tri_ms = [], []
        for _ in range(reps):
            ref_ms.append(timer(case.ref))
            tri_ms.append(timer(case.tri))
        row = dict(case=label or case.name, ref_ms=statistics.median(ref_ms), triton_ms=statistics.median(tri_ms))
        row["ratio"] = row["ref_ms"] / row["triton_ms"] if row["triton_ms"] > 0 else float("inf")
        rows.append(row)
        print(
            f"  {row['case']:<44} ref {row['ref_ms']:9.3f} ms   triton {row['triton_ms']:9.3f} ms   "
            f"ref/triton {row['ratio']:6.2f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--ratio", type=float, default=0.15, help="share of rows selected (CacheBlend recompute ratio)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="time the scattered attention over launch configs")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "python -m benchmarks kernels: no CUDA GPU here (torch.cuda.is_available() is False); the Triton "
            "kernels run only on CUDA tensors. Run this on a machine with a GPU; on CPU kvrag uses the "
            "PyTorch references.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("python -m benchmarks kernels: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    print(
        f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{args.dtype} | heads {args.heads}/{args.kv_heads} | head dim {args.head_dim} | ratio {args.ratio}"
    )
    shape = dict(
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, ratio=args.ratio, dtype=dtype, device=device
    )
    for seq in args.seq:
        print(f"seq {seq}:")
        run(cases(seq=seq, **shape), device, args.reps)
        if args.sweep:
            print(f"  attention scattered, launch configs (block_m, block_n, warps, stages) at seq {seq}:")
            for bm, bn, w, st in SWEEP:
                kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                scattered = [c for c in cases(seq=seq, attention_kwargs=kw, **shape) if "scattered" in c.name]
                try:
                    run(scattered, device, args.reps, label=f"  {(bm, bn, w, st)}")
                except Exception as exc:  # a config that does not fit this GPU (shared memory, registers)
                    print(f"    {(bm, bn, w, st)} failed: {type(exc).__name__}: {str(exc)[:100]}")
    return 0
