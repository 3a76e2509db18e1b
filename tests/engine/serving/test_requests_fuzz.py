"""Fuzzing the request checks: every bad argument gets one kvrag error that names it.

Each case passes one bad value (random, of any type) for one argument of ``generate``, ``stream``
or ``score``; the rest of the request is valid. Nothing reaches the model.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrag import Engine, KvragError, SamplingParams
from kvrag.config import MODES
from kvrag.engine.reuse.selection import registered_selections

_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=1),
)
_NOT_TEXT = _ANY.filter(lambda x: x is not None and not isinstance(x, str))
_BAD_NUMBER = st.one_of(
    st.floats(allow_nan=True), st.text(max_size=8), st.lists(st.integers(), max_size=2), st.binary()
)

#: argument -> (values it refuses, the word its error must contain)
BAD = {
    "mode": (_ANY.filter(lambda x: x is not None and x not in MODES), "mode"),
    "selection": (_ANY.filter(lambda x: x is not None and x not in registered_selections()), "selection"),
    "recompute_ratio": (
        st.one_of(_NOT_TEXT, st.text()).filter(
            lambda x: x is not None and not (type(x) in (int, float) and 0 <= x <= 1)
        ),
        "recompute_ratio",
    ),
    "max_new_tokens": (_ANY.filter(lambda x: x is not None and not (type(x) is int and x >= 0)), "max_new_tokens"),
    "temperature": (
        _BAD_NUMBER.filter(lambda x: not (type(x) is float and math.isfinite(x) and x >= 0)),
        "temperature",
    ),
    "top_p": (_BAD_NUMBER.filter(lambda x: not (type(x) is float and 0 < x <= 1)), "top_p"),
    "stop": (
        st.one_of(_NOT_TEXT.filter(lambda x: x != []), st.lists(_NOT_TEXT, min_size=1, max_size=2)),
        "stop",
    ),
    "seed": (
        st.one_of(_ANY, st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)).filter(
            lambda x: x is not None and not (type(x) is int and -(2**63) <= x < 2**64)
        ),
        "seed",
    ),
    "chunks": (
        st.one_of(
            st.text(min_size=1),
            st.binary(min_size=1),
            st.integers(),
            st.floats(),
            st.lists(_NOT_TEXT, min_size=1, max_size=2),
        ),
        "chunk",
    ),
    "prefix": (_NOT_TEXT, "prefix"),
    "suffix": (_NOT_TEXT, "suffix"),
    "prompt": (_NOT_TEXT, "prompt"),
    "conversation_id": (
        _ANY.filter(lambda x: x is not None and not (type(x) in (str, int) and str(x))),
        "conversation_id",
    ),
    "dedup": (_ANY.filter(lambda x: x is not None and type(x) is not bool), "dedup"),
}


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=1))
    yield engine
    engine.close()


@st.composite
def bad_arguments(draw):
    name = draw(st.sampled_from(sorted(BAD)))
    values, word = BAD[name]
    return name, draw(values), word


@given(bad_arguments())
def test_every_bad_argument_gets_one_error_naming_it(engine, case):
    name, value, word = case
    kwargs = {name: value} if name in ("prompt", "suffix") else {name: value, "suffix": "a question"}
    if name == "dedup":
        kwargs["conversation_id"] = "c"
    if name == "seed":
        kwargs["temperature"] = 1.0  # the seed is used: a value torch refuses must not get that far
    for call in (engine.generate, engine.stream):
        with pytest.raises(KvragError, match=word):
            call(**kwargs)
    if name not in ("max_new_tokens", "temperature", "top_p", "stop", "seed", "conversation_id", "dedup"):
        with pytest.raises(KvragError, match=word):  # score takes the prompt and prefill arguments
            engine.score("an answer", **kwargs)
