"""``python -m benchmarks calibrate``: measure a model's constants of ``recompute_ratio="auto"`` on dev questions.

    python -m benchmarks calibrate --dataset ../shared/data/musique_dev.json --n 20 --top-k 6 [--model M]

``auto`` can recompute every probed block whose KV deviation reaches a per-model threshold (with
``craft``: ``alpha * CFO`` of each chunk); without one (the default) it recomputes a fixed share.
On KV computed in another context it recomputes a share of each such chunk set by ``quality``;
``--what qualities`` measures that share per quality for this model
(:func:`benchmarks.calibration.calibrate_qualities`). ``--what both`` (default) runs the two.
The command reads a QA file in the dev-set shape (a JSON list of ``{"question", "answers",
"ctxs": [{"title", "text"}]}``), builds each of the first ``--n`` questions' prompt as the benchmark
does (its first ``--top-k`` passages as chunks, in a seeded shuffled order, inside the model's chat
template), and prints the settings that would use what it measured (``auto_threshold=...``,
``other_context_ratio=...``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.data import read_dataset_list
from kvrag.errors import InvalidRequestError, KvragError

__all__ = [
    "main",
    "parser",
    "DevQuestion",
    "read_questions",
    "prompt_parts",
    "calibration_questions",
]

#: The benchmark's prompt (``benchmarks.data``): a calibration measures the prompts it is judged on.
SYSTEM = "You are a careful assistant that answers questions from the given passages."
INSTRUCTIONS = (
    "Read the passages below and answer the question that follows them. Give only the answer, without any other words."
)
ANSWER_HINT = "Answer within 5 words."
_DOCS, _QUESTION = "\x00KVRAG-DOCS\x00", "\x01"


@dataclass(frozen=True, slots=True)
class DevQuestion:
    """One question of a QA file: its text and its passages as chunk texts, in retrieval order."""

    question: str
    passages: list[str]


def _passage(ctx: dict) -> str:
    """A passage as a chunk: title line, text, blank line (nothing position-dependent)."""
    title = str(ctx.get("title") or "").strip()
    text = str(ctx.get("text") or "").strip()
    return f"{title}\n{text}\n\n" if title else f"{text}\n\n"


def read_questions(path: str | Path, n: int) -> list[DevQuestion]:
    """The first ``n`` questions of a QA file (answers are not needed, nor read).

    Raises:
        InvalidRequestError: the file is missing, not JSON, not a list of questions with passages,
            or holds fewer than ``n``.
    """
    path = Path(path)
    data = read_dataset_list(path)
    if len(data) < n:
        raise InvalidRequestError(f"dataset {path} has {len(data)} questions, {n} were asked for")
    out = []
    for i, row in enumerate(data[:n]):
        where = f"dataset {path}, item {i}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise InvalidRequestError(f"{where}: needs a non-empty 'question' string")
        ctxs = row.get("ctxs")
        if not isinstance(ctxs, list) or not ctxs or not all(isinstance(c, dict) for c in ctxs):
            raise InvalidRequestError(f"{where}: 'ctxs' must be a non-empty list of {{'title', 'text'}} objects")
        out.append(DevQuestion(row["question"].strip(), [_passage(c) for c in ctxs]))
    return out


def prompt_parts(
    tokenizer, system: str = SYSTEM, instructions: str = INSTRUCTIONS, answer_hint: str = ANSWER_HINT
) -> tuple[str, str, str]:
    """``(head, question head, tail)``: a prompt is ``head + passages + question head + question + tail``.

    Inside the tokenizer's chat template (a template without a system role gets the system prompt
    in the user turn); a tokenizer without one (a base model) gets a completion prompt ending in
    ``Answer:``. Markers rendered through the template find where the passages and question go.

    Raises:
        InvalidRequestError: the template altered the markers, so the passages cannot be placed.
    """
    user = f"{instructions}\n\n{_DOCS}Question: {_QUESTION}\n{answer_hint}".rstrip("\n")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None) is None:
        rendered = "".join(f"{m['content']}\n\n" for m in messages) + "Answer:"
    else:
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates without a system role
            if not system:
                raise
            merged = [{"role": "user", "content": f"{system}\n\n{user}"}]
            rendered = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    if rendered.count(_DOCS) != 1 or rendered.count(_QUESTION) != 1:
        raise InvalidRequestError("the chat template altered the prompt layout; cannot place passages")
    head, rest = rendered.split(_DOCS)
    question_head, tail = rest.split(_QUESTION)
    return head, question_head, tail


def calibration_questions(items: list[DevQuestion], tokenizer, *, top_k: int, seed: int) -> list:
    """Each question's first ``top_k`` passages, asked in a shuffled order (the benchmark's, by ``seed``)."""
    from benchmarks.calibration import CalibrationQuestion

    head, question_head, tail = prompt_parts(tokenizer)
    rng = random.Random(seed)
    out = []
    for item in items:
        order = list(range(min(top_k, len(item.passages))))
        rng.shuffle(order)
        out.append(
            CalibrationQuestion(
                chunks=[item.passages[i] for i in order],
                retrieved=item.passages[: len(order)],
                prefix=head,
                suffix=f"{question_head}{item.question}{tail}",
            )
        )
    return out


def parser(prog: str = "python -m benchmarks calibrate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Measure the model's constants of recompute_ratio='auto' on dev questions and print the "
        "settings that would use them.",
    )
    p.add_argument("--dataset", required=True, help="QA JSON: [{question, answers, ctxs: [{title, text}]}]")
    p.add_argument("--n", type=int, default=20, help="dev questions (the first N)")
    p.add_argument("--top-k", type=int, default=6, help="passages per question")
    p.add_argument(
        "--target", type=float, default=0.15, help="share of cached tokens auto recomputes in the favourable case"
    )
    p.add_argument(
        "--what",
        choices=("both", "threshold", "qualities"),
        default="both",
        help="the probe's threshold (own context), the share of KV from another context per quality, or both",
    )
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer tokens scored by the quality calibration")
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0, help="passage orders (as the benchmark's)")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig field of the engine calibrated for, e.g. --config dtype=bfloat16 (repeatable)",
    )
    return p


def main(argv: list[str] | None = None, *, prog: str = "python -m benchmarks calibrate") -> int:
    """Entry point of the calibration: 0 when the constants are measured, 2 on a bad argument."""
    a = parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from benchmarks.calibration import calibrate, calibrate_qualities, check_target
    from kvrag.config import EngineConfig, parse_overrides
    from kvrag.engine import Engine

    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"{prog}: question {done}/{total}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    try:  # the arguments and the dataset are checked before the model loads
        if a.n < 1 or a.top_k < 1 or a.max_new_tokens < 1:
            raise InvalidRequestError("--n, --top-k and --max-new-tokens must be >= 1")
        if a.what != "threshold" and a.n < 2:
            raise InvalidRequestError("the quality calibration needs --n 2 or more (passages of other questions)")
        check_target(a.target)
        config = EngineConfig(**parse_overrides(a.config))
        items = read_questions(a.dataset, a.n)
        with Engine.from_pretrained(a.model, config=config) as engine:
            questions = calibration_questions(items, engine.tokenizer, top_k=a.top_k, seed=a.seed)
            if a.what in ("both", "threshold"):
                res = calibrate(engine, questions, target=a.target, progress=progress)
                print(f"{engine.model_name} ({res.probe}): threshold {res.threshold:.6g}, alpha {res.alpha:.4g}")
                print(
                    f"  to use them: auto_threshold={res.threshold:.6g} (craft: selection_params.alpha={res.alpha:.4g})"
                )
            if a.what in ("both", "qualities"):
                got = calibrate_qualities(engine, questions, max_new_tokens=a.max_new_tokens, progress=progress)
                drifts = ", ".join(f"{s:g}: {d:.3f}" for s, d in got.drifts.items())
                print(f"{engine.model_name} ({got.selection} on KV from another context): drift {drifts}")
                print(f"  probe@15%: {got.reference:.3f}")
                if not got.switch:
                    print(f"  {got.selection} needs more than the probe's 15% for the probe's drift: leave KV")
                    print("  from another context to the probe on this model: other_context_selection=null")
                for quality in got.reached:
                    if quality in got.shares:
                        print(f"  {quality}: {got.shares[quality]:.0%} of each chunk from another context")
                    elif got.switch:
                        print(f"  {quality}: no share tried reaches its target; the built-in share stays")
                if "balanced" in got.shares:
                    print(f"  to use it: other_context_ratio={got.shares['balanced']:.2f}")
            print(f"fingerprint {engine.fingerprint}")
    except KvragError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0
