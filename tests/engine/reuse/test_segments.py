"""The prompt tokenizer: parts tokenised on their own, positioned, with the BOS token in front once.

A character tokenizer stands in for a real one, so that the expected ids are written down here
and not derived the way the code under test derives them.
"""

from __future__ import annotations

import torch

from kvrag.engine.reuse.segments import MEMO_TEXTS, PromptTokenizer


class CharTokenizer:
    """One id per character (its code point); ``<s>`` (id 1) in front when special tokens are added
    and ``adds_bos`` (some tokenizers define a BOS token and never add it)."""

    bos_token = "<s>"
    bos_token_id = 1

    def __init__(self, adds_bos: bool = True) -> None:
        self.adds_bos = adds_bos
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls += 1
        ids = [1] if add_special_tokens and self.adds_bos else []
        if text.startswith("<s>"):  # the BOS token spelt out in the text
            ids, text = [*ids, 1], text[3:]
        return {"input_ids": ids + [ord(c) for c in text]}


def test_parts_are_tokenised_on_their_own_and_positioned_behind_one_bos():
    tok = PromptTokenizer(CharTokenizer())
    assert tok.bos_id == 1
    segments, ids = tok.segment([("text", "ab"), ("chunk", ""), ("chunk", "xyz"), ("text", "?")])
    assert [(s.kind, s.ids, s.start, s.end) for s in segments] == [
        ("text", [1], 0, 1),
        ("text", [97, 98], 1, 3),
        ("chunk", [120, 121, 122], 3, 6),  # the empty chunk is dropped
        ("text", [63], 6, 7),
    ]
    assert torch.equal(ids, torch.tensor([1, 97, 98, 120, 121, 122, 63])) and ids.dtype == torch.long


def test_a_prompt_that_spells_out_its_bos_gets_no_second_one():
    tok = PromptTokenizer(CharTokenizer())
    segments, ids = tok.segment([("text", "<s>ab"), ("chunk", "xy")])
    assert ids.tolist() == [1, 97, 98, 120, 121]
    assert segments[0].start == 0 and segments[1].start == 3


def test_a_tokenizer_that_never_adds_its_bos_gets_none():
    tok = PromptTokenizer(CharTokenizer(adds_bos=False))
    assert tok.bos_id is None
    segments, ids = tok.segment([("text", "ab"), ("chunk", "xy")])
    assert ids.tolist() == [97, 98, 120, 121] and segments[0].start == 0


def test_tokenize_is_memoised_and_bounded():
    inner = CharTokenizer()
    tok = PromptTokenizer(inner)
    calls = inner.calls
    assert tok.tokenize("hello") == [104, 101, 108, 108, 111] and inner.calls == calls + 1
    assert tok.tokenize("hello") == [104, 101, 108, 108, 111] and inner.calls == calls + 1
    for i in range(MEMO_TEXTS):
        tok.tokenize(str(i))
    tok.tokenize("hello")  # forgotten by now: asked of the tokenizer again
    assert inner.calls == calls + 1 + MEMO_TEXTS + 1
