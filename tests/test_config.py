"""The config a user reads: default sampling as one field, moved fields pointing where they went,
``--config`` overrides, and an import that needs no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvrag
from kvrag import Engine, EngineConfig, InvalidRequestError, SamplingParams
from kvrag.config import DEFAULT_SAMPLING, parse_overrides
from tests.helpers import PREFIX, SUFFIX


def test_the_config_module_imports_without_torch():
    """The module itself (the package's ``__init__`` loads the engine): torch blocked, an empty package."""
    package = str(Path(kvrag.__file__).parent)
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = None\n"
        f"pkg = types.ModuleType('kvrag'); pkg.__path__ = [{package!r}]; sys.modules['kvrag'] = pkg\n"
        "import kvrag.config\n"
        "print(kvrag.config.EngineConfig(sampling={'max_new_tokens': 3}).sampling.max_new_tokens)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "3", out.stderr


def test_default_sampling_is_one_field_with_the_defaults_of_before():
    assert EngineConfig().sampling == DEFAULT_SAMPLING == SamplingParams(64, 0.0, 1.0, None, None)
    # fields left unset keep the defaults; a mapping of fields works too (JSON, engine_config)
    assert EngineConfig(sampling=SamplingParams(max_new_tokens=5)).sampling == SamplingParams(5, 0.0, 1.0)
    assert EngineConfig(sampling={"temperature": 0.7, "seed": 3}).sampling == SamplingParams(64, 0.7, 1.0, None, 3)
    with pytest.raises(InvalidRequestError, match="sampling must be a SamplingParams"):
        EngineConfig(sampling=5)
    with pytest.raises(InvalidRequestError, match="sampling has no field"):
        EngineConfig(sampling={"max_tokens": 5})
    with pytest.raises(InvalidRequestError, match="top_p"):
        EngineConfig(sampling=SamplingParams(top_p=0.0))
    # a request's own fields override the engine's one by one
    engine_defaults = EngineConfig(sampling=SamplingParams(max_new_tokens=5, stop=["END"])).sampling
    assert SamplingParams(temperature=0.5).resolved(engine_defaults) == SamplingParams(5, 0.5, 1.0, ("END",), None)
    assert SamplingParams(stop=[]).resolved(engine_defaults).stop == ()
    assert SamplingParams().resolved(DEFAULT_SAMPLING) == SamplingParams(64, 0.0, 1.0, (), None)


def test_engine_default_sampling_and_a_per_request_override(tiny_model, tiny_tokenizer):
    with Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=3)) as engine:
        assert engine.generate(["a document about rivers"], PREFIX, SUFFIX).stats.completion_tokens == 3
        short = engine.generate(["a document about rivers"], PREFIX, SUFFIX, max_new_tokens=2)
        assert short.stats.completion_tokens == 2
        same = engine.generate(["a document about rivers"], PREFIX, SUFFIX, sampling=SamplingParams(temperature=0.0))
        assert same.stats.completion_tokens == 3  # the engine's max_new_tokens, the request's temperature


def test_a_moved_field_says_where_it_went(tiny_model, tiny_tokenizer):
    with pytest.raises(TypeError, match=r"sampling=SamplingParams\(max_new_tokens=\.\.\.\)"):
        Engine.from_model(tiny_model, tiny_tokenizer, max_new_tokens=8)
    with pytest.raises(TypeError, match=r"selection_params=\{'probe_layer': \.\.\.\}"):
        EngineConfig().replace(probe_layer=12)
    with pytest.raises(TypeError, match="unknown EngineConfig field"):
        Engine.from_model(tiny_model, tiny_tokenizer, memory_budget=1)


def test_overrides_set_sampling_and_selection_parameters_field_by_field():
    pairs = ["sampling.max_new_tokens=32", 'sampling.stop=["END"]', "selection_params.probe_layer=12", "mode=full"]
    out = parse_overrides(pairs)
    assert out == {
        "sampling": {"max_new_tokens": 32, "stop": ("END",)},
        "selection_params": {"probe_layer": 12},
        "mode": "full",
    }
    config = EngineConfig().replace(**out)
    assert config.sampling == SamplingParams(32, 0.0, 1.0, ("END",)) and config.selection_params == {"probe_layer": 12}
    assert parse_overrides(['sampling={"seed": 1}'])["sampling"] == {"seed": 1}
    for pair, message in (
        ("max_new_tokens=32", "max_new_tokens is sampling.max_new_tokens now"),
        ("probe_layer=12", "probe_layer is selection_params.probe_layer now"),
        ("sampling.max_tokens=3", "sampling has no field 'max_tokens'"),
        ("mode.x=3", "field of EngineConfig"),
        ("selection_params.=3", "selection_params.NAME=VALUE"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            parse_overrides([pair])


def test_the_docstring_reads_true():
    """``help(kvrag.EngineConfig)``: the two groups, every field documented, the families and selections of today."""
    import dataclasses

    from kvrag.engine.model.families import FAMILIES
    from kvrag.engine.reuse.selection import registered_selections
    from tests.engine.reuse.test_selection_registry import PRODUCT as PRODUCT_SELECTIONS

    doc = EngineConfig.__doc__
    users, advanced = doc.split("What users set:")[1].split("Advanced:")
    for field in dataclasses.fields(EngineConfig):
        assert f"\n        {field.name}: " in doc, f"{field.name} is not documented"
    for field in ("model", "dtype", "mode", "recompute_ratio", "sampling", "memory_budget_bytes", "namespace"):
        assert f"\n        {field}: " in users
    assert "\n        selection_params: " in advanced
    for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma 3"):
        assert name in doc
    assert len(FAMILIES) == 5
    for name in PRODUCT_SELECTIONS:  # what kvrag registers (a harness may have added its own by now)
        assert f"``{name}``" in doc and name in registered_selections()
