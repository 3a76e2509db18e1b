"""Workload (c): multi-turn RAG conversations over the engine's conversation API.

Consecutive dataset questions form conversations of ``turns`` turns. Layout is append-only (the
layout whose history the engine reuses as an exact prefix): each turn's user message carries that
turn's top-k passages (shuffled, seeded) and its question, and stays in the history with the
assistant's answer. All methods see the same prompts: the history holds ``full``'s answers, so
ratios and fidelity pair per turn. ``conv`` keeps its own previous turn's KV (prompt + its own
answer); where its answer differed from ``full``'s, reuse stops at the first differing token, so
the setting is conservative for it. Passages are registered with the engine so that the segmenter
finds them (as chunks) in the rendered prompts; the chunks of each turn are pre-warmed in dataset
order, as in workload (a).
"""

from __future__ import annotations

import random

from benchmarks.data import QAItem, Request, request_order
from benchmarks.methods import Outcome, ttft_ratios
from benchmarks.workloads import RunContext, make_record, ordered, warm_in_dataset_order
from kvrag.errors import InvalidRequestError

__all__ = ["run_conversations"]


def _messages(ctx: RunContext, history: list[dict], user: str) -> list[dict]:
    msgs = [{"role": "system", "content": ctx.fmt.system}] if ctx.fmt.system else []
    return msgs + history + [{"role": "user", "content": user}]


def run_conversations(ctx: RunContext, items: list[QAItem]) -> list[dict]:
    """Conversations of ``conv_turns`` turns; every method runs every turn before the next turn."""
    engine = ctx.engine
    methods = ordered(ctx.opt("conv_methods") or ctx.methods)
    if not any(m.name == "full" for m in methods):
        raise InvalidRequestError("the conversations workload needs 'full' among its methods")
    if ctx.fmt.style != "chat":
        raise InvalidRequestError("the conversations workload needs a model with a chat template (this one has none)")
    if any(m.exact_prefix_writer for m in methods):
        raise InvalidRequestError("'prefix' would serve the other methods' turns from its cache; not in workload c")
    turns, top_k = ctx.opt("conv_turns", 3), ctx.opt("conv_top_k", 2)
    if turns < 1 or len(items) < turns:
        raise InvalidRequestError(f"workload c needs at least {turns} questions (--conv-turns)")
    rng = random.Random(ctx.opt("seed", 0))
    convs = [items[i : i + turns] for i in range(0, len(items) - turns + 1, turns)]
    max_new = ctx.opt("conv_max_new_tokens", 24)
    n_jobs = len(convs) * turns
    out: list[dict] = []
    bar = ctx.progress(range(n_jobs), desc="(c) conversations", total=n_jobs) if ctx.progress else None
    j = 0
    for c, conv in enumerate(convs):
        history: list[dict] = []
        for t, item in enumerate(conv):
            order = request_order(len(item.passages), top_k, True, rng)
            chunks = [item.passages[i] for i in order]
            for eng in {id(e): e for e in map(ctx.engine_for, methods)}.values():
                eng.register(chunks)  # each engine finds them in the prompt (its own registry)
            warm_in_dataset_order(engine, item, order)
            hint = f"\n{ctx.fmt.answer_hint}" if ctx.fmt.answer_hint else ""
            user = f"{ctx.fmt.instructions}\n\n{''.join(chunks)}Question: {item.question}{hint}"
            prompt = engine.apply_chat_template(_messages(ctx, history, user))
            req = Request(
                "conversations",
                j,
                0,
                "",
                chunks,
                "",
                item.question,
                item.answers,
                order=order,
                meta={"conversation": f"{ctx.run_id[:8]}-{c}", "turn": t},
                prompt=prompt,
            )
            outcomes: dict[str, Outcome] = {}
            for m in methods:
                eng = ctx.engine_for(m)
                outcomes[m.name] = m.run(eng, req, max_new_tokens=max_new)
                eng.flush()
            for m in methods:
                rec = make_record(ctx.run_id, req, m, outcomes[m.name], outcomes["full"])
                rec.update(conversation=c, turn=t)
                out.append(rec)
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": outcomes["full"].text}]
            j += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(ttft_ratios(outcomes))
        for m in methods:
            m.end(ctx.engine_for(m), req.meta["conversation"])
    if bar is not None:
        bar.close()
    ctx.records.extend(out)
    return out
