"""Microbenchmark: finding registered passages in a prompt, against small and large registries.

    python -m benchmarks registry [--sizes 100 100000] [--reps 30]

Integrations register every retrieved passage; the engine then splits each prompt string at the
registered texts (:meth:`kvrag.engine.reuse.documents.DocumentFinder.split`). That split must cost what
the prompt costs, not what the registry holds (100,000 texts by default). The prompt here is a
realistic RAG prompt: ~16,000 characters (~4K tokens) of text with 6 registered ~500-character
passages inside, between unregistered passages of the same kind. For each registry size, the
registry holds that many ~500-character texts, the prompt's 6 among them; the benchmark prints the
median seconds per ``split()`` and the ratio of each size to the smallest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvrag.engine.reuse.documents import DocumentFinder

__all__ = ["make_passages", "make_prompt", "time_split", "main"]

_WORDS = (
    "river mountain castle library harbor museum garden bridge market village forest island desert "
    "valley tower palace temple school station college theatre stadium canal born founded built named "
    "located known famous first largest oldest capital city king queen author painter composer "
    "scientist engineer general mayor bishop poet the of and in to was is by for with on at from as"
).split()
PASSAGE_CHARS = 500
PROMPT_CHARS = 16_000  # ~4K tokens of English text
IN_PROMPT = 6


def make_passages(n: int, *, seed: int = 0, chars: int = PASSAGE_CHARS) -> list[str]:
    """``n`` distinct passages of about ``chars`` characters (numbered title, random words)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"Passage {seed}-{i}\n"]
        size = len(words[0])
        while size < chars:
            word = rng.choice(_WORDS)
            words.append(word)
            size += len(word) + 1
        out.append(" ".join(words))
    return out


def make_prompt(passages: list[str], filler: list[str], *, chars: int = PROMPT_CHARS) -> str:
    """A chat-style RAG prompt of about ``chars`` characters: the passages in it, spread out
    between unregistered filler passages, then a question."""
    head = "<|im_start|>system\nAnswer the question from the documents.<|im_end|>\n<|im_start|>user\n"
    tail = "\nQuestion: who founded the city?<|im_end|>\n<|im_start|>assistant\n"
    budget = chars - len(head) - len(tail) - sum(len(p) + 2 for p in passages)
    extra = []
    for text in filler:
        if budget <= 0:
            break
        extra.append(text)
        budget -= len(text) + 2
    docs = []
    step = max(1, len(extra) // max(1, len(passages)))
    for i, passage in enumerate(passages):  # a registered passage after every few filler ones
        docs += extra[i * step : (i + 1) * step] + [passage]
    docs += extra[len(passages) * step :]
    return head + "\n\n".join(docs) + tail


def time_split(registry: DocumentFinder, prompt: str, reps: int) -> float:
    """Median seconds of one ``registry.split(prompt)`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        registry.split(prompt)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks registry``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks registry", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 100_000], help="registered texts")
    ap.add_argument("--reps", type=int, default=30, help="split() calls timed per size (median)")
    args = ap.parse_args(argv)
    if min(args.sizes) < IN_PROMPT:
        ap.error(f"--sizes must be >= {IN_PROMPT} (the prompt's passages are registered)")
    t0 = time.perf_counter()
    registered = make_passages(max(args.sizes), seed=0)
    filler = make_passages(40, seed=1)  # never registered
    in_prompt = registered[:IN_PROMPT]
    prompt = make_prompt(in_prompt, filler)
    print(
        f"prompt: {len(prompt):,} characters, {IN_PROMPT} registered passages inside; "
        f"passages of ~{PASSAGE_CHARS} characters (made in {time.perf_counter() - t0:.1f} s)"
    )
    base = None
    for size in args.sizes:
        registry = DocumentFinder(max_entries=max(size, IN_PROMPT))
        registry.register(registered[IN_PROMPT:size])
        registry.register(in_prompt)
        found = [text for kind, text in registry.split(prompt) if kind == "chunk"]
        if found != in_prompt:
            raise SystemExit(f"registry of {size}: found {len(found)} passages, expected the prompt's {IN_PROMPT}")
        median = time_split(registry, prompt, args.reps)
        base = median if base is None else base
        print(f"  {size:>9,} registered: {median:.5f} s per split()   {median / base:5.2f}x the first size")
    return 0
