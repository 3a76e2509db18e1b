"""The kvrag benchmark harness: TTFT against answer fidelity, per method, paired within one run.

Run it with ``python -m benchmarks`` from a clone (the package is not in the wheel); from code::

    from benchmarks import BenchOptions, run_bench
    res = run_bench(BenchOptions(dataset="qa.json", n=20, top_k=6, out="bench-out"))
"""

from benchmarks.data import PromptFormat, QAItem, Request, load_dataset, make_synthetic_dataset
from benchmarks.methods import Method, Outcome, available_methods, parse_methods, register_method
from benchmarks.metrics import MixedRunsError, best_f1, f1_score, first_word_agreement, paired_ratios, rouge_l
from benchmarks.report import compare_table, load_results, merge_results
from benchmarks.run import WORKLOADS, BenchOptions, run_bench

__all__ = [
    "BenchOptions",
    "run_bench",
    "Method",
    "Outcome",
    "register_method",
    "available_methods",
    "parse_methods",
    "WORKLOADS",
    "PromptFormat",
    "QAItem",
    "Request",
    "load_dataset",
    "make_synthetic_dataset",
    "f1_score",
    "best_f1",
    "rouge_l",
    "first_word_agreement",
    "paired_ratios",
    "MixedRunsError",
    "load_results",
    "merge_results",
    "compare_table",
]
