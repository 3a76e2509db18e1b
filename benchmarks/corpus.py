"""Workload (r)'s traffic: a retrieval corpus, and questions that come back reworded.

- :class:`Corpus`: every passage of the first N questions, pooled once each, embedded and put in a
  faiss inner-product index over unit vectors (exact search); a question's passages are its top-k
  there, best first. Embeddings: the bundled all-MiniLM-L6-v2 (``minilm``, what the examples and
  the integrations' acceptance use) or a hashed bag of words (``lexical``: no model, for quick
  runs and tests).
- :func:`question_stream`: the N questions asked once each in dataset order and, in between,
  repeats: each question comes back later in the stream, reworded by one of :data:`REWORDINGS`,
  as often as a Zipf popularity over the questions (seeded) says. A reworded question retrieves
  through its own embedding, so its passages come back in another order or with others; and
  since questions share passages in a pooled corpus, a passage meets other company in other
  questions' prompts too.

The integrations' acceptance (``benchmarks/acceptance/rag.py``) runs the same stream through
LangChain and LlamaIndex chains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.data import QAItem
from kvrag.errors import InvalidRequestError

__all__ = ["REWORDINGS", "EMBEDDERS", "Ask", "reword", "question_stream", "make_embedder", "Corpus", "corpus_order"]

#: How a question is asked again: a lead-in or a tail around the question's own words.
REWORDINGS = (
    "Quick question: {q}",
    "I was wondering: {q}",
    "Can you help me with this one? {q}",
    "{q} I need it for a quiz.",
    "Sorry to ask again. {q}",
)
#: Embedders of :func:`make_embedder`.
EMBEDDERS = ("minilm", "lexical")
#: Orders in which ``--store corpus`` warms the pool (:func:`corpus_order`).
CORPUS_ORDERS = ("similar", "shuffled", "dataset")

#: Texts -> [n, d] float32 unit vectors.
Embedder = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True, slots=True)
class Ask:
    """One request of the stream.

    Attributes:
        position: place in the stream (0-based).
        question: index of the question among the dataset's first N.
        occurrence: 0 for its first ask, 1, 2, ... for the times it comes back.
        wording: index into :data:`REWORDINGS`, or -1 for the dataset's own words.
        text: the question as asked (what is embedded and what the prompt carries).
    """

    position: int
    question: int
    occurrence: int
    wording: int
    text: str


def reword(question: str, wording: int) -> str:
    """The question in wording ``wording`` (-1: as it is)."""
    return question if wording < 0 else REWORDINGS[wording % len(REWORDINGS)].format(q=question)


def question_stream(items: list[QAItem], n_requests: int, zipf_s: float, seed: int) -> list[Ask]:
    """The stream of asks: first asks in dataset order, repeats placed after their first ask.

    ``n_requests - len(items)`` repeats; repeat ``i`` asks question ``q`` drawn with weight
    ``1 / rank(q) ** zipf_s`` (ranks a seeded permutation of the questions) and goes to a random
    place after ``q``'s first ask. Its ``k``-th return uses wording ``(q + k - 1) % len(REWORDINGS)``,
    so a question comes back in several wordings and the wordings spread over the questions.
    With fewer requests than questions, the first ``n_requests`` questions are asked once each.
    """
    if n_requests < 1:
        raise InvalidRequestError("the stream needs at least one request")
    n = len(items)
    rng = np.random.default_rng(seed)
    rank = rng.permutation(n)
    weights = 1.0 / np.power(rank + 1.0, zipf_s)
    repeats = rng.choice(n, size=max(0, n_requests - n), p=weights / weights.sum()).tolist()
    order = list(range(min(n, n_requests)))  # question per place
    for q in repeats:
        first = order.index(q)
        order.insert(int(rng.integers(first + 1, len(order) + 1)), q)
    seen: dict[int, int] = {}
    asks = []
    for pos, q in enumerate(order):
        k = seen.get(q, 0)
        seen[q] = k + 1
        wording = -1 if k == 0 else (q + k - 1) % len(REWORDINGS)
        asks.append(Ask(pos, q, k, wording, reword(items[q].question, wording)))
    return asks


def make_embedder(name: str) -> Embedder:
    """An embedder by name (:data:`EMBEDDERS`); unit vectors, so inner product is cosine."""
    if name == "minilm":
        from kvrag.integrations.minilm import load_minilm

        model = load_minilm()
        return lambda texts: model.encode(
            list(texts), batch_size=32, normalize_embeddings=True, convert_to_numpy=True
        ).astype(np.float32)
    if name == "lexical":
        from sklearn.feature_extraction.text import HashingVectorizer

        vectorizer = HashingVectorizer(n_features=2**12, alternate_sign=False, norm="l2", stop_words="english")
        return lambda texts: vectorizer.transform(list(texts)).toarray().astype(np.float32)
    raise InvalidRequestError(f"unknown embedder {name!r}; use one of {', '.join(EMBEDDERS)}")


class Corpus:
    """The pooled passages of some questions in a faiss index (exact inner product).

    Args:
        items: the questions whose passages are pooled (each distinct passage once, in dataset order).
        embed: texts -> unit vectors.

    Attributes:
        passages: the pooled chunk texts (as the benchmark puts them in prompts).
        owner: per passage, the first question that lists it.
        vectors: [P, d] their embeddings.
    """

    def __init__(self, items: list[QAItem], embed: Embedder) -> None:
        import faiss

        seen: dict[str, int] = {}
        self.passages: list[str] = []
        self.owner: list[int] = []
        for i, item in enumerate(items):
            for text in item.passages:
                if text not in seen:
                    seen[text] = len(self.passages)
                    self.passages.append(text)
                    self.owner.append(i)
        if not self.passages:
            raise InvalidRequestError("the corpus has no passages")
        self.embed = embed
        self.vectors = np.ascontiguousarray(embed([p.strip() for p in self.passages]), dtype=np.float32)
        self.index = faiss.IndexFlatIP(self.vectors.shape[1])
        self.index.add(self.vectors)

    def search(self, queries: list[str], k: int) -> list[list[int]]:
        """Per query, the ids of its ``k`` nearest passages, best first."""
        if not 1 <= k <= len(self.passages):
            raise InvalidRequestError(f"top-k must be in [1, {len(self.passages)}] (the corpus), got {k}")
        q = np.ascontiguousarray(self.embed(list(queries)), dtype=np.float32)
        _, ids = self.index.search(q, k)
        return [[int(i) for i in row] for row in ids]


def corpus_order(corpus: Corpus, order: str, seed: int) -> tuple[list[str], dict]:
    """The pool as ``--store corpus`` warms it, and the keywords of that ``Engine.warm`` call.

    ``similar`` (kvrag's own way): the pool in a seeded shuffle, given to
    ``warm(order="similar", embeddings=...)`` with the retriever's own vectors, which computes each
    passage behind the ones most like it (the company it will keep in prompts). ``shuffled``: the
    seeded shuffle as it is (among passages of unrelated questions). ``dataset``: each question's
    passages together (every chunk computed among its own question's passages, the favourable case).
    """
    if order not in CORPUS_ORDERS:
        raise InvalidRequestError(f"corpus order must be one of {CORPUS_ORDERS}, got {order!r}")
    rows = list(range(len(corpus.passages)))
    if order != "dataset":
        rows = [int(i) for i in np.random.default_rng(seed).permutation(len(rows))]
    texts = [corpus.passages[i] for i in rows]
    if order == "similar":
        return texts, {"order": "similar", "embeddings": corpus.vectors[rows]}
    return texts, {}
