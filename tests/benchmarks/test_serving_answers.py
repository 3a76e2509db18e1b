"""`python -m benchmarks serving --only answers`: each question once per draft setting, the tokens compared."""

from __future__ import annotations

from benchmarks.data import QAItem
from benchmarks.serving import measure_answers
from kvrag import Engine
from tests.helpers import make_docs


def test_answers_per_draft_setting_are_identical_and_say_the_fitted_step(tiny_model, tiny_tokenizer):
    docs = make_docs(4, seed=7)
    items = [QAItem(i, "where was the king born?", ["rome"], docs[i : i + 2] * 2) for i in range(3)]
    with Engine.from_model(tiny_model, tiny_tokenizer) as engine:
        out = measure_answers(engine, items, [0, 4], max_new_tokens=20)
        assert engine.config.draft_tokens == 4  # the engine's own setting back afterwards
    assert [r["question"] for r in out["rows"]] == [0, 1, 2]
    for row in out["rows"]:
        assert set(row["by_drafts"]) == {0, 4} and row["by_drafts"][0]["drafted"] == 0
    s = out["summary"]
    assert s[4]["identical"] == s[4]["questions"] == 3  # drafts never change the tokens
    assert out["step_cost"] is None or set(out["step_cost"]) == {"fixed_ms", "per_1k_keys_ms"}
