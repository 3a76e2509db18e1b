"""Compile every Triton kernel for a CUDA target, down to a cubin, on a machine without a GPU.

    python -m benchmarks.kernels_compile_check [--arch 75 80 90] [--dtype float16 bfloat16 float32]

The interpreter tests check what the kernels compute; this checks that the compiler accepts them
for real GPUs (Triton's front end, layouts, PTX, and ptxas, which ships inside the triton wheel),
at the launch configurations the wrappers use, and reports each kernel's shared memory. It runs
only where Triton is not in interpreter mode (``TRITON_INTERPRET`` unset).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["compile_all", "main"]

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
_SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # bytes per block


def _specs(dtype: torch.dtype, head_dim: int) -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, pointer/float argument types, constexprs) at the wrappers' default configs."""
    from kvrag.kernels import triton_attention as ta
    from kvrag.kernels import triton_deviation as td
    from kvrag.kernels import triton_rope as tr

    ptr = _PTR[dtype]
    half = head_dim // 2
    specs = []
    for tq in (1, 300):  # decode-sized and prefill-sized row blocks
        cfg = ta.launch_config(tq, head_dim, dtype)
        specs.append(
            (
                f"attention Tq={tq}",
                ta._attention_kernel,
                {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "POS": "*i64", "qk_scale": "fp32"},
                dict(HEAD_DIM=head_dim, UPCAST=False, IEEE=dtype == torch.float32, **cfg),
            )
        )
    specs.append(
        (
            "rope_rotate",
            tr._rope_table_kernel,
            {"X": ptr, "COS": ptr, "SIN": ptr, "OUT": ptr},
            dict(HALF=half, **tr.launch_config(1000, half)),
        )
    )
    specs.append(
        (
            "kv_deviation",
            td._deviation_kernel,
            {"KN": ptr, "KO": ptr, "VN": ptr, "VO": ptr, "OUT": "*fp32"},
            dict(HEAD_DIM=head_dim, HAS_K=True, HAS_V=True, **td.launch_config(1000, head_dim)),
        )
    )
    return specs


def compile_all(archs: list[int], dtypes: list[torch.dtype], head_dims: list[int], out=sys.stdout) -> list[dict]:
    """Compile each kernel for each target; raises on the first failure. Returns one row per build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction

    from kvrag.kernels import triton_attention

    if isinstance(triton_attention._attention_kernel, InterpretedFunction):
        raise RuntimeError("Triton is in interpreter mode (TRITON_INTERPRET=1): unset it to compile for a GPU")
    rows = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for dtype in dtypes:
            for d in head_dims:
                for label, kernel, types, consts in _specs(dtype, d):
                    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
                    t0 = time.perf_counter()
                    compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=target)
                    smem = int(compiled.metadata.shared)
                    limit = _SMEM_LIMIT.get(arch)
                    if limit is not None and smem > limit:
                        raise RuntimeError(
                            f"{label} ({dtype}, head dim {d}) needs {smem} B of shared memory > {limit} B on sm_{arch}"
                        )
                    row = dict(
                        arch=arch,
                        dtype=str(dtype).replace("torch.", ""),
                        head_dim=d,
                        kernel=label,
                        shared_bytes=smem,
                        seconds=time.perf_counter() - t0,
                    )
                    rows.append(row)
                    print(
                        f"  sm_{arch} {row['dtype']:<9} D={d:<4} {label:<28} ok  shared {smem:>6} B  "
                        f"({row['seconds']:.1f} s)",
                        file=out,
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels_compile_check", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80], help="CUDA compute capabilities, e.g. 75 80 90")
    p.add_argument("--dtype", nargs="+", default=["float16"], choices=["float16", "bfloat16", "float32"])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("compile_check: triton is not installed", file=sys.stderr)
        return 2
    rows = compile_all(args.arch, [getattr(torch, d) for d in args.dtype], args.head_dim)
    print(f"{len(rows)} kernel builds compiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
