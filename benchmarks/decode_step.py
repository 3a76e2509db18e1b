"""``python -m benchmarks decode-step``: where one decode step after a long prompt spends its time.

    python -m benchmarks decode-step --model qwen2.5-coder-1.5b --keys 3600 --threads 1

One sequence with ``--keys`` cached positions (random K/V: the step's cost does not depend on their
values) is decoded ``--steps`` times through the engine's own decoder, then each part alone: the LM
head's product, every layer's products (Q/K/V, output, gate/up, down, each layer's own weights so
they stream from memory as in a step), and every layer's attention over the cached keys; the rest
(norms, RoPE, residuals, the KV writes, Python) is the step less those. With ``--threads 1`` times are
the thread's CPU time (``time.thread_time``), which a shared machine's time slicing does not inflate;
with more threads, wall time. Medians and minimums in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.real_models import resolve_model

__all__ = ["main", "profile_step"]


def profile_step(model: str | None, keys: int, steps: int, threads: int, settings: dict) -> dict:
    """The step's and its parts' times (ms: median, min) after ``keys`` positions; see the module note."""
    from kvrag import Engine
    from kvrag.engine.model.batch import DecodeRow
    from kvrag.engine.model.runner import KVBuffer
    from kvrag.kernels import attention

    engine = Engine.from_pretrained(model, num_threads=threads, draft_tokens=0, **settings)
    torch.set_num_threads(threads)  # this thread's pool: the parts below run here
    ad, dec = engine.adapter, engine.decoding.decoder
    weights = dec.weights
    buf = KVBuffer(ad, keys + 4 * steps + 16)
    gen = torch.Generator().manual_seed(0)
    for t in (buf.k, buf.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    buf.length = keys
    clock = time.thread_time if threads == 1 else time.perf_counter
    pos = [keys]

    def step() -> None:
        dec.step([DecodeRow(buf, 100, pos[0])])
        pos[0] += 1

    def timed(fn) -> tuple[float, float]:
        fn(), fn()
        t = []
        for _ in range(steps):
            t0 = clock()
            fn()
            t.append(clock() - t0)
        return statistics.median(t) * 1e3, min(t) * 1e3

    x = torch.randn(1, ad.hidden_size).to(ad.dtype)
    q = torch.randn(ad.n_heads, 1, ad.head_dim).to(ad.dtype)
    q_pos = torch.tensor([keys - 1])

    def products() -> None:
        for p in weights.layers:
            a = p.qkv(x)
            p.o(a[:, : ad.n_heads * ad.head_dim])
            m = p.gate_up(x)
            p.down(m[:, : m.shape[1] // 2])

    def attend() -> None:
        for layer in range(ad.n_layers):
            k, v = buf.k[layer][:, :keys], buf.v[layer][:, :keys]
            attention(q, q_pos, k, v, ad.scale, window=ad.windows[layer], span=(keys - 1, keys - 1))

    out = {"decoder": dec.description, "keys": keys, "threads": threads, "clock": clock.__name__}
    with torch.inference_mode():
        out["parts_ms"] = {
            "step": timed(step),
            "lm_head": timed(lambda: weights.lm_head(x)),
            "layer_products": timed(products),
            "attention": timed(attend),
        }
    med = {k: v[0] for k, v in out["parts_ms"].items()}
    out["rest_ms"] = med["step"] - med["lm_head"] - med["layer_products"] - med["attention"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks decode-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (fetched), a path, or bundled")
    p.add_argument("--keys", type=int, default=3600, help="cached positions before the step")
    p.add_argument(
        "--attention", default="auto", choices=("auto", "reference"),
        help="reference: decode rows through PyTorch's fused attention, not kvrag's row kernel (A/B)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="1: CPU time of the thread; more: wall time")
    p.add_argument("--settings", default="", help='EngineConfig settings as JSON, e.g. \'{"weights": "int8"}\'')
    p.add_argument(
        "--int4-kernel",
        choices=("auto", "torch"),
        default="auto",
        help="int4 decode weights: kvrag's own kernel where it builds (auto), or torch's (the A/B of issue 61)",
    )
    p.add_argument("--out", default=None, help="a directory for decode_step.json")
    a = p.parse_args(argv)
    if a.int4_kernel == "torch":  # this process only: the decoder then builds torch's int4 layout
        from kvrag.engine.model import quantized

        quantized.int4_kernel = lambda: (None, "set aside by --int4-kernel torch")
    model = resolve_model(a.model)
    from kvrag.kernels import use_backend

    with use_backend(a.attention):
        result = profile_step(model, a.keys, a.steps, a.threads, json.loads(a.settings) if a.settings else {})
    print(result["decoder"] + ("" if a.attention == "auto" else f" [set aside: --attention {a.attention}]"))
    for name, (med, low) in result["parts_ms"].items():
        print(f"{name:15s} median {med:8.2f} ms   min {low:8.2f} ms")
    print(f"{'rest':15s} median {result['rest_ms']:8.2f} ms (the step less its parts)")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "decode_step.json").write_text(json.dumps(result, indent=1))
    return 0
