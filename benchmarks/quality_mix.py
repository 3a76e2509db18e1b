"""What a per-request quality dial could reach: settings mixed request by request, from a bench run.

Model-free: reads a workload (r) run's records (``results.json`` of ``python -m benchmarks ...
--workloads r``; or several runs of the same stream, each method from one of them, its TTFT × full
paired within its own run), keeps one kind of ask (first asks by default) and, per request, each
listed method's TTFT × full and answer drift. Then:

- each method alone: median (and mean) TTFT × full, mean drift;
- ``oracle``: per request the method a perfect dial would choose, to get the least mean drift while
  the median TTFT × full stays at most ``--cap``: more than half the requests run their least
  drifting method under the cap, chosen where that costs least drift, the others their least
  drifting method of all. No dial that picks among these methods, on any signal, does better;
- ``rule``: the dear method where a request's signal (``--signal``, a record field, by default
  ``blended_overlap``: Cache-Craft's beta of the blended KV) is below each threshold, the cheap
  one elsewhere: what that signal buys as a dial.

``python -m benchmarks.quality_mix OUT --methods auto+quality=fast,auto,auto+quality=faithful --cap 0.25``
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from benchmarks.metrics import summarize
from benchmarks.specs import split_specs
from kvrag.errors import InvalidRequestError

__all__ = ["requests_of", "oracle", "rule", "summary", "main"]

#: Ask kinds: an ask's occurrence 0 (a question's first ask), 1 or more (its returns), or every ask.
KINDS = {"first": lambda o: o == 0, "returns": lambda o: o >= 1, "all": lambda o: True}

Table = dict[int, dict[str, dict]]  # request position -> method -> record


def requests_of(records: list[dict], methods: list[str], kind: str = "first") -> Table:
    """Per request of ``kind``, each method's record; requests some method has no scored record of are left out."""
    if kind not in KINDS:
        raise InvalidRequestError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    table: Table = {}
    for r in records:
        if r.get("method") in methods and KINDS[kind](r.get("occurrence") or 0):
            table.setdefault(r["request"], {})[r["method"]] = r
    keep = {
        q: row
        for q, row in table.items()
        if all(m in row and row[m].get("answer_drift_full") is not None for m in methods)
    }
    if not keep:
        raise InvalidRequestError(f"no request of kind {kind!r} has a scored record of every method {methods}")
    return dict(sorted(keep.items()))


def _t(rec: dict) -> float:
    return rec["ttft_ratio_full"]


def _d(rec: dict) -> float:
    return rec["answer_drift_full"]


def oracle(table: Table, methods: list[str], cap: float) -> dict[int, str]:
    """Per request, the method of the least mean drift at a median TTFT × full of at most ``cap``.

    The objective is a sum over requests, so the choice is exact: ``n // 2 + 1`` requests (enough for
    the median) take their least drifting method under the cap, those whose loss from it is least;
    the others take their least drifting method. Raises if too few requests have a method under the cap.
    """
    best = {q: min(methods, key=lambda m: _d(row[m])) for q, row in table.items()}
    under = {}
    for q, row in table.items():
        fit = [m for m in methods if _t(row[m]) <= cap]
        if fit:
            under[q] = min(fit, key=lambda m: _d(row[m]))
    need = len(table) // 2 + 1
    if len(under) < need:
        raise InvalidRequestError(f"only {len(under)} of {len(table)} requests have a method at <= {cap}x full")
    loss = {q: _d(table[q][m]) - _d(table[q][best[q]]) for q, m in under.items()}
    cheap = set(sorted(under, key=lambda q: (loss[q], q))[:need])
    return {q: under[q] if q in cheap else best[q] for q in table}


def rule(table: Table, cheap: str, dear: str, signal: str, threshold: float) -> dict[int, str]:
    """``dear`` where the cheap method's record has ``signal`` below ``threshold`` (missing: 0), else ``cheap``."""
    return {q: dear if (row[cheap].get(signal) or 0.0) < threshold else cheap for q, row in table.items()}


def summary(table: Table, choice: dict[int, str]) -> dict:
    """Median and mean TTFT × full, mean drift, and how many requests took each method."""
    recs = [table[q][m] for q, m in choice.items()]
    ttft = summarize(_t(r) for r in recs)
    return {
        "requests": len(recs),
        "ttft_ratio_median": ttft["median"],
        "ttft_ratio_mean": ttft["mean"],
        "drift_mean": summarize(_d(r) for r in recs)["mean"],
        "methods": dict(Counter(choice.values())),
    }


def _line(name: str, s: dict) -> str:
    took = ", ".join(f"{m} {n}" for m, n in s["methods"].items())
    return f"| {name} | {s['ttft_ratio_median']:.3f} | {s['ttft_ratio_mean']:.3f} | {s['drift_mean']:.4f} | {took} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality_mix", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="+", help="bench runs' output folders (their results.json)")
    p.add_argument("--methods", required=True, help="comma-separated methods of the run, cheapest first")
    p.add_argument("--kind", default="first", choices=sorted(KINDS), help="which asks (default: first asks)")
    p.add_argument("--cap", type=float, default=0.25, help="the oracle's median TTFT × full (default 0.25)")
    p.add_argument("--signal", default="blended_overlap", help="the rule's record field (default: blended_overlap)")
    p.add_argument("--thresholds", default="0.1,0.2,0.25,0.3,0.4,0.5", help="the rule's thresholds")
    p.add_argument(
        "--cheap", help="the rule's method above the threshold (default: the second of --methods; of two, the first)"
    )
    p.add_argument("--dear", help="the rule's method below it (default: the last of --methods)")
    a = p.parse_args(argv)
    methods = split_specs(a.methods)
    if len(methods) < 2:
        p.error("--methods needs two methods at least")
    records, source = [], {}
    for out in a.out:
        for r in json.loads((out / "results.json").read_text())["records"]:
            if r.get("method") in methods and source.setdefault(r["method"], out) != out:
                p.error(f"method {r['method']} is in {source[r['method']]} and {out}: give each method from one run")
            records.append(r)
    table = requests_of(records, methods, a.kind)
    cheap, dear = a.cheap or methods[min(1, len(methods) - 2)], a.dear or methods[-1]
    print(f"{len(table)} requests ({a.kind} asks) of {', '.join(map(str, a.out))}\n")
    print("| choice | TTFT × full, median | mean | drift, mean | requests per method |\n|---|---|---|---|---|")
    for m in methods:
        print(_line(m, summary(table, {q: m for q in table})))
    print(_line(f"oracle, median ≤ {a.cap}", summary(table, oracle(table, methods, a.cap))))
    for t in (float(x) for x in a.thresholds.split(",") if x):
        print(
            _line(
                f"{dear} where {a.signal} < {t:g}, else {cheap}", summary(table, rule(table, cheap, dear, a.signal, t))
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
