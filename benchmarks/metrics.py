"""Answer-quality metrics and timing statistics of the benchmark.

F1 and exact match use the SQuAD/LongBench normalisation (lower case, no punctuation, no articles,
single spaces). ROUGE-L is the LCS F-measure of Google's ``rouge-score`` package. Timing summaries
are medians and 90th percentiles; ratios are *paired*: a method's value divided by the baseline's
value measured on the same request in the same run, and only then summarised.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "normalize_answer",
    "f1_score",
    "best_f1",
    "rouge_l",
    "best_rouge_l",
    "first_word",
    "first_word_agreement",
    "summarize",
    "percentile",
    "paired_ratios",
    "fp32_full",
    "FP32_FULL",
    "MixedRunsError",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_scorer = None


class MixedRunsError(ValueError):
    """Raised when results of different runs would be combined into one ratio."""


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token-overlap F1 of two normalised answers (SQuAD / LongBench ``qa_f1_score``)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, golds: Iterable[str]) -> float:
    """F1 against the best-matching gold answer (datasets list aliases)."""
    return max((f1_score(prediction, g) for g in golds), default=0.0)


def _rouge():
    global _scorer
    if _scorer is None:
        from rouge_score import rouge_scorer, tokenizers  # pure Python; its nltk stemmer is not used

        _scorer = (rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False), tokenizers.DefaultTokenizer())
    return _scorer


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (``rouge-score``). Two texts without any word are identical: 1.0."""
    scorer, tokenizer = _rouge()
    score = scorer.score(reference, prediction)["rougeL"].fmeasure
    if score == 0.0 and not tokenizer.tokenize(prediction) and not tokenizer.tokenize(reference):
        return 1.0
    return float(score)


def best_rouge_l(prediction: str, golds: Iterable[str]) -> float:
    return max((rouge_l(prediction, g) for g in golds), default=0.0)


def drift(got: Sequence[float], ref: Sequence[float]) -> float:
    """Answer drift: mean |Δ log p| per token of the full prefill's answer, teacher-forced, against
    the full prefill's own log-probabilities (the benchmarks' fidelity measure too).

    More sensitive than ROUGE-L: two methods whose greedy answers read the same can still differ
    in how sure they are of every token, and one flipped token no longer hides the rest.
    """
    if len(got) != len(ref) or not ref:
        raise ValueError("log-probabilities of different continuations")
    return sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)


def first_word(text: str) -> str:
    """The first normalised word of a text ('' if it has none)."""
    words = normalize_answer(text).split()
    return words[0] if words else ""


def first_word_agreement(a: str, b: str) -> bool:
    """Do two answers start with the same (normalised) word?"""
    return first_word(a) == first_word(b)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, numpy's default); None if there are no values."""
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def summarize(values: Iterable[float | None]) -> dict:
    """n, mean, median, p10, p90, min, max of the non-missing values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"n": 0, "mean": None, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    return {
        "n": len(vals),
        "mean": float(np.mean(vals)),
        "median": float(np.median(vals)),
        "p10": percentile(vals, 10),
        "p90": percentile(vals, 90),
        "min": min(vals),
        "max": max(vals),
    }


def paired_ratios(records: Sequence[dict], method: str, baseline: str, field: str = "ttft_s") -> list[float]:
    """Per-request ratios ``method / baseline`` of ``field``, paired within one run.

    Records are paired on (run_id, workload, request, repeat): a value is only ever divided by the
    baseline's value measured on the same request in the same run. Records of several runs may be
    given (merged results); they never pair with each other.

    Raises:
        MixedRunsError: a record lacks a ``run_id`` (it could not be paired safely).
    """
    base: dict[tuple, float] = {}
    for r in records:
        if "run_id" not in r:
            raise MixedRunsError("a result record has no run_id; refusing to pair it with anything")
        if r["method"] == baseline and r.get(field) is not None:
            base[_pair_key(r)] = r[field]
    out = []
    for r in records:
        if r["method"] != method or r.get(field) is None:
            continue
        b = base.get(_pair_key(r))
        if b:
            out.append(r[field] / b)
    return out


#: Methods that are the float32 full prefill of a run, the reference of "× fp32 full": ``full``
#: itself in a float32 run, else ``full+dtype=float32`` run beside it.
FP32_FULL = ("full", "full+dtype=float32")


def fp32_full(records: Sequence[dict]) -> str | None:
    """The method of ``records`` that is a float32 full prefill (:data:`FP32_FULL`, by the ``dtype``
    its records carry), or None (no such method, or records from before the dtype was recorded)."""
    for name in FP32_FULL:
        if {r.get("dtype") for r in records if r["method"] == name} == {"float32"}:
            return name
    return None


def _pair_key(r: dict) -> tuple:
    return (r["run_id"], r.get("workload"), r.get("request"), r.get("repeat", 0))
