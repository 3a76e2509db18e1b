"""The selections the benchmarks register for themselves: the research baselines (``hkvd``, ``focus``,
``craft``, ``epic``, ``query``), the ablation (``random``) and the research harnesses' oracles, through
kvrag's registry, with their parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.selections import HKVDParams
from kvrag import Engine, EngineConfig, InvalidRequestError
from kvrag.engine.reuse.selection import (
    ProbeParams,
    SelectionParams,
    configured_params,
    params_class,
    registered_selections,
    selection_params,
)
from tests.engine.reuse.test_selection_registry import PRODUCT
from tests.helpers import PREFIX, SUFFIX, make_docs, probe_strides

#: What importing the benchmarks adds to kvrag's own (``python -m benchmarks`` and every method spec have them).
RESEARCH = {"hkvd", "focus", "craft", "epic", "query", "random"}


def test_importing_the_benchmarks_registers_the_research_selections():
    code = (
        "from kvrag.engine.reuse.selection import registered_selections as r; before = set(r()); import benchmarks; "
        "print(','.join(sorted(before)), ','.join(r()), sep=';')"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    before, after = (set(part.split(",")) for part in out.strip().split(";"))
    assert before == PRODUCT and after == PRODUCT | RESEARCH


def test_the_research_harnesses_register_through_the_registry():
    import benchmarks.research.key_temperature as key_temperature
    import benchmarks.research.oracle_selection as oracle_selection

    assert set(oracle_selection.ORACLES) | set(key_temperature.SCALES) <= set(registered_selections())
    assert params_class("otok8") is ProbeParams  # the oracle reads the probe's layer and block size


def test_selection_params_belong_to_the_selection_and_those_sharing_its_class():
    config = EngineConfig(selection_params={"probe_layer": 12, "probe_stride": 8})
    assert configured_params(config) == ProbeParams(probe_layer=12, probe_stride=8)
    assert configured_params(config, "focus") == ProbeParams(probe_layer=12, probe_stride=8)  # the probe's too
    assert configured_params(config, "hkvd") == HKVDParams()  # another class: its defaults
    assert configured_params(config, "epic") == SelectionParams()
    hkvd = EngineConfig(selection="hkvd", selection_params={"filter_schedule": [3.0, 2.0], "check_layer": 2})
    assert configured_params(hkvd) == HKVDParams(check_layer=2, filter_schedule=(3.0, 2.0))
    assert configured_params(hkvd, "probe") == ProbeParams()
    with pytest.raises(InvalidRequestError, match="takes no parameter"):
        selection_params("epic", {"probe_layer": 2})
    # (hkvd's check_layer on a probe config, and no mapping: tests/engine/reuse/test_selection_registry.py)


def test_bad_selection_params_fail_when_the_engine_is_built(tiny_model, tiny_tokenizer):
    for selection, params, message in (
        ("focus", {"deviation": "q"}, "deviation"),
        ("hkvd", {"filter_schedule": [1.5, 2.0]}, "filter_schedule"),
        ("hkvd", {"check_layer": 0}, "check_layer"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            Engine.from_model(tiny_model, tiny_tokenizer, selection=selection, selection_params=params)


def test_focus_shares_the_probes_configured_parameters(tiny_model, tiny_tokenizer, monkeypatch):
    strides = probe_strides(monkeypatch)
    probe = {"probe_layer": 2, "probe_stride": 8}
    config = EngineConfig(selection_params=probe, tree_refresh=False, prefix_cache=False)
    with Engine.from_model(tiny_model, tiny_tokenizer, config=config) as engine:
        docs = make_docs(4, seed=3)
        engine.warm(docs)
        engine.generate(docs[::-1], PREFIX, SUFFIX, selection="focus", recompute_ratio=0.3, max_new_tokens=1)
    assert strides == [8]  # focus shares the probe's parameters
