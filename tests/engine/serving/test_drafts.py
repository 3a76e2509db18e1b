"""Prompt-lookup drafts: the tokens are the same with or without them, whatever the drafts guess."""

from __future__ import annotations

import threading

import pytest

import kvrag.engine.serving.decode as decode_module
from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.serving.drafts import (
    PROBE_EVERY,
    DraftCandidate,
    HoldRate,
    PromptLookup,
    StepCost,
    next_width,
    plan_drafts,
)
from tests.helpers import FAMILIES, PREFIX, SUFFIX, as_dtype, make_docs, make_tiny_model

# ---- the lookup itself ---------------------------------------------------------------------------


def test_the_longest_tail_that_occurred_before_gives_the_draft():
    lookup = PromptLookup([5, 6, 7, 8, 9, 1, 6, 7, 2, 3])
    lookup.extend([6, 7])  # tail "6 7": latest earlier occurrence ends before 2
    assert lookup.propose(3) == [2, 3, 6]
    lookup.extend([8])  # "6 7 8" occurred at the start only (the longest match wins over "7 8")
    assert lookup.propose(2) == [9, 1]


def test_no_earlier_occurrence_no_draft_and_a_draft_never_runs_past_the_tokens():
    lookup = PromptLookup([1, 2, 3])
    assert lookup.propose(4) == []
    lookup.extend([1])
    assert lookup.propose(8) == [2, 3, 1]  # what follows, up to the end of the sequence
    assert lookup.propose(0) == []
    with pytest.raises(ValueError):
        PromptLookup([1], max_ngram=0)


def test_the_draft_width_halves_on_a_miss_and_doubles_when_all_hold():
    assert next_width(4, 4, 0, 4) == 2
    assert next_width(1, 1, 0, 4) == 1
    assert next_width(2, 2, 2, 4) == 4
    assert next_width(4, 4, 4, 4) == 4
    assert next_width(4, 4, 2, 4) == 4  # some held: unchanged
    assert next_width(3, 0, 0, 4) == 3  # nothing checked (no match): unchanged


def test_the_step_cost_fits_the_products_and_each_key_once_the_keys_varied():
    cost = StepCost()
    for _ in range(20):  # one row, one context: nothing tells the products from the attention
        cost.observe(3700, 0.030 + 2e-6 * 3700)
    assert cost.fit() is None
    for i in range(40):  # rows of 1..5 contexts (a step with 0..4 drafts)
        keys = 3700 * (1 + i % 5)
        cost.observe(keys, 0.030 + 2e-6 * keys)
    fixed, per_key = cost.fit()
    assert fixed == pytest.approx(0.030, rel=1e-3) and per_key == pytest.approx(2e-6, rel=1e-3)
    for _ in range(200):  # back to one row: the fit stays what the varied passes said
        cost.observe(3800, 0.030 + 2e-6 * 3800)
    assert cost.fit()[1] == pytest.approx(2e-6, rel=0.05)
    noisy = StepCost()
    for i in range(40):
        noisy.observe(1000 * (1 + i % 2), 0.05 - 1e-6 * 1000 * (i % 2))  # more keys, less time: noise
    assert noisy.fit()[1] == 0.0  # never a negative cost


def test_drafts_are_planned_for_the_most_tokens_a_second():
    step, context = 0.030, 3700
    third = DraftCandidate(most=4, hold=0.5, context=context)
    per_key = step / 3 / context  # a draft row costs a third of the step (no AMX, 3.7K keys)
    assert plan_drafts([third], 1, context, (step - per_key * context, per_key), room=4) == [1]
    sure = DraftCandidate(most=4, hold=0.95, context=context)
    assert plan_drafts([sure], 1, context, (step - per_key * context, per_key), room=4) == [4]
    assert plan_drafts([sure], 1, context, (step - per_key * context, per_key), room=2) == [2]
    poor = DraftCandidate(most=4, hold=0.2, context=context)
    assert plan_drafts([poor], 1, context, (step - per_key * context, per_key), room=4) == [0]
    sixth = step / 6 / context  # a sixth (AMX): the same odds buy more drafts
    assert plan_drafts([third], 1, context, (step - sixth * context, sixth), room=4) == [2]
    assert plan_drafts([third], 1, context, (step, 0.0), room=4) == [4]  # free rows: all of them
    # two sequences: the likelier drafts first, and a step shared by several pays for less
    both = plan_drafts([poor, sure], 2, 2 * context, (step - 2 * per_key * context, per_key), room=4)
    assert both[0] == 0 and 1 <= both[1] <= 4


