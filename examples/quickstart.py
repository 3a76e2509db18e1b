"""kvrag in one screen: the same RAG questions answered with a full prefill and with cached chunk KV.

Runs on the bundled SmolLM2-135M-Instruct, offline. Documents are in examples/data/handbook.json.

    python examples/quickstart.py [--questions N] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvrag import Engine  # noqa: E402

HERE = Path(__file__).parent
QUESTIONS = [
    "When does the ferry leave Port Alder on Sundays?",
    "Who built the lighthouse at Gull Point?",
    "How long is Alder Blue cheese aged?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=len(QUESTIONS), help=f"questions asked (at most {len(QUESTIONS)})")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args()

    docs = json.loads((HERE / "data" / "handbook.json").read_text())
    chunks = [f"{d['title']}\n{d['text']}\n\n" for d in docs]
    print("Loading the bundled model (the first run converts it once, ~30 s)...")
    engine = Engine.from_pretrained()
    template = engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer the question from the documents, in one sentence."},
            {"role": "user", "content": "@@"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    head, tail = template.split("@@")
    warm = engine.warm(chunks)
    print(f"Warmed {warm.computed} chunks ({warm.tokens} tokens) in {warm.seconds:.1f} s\n")
    rng = random.Random(0)
    for question in QUESTIONS[: args.questions]:
        order = chunks[:]
        rng.shuffle(order)  # retrieved documents come back in any order
        suffix = f"Question: {question}{tail}"
        full = engine.generate(order, head, suffix, mode="full", max_new_tokens=args.max_new_tokens)
        blend = engine.generate(order, head, suffix, mode="blend", max_new_tokens=args.max_new_tokens)
        print(f"Q: {question}")
        print(f"  full prefill  TTFT {full.ttft_s:6.3f} s : {full.text.strip()}")
        print(f"  kvrag blend   TTFT {blend.ttft_s:6.3f} s : {blend.text.strip()}")
        s = blend.stats
        print(
            f"  {s.chunk_hits}/{s.chunk_hits + s.chunk_misses} chunks reused, {s.cached_tokens}/{s.prompt_tokens} "
            f"prompt tokens from cache, {s.recomputed_tokens} recomputed; "
            f"TTFT {full.ttft_s / blend.ttft_s:.1f}x faster\n"
        )
    engine.close()


if __name__ == "__main__":
    main()
