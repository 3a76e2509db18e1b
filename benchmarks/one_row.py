"""How fast is one decode row's attention, by method, as a decode step calls it?

    python -m benchmarks.one_row                              # this machine's CPU, bf16, SmolLM2 shapes
    python -m benchmarks.one_row --device cuda --keys 1024 4096

A decode step attends one query row [H, 1, D] over a sequence's keys [Hkv, S, D], once per layer,
and the key count grows by one every step. Each method runs ``--calls`` such calls with S, S+1,
S+2, ... keys (so a per-shape plan or compile shows), and the table gives, per call:

- ``wall``: the calls' wall time, the device synchronised at the end only (what a decode step pays
  when its launches overlap the device's work);
- ``host``: the wall time of the launches alone, the device not waited for (on a CPU it is the work).

Methods: ``sdpa`` (PyTorch's fused attention, its own backend choice, ``enable_gqa``), ``sdpa:NAME``
(one backend pinned with ``torch.nn.attention.sdpa_kernel``; skipped where it refuses the call),
``products`` (two matmuls and a softmax in the inputs' dtype, each KV head's queries as one block),
``products32`` (the same in float32, the inputs converted: kvrag's decode path before its ``folded``),
``folded`` (each KV head's queries as query rows of one fused call: kvrag's decode path where its row
kernel is not built), ``kernel`` (kvrag's C++ row kernel, :mod:`kvrag.kernels.row_attention_cpu`: a
bfloat16 row on a CPU; skipped elsewhere). The error of each against a float64 reference is printed
beside its time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvrag.kernels.reference import one_row
from kvrag.kernels.row_attention_cpu import row_kernel

__all__ = ["main", "METHODS"]


def _products(q, k, v, scale, dtype):
    heads, kv_heads, d = q.shape[0], k.shape[0], q.shape[-1]
    scores = torch.matmul(q.to(dtype).reshape(kv_heads, heads // kv_heads, d), k.to(dtype).transpose(1, 2))
    weights = torch.softmax(scores.mul_(scale), dim=-1)
    return torch.matmul(weights, v.to(dtype)).view(heads, 1, d).to(q.dtype)


def _sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=q.shape[0] != k.shape[0])[
        0
    ]


def _sdpa_expanded(q, k, v, scale):
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0]


METHODS = {
    "sdpa": _sdpa,
    "sdpa-expanded": _sdpa_expanded,
    "sdpa-contiguous": lambda q, k, v, s: _sdpa(q.contiguous(), k, v, s),
    "products": lambda q, k, v, s: _products(q, k, v, s, q.dtype),
    "products32": lambda q, k, v, s: _products(q, k, v, s, torch.float32),
    "folded": lambda q, k, v, s: one_row(q, k, v, s),
}
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, q, k, v, scale, start: int, calls: int, device) -> tuple[float, float]:
    """(wall per call, host per call) in seconds over keys start, start+1, ..."""
    fn(q, k[:, :start], v[:, :start], scale)  # warm-up at the first shape
    _sync(device)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(q, k[:, : start + i], v[:, : start + i], scale)
    host = time.perf_counter() - t0
    _sync(device)
    wall = time.perf_counter() - t0
    return wall / calls, host / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.one_row", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--keys", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--calls", type=int, default=200, help="calls per method and key count (keys grow by one)")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per method; the median is shown")
    p.add_argument(
        "--step-rows",
        type=int,
        default=1,
        help="the row is one of a step's N rows (a strided view, as a decode step with drafts passes it)",
    )
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"one-row attention on {args.device} ({where}), {args.dtype}, torch {torch.__version__}, "
        f"{args.heads}/{args.kv_heads} heads, dim {args.head_dim}; {args.calls} calls, keys growing by one; "
        f"the row one of {args.step_rows}",
        flush=True,
    )
    methods = dict(METHODS)
    kernel, why = row_kernel() if device.type == "cpu" and dtype == torch.bfloat16 else (None, "not a bf16 CPU row")
    if kernel is not None:
        methods["kernel"] = kernel.attend
    else:
        print(f"kvrag's row kernel: not run ({why})", flush=True)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name in BACKENDS:
            backend = getattr(SDPBackend, name, None)
            if backend is None:
                continue

            def pinned(q, k, v, s, backend=backend):
                with sdpa_kernel(backend):
                    return _sdpa(q, k, v, s)

            methods[f"sdpa:{name.split('_')[0].lower()}"] = pinned
    print(f"{'keys':>6} {'method':<16} {'wall us/call':>12} {'host us/call':>12} {'max err':>9}", flush=True)
    torch.manual_seed(0)
    for keys in args.keys:
        total = keys + args.calls
        q = torch.randn(args.heads, args.step_rows, args.head_dim, device=device, dtype=dtype)[:, -1:]
        k = torch.randn(args.kv_heads, total, args.head_dim, device=device, dtype=dtype)
        v = torch.randn(args.kv_heads, total, args.head_dim, device=device, dtype=dtype)
        scale = args.head_dim**-0.5
        ref = _products(q.double(), k[:, :keys].double(), v[:, :keys].double(), scale, torch.float64)
        for name, fn in methods.items():
            try:
                err = (fn(q, k[:, :keys], v[:, :keys], scale).double() - ref).abs().max().item()
                runs = [_time(fn, q, k, v, scale, keys, args.calls, device) for _ in range(args.repeat)]
            except RuntimeError as e:  # a pinned backend that does not take this call
                print(f"{keys:>6} {name:<16} {'refused':>12} {str(e).splitlines()[0][:60]}", flush=True)
                continue
            wall = statistics.median(r[0] for r in runs) * 1e6
            host = statistics.median(r[1] for r in runs) * 1e6
            print(f"{keys:>6} {name:<16} {wall:>12.1f} {host:>12.1f} {err:>9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
