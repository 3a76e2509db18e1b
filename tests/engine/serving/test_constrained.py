"""Constrained decoding: a request's output follows its JSON schema, regex or grammar, token by token,
in batched decode and with prompt-lookup drafts; bad specs fail at submission."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

import kvrag.engine.serving.decode as decode_module
import kvrag.engine.serving.prefill as prefill_module
from kvrag import Constraint, Engine, InvalidRequestError, SamplingParams
from kvrag.engine.model.grammar import Grammars
from tests.engine.serving.test_drafts import FREE, PlantedCost
from tests.helpers import PREFIX, SUFFIX, hold_engine_thread, make_docs

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "passages": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "passages", "sure"],
    "additionalProperties": False,
}
TOOL_CALL = (
    'start: "<tool_call>" %json {"type": "object", "properties": {"name": {"const": "search"}, '
    '"arguments": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"], '
    '"additionalProperties": false}}, "required": ["name", "arguments"], "additionalProperties": false} "</tool_call>"'
)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=160))
    yield engine
    engine.close()


def ask(engine, **kw):
    return engine.generate(make_docs(2, seed=51), PREFIX, SUFFIX, mode="full", **kw)


def test_sampled_output_validates_against_the_schema_and_ends_when_complete(engine):
    c = Constraint.json_schema(SCHEMA)
    for seed in range(6):
        g = ask(engine, constraint=c, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(g.text), SCHEMA)
        assert g.finish_reason == "stop" and len(g.token_ids) < 160  # ended by the grammar, not the limit
    streamed = engine.stream(make_docs(2, seed=51), PREFIX, SUFFIX, mode="full", constraint=c, temperature=1.0, seed=3)
    text = "".join(streamed)
    assert text == streamed.generation.text == ask(engine, constraint=c, temperature=1.0, seed=3).text


def test_a_regex_a_json_object_and_a_tool_call_grammar(engine):
    pattern = r"(cat|dog) [0-9]{2}!"
    for seed in range(4):
        g = ask(engine, constraint=Constraint.regex(pattern), temperature=1.0, seed=seed)
        assert re.fullmatch(pattern, g.text) and g.finish_reason == "stop"
    assert isinstance(json.loads(ask(engine, constraint=Constraint.json_object(), temperature=1.0, seed=1).text), dict)
    for seed in range(3):
        text = ask(engine, constraint=Constraint.grammar(TOOL_CALL), temperature=1.0, seed=seed).text
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>") and call["name"] == "search"


def test_bad_specs_fail_at_submission_before_any_work(engine, monkeypatch):
    ran = []
    monkeypatch.setattr(prefill_module, "prefill", lambda *a, **k: ran.append(1))
    for bad, why in [
        (Constraint.regex("[a-z"), "unclosed character class"),
        (Constraint.grammar("start: foo"), 'unknown name: "foo"'),
        (Constraint.json_schema({"type": "foo"}), "Invalid type: foo"),
        (Constraint.grammar('start: %json {"type": "object", "properties": {"a": {"format": "nope"}}}'), "nope"),
    ]:
        with pytest.raises(InvalidRequestError, match=re.escape(why)):
            ask(engine, constraint=bad)
        with pytest.raises(InvalidRequestError, match=re.escape(why)):
            engine.stream(make_docs(1), PREFIX, SUFFIX, constraint=bad)
    assert ran == []


def test_unconstrained_streams_decode_as_alone_beside_constrained_ones(engine):
    """One batched step holds constrained and free sequences: each row gets its own mask (or none)."""
    free = [dict(max_new_tokens=20), dict(max_new_tokens=30, temperature=1.0, seed=7)]
    bound = [dict(constraint=Constraint.json_schema(SCHEMA), temperature=1.0, seed=s) for s in (1, 2)]
    alone = [ask(engine, **kw).token_ids for kw in free]
    gate = hold_engine_thread(engine)  # all queued before the engine takes the first: they decode together
    calls = free + bound + [dict(constraint=Constraint.regex(r"[a-z]{3,9}"), max_new_tokens=40)]
    streams = [engine.stream(make_docs(2, seed=51), PREFIX, SUFFIX, mode="full", **kw) for kw in calls]
    out: dict[int, object] = {}

    def consume(i):
        for _ in streams[i]:
            pass
        out[i] = streams[i].generation

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert [out[0].token_ids, out[1].token_ids] == alone
    for i in (2, 3):
        jsonschema.validate(json.loads(out[i].text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3,9}", out[4].text)


class Reference:
    """A drafter that proposes the tokens a plain run generated, every other draft spoiled at its second
    token (a letter: allowed inside a JSON string, forbidden where JSON needs structure)."""

    reference: list[int] = []
    spoil = 0
    calls = 0
    proposed = 0

    def __init__(self, tokens) -> None:
        self.tokens = list(tokens)
        self.prompt_len = len(self.tokens) - 1

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        done = len(self.tokens) - self.prompt_len
        draft = list(Reference.reference[done : done + k])
        Reference.calls += 1
        if Reference.calls % 2 == 0 and len(draft) > 1:
            draft[1] = Reference.spoil
        Reference.proposed += len(draft)
        return draft


def test_drafts_give_the_same_output_and_a_forbidden_draft_is_never_checked(tiny_model, tiny_tokenizer, monkeypatch):
    c = Constraint.json_schema(SCHEMA)
    chunks = make_docs(2, seed=51)
    sampling = SamplingParams(max_new_tokens=160)
    with Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=0, sampling=sampling) as plain:
        expected = plain.generate(chunks, PREFIX, SUFFIX, mode="full", constraint=c)
    jsonschema.validate(json.loads(expected.text), SCHEMA)
    spoil = tiny_tokenizer.convert_tokens_to_ids("z")  # never valid JSON where the reference is
    Reference.reference, Reference.spoil = expected.token_ids + [tiny_tokenizer.eos_token_id], spoil
    Reference.calls = Reference.proposed = 0
    monkeypatch.setattr(decode_module, "PromptLookup", Reference)
    checked = []
    planned = decode_module.Decoding._drafts

    def spy(self, seqs):
        drafts = planned(self, seqs)
        for seq, draft in zip(seqs, drafts):
            assert seq.grammar.allowed(draft) == len(draft)  # every draft checked is one the grammar allows
            checked.extend(draft)
        return drafts

    monkeypatch.setattr(decode_module.Decoding, "_drafts", spy)
    with Engine.from_model(tiny_model, tiny_tokenizer, draft_tokens=4, sampling=sampling) as engine:
        engine.decoding.step_cost = PlantedCost(FREE)
        got = engine.generate(chunks, PREFIX, SUFFIX, mode="full", constraint=c)
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.stats.draft_accepted > 0 and got.stats.decode_steps < expected.stats.decode_steps
    assert Reference.proposed > len(checked)  # some drafts were cut by the grammar before the pass


def test_the_mask_allows_the_end_only_where_the_grammar_accepts(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    grammars = Grammars(tiny_tokenizer, {eos}, len(tiny_tokenizer) + 8)  # logits wider than the vocabulary
    m = grammars.matcher(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    first = m.forbidden()
    assert first.shape == (len(tiny_tokenizer) + 8,) and first[eos] and first[-8:].all()
    allowed = (~first).nonzero().flatten().tolist()
    assert allowed and all(tiny_tokenizer.decode([t]).startswith("{") for t in allowed)
    ids = tiny_tokenizer.encode('{"a": 12}', add_special_tokens=False)
    assert m.allowed(ids + ids) == len(ids)  # nothing may follow the complete object
    for t in ids:
        m.advance(t)
    assert m.stopped and (~m.forbidden()).nonzero().flatten().tolist() == [eos]
    logits = m.mask(torch.zeros(len(tiny_tokenizer) + 8))
    assert int(torch.argmax(logits)) == eos and torch.isinf(logits).sum() == len(logits) - 1


def test_each_distinct_constraint_compiles_once_and_the_cache_is_bounded(tiny_tokenizer):
    grammars = Grammars(tiny_tokenizer, {tiny_tokenizer.eos_token_id}, len(tiny_tokenizer), max_compiled=2)
    a, b, c = Constraint.regex("a+"), Constraint.regex("b+"), Constraint.regex("c+")
    first = grammars.compiled(a)
    assert grammars.compiled(Constraint.regex("a+")) is first  # equal constraints share one compilation
    assert grammars.matcher(a)._m is not first  # each sequence its own copy
    grammars.compiled(b), grammars.compiled(c)
    assert list(grammars._compiled) == [b, c]  # the least recently used dropped


@pytest.mark.model
def test_the_bundled_model_answers_in_the_schema(smol_engine):
    """The real SmolLM2 tokenizer (49K tokens, byte-level BPE with merges across JSON punctuation)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["city", "year"],
    }
    docs = ["The Eiffel Tower was finished in 1889 in Paris for the World's Fair."]
    g = smol_engine.generate(
        docs, suffix="Where and when was the Eiffel Tower built? Answer in JSON.", max_new_tokens=48,
        constraint=Constraint.json_schema(schema),
    )  # fmt: skip
    jsonschema.validate(json.loads(g.text), schema)
    assert g.finish_reason == "stop"


