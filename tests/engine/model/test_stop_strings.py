"""Stop strings: matching only the newly decoded tail gives the text and pieces the full scan gave."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrag import InvalidRequestError, SamplingParams
from kvrag.config import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvrag.engine.model.sampling import TextStream


class Pieces:
    """A tokenizer whose token i decodes to ``pieces[i]``; ``tidy`` rewrites earlier text as a later
    token arrives (as clean_up_tokenization_spaces does: " ." becomes ".")."""

    def __init__(self, pieces: list[str], tidy: bool = False) -> None:
        self.pieces, self.tidy = pieces, tidy

    def decode(self, ids, skip_special_tokens=True) -> str:
        text = "".join(self.pieces[i] for i in ids)
        return text.replace(" .", ".") if self.tidy else text


class FullScan:
    """The earlier TextStream: every stop searched in the whole text, the hold-back over every stop's prefixes."""

    def __init__(self, tokenizer, stop) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids, self.text, self.emitted, self.stopped = [], "", 0, False

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            full = full[:cut]
        self.text = full
        safe = len(full)
        if not self.stopped:
            for s in self.stop:
                for n in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:n]):
                        safe = min(safe, len(full) - n)
                        break
        piece = full[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return piece


def run(stream, n: int) -> tuple:
    pieces = []
    for i in range(n):
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    return pieces, stream.text, stream.stopped


TRICKY = [
    (["ab", "b", "a", "b", "c"], ["abc"], False),  # a stop that begins, breaks off, begins again
    (["x", "aa", "a", "ab"], ["aab", "aaa"], False),  # overlapping stops, the earlier one wins
    (["he", "llo", " wor", "ld"], ["lo w", "low"], False),  # across three tokens
    (["a", "\ufffd", "b", "stop"], ["b s", "bst"], False),  # an incomplete character waits
    (["one", " ", ".", "two", " .", "end"], ["e.t", "o.e"], True),  # the decode rewrites earlier text
    (["ab", "ab", "ab", "c"], ["ababc", "abab"], False),
    (["x"] * 5, ["y"], False),  # never stops: everything emitted, nothing held at the end
    (["a", "b"], ["", "ab"], False),  # an empty stop is ignored
]


@pytest.mark.parametrize("pieces, stop, tidy", TRICKY)
def test_tail_matching_gives_the_full_scans_text_and_pieces(pieces, stop, tidy):
    tok = Pieces(pieces, tidy)
    assert run(TextStream(tok, stop), len(pieces)) == run(FullScan(tok, stop), len(pieces))


@given(
    pieces=st.lists(st.text(alphabet="ab .\ufffd", min_size=0, max_size=3), min_size=1, max_size=12),
    stop=st.lists(st.text(alphabet="ab .", min_size=0, max_size=4), max_size=4),
    tidy=st.booleans(),
)
def test_tail_matching_agrees_with_the_full_scan_on_any_text(pieces, stop, tidy):
    tok = Pieces(pieces, tidy)
    new, old = TextStream(tok, stop), FullScan(tok, stop)
    assert run(new, len(pieces)) == run(old, len(pieces))
    assert new.flush() == old.text[old.emitted :]


def test_stop_strings_are_bounded():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS} strings, got 5000"):
        SamplingParams(stop=["stop"] * 5000)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
