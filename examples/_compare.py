"""How the RAG examples pick their two questions and compare kvrag's answers with the full prefill's.

Plain Python and ``rouge-score`` (``pip install rouge-score``): copy it beside an example.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import combinations

from rouge_score import rouge_scorer

_SCORER = rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure of two answers (how alike they read; 1.0 is the same words in the same order)."""
    return _SCORER.score(reference, prediction)["rougeL"].fmeasure


def question_pair(questions: Sequence[str], tops: Sequence[Sequence[Hashable]], min_shared: int = 4):
    """Two questions whose retrieved passages overlap, in another order: the case kvrag is for (plain
    prefix caching cannot reuse passages that come back in another order).

    ``tops`` holds each question's retrieved passages (ids or texts) in retrieval order. Returns
    ``(first question, second question, passages shared)``: the pair sharing the most, the earliest
    on a tie.
    """
    pairs = []
    for (i, a), (j, b) in combinations(enumerate(tops), 2):
        shared = set(a) & set(b)
        if len(shared) >= min_shared and [x for x in a if x in shared] != [x for x in b if x in shared]:
            pairs.append((-len(shared), i, j))
    if not pairs:
        raise SystemExit(f"no two questions share {min_shared} retrieved passages in another order")
    most, i, j = min(pairs)
    return questions[i], questions[j], -most
