"""``python -m benchmarks structured``: structured output and forced tool calls of the LangChain chat model
on a real model, per dev question.

    python -m benchmarks structured --model /path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --dataset ../shared/data/musique_dev.json --n 20 --out structured.json

Per question (its first ``--top-k`` passages, numbered): ``with_structured_output(Answer)`` (an answer and
the numbers of the passages it used; ``method="json_schema"``: decoding constrained to the schema) and
``bind_tools([search, answer], tool_choice="any")`` (a call forced by grammar). Counted: objects that
validate against ``Answer``, and tool calls whose arguments validate against the called tool's schema;
the answers' F1 against the gold answers; seconds per call. The passages are registered as documents, so
the second call reuses their KV (``tool_cache_read``). Without constrained decoding in the engine (the
constraint ignored: free text) the counts measure the model's own formatting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Annotated

from pydantic import BaseModel, Field, ValidationError

from benchmarks.data import load_dataset
from benchmarks.metrics import best_f1
from benchmarks.real_models import resolve_model

__all__ = ["main", "Answer", "run"]

SYSTEM = (
    "Answer the question from the numbered passages. Reply in JSON with the answer (a few words) and "
    "the numbers of the passages you used."
)
#: passages a dev question has (MuSiQue: 10); a passage number is at most this
MAX_PASSAGES = 10
TOOL_SYSTEM = "Use the tools: search for more passages, or give the answer with the numbers of the passages used."


# The schemas bound what they can, as a schema for a small constrained model should: the grammar then ends a
# string or a list where the schema does (unbounded, Qwen2.5-0.5B copied a whole passage into `query` and
# numbered passages past 23, both cut by the token limit: docs/journal/tools.md)
PassageNumber = Annotated[int, Field(ge=1, le=MAX_PASSAGES)]


class Answer(BaseModel):
    """An answer to the question and the passages it comes from."""

    answer: str = Field(max_length=200, description="the answer, a few words")
    passages: list[PassageNumber] = Field(max_length=MAX_PASSAGES, description="numbers of the passages used")


class search(BaseModel):  # noqa: N801 - the tool's name as the model sees it
    """Search the corpus for passages about a query."""

    query: str = Field(max_length=200, description="what to search for, a few words")


class answer(BaseModel):  # noqa: N801
    """Give the final answer and the passages it comes from."""

    text: str = Field(max_length=200, description="the answer, a few words")
    passages: list[PassageNumber] = Field(max_length=MAX_PASSAGES, description="numbers of the passages used")


TOOLS = {"search": search, "answer": answer}


def _messages(passages: list[str], question: str, system: str) -> list[tuple[str, str]]:
    numbered = "\n".join(f"[{i + 1}] {p.strip()}" for i, p in enumerate(passages))
    return [("system", system), ("human", f"{numbered}\n\nQuestion: {question}")]


def _summary(rows: list[dict]) -> dict:
    n = len(rows)
    return {
        "questions": n,
        "structured_valid": sum(r["structured_valid"] for r in rows),
        "tool_valid": sum(r["tool_valid"] for r in rows),
        "answer_f1_mean": sum(r["answer_f1"] for r in rows) / n if n else 0.0,
        "structured_s_mean": sum(r["structured_s"] for r in rows) / n if n else 0.0,
        "tool_s_mean": sum(r["tool_s"] for r in rows) / n if n else 0.0,
    }


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


def run(a: argparse.Namespace) -> dict:
    from kvrag.integrations.langchain import KVCachedLLM

    llm = KVCachedLLM(
        model=resolve_model(a.model),
        max_tokens=a.max_tokens,
        temperature=0,
        engine_config={"num_threads": a.threads} if a.threads else {},
    )
    structured = llm.with_structured_output(Answer, include_raw=True)
    tooled = llm.bind_tools(list(TOOLS.values()), tool_choice="any")
    rows = []
    for item in load_dataset(a.dataset, a.n):
        passages = item.passages[: a.top_k]
        llm.get_engine().register([p.strip() for p in passages])  # the second call reuses their KV
        t0 = time.perf_counter()
        out = structured.invoke(_messages(passages, item.question, SYSTEM))
        t1 = time.perf_counter()
        msg = tooled.invoke(_messages(passages, item.question, TOOL_SYSTEM))
        t2 = time.perf_counter()
        parsed: Answer | None = out["parsed"]
        calls, tool_error = msg.tool_calls, None
        try:
            if not calls:
                raise ValueError("no tool call")
            for call in calls:
                TOOLS[call["name"]].model_validate(call["args"])
        except (KeyError, ValueError, ValidationError) as e:
            tool_error = f"{type(e).__name__}: {e}"
        rows.append(
            {
                "question": item.question,
                "answers": item.answers,
                "structured_raw": out["raw"].content,
                "structured_valid": parsed is not None,
                "structured_error": None if parsed is not None else str(out["parsing_error"]),
                "answer_f1": best_f1(parsed.answer, item.answers) if parsed is not None else 0.0,
                "passages_cited": parsed.passages if parsed is not None else None,
                "tool_raw": msg.content,
                "tool_calls": [{"name": c["name"], "args": c["args"]} for c in calls],
                "tool_valid": tool_error is None,
                "tool_error": tool_error,
                "structured_s": t1 - t0,
                "tool_s": t2 - t1,
                "tool_cache_read": msg.usage_metadata["input_token_details"]["cache_read"],
            }
        )
        r = rows[-1]
        print(
            f"q{item.index}: structured {'ok' if r['structured_valid'] else 'INVALID'} "
            f"tool {'ok' if r['tool_valid'] else 'INVALID'} ({r['structured_s']:.1f}s, {r['tool_s']:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
        _write(a.out, {"settings": vars(a), "summary": _summary(rows), "rows": rows})  # a partial run is kept
    engine = llm.get_engine()
    result = {"settings": vars(a), "model": engine.model_name, "dtype": engine.config.dtype, "summary": _summary(rows)}
    return {**result, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf path, a model directory or a real model's name")
    p.add_argument("--dataset", required=True, help="a QA JSON file (question, answers, ctxs)")
    p.add_argument("--n", type=int, default=20, help="questions (the first n)")
    p.add_argument("--top-k", type=int, default=5, help="passages per question")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the rows and the summary here (JSON)")
    a = p.parse_args(argv)
    result = run(a)
    print(json.dumps(result["summary"], indent=1))
    _write(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
