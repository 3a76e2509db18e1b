"""The kvrag benchmark harness: TTFT against answer fidelity, per method, paired within one run.

Run it with ``python -m kvrag.bench`` (or ``kvrag bench``); from code::

    from kvrag.bench import BenchOptions, run_bench
    res = run_bench(BenchOptions(dataset="qa.json", n=20, top_k=6, out="bench-out"))
"""

from kvrag.bench.data import PromptFormat, QAItem, Request, load_dataset, make_synthetic_dataset
from kvrag.bench.methods import Method, Outcome, available_methods, parse_methods, register_method
from kvrag.bench.metrics import MixedRunsError, best_f1, f1_score, first_word_agreement, paired_ratios, rouge_l
from kvrag.bench.report import compare_table, load_results, merge_results
from kvrag.bench.run import BenchOptions, run_bench
from kvrag.bench.workloads import WORKLOADS

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
