"""kvrag's int4×int8 CPU kernel against torch's int4 kernel and a bfloat16 ``F.linear``, per shape.

    python -m benchmarks int4-kernel                       # Qwen2.5-Coder-1.5B's decode shapes, M = 1 and 4
    python -m benchmarks int4-kernel --m 1 4 8 16 --reps 30 --threads 2

Random weights of each shape (the decode step's fused products: Q/K/V, O, gate/up, down, the LM
head), the three products interleaved in one process (each rep runs all three in turn), medians in
ms and GB/s of the weights each reads (kvrag's: 4-bit codes plus fp16 scale and low per 32; torch's:
its packed codes plus bf16 scale and zero; bf16: 2 bytes a weight). With ``--threads 1`` times are the
thread's CPU time (``time.thread_time``: a shared machine's time slicing does not inflate them); with
more, wall time. Timings on a shared machine are noisy: compare the ratios, and say so beside any figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

__all__ = ["SHAPES", "main"]

#: Qwen2.5-Coder-1.5B: hidden 1536, 12 heads and 2 KV heads of 128, MLP 8960, vocabulary 151,936.
SHAPES = {
    "qkv": (1536 + 2 * 256, 1536),
    "o": (1536, 1536),
    "gate_up": (2 * 8960, 1536),
    "down": (1536, 8960),
    "head": (151936, 1536),
}


def _time(fn, reps: int, clock=time.perf_counter) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    from kvrag.kernels.int4_cpu import int4_kernel, pack_int4

    p = argparse.ArgumentParser(prog="python -m benchmarks int4-kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4], help="input rows per product")
    p.add_argument("--reps", type=int, default=20, help="timed reps of each product (after 3 warm-ups)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--isa", default=None, help="force the kernel's SIMD path (avx512-vnni, avx2)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    kernel, why = int4_kernel()
    if kernel is None:
        print(f"kvrag's int4 kernel is not available here: {why}", file=sys.stderr)
        return 2
    isa = a.isa or kernel.isa
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    print(
        f"{why}; path {isa}; torch {torch.__version__}, {torch.get_num_threads()} threads"
        f" ({clock.__name__}); medians of {a.reps}"
    )
    print(f"{'shape':>8} {'N x K':>13} {'M':>3} | {'kvrag ms':>9} {'GB/s':>6} | {'torch int4':>10} {'GB/s':>6} |"
          f" {'bf16 ms':>8} {'GB/s':>6} | torch/kvrag")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for name in a.shapes:
        n, k = SHAPES[name]
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        ours = (pack_int4(codes), torch.rand(n, k // 32, generator=gen).half(), torch.rand(n, k // 32).half())
        ours_bytes = sum(t.nbytes for t in ours)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.rand(k // 32, n, 2, generator=gen).to(torch.bfloat16)
        torch_bytes = packed.nbytes + sz.nbytes
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        del codes
        for m in a.m:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            fns = {
                "kvrag": lambda x=x, ours=ours: kernel.mm(x, *ours, isa=isa),
                "torch": lambda x=x, p=packed, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz),
                "bf16": lambda x=x, w=w: F.linear(x, w),
            }
            for fn in fns.values():
                for _ in range(3):
                    fn()
            times = {key: [] for key in fns}
            for _ in range(a.reps):  # interleaved: each rep runs all three
                for key, fn in fns.items():
                    times[key] += _time(fn, 1, clock)
            med = {key: statistics.median(t) for key, t in times.items()}
            gbs = {"kvrag": ours_bytes / med["kvrag"] / 1e9, "torch": torch_bytes / med["torch"] / 1e9}
            gbs["bf16"] = w.nbytes / med["bf16"] / 1e9
            print(
                f"{name:>8} {n:>6}x{k:<6} {m:>3} | {med['kvrag'] * 1e3:9.3f} {gbs['kvrag']:6.1f} |"
                f" {med['torch'] * 1e3:10.3f} {gbs['torch']:6.1f} | {med['bf16'] * 1e3:8.3f} {gbs['bf16']:6.1f} |"
                f" {med['torch'] / med['kvrag']:6.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