def test_json_whitespace_is_bounded_and_boolean_schemas_are_handled(tiny_tokenizer):
    """JSON in the model's own layout (compact, json.dumps's, indented), but no run of whitespace past 20:
    unbounded, a model can spend its tokens on it. ``true`` is any JSON value; ``false`` admits nothing and is
    refused before any work."""
    grammars = Grammars(tiny_tokenizer, {tiny_tokenizer.eos_token_id}, len(tiny_tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    m = grammars.matcher(Constraint.json_schema(schema))
    dumped = tiny_tokenizer.encode(json.dumps({"a": 12, "b": [1, 2]}), add_special_tokens=False)
    assert m.allowed(dumped) == len(dumped)
    for text in ('{"a":12}', '{\n  "a": 12\n}'):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert m.allowed(ids) == len(ids)
    ids = tiny_tokenizer.encode("{" + " " * 40 + '"a": 12}', add_special_tokens=False)
    assert m.allowed(ids) < len(ids)
    anything = grammars.matcher(Constraint.json_schema("true"))
    ids = tiny_tokenizer.encode("[1, 2]", add_special_tokens=False)
    assert anything.allowed(ids) == len(ids)
    with pytest.raises(InvalidRequestError, match="no output is valid"):
        grammars.check(Constraint.json_schema("false"))


def test_a_tokenizer_larger_than_the_logits_is_read_whole(tiny_tokenizer):
    """A small model whose logits are narrower than its tokenizer (added tokens past them): the grammar reads
    every token; tokens past the logits are never sampled."""
    grammars = Grammars(tiny_tokenizer, {tiny_tokenizer.eos_token_id}, len(tiny_tokenizer) - 1)
    m = grammars.matcher(Constraint.regex("[ab]+"))
    logits = m.mask(torch.zeros(len(tiny_tokenizer) - 1))
    assert not torch.isinf(logits).all()
