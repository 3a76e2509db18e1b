"""The selection registry is the one list of selections: a strategy declared in one place is accepted
by the config, the engine and every request; names and parameters outside it get one clear error."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kvrag import Engine, EngineConfig, InvalidRequestError
from kvrag.engine.reuse.selection import (
    ProbeParams,
    SelectionParams,
    configured_params,
    register_selection,
    registered_selections,
    selection_params,
)
from kvrag.engine.reuse.selection import base as registry
from kvrag.engine.reuse.selection.base import BlendPass
from kvrag.engine.store import build_store, make_policy
from tests.helpers import PREFIX, SUFFIX, make_docs, probe_strides

#: What the wheel registers: the default and the other-context rule's (research baselines register from
#: the benchmarks: tests/benchmarks/selections).
PRODUCT = {"probe", "recency"}


@dataclass(frozen=True, slots=True)
class TailParams(SelectionParams):
    """A throwaway strategy's parameters: how many tokens of each chunk's end it recomputes."""

    tail: int = 2
    layers_seen: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.tail, bool) or not isinstance(self.tail, int) or self.tail < 0:
            raise InvalidRequestError(f"tail must be an integer >= 0, got {self.tail!r}")

    def resolved(self, n_layers: int) -> TailParams:
        return TailParams(self.tail, n_layers)


@pytest.fixture
def tail_selection(monkeypatch):
    """Registers ``tail`` (the last ``tail`` tokens of every cached chunk, one pass) for one test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registration ends with the test
    calls: list[TailParams] = []

    def tail(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(p.params)
        chosen = torch.zeros_like(p.candidates)
        for _, end in p.spans:
            chosen[max(0, end - p.params.tail) : end] = True
        return p.run(p.all_pos[p.rows & ~(p.candidates & ~chosen)], last_row_only=True)

    register_selection("tail", tail, params=TailParams)
    return calls


def test_the_product_registers_its_selections_and_no_ablation():
    import subprocess
    import sys

    code = "from kvrag.engine.reuse.selection import registered_selections as r; print(','.join(r()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert set(out.strip().split(",")) == PRODUCT  # ``hkvd``, ``random``, the oracles... come with the benchmarks


def test_a_selection_registered_in_one_place_is_accepted_everywhere(tail_selection, tiny_model, tiny_tokenizer):
    chunks = make_docs(3, seed=8)
    assert "tail" in registered_selections()
    config = EngineConfig(selection="tail", selection_params={"tail": 3}, tree_refresh=False)
    with Engine.from_model(tiny_model, tiny_tokenizer, config=config) as engine:
        engine.warm(chunks)
        g = engine.generate(chunks[::-1], PREFIX, SUFFIX, recompute_ratio=0.2, max_new_tokens=1)
        assert tail_selection[-1] == TailParams(3, engine.adapter.n_layers)  # resolved for the model
        assert g.stats.recomputed_tokens == 3 * len(chunks)
    with Engine.from_model(tiny_model, tiny_tokenizer, tree_refresh=False) as engine:  # per request
        engine.warm(chunks)
        g = engine.generate(chunks[::-1], PREFIX, SUFFIX, selection="tail", recompute_ratio=0.2, max_new_tokens=1)
        assert tail_selection[-1] == TailParams(2, engine.adapter.n_layers)  # not the probe's: its defaults
        assert g.stats.recomputed_tokens == 2 * len(chunks)
    with pytest.raises(InvalidRequestError, match=r"selection 'tail' takes no parameter\(s\) probe_layer"):
        Engine.from_model(tiny_model, tiny_tokenizer, selection="tail", selection_params={"probe_layer": 3})
    with pytest.raises(InvalidRequestError, match="tail must be"):
        Engine.from_model(tiny_model, tiny_tokenizer, selection="tail", selection_params={"tail": -1})


def test_an_unknown_selection_is_one_error_listing_the_registered_ones(tiny_engine, tiny_model, tiny_tokenizer):
    config = EngineConfig(selection="oracle")  # the config imports without torch: it checks the type only
    for call in (
        lambda: Engine.from_model(tiny_model, tiny_tokenizer, config=config),
        lambda: tiny_engine.generate(["a document about rivers"], PREFIX, SUFFIX, selection="oracle"),
        lambda: tiny_engine.score("yes", ["a document about rivers"], PREFIX, SUFFIX, selection="oracle"),
    ):
        with pytest.raises(InvalidRequestError, match="unknown selection 'oracle'; registered: ") as info:
            call()
        assert all(name in str(info.value) for name in registered_selections())
    for bad in ("", None, 3):
        with pytest.raises(InvalidRequestError, match="selection must be"):
            EngineConfig(selection=bad)
    with pytest.raises(ValueError, match="already registered"):
        register_selection("probe", lambda p: None)


def test_an_unknown_eviction_policy_is_one_error_listing_the_store_policies(tiny_model, tiny_tokenizer):
    config = EngineConfig(eviction_policy="fifo")
    for call in (
        lambda: Engine.from_model(tiny_model, tiny_tokenizer, config=config),
        lambda: build_store(config),
        lambda: make_policy("fifo"),
    ):
        with pytest.raises(InvalidRequestError, match="unknown eviction_policy 'fifo'; use one of lru, pgdsf"):
            call()
    with pytest.raises(InvalidRequestError, match="eviction_policy must be"):
        EngineConfig(eviction_policy="")


def test_selection_params_belong_to_the_selection_and_those_sharing_its_class(tail_selection):
    register_selection("shares_probe", lambda p: None, params=ProbeParams)  # as the benchmarks' focus and random
    config = EngineConfig(selection_params={"probe_layer": 12, "probe_stride": 8})
    assert configured_params(config) == ProbeParams(probe_layer=12, probe_stride=8)
    assert configured_params(config, "shares_probe") == ProbeParams(probe_layer=12, probe_stride=8)  # the probe's too
    assert configured_params(config, "tail") == TailParams()  # another class: its defaults
    assert configured_params(config, "recency") == SelectionParams()
    tail = EngineConfig(selection="tail", selection_params={"tail": 3})
    assert configured_params(tail) == TailParams(tail=3)
    assert configured_params(tail, "probe") == ProbeParams()
    with pytest.raises(InvalidRequestError, match=r"takes no parameter\(s\) check_layer \(its parameters: probe_layer"):
        configured_params(EngineConfig(selection_params={"check_layer": 2}))
    with pytest.raises(InvalidRequestError, match="takes no parameter"):
        selection_params("recency", {"probe_layer": 2})
    with pytest.raises(InvalidRequestError, match="selection_params must be a mapping"):
        EngineConfig(selection_params=[("probe_layer", 2)])


@pytest.mark.parametrize(
    "selection, params, message",
    [
        ("probe", {"probe_layer": 0}, "probe_layer"),
        ("probe", {"probe_stride": 0}, "probe_stride"),
        ("probe", {"deviation": "q"}, "deviation"),
    ],
)
def test_bad_selection_params_fail_when_the_engine_is_built(tiny_model, tiny_tokenizer, selection, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        Engine.from_model(tiny_model, tiny_tokenizer, selection=selection, selection_params=params)


def test_configured_probe_parameters_reach_the_probe(tiny_model, tiny_tokenizer, monkeypatch):
    strides = probe_strides(monkeypatch)
    chunks = make_docs(4, seed=3)
    settings = dict(selection_params={"probe_layer": 2, "probe_stride": 8}, tree_refresh=False, prefix_cache=False)
    with Engine.from_model(tiny_model, tiny_tokenizer, **settings) as engine:
        engine.warm(chunks)
        g = engine.generate(chunks[::-1], PREFIX, SUFFIX, selection="probe", recompute_ratio=0.3, max_new_tokens=1)
        # the sample, one token per 8-token block, runs up to layer 2; the rest through every layer
        blocks = sum(math.ceil(c.tokens / 8) for c in g.stats.chunks if c.source == "store")
        uncached, layers = g.stats.prompt_tokens - g.stats.cached_tokens, engine.adapter.n_layers
        work = round(g.stats.compute_fraction * g.stats.prompt_tokens * layers)
        assert work == (uncached + g.stats.recomputed_tokens) * layers + blocks * 2
        assert strides == [8]  # (the benchmarks' focus shares them: tests/benchmarks/selections)