def test_the_hold_rate_follows_the_recent_steps():
    hold = HoldRate()
    assert hold.p == 0.5
    for _ in range(6):
        hold.update(4, 4)  # copying a passage
    assert hold.p > 0.8
    for _ in range(6):
        hold.update(2, 0)  # stopped copying
    assert hold.p < 0.3
    before = hold.p
    hold.update(0, 0)  # nothing checked: no evidence
    assert hold.p == before


FREE = (1.0, 0.0)  # a planted step cost under which draft rows cost nothing: the most drafts a step allows


class PlantedCost:
    """A step cost the test decides (the engine's own fit depends on this machine's timings)."""

    def __init__(self, fit) -> None:
        self._fit = fit

    def observe(self, keys, seconds) -> None:
        pass

    def fit(self):
        return self._fit


def test_the_engine_checks_the_drafts_the_cost_pays_for(tiny_model, tiny_tokenizer, monkeypatch):
    chunks = make_docs(3, seed=41)
    with Engine.from_model(
        tiny_model, tiny_tokenizer, draft_tokens=0, sampling=SamplingParams(max_new_tokens=24)
    ) as plain:
        expected = greedy(plain, chunks)
    Oracle.reference, Oracle.calls = expected.token_ids, 0
    monkeypatch.setattr(decode_module, "PromptLookup", Oracle)
    with Engine.from_model(
        tiny_model, tiny_tokenizer, draft_tokens=4, sampling=SamplingParams(max_new_tokens=24)
    ) as engine:
        engine.decoding.step_cost = PlantedCost((0.0, 1.0))  # a draft row costs as much as the step: never worth it
        dear = greedy(engine, chunks)
        engine.decoding.step_cost = PlantedCost(FREE)  # draft rows are free: as many as allowed
        free = greedy(engine, chunks)
    assert dear.token_ids == free.token_ids == expected.token_ids
    steps = dear.stats.decode_steps
    assert dear.stats.draft_tokens == len(range(0, steps, PROBE_EVERY))  # one on every PROBE_EVERY-th step
    assert free.stats.draft_tokens > steps and free.stats.decode_steps < expected.stats.decode_steps


def test_draft_tokens_is_validated():
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        from kvrag import EngineConfig

        EngineConfig(draft_tokens=-1)


def test_draft_tokens_default_to_the_device():
    """Left unset, a CPU engine checks up to 4 drafts a step and a GPU none (a draft row's kernel
    launches cost more there than its guesses save); a number given is kept on any device."""
    resolve = decode_module.draft_tokens_for
    assert resolve(None, "cpu") == decode_module.CPU_DRAFT_TOKENS == 4
    assert resolve(None, "cuda") == resolve(None, "cuda:1") == 0
    assert resolve(2, "cuda") == 2 and resolve(0, "cpu") == 0


def test_an_engine_holds_the_draft_tokens_it_resolved(tiny_model, tiny_tokenizer):
    with Engine.from_model(tiny_model, tiny_tokenizer) as engine:
        assert engine.config.draft_tokens == 4 and "drafts: up to 4 a step" in engine.info().decode


# ---- drafts through the engine --------------------------------------------------------------------


class Oracle:
    """A drafter that knows the answer (``reference``, the tokens generated without drafts) and
    spoils every third draft at its second token: drafts fully kept, partly kept and refused."""

    reference: list[int] = []
    calls = 0

    def __init__(self, tokens) -> None:
        self.tokens = list(tokens)
        self.prompt_len = len(self.tokens) - 1  # made at the first step: the prompt and one token

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        done = len(self.tokens) - self.prompt_len
        draft = list(Oracle.reference[done : done + k])
        Oracle.calls += 1
        if Oracle.calls % 3 == 0 and len(draft) > 1:
            draft[1] = draft[1] + 1
        if Oracle.calls % 5 == 0 and draft:
            draft[0] = draft[0] + 1  # refused at once
        return draft


