"""``python -m benchmarks calibrate``: the per-model constants of ``recompute_ratio="auto"``, measured on dev questions.

``auto`` recomputes, with a measuring selection (``probe``, ``focus``), every probed block whose KV
deviation reaches a threshold; with ``craft``, ``alpha * CFO`` of each chunk. Both constants have a
scale of their own per model. They are set so that in the favourable case — each question's
passages warmed together, in retrieval order, and asked in another order (the benchmark's
workload a) — ``auto`` recomputes ``--target`` of the cached tokens, as the fixed default did;
where the chunks were computed in foreign company it then measures larger deviations (and fix
overheads) and spends more, up to ``auto_max_ratio``. The result is written for this model's
fingerprint (:mod:`kvrag.engine.reuse.calibration`) and printed.

    python -m benchmarks calibrate --dataset ../shared/data/musique_dev.json --n 20 --top-k 6
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

__all__ = ["main", "threshold_for", "alpha_for"]


def threshold_for(sizes: torch.Tensor, deviation: torch.Tensor, target: float) -> float:
    """The deviation at which blocks above it (largest first) hold ``target`` of all tokens."""
    order = torch.argsort(deviation, descending=True)
    covered = torch.cumsum(sizes[order].float(), 0) / float(sizes.sum())
    at = int(torch.searchsorted(covered, torch.tensor(target)).clamp(max=len(order) - 1))
    return float(deviation[order][at])


def alpha_for(chunks: list[tuple[int, float]], target: float) -> float:
    """Cache-Craft's alpha: ``sum(min(size, alpha * fix * size)) = target * sum(size)`` (bisection)."""
    total = sum(s for s, _ in chunks)

    def spent(alpha: float) -> float:
        return sum(min(s, alpha * f * s) for s, f in chunks) / total

    lo, hi = 0.0, 1.0
    while spent(hi) < target and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) < target else (lo, mid)
    return hi


def main(argv: list[str] | None = None) -> int:
    from benchmarks.data import PromptFormat, load_dataset
    from benchmarks.workloads import warm_in_dataset_order
    from kvrag import Engine
    from kvrag.engine.model.sampling import SamplingParams
    from kvrag.engine.reuse import calibration

    p = argparse.ArgumentParser(prog="python -m benchmarks calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--n", type=int, default=20, help="dev questions (the first N)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument(
        "--target", type=float, default=0.15, help="share of cached tokens auto recomputes in the favourable case"
    )
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0, help="passage orders (as the benchmark's)")
    a = p.parse_args(argv)

    engine = Engine.from_pretrained(a.model)
    fmt = PromptFormat(engine.tokenizer)
    rng = random.Random(a.seed)
    sizes, deviations, chunks = [], [], []
    t0 = time.perf_counter()
    for item in load_dataset(a.dataset, a.n)[: a.n]:
        order = list(range(min(a.top_k, len(item.passages))))
        rng.shuffle(order)
        req = fmt.request(item, order, workload="calibrate", request=item.index)
        warm_in_dataset_order(engine, item, order)
        request = engine._request(
            chunks=req.chunks,
            prefix=req.prefix,
            suffix=req.suffix,
            sampling=SamplingParams(max_new_tokens=0),
            mode="blend",
            recompute_ratio=a.target,
            selection="probe",
        )
        n = int(request.ids.shape[0])  # the prefill runs on the engine thread, as requests do
        plan, res = engine._run_internal(lambda pause, r=request, n=n: engine._prefill(r, capacity=n, pause=pause), n)
        sizes.append(res.measured["block_sizes"])
        deviations.append(res.measured["block_deviation"])
        chunks += [(u.length, u.fix) for u in plan.chunks if u.source == "store" and u.fix is not None]
        print(f"  question {item.index}: {len(sizes[-1])} blocks, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        engine.store.clear()
    threshold = threshold_for(torch.cat(sizes), torch.cat(deviations), a.target)
    alpha = alpha_for(chunks, a.target)
    cfg = engine.config
    probe = engine.calibration_key
    facts = {"alpha": alpha, "target": a.target, "questions": a.n, "top_k": a.top_k, "model": engine.model_name}
    path = calibration.save(cfg.resolved_cache_dir(), engine.fingerprint, probe, threshold, facts)
    print(f"{engine.model_name} ({probe}): threshold {threshold:.6g}, alpha {alpha:.4g} -> {path}")
    print(f"fingerprint {engine.fingerprint}")
    return 0
