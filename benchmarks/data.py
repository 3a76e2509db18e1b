"""QA datasets and the reference request built from them.

A dataset is a JSON list in the LongBench/CacheBlend shape:
``[{"question": str, "answers": [str, ...], "ctxs": [{"title": str, "text": str}, ...]}]``.
The reference request puts the system prompt and instructions in the prefix, each passage in its
own chunk (``title\\ntext\\n\\n``: nothing position-dependent, so a chunk's KV is reusable in any
order), and the question plus the chat template's tail in the suffix.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.errors import InvalidRequestError

__all__ = [
    "QAItem",
    "Request",
    "PromptFormat",
    "load_dataset",
    "passage_text",
    "make_synthetic_dataset",
    "pick_question_pair",
    "request_order",
    "DEFAULT_SYSTEM",
    "DEFAULT_INSTRUCTIONS",
    "DEFAULT_ANSWER_HINT",
]

DEFAULT_SYSTEM = "You are a careful assistant that answers questions from the given passages."
DEFAULT_INSTRUCTIONS = (
    "Read the passages below and answer the question that follows them. Give only the answer, without any other words."
)
#: CacheBlend appends this to MuSiQue/2WikiMQA prompts (their gold answers are under 5 words).
DEFAULT_ANSWER_HINT = "Answer within 5 words."
_DOCS = "\x00KVRAG-DOCS\x00"


@dataclass(slots=True)
class QAItem:
    """One question of a dataset."""

    index: int
    question: str
    answers: list[str]
    passages: list[str]  # chunk texts, in dataset order


@dataclass(slots=True)
class Request:
    """One benchmark request: the engine's prefix/chunks/suffix and what it is judged against."""

    workload: str
    request: int  # request number within the workload (the question index in workload a)
    repeat: int
    prefix: str
    chunks: list[str]
    suffix: str
    question: str
    answers: list[str]
    order: list[int] = field(default_factory=list)  # passage ids, in prompt order
    meta: dict = field(default_factory=dict)
    prompt: str | None = None  # the whole prompt as one string (chunks found by the engine's registry)


def passage_text(ctx: dict) -> str:
    """A passage as a chunk: title line, text, blank line."""
    title = str(ctx.get("title") or "").strip()
    text = str(ctx.get("text") or "").strip()
    return f"{title}\n{text}\n\n" if title else f"{text}\n\n"


def read_dataset_list(path: Path) -> list:
    """A QA file's rows: a non-empty JSON list (each row is checked by its reader).

    Raises:
        InvalidRequestError: the file is missing, not JSON, or not a non-empty list.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequestError(f"dataset not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"dataset {path} is not readable JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise InvalidRequestError(f"dataset {path} must be a non-empty JSON list of questions")
    return data


def load_dataset(path: str | Path, n: int | None = None) -> list[QAItem]:
    """Read and validate a QA file; the first ``n`` questions (all if None).

    Raises:
        InvalidRequestError: the file is missing, not JSON, or not in the expected shape.
    """
    path = Path(path)
    data = read_dataset_list(path)
    items = []
    for i, row in enumerate(data[: n if n else None]):
        where = f"dataset {path}, item {i}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise InvalidRequestError(f"{where}: needs a non-empty 'question' string")
        answers = row.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise InvalidRequestError(f"{where}: 'answers' must be a non-empty list of strings")
        ctxs = row.get("ctxs")
        if not isinstance(ctxs, list) or not ctxs or not all(isinstance(c, dict) for c in ctxs):
            raise InvalidRequestError(f"{where}: 'ctxs' must be a non-empty list of {{'title', 'text'}} objects")
        items.append(QAItem(i, row["question"].strip(), list(answers), [passage_text(c) for c in ctxs]))
    if n is not None and len(items) < n:
        raise InvalidRequestError(f"dataset {path} has {len(items)} questions, {n} were asked for")
    return items


class PromptFormat:
    """Builds the reference request inside a tokenizer's chat template, or as a completion prompt.

    A tokenizer without a chat template (a base model such as Gemma 3 270M) gets a completion
    prompt: the system prompt and instructions as plain paragraphs, the passages, then
    ``Question: ...``, the answer hint and ``Answer:``; the model continues from there until its
    end token (``<eos>``) or the token limit. :attr:`style` says which one was built.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system: system prompt ('' for none).
        instructions: text before the passages, in the user turn.
        answer_hint: text after the question ('' for none).
    """

    def __init__(
        self,
        tokenizer,
        system: str = DEFAULT_SYSTEM,
        instructions: str = DEFAULT_INSTRUCTIONS,
        answer_hint: str = DEFAULT_ANSWER_HINT,
    ) -> None:
        self.system = system
        self.instructions = instructions
        self.answer_hint = answer_hint
        user = f"{instructions}\n\n{_DOCS}Question: \x01\n{answer_hint}".rstrip("\n")
        messages = [{"role": "user", "content": user}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        #: ``chat`` (the tokenizer's chat template) or ``completion`` (no template)
        self.style = "chat" if getattr(tokenizer, "chat_template", None) is not None else "completion"
        rendered = self._render(tokenizer, messages, system)
        if rendered.count(_DOCS) != 1 or rendered.count("\x01") != 1:
            raise InvalidRequestError("the chat template altered the prompt layout; cannot place passages")
        self.head, rest = rendered.split(_DOCS)
        self.question_head, self.tail = rest.split("\x01")

    @staticmethod
    def _render(tokenizer, messages: list[dict], system: str) -> str:
        if getattr(tokenizer, "chat_template", None) is None:  # completion style (see the class)
            return "".join(f"{m['content']}\n\n" for m in messages) + "Answer:"
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates without a system role: put it in the user turn
            if not system:
                raise
            merged = [{"role": "user", "content": f"{system}\n\n{messages[-1]['content']}"}]
            return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)

    def request(self, item: QAItem, order: list[int], *, workload: str, request: int, repeat: int = 0) -> Request:
        """The request over ``item``'s passages in ``order`` (indices into ``item.passages``)."""
        return Request(
            workload=workload,
            request=request,
            repeat=repeat,
            prefix=self.head,
            chunks=[item.passages[i] for i in order],
            suffix=f"{self.question_head}{item.question}{self.tail}",
            question=item.question,
            answers=item.answers,
            order=list(order),
        )


