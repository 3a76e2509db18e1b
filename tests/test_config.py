"""The config a user reads: four groups set and read flat or grouped, default sampling as one field,
moved and renamed fields pointing where they went, ``--config`` overrides, the checks behind every
value, and an import that needs no torch."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import kvrag
from kvrag import (
    ComputeSettings,
    Engine,
    EngineConfig,
    InvalidRequestError,
    ReuseSettings,
    SamplingParams,
    ServingSettings,
    StoreSettings,
)
from kvrag.checks import flag, integer, is_int, is_number, number, one_of, share, text
from kvrag.config import DEFAULT_SAMPLING, FLAT_FIELDS, GROUPS, OTHER_CONTEXT_RATIO, check_field_names, parse_overrides
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
    assert SamplingParams(temperature=0.5).resolved(engine_defaults) == SamplingParams(
        5, 0.5, 1.0, ("END",), None, False
    )
    assert SamplingParams(stop=[]).resolved(engine_defaults).stop == ()
    assert SamplingParams().resolved(DEFAULT_SAMPLING) == SamplingParams(64, 0.0, 1.0, (), None, False)


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


def test_groups_hold_every_setting_once_and_flat_names_reach_them():
    groups = (ComputeSettings, ReuseSettings, StoreSettings, ServingSettings)
    assert tuple(GROUPS.values()) == groups
    names = [f.name for cls in groups for f in dataclasses.fields(cls)]
    assert FLAT_FIELDS == tuple(names) and len(set(names)) == len(names) == 56
    config = EngineConfig()
    assert list(config.flat()) == list(FLAT_FIELDS)
    for name, cls in GROUPS.items():
        group = getattr(config, name)
        assert group == cls()
        for field in dataclasses.fields(cls):  # flat and grouped reads agree, and the default is the field's
            assert getattr(config, field.name) == getattr(group, field.name) == config.flat()[field.name]
            assert getattr(config, field.name) == (field.default if field.name != "sampling" else DEFAULT_SAMPLING)
    assert "recompute_ratio" in dir(config)
    custom = EngineConfig(recompute_ratio=0.2, namespace="n", sampling={"seed": 1})
    assert EngineConfig(**custom.flat()) == custom  # flat() round-trips
    with pytest.raises(AttributeError, match="recompute"):
        config.recompute  # noqa: B018


def test_a_config_is_built_grouped_or_flat_or_both_and_a_flat_setting_wins():
    grouped = EngineConfig(reuse=ReuseSettings(recompute_ratio=0.3), store=StoreSettings(disk_tier=True))
    flat = EngineConfig(recompute_ratio=0.3, disk_tier=True)
    assert grouped == flat and hash(grouped) == hash(flat) and flat.reuse.recompute_ratio == flat.recompute_ratio == 0.3
    assert flat != EngineConfig() and len({flat, grouped, EngineConfig()}) == 2
    mixed = EngineConfig(reuse=ReuseSettings(mode="full", recompute_ratio=0.5), recompute_ratio=1, namespace="a")
    assert (mixed.mode, mixed.recompute_ratio, mixed.namespace) == ("full", 1.0, "a")  # int -> float
    assert isinstance(mixed.recompute_ratio, float)
    # replace takes names and groups alike; a group given whole replaces the old one
    changed = mixed.replace(max_running=2, store=StoreSettings(namespace="b"))
    assert (changed.max_running, changed.namespace, changed.mode) == (2, "b", "full")
    assert changed.replace(compute=ComputeSettings(), dtype="float32").compute == ComputeSettings(dtype="float32")
    assert dataclasses.replace(mixed, namespace="c").namespace == "c"
    with pytest.raises(InvalidRequestError, match="reuse must be a ReuseSettings"):
        EngineConfig(reuse={"mode": "full"})
    with pytest.raises(TypeError):
        EngineConfig(None)  # groups and settings by name only


def test_a_config_is_immutable_hashable_and_copies_by_value():
    config = EngineConfig(selection_params={"probe_stride": 8, "probe_layer": [1]}, sampling={"stop": ["END"]})
    assert config.selection_params == {"probe_layer": (1,), "probe_stride": 8}  # sorted, lists as tuples
    assert list(config.selection_params) == ["probe_layer", "probe_stride"]
    same = EngineConfig(selection_params={"probe_layer": (1,), "probe_stride": 8}, sampling={"stop": "END"})
    assert config == same and hash(config) == hash(same) and {config: 1}[same] == 1
    for copied in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), copy.copy(config)):
        assert copied == config and hash(copied) == hash(config)
    for name in ("recompute_ratio", "reuse"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.reuse.mode = "full"


def test_old_names_are_taken_with_a_warning_naming_the_new_one():
    with pytest.warns(DeprecationWarning, match="foreign_ratio is now other_context_ratio") as seen:
        config = EngineConfig(foreign_ratio=0.2)
    assert seen[0].filename == __file__  # the warning points at the caller
    assert config.other_context_ratio == config.reuse.other_context_ratio == 0.2
    with pytest.warns(DeprecationWarning, match="other_context_overlap"):
        assert config.replace(foreign_overlap=0.1).other_context_overlap == 0.1
    with pytest.warns(DeprecationWarning, match="other_context_selection"):
        out = parse_overrides(["foreign_selection=null", "recompute_ratio=0.3"])
    assert out == {"other_context_selection": None, "recompute_ratio": 0.3}
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidRequestError, match="other_context_selection must be"):
        EngineConfig(foreign_selection="")
    with pytest.raises(TypeError, match="foreign_ratio is the old name of other_context_ratio"):
        EngineConfig(foreign_ratio=0.1, other_context_ratio=0.2)
    check_field_names(["foreign_ratio", "other_context_ratio", "reuse"])  # old names and groups are known
    with pytest.raises(AttributeError):  # an old name is taken as a keyword, never read
        config.foreign_ratio  # noqa: B018
    assert OTHER_CONTEXT_RATIO == EngineConfig().other_context_ratio


def test_each_check_returns_the_value_or_names_the_setting():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3.5) and is_number(3) and not is_number(False) and not is_number("3")
    assert integer(1)("n", 5) == 5 and integer(1, also=(None,))("n", None) is None
    assert integer(0, also=("auto",))("budget", "auto") == "auto"
    for bad, message in (
        (0, "n must be an integer >= 1, got 0"),
        (True, "n must be an integer >= 1, got True"),
        (2.0, "n must be an integer >= 1, got 2.0"),
        (None, "n must be an integer >= 1, got None"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            integer(1)("n", bad)
    with pytest.raises(InvalidRequestError, match=r"^n must be 'auto' or an integer >= 0 or None \(why\), got -1$"):
        integer(0, also=("auto", None), note="why")("n", -1)
    assert number(0.0)("x", 2) == 2.0 and isinstance(number(0.0)("x", 2), float)
    assert number(0.0)("x", math.inf) == math.inf and number(0.0, also=(None,))("x", None) is None
    for check, bad, message in (
        (number(0.0), -1, "x must be a number >= 0, got -1"),
        (number(0.0, finite=True), math.inf, "x must be a finite number >= 0, got inf"),
        (number(0.0, open_low=True), 0, "x must be a number > 0, got 0"),
        (number(0.0, 1.0, open_low=True), 0.0, r"x must be a number in \(0, 1\], got 0.0"),
        (number(0.0), True, "x must be a number >= 0, got True"),
        (number(0.0), math.nan, "x must be a number >= 0, got nan"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            check("x", bad)
    assert share()("s", 1) == 1.0 and share()("s", 0) == 0.0
    for bad in (1.5, -0.1, "0.5", True):
        with pytest.raises(InvalidRequestError, match=r"s must be a number in \[0, 1\]"):
            share()("s", bad)
    assert flag()("b", False) is False
    with pytest.raises(InvalidRequestError, match="b must be True or False, got 1"):
        flag()("b", 1)
    assert one_of(("a", "b"))("c", "b") == "b" and one_of((1, 2), also=(None,))("c", None) is None
    with pytest.raises(InvalidRequestError, match=r"c must be 'auto' or one of \('a', 'b'\), got 'z'"):
        one_of(("a", "b"), also=("auto",))("c", "z")
    with pytest.raises(InvalidRequestError, match=r"c must be one of \(1, 2\), got True"):
        one_of((1, 2))("c", True)  # a bool is no count
    assert text()("t", "x") == "x" and text(also=(None,))("t", None) is None
    for bad in ("", None, 3):
        with pytest.raises(InvalidRequestError, match="t must be the name of a policy, got"):
            text(what="the name of a policy")("t", bad)


@pytest.mark.parametrize(
    "setting, bad, message",
    [
        ("dtype", "fp32", r"dtype must be 'auto' or one of \('float32'"),
        ("num_threads", 0, "num_threads must be an integer >= 1 or None"),
        ("tune_malloc", "yes", "tune_malloc must be True or False"),
        ("max_context", 1, "max_context must be an integer >= 2 or None"),
        ("mode", "fast", "mode must be one of"),
        ("recompute_ratio", 1.5, r"recompute_ratio must be in \[0, 1\] or 'auto'"),
        ("quality", "best", "quality must be one of 'fast', 'balanced', 'faithful'"),
        ("selection", "", "selection must be the name of a selection strategy"),
        ("selection_params", [("probe_layer", 2)], "selection_params must be a mapping"),
        ("auto_max_ratio", 2, r"auto_max_ratio must be a number in \[0, 1\]"),
        ("auto_threshold", -1, "auto_threshold must be a number >= 0 or None"),
        ("other_context_ratio", -0.5, "other_context_ratio must be a number in"),
        ("prefix_block_tokens", 0, "prefix_block_tokens must be an integer >= 1"),
        ("chunk_context", "left", "chunk_context must be one of"),
        ("chunk_min_tokens", -1, "chunk_min_tokens must be"),
        ("max_variants", 0, "max_variants must be an integer >= 1"),
        ("warm_window_tokens", 255, "warm_window_tokens must be an integer >= 256"),
        ("warm_variants", 3, "warm_variants must be 1 or 2 and at most max_variants"),
        ("write_back", None, "write_back must be True or False"),
        ("chunk_access_window", 0, "chunk_access_window must be an integer >= 1 or None"),
        ("promotion_threshold", 0, "promotion_threshold must be an integer >= 1"),
        ("max_conversations", -1, "max_conversations must be an integer >= 0"),
        ("memory_budget_bytes", "2GiB", "memory_budget_bytes must be 'auto' or an integer >= 0"),
        ("disk_budget_bytes", -1, "disk_budget_bytes must be an integer >= 0"),
        ("remote_url", "http://x", "remote_url must start with redis://"),
        ("namespace", "", "namespace must be a non-empty string"),
        ("kv_codec", "int4", "kv_codec must be 'auto' or one of"),
        ("disk_dtype", "auto", "disk_dtype must be one of"),
        ("remote_timeout_s", 0, "remote_timeout_s must be a number > 0"),
        ("remote_ttl_s", 0, "remote_ttl_s must be a number > 0 or None"),
        ("eviction_policy", "", "eviction_policy must be the name of a policy"),
        ("sampling", 5, "sampling must be a SamplingParams"),
        ("max_queued", 0, "max_queued must be an integer >= 1"),
        ("draft_tokens", -1, "draft_tokens must be an integer >= 0 or None"),
        ("prefill_slice_s", math.inf, "prefill_slice_s must be a finite number >= 0"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_setting(setting, bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**{setting: bad})


def test_warm_variants_stay_within_max_variants():
    assert EngineConfig(warm_variants=1, max_variants=1).warm_variants_for("similar") == 1
    assert EngineConfig().warm_variants_for("similar") == 2 and EngineConfig().warm_variants_for("given") == 1
    with pytest.raises(InvalidRequestError, match="warm_variants must be 1 or 2 and at most max_variants, got 2"):
        EngineConfig(warm_variants=2, max_variants=1)


def test_the_docstrings_read_true():
    """``help(kvrag.EngineConfig)``: a short page naming every setting and its group; each group documents
    its fields, what users set first; the families and selections of today; no run's figures."""
    from kvrag.engine.model.families import FAMILIES
    from kvrag.engine.reuse.selection import registered_selections
    from tests.engine.reuse.test_selection_registry import PRODUCT as PRODUCT_SELECTIONS

    doc = EngineConfig.__doc__
    assert len(doc.splitlines()) <= 60
    for name in (*FLAT_FIELDS, *GROUPS):
        assert f"``{name}``" in doc, f"{name} is not named in EngineConfig's docstring"
    for cls in GROUPS.values():
        assert cls.__name__ in doc
        for field in dataclasses.fields(cls):
            assert f"\n        {field.name}: " in cls.__doc__, f"{cls.__name__}.{field.name} is not documented"
    users = "".join(cls.__doc__.split("Advanced attributes:")[0] for cls in GROUPS.values())
    advanced = "".join(cls.__doc__.partition("Advanced attributes:")[2] for cls in GROUPS.values())
    for field in ("model", "dtype", "mode", "recompute_ratio", "sampling", "memory_budget_bytes", "namespace"):
        assert f"\n        {field}: " in users
    assert "\n        selection_params: " in users and "\n        other_context_ratio: " in advanced
    docs = doc + "".join(cls.__doc__ for cls in GROUPS.values())
    for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma 3"):
        assert name in docs
    assert len(FAMILIES) == 5
    for name in PRODUCT_SELECTIONS:  # what kvrag registers (a harness may have added its own by now)
        assert f"``{name}``" in docs and name in registered_selections()
    for word in ("H200", "issue ", "company", "foreign"):  # figures and history live in docs/, words are plain
        assert word not in docs.replace("foreign_", ""), word