def greedy(engine: Engine, chunks, **kw):
    return engine.generate(chunks, PREFIX, SUFFIX, mode="full", **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_kept_or_refused_never_change_the_tokens(tiny_tokenizer, monkeypatch, family, dtype):
    model = as_dtype(make_tiny_model(len(tiny_tokenizer), family), dtype)
    chunks = make_docs(3, seed=41)
    plain = Engine.from_model(model, tiny_tokenizer, draft_tokens=0, sampling=SamplingParams(max_new_tokens=24))
    try:
        expected = greedy(plain, chunks)
    finally:
        plain.close()
    assert expected.stats.draft_tokens == 0 and expected.stats.decode_steps >= len(expected.token_ids) - 1
    Oracle.reference, Oracle.calls = expected.token_ids, 0
    monkeypatch.setattr(decode_module, "PromptLookup", Oracle)
    engine = Engine.from_model(model, tiny_tokenizer, draft_tokens=4, sampling=SamplingParams(max_new_tokens=24))
    engine.decoding.step_cost = PlantedCost(FREE)  # how many are checked would follow this machine's timing
    try:
        got = greedy(engine, chunks)
        again = greedy(engine, chunks)  # the KV a refused draft left behind is not read
    finally:
        engine.close()
    assert got.token_ids == again.token_ids == expected.token_ids
    assert got.text == expected.text and got.finish_reason == expected.finish_reason
    s = got.stats
    assert 0 < s.draft_accepted < s.draft_tokens  # some drafts held, some did not
    assert s.decode_steps < expected.stats.decode_steps  # and the held ones saved steps


def test_the_lookup_on_each_family_gives_the_plain_tokens(family_model, tiny_tokenizer):
    chunks = make_docs(2, seed=43)
    repeated = chunks + chunks  # a prompt that repeats itself: a random model's loops find matches
    out = {}
    for k in (0, 4):
        engine = Engine.from_model(
            family_model, tiny_tokenizer, draft_tokens=k, sampling=SamplingParams(max_new_tokens=30)
        )
        try:
            out[k] = greedy(engine, repeated)
        finally:
            engine.close()
    assert out[4].token_ids == out[0].token_ids
    assert out[4].stats.decode_steps <= out[0].stats.decode_steps


def test_drafts_stop_at_the_token_budget_and_at_a_stop_string(tiny_model, tiny_tokenizer, monkeypatch):
    chunks = make_docs(2, seed=44)
    plain = Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=0)
    try:
        long = greedy(plain, chunks, max_new_tokens=20)
        short = greedy(plain, chunks, max_new_tokens=5)
        stop = plain.tokenizer.decode(long.token_ids[6:8])
        stopped = greedy(plain, chunks, max_new_tokens=20, stop=[stop]) if stop.strip() else None
    finally:
        plain.close()
    Oracle.reference, Oracle.calls = long.token_ids, 1  # calls 2, 3, ...: some spoiled
    monkeypatch.setattr(decode_module, "PromptLookup", Oracle)
    engine = Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=7)
    try:
        got = greedy(engine, chunks, max_new_tokens=5)
        assert got.token_ids == short.token_ids and len(got.token_ids) == 5
        assert got.finish_reason == short.finish_reason
        if stopped is not None:
            Oracle.calls = 1
            cut = greedy(engine, chunks, max_new_tokens=20, stop=[stop])
            assert (cut.text, cut.finish_reason, cut.token_ids) == (
                stopped.text,
                stopped.finish_reason,
                stopped.token_ids,
            )
    finally:
        engine.close()


def test_sampled_requests_draft_nothing_and_concurrent_greedy_ones_match_each_alone(tiny_model, tiny_tokenizer):
    docs = [make_docs(2, seed=s) for s in (45, 46, 47)]
    plain = Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=0, sampling=SamplingParams(max_new_tokens=20))
    try:
        alone = [greedy(plain, d + d).token_ids for d in docs]
    finally:
        plain.close()
    engine = Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=4, sampling=SamplingParams(max_new_tokens=20))
    try:
        sampled = greedy(engine, docs[0] + docs[0], temperature=0.8, seed=3)
        assert sampled.stats.draft_tokens == 0
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = greedy(engine, docs[i] + docs[i]).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(docs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    assert [results[i] for i in range(len(docs))] == alone


@pytest.mark.model
def test_drafts_on_the_bundled_model_save_steps_and_change_no_token(smol_engine):
    passage = (
        "The Amberley Viaduct carries the Western Line over the River Wey. It was designed by Ada Moreland "
        "and opened in 1871, and the Amberley Viaduct is still the longest brick viaduct in the county."
    )
    question = "Who designed the Amberley Viaduct, and when did the Amberley Viaduct open?"
    prompt = smol_engine.apply_chat_template([{"role": "user", "content": f"{passage}\n\n{question}"}])
    base = smol_engine.decoding.draft_tokens
    out = {}
    fitted = smol_engine.decoding.step_cost
    smol_engine.decoding.step_cost = PlantedCost(FREE)  # the steps saved would follow this machine's timing
    try:
        for k in (0, 4):
            smol_engine.decoding.draft_tokens = k
            out[k] = smol_engine.generate(prompt=prompt, mode="full", max_new_tokens=40)
    finally:
        smol_engine.decoding.draft_tokens, smol_engine.decoding.step_cost = base, fitted
    assert out[4].token_ids == out[0].token_ids
    assert out[4].stats.draft_accepted > 0
    assert out[4].stats.decode_steps < out[0].stats.decode_steps
