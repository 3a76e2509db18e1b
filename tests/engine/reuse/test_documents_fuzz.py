"""Fuzzing the segmenter: random documents and prompts (overlaps, repeats, unicode, decorations).

Whatever the input, splitting never fails and its spans are exactly right: the parts rebuild the
prompt, every chunk is a registered text, the longest one starting there, and no registered text
starts inside a text part (the scan missed nothing).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvrag.engine.reuse.documents import DocumentFinder

# a few atoms that documents and decorations share, so that texts overlap, nest and repeat
_ATOMS = st.lists(st.text(min_size=1, max_size=9), min_size=1, max_size=6, unique=True)


def _texts(atoms, max_atoms: int):
    return st.lists(st.one_of(st.sampled_from(atoms), st.text(max_size=12)), max_size=max_atoms).map("".join)


@st.composite
def scenarios(draw):
    atoms = draw(_ATOMS)
    docs = draw(st.lists(_texts(atoms, 14), min_size=1, max_size=6))
    docs += [d[: draw(st.integers(0, len(d)))] for d in docs[:2]]  # prefixes of documents: nested matches
    pieces = draw(
        st.lists(
            st.one_of(
                st.sampled_from(docs),  # whole documents, possibly repeated
                _texts(atoms, 4),  # decorations: template fragments, separators, unicode
                st.sampled_from(docs).map(lambda d: d[len(d) // 3 :]),  # a document's tail only
            ),
            max_size=10,
        )
    )
    small = draw(st.booleans())
    return docs, "".join(pieces), small


@given(scenarios())
def test_split_is_exact_for_any_documents_and_prompt(scenario):
    docs, prompt, small = scenario
    reg = DocumentFinder(min_chars=8, anchor=8) if small else DocumentFinder()
    reg.register(docs)
    registered = {d for d in docs if len(d) >= reg.min_chars}
    parts = reg.split(prompt)
    assert "".join(text for _, text in parts) == prompt
    pos = 0
    for i, (kind, text) in enumerate(parts):
        assert text and kind in ("text", "chunk")
        if kind == "chunk":
            assert text in registered
            assert not any(len(t) > len(text) and prompt.startswith(t, pos) for t in registered)  # the longest
        else:
            assert i == 0 or parts[i - 1][0] == "chunk"  # text parts are merged
            end = pos + len(text)
            for t in registered:  # no registered text starts inside a text part
                assert prompt.find(t, pos, end + len(t) - 1) == -1, (t, text)
        pos += len(text)


@given(st.text(max_size=200), st.lists(st.text(max_size=60), max_size=5))
def test_any_prompt_splits_without_error(prompt, docs):
    reg = DocumentFinder(min_chars=8, anchor=8)
    reg.register(docs)
    assert "".join(text for _, text in reg.split(prompt)) == prompt
    assert DocumentFinder().split(prompt) == ([("text", prompt)] if prompt else [])  # nothing registered
