"""CPU micro-benchmark: the kernel dispatch layer against calling the PyTorch references directly.

    python -m kvrag.kernels.bench_cpu [--reps 30]

On CPU the dispatch (:mod:`kvrag.kernels`) routes every call to the unchanged references; what it
adds is one backend check per call. This times, interleaved in one run, each kernel through the
dispatch and through the pre-Triton dispatch (a plain call of the reference), at the bundled
model's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64) and at a tiny shape where
per-call overhead dominates; it prints medians and the ratio ``before / after`` (1.0: no change).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import kvrag.kernels as K
from kvrag.kernels import reference as R

__all__ = ["main"]


# The dispatch as it was before the Triton kernels: straight calls of the references.
def _old_rope_rotate(x, cos, sin):
    return R.rope_rotate_ref(x, cos, sin)


def _old_attention(q, q_pos, k, v, scale):
    return R.attention_ref(q, q_pos, k, v, scale)


def _old_kv_deviation(k_new, k_old, v_new, v_old, what="kv"):
    return R.kv_deviation_ref(k_new, k_old, v_new, v_old, what)


def _old_topk(scores, k):
    return R.topk_ref(scores, k)


def _cases(heads: int, kv_heads: int, d: int, seq: int, ratio: float) -> list[tuple[str, Callable, Callable]]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pos = torch.arange(seq)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    k, v, x = rnd(kv_heads, seq, d), rnd(kv_heads, seq, d), rnd(heads, seq, d)
    sel = torch.sort(torch.randperm(seq, generator=g)[: max(1, int(seq * ratio))]).values
    q_sel, q_dec = rnd(heads, sel.numel(), d), rnd(heads, 1, d)
    dec = torch.tensor([seq - 1])
    kn, vn = rnd(kv_heads, sel.numel(), d), rnd(kv_heads, sel.numel(), d)
    scores = rnd(seq)
    s = d**-0.5
    return [
        ("rope_rotate", lambda: _old_rope_rotate(x, cos, sin), lambda: K.rope_rotate(x, cos, sin)),
        ("attention prefill", lambda: _old_attention(x, pos, k, v, s), lambda: K.attention(x, pos, k, v, s)),
        ("attention scattered", lambda: _old_attention(q_sel, sel, k, v, s), lambda: K.attention(q_sel, sel, k, v, s)),
        ("attention decode", lambda: _old_attention(q_dec, dec, k, v, s), lambda: K.attention(q_dec, dec, k, v, s)),
        (
            "kv_deviation",
            lambda: _old_kv_deviation(kn, k[:, sel], vn, v[:, sel]),
            lambda: K.kv_deviation(kn, k[:, sel], vn, v[:, sel]),
        ),
        ("topk", lambda: _old_topk(scores, seq // 7), lambda: K.topk(scores, seq // 7)),
    ]


def _best_ms(fn: Callable, n: int) -> float:
    """Fastest of n calls: on a shared machine, slower ones mostly measure other processes."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrag.kernels.bench_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=30, help="interleaved rounds (each round times both paths)")
    p.add_argument("--seq", type=int, default=1024, help="KV length of the model-shaped cases")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [
        (f"SmolLM2 shape, seq {args.seq}", (9, 3, 64, args.seq, 0.15)),
        ("tiny shape, seq 24", (4, 2, 16, 24, 0.25)),
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"medians of {args.reps} interleaved rounds of best-of-3"
    )
    for title, shape in shapes:
        print(title)
        ratios = []
        for name, before, after in _cases(*shape):
            before(), after()  # warm-up
            b, a = [], []
            for _ in range(args.reps):  # interleaved: drift of a shared machine hits both alike
                b.append(_best_ms(before, 3))
                a.append(_best_ms(after, 3))
            mb, ma = statistics.median(b), statistics.median(a)
            ratios.append(mb / ma)
            print(
                f"  {name:<22} before {mb:9.4f} ms   after {ma:9.4f} ms   before/after {mb / ma:5.3f}"
                f"   (dispatch {1e3 * (ma - mb):+7.2f} us)"
            )
        print(f"  geometric mean before/after: {statistics.geometric_mean(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