def request_order(n_passages: int, top_k: int, shuffle: bool, rng: random.Random) -> list[int]:
    """The passages a request asks (indices into its question's passages): the first ``top_k``,
    shuffled by ``rng`` unless ``shuffle`` is False (retrieval order)."""
    order = list(range(min(top_k, n_passages)))
    if shuffle:
        rng.shuffle(order)
    return order


# -- a synthetic dataset the project generates for its tests --------------------------------------

_PLACES = [
    "Arden",
    "Belmora",
    "Corvel",
    "Dunmere",
    "Eskarth",
    "Falwick",
    "Glenhaven",
    "Harrowgate",
    "Ithmoor",
    "Jasperton",
    "Kelmarsh",
    "Lowenfold",
    "Marrowby",
    "Northcliff",
    "Oakhollow",
]
_PEOPLE = [
    "Ada Finch",
    "Bram Holt",
    "Cora Vance",
    "Dmitri Lowe",
    "Elin Marsh",
    "Felix Crane",
    "Greta Stone",
    "Hugo Pell",
    "Iris Wynn",
    "Jonas Reed",
    "Kira Sand",
    "Leon Brook",
]
_THINGS = ["library", "bridge", "observatory", "harbour", "museum", "lighthouse", "theatre", "mill"]
_FILLER = (
    "the town council met in spring and summer to discuss roads markets and schools while "
    "travellers crossed the valley on foot carrying wool grain and salt to distant fairs"
).split()


def make_synthetic_dataset(n: int = 8, passages: int = 6, words: int = 60, seed: int = 0) -> list[dict]:
    """A small QA set in the dataset shape: each question's answer is stated in one of its passages.

    Args:
        n: questions.
        passages: passages per question (one holds the answer, the rest are distractors).
        words: filler words per passage (sets the chunk length).
        seed: random seed (the output is deterministic).
    """
    rng = random.Random(seed)
    out = []
    for q in range(n):
        thing, place, person = rng.choice(_THINGS), rng.choice(_PLACES), rng.choice(_PEOPLE)
        year = rng.randint(1700, 1990)
        ctxs = []
        for p in range(passages):
            filler = " ".join(rng.choice(_FILLER) for _ in range(words))
            if p == 0:
                fact = f"The {thing} of {place} was built by {person} in {year}."
            else:
                fact = f"The {rng.choice(_THINGS)} of {rng.choice(_PLACES)} was built by {rng.choice(_PEOPLE)}."
            ctxs.append(
                {
                    "title": f"{place} {p}" if p == 0 else f"{rng.choice(_PLACES)} {q}-{p}",
                    "text": f"{fact} {filler.capitalize()}.",
                }
            )
        rng.shuffle(ctxs)
        out.append({"question": f"Who built the {thing} of {place}?", "answers": [person], "ctxs": ctxs})
    return out


def pick_question_pair(
    questions: Sequence[str], top_ids: Sequence[Sequence[Hashable]], *, min_shared: int = 4
) -> tuple[str, str, int]:
    """Two questions whose retrieved passages overlap, in another order: kvrag's case.

    The pair whose top-k lists share the most passages, counting only pairs whose shared passages
    come back in a different order (exact prefix reuse would serve the others); the earliest pair
    wins a tie. The examples and acceptance scripts ask the first question cold, the second warm.

    Args:
        questions: the questions, in dataset order.
        top_ids: per question, its retrieved passages (ids or texts) in retrieval order.
        min_shared: the fewest shared passages acceptable.

    Returns:
        (first question, second question, passages they share).

    Raises:
        InvalidRequestError: ``top_ids`` does not match ``questions``, or no pair shares
            ``min_shared`` passages in another order.
    """
    if len(top_ids) != len(questions):
        raise InvalidRequestError(f"top_ids has {len(top_ids)} lists for {len(questions)} questions")
    best: tuple[str, str, int] | None = None
    for i in range(len(questions)):
        for j in range(i + 1, len(questions)):
            shared = set(top_ids[i]) & set(top_ids[j])
            reordered = [x for x in top_ids[i] if x in shared] != [x for x in top_ids[j] if x in shared]
            if reordered and len(shared) >= min_shared and (best is None or len(shared) > best[2]):
                best = (questions[i], questions[j], len(shared))
    if best is None:
        raise InvalidRequestError(f"no pair of questions shares >= {min_shared} retrieved passages in another order")
    return best
