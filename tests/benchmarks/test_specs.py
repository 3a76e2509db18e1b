"""Method specs NAME[@RATIO][+FIELD=VALUE]: parsing, refusals, and overrides that reach the engine."""

from __future__ import annotations

import json

import pytest

from benchmarks import BenchOptions, make_synthetic_dataset, parse_methods, run_bench
from benchmarks.specs import config_overrides, split_specs
from kvrag import InvalidRequestError


def test_specs_carry_a_ratio_and_engine_overrides():
    ms = parse_methods("probe@0.15,epic@0.15+chunk_context=sink,hkvd@0.2+filter_schedule=[3.0,2.0]+check_layer=2")
    assert [m.name for m in ms] == [
        "full",
        "probe@0.15",
        "epic@0.15+chunk_context=sink",
        "hkvd@0.2+filter_schedule=[3.0,2.0]+check_layer=2",
    ]
    assert (ms[1].selection, ms[1].ratio, ms[1].overrides) == ("probe", 0.15, {})
    assert (ms[2].selection, ms[2].ratio, ms[2].overrides) == ("epic", 0.15, {"chunk_context": "sink"})
    # a strategy's parameter configures the method's selection; JSON values, lists as tuples
    assert ms[3].overrides == {
        "selection": "hkvd",
        "selection_params": {"filter_schedule": (3.0, 2.0), "check_layer": 2},
    }
    (probe12,) = parse_methods("probe@0.15+probe_layer=12")[1:]
    assert probe12.overrides == {"selection": "probe", "selection_params": {"probe_layer": 12}}
    blend12 = parse_methods("blend@0.15+selection_params.probe_layer=12")[1]  # the dotted form works too
    assert blend12.overrides == {"selection_params": {"probe_layer": 12}} and blend12.selection is None
    auto, probe_auto = parse_methods("auto+auto_max_ratio=0.5,probe@auto")[1:]
    assert (auto.ratio, auto.selection, auto.overrides) == ("auto", None, {"auto_max_ratio": 0.5})
    assert (probe_auto.ratio, probe_auto.selection) == ("auto", "probe")
    assert parse_methods("blend+recompute_ratio=0.3+prefix_cache=false")[1].overrides == {
        "recompute_ratio": 0.3,
        "prefix_cache": False,
    }
    # full takes a dtype of its own: a float32 reference beside the run's full
    full, fp32 = parse_methods("full,full+dtype=float32")
    assert (fp32.name, fp32.mode, fp32.overrides, fp32.uses_store) == (
        "full+dtype=float32",
        "full",
        {"dtype": "float32"},
        False,
    )
    assert full.overrides == {}


def test_a_method_in_another_dtype_gets_the_model_in_that_dtype(tiny_engine, tiny_model, tiny_tokenizer):
    """``full+dtype=...`` runs on an engine of its own, in every workload: built by ``load`` where the
    bench loaded the model (the model in that dtype), else over a converted copy of the run's model;
    a store of its own, closed with the others. A method in the run's dtype shares its weights."""
    import torch

    from benchmarks.engines import MethodEngines
    from kvrag import Engine
    from tests.helpers import as_dtype

    ref = parse_methods("full+dtype=bfloat16")[1]
    loaded = []

    def load(config, store):
        loaded.append((config.dtype, store))
        return Engine.from_model(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer, config=config)

    with MethodEngines(tiny_engine, load) as engines:
        own = engines.shared(ref)
        assert engines.reference(ref) is own and engines.runners([ref], {"lru": {}})[0][2] is own
        assert loaded == [("bfloat16", None)]  # once per method, with no store: it builds its own
        assert own.store is not tiny_engine.store and own.fingerprint != tiny_engine.fingerprint
    with MethodEngines(tiny_engine) as engines:
        converted = engines.reference(ref)
        assert converted.hf_model is not tiny_engine.hf_model and converted.config.dtype == "bfloat16"
        assert converted.hf_model.dtype == torch.bfloat16 and tiny_engine.hf_model.dtype == torch.float32
        assert converted.store is not tiny_engine.store and converted.fingerprint != tiny_engine.fingerprint
        same = engines.reference(parse_methods("full+dtype=float32")[1])
        assert same.hf_model is tiny_engine.hf_model and same.store is not tiny_engine.store
    for engine in (own, converted, same):  # closed with the others; the run's engine stays open
        with pytest.raises(InvalidRequestError, match="closed"):
            engine.generate(prompt="still open?", max_new_tokens=1)
    assert tiny_engine.count_tokens("still open") > 0


def test_a_list_splits_on_commas_outside_brackets():
    assert split_specs("full, hkvd@0.15+filter_schedule=[3.0,2.0] ,epic@0.1,") == [
        "full",
        "hkvd@0.15+filter_schedule=[3.0,2.0]",
        "epic@0.1",
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("probe@0.15+nonsense=1", "field of EngineConfig"),
        ("probe@0.15+probe_stride", "FIELD=VALUE"),
        ("probe@0.15+probe_stride=0", "probe_stride"),  # the probe's parameters' own validation
        ("hkvd@0.15+filter_schedule=[1.0,2.0]", "filter_schedule"),
        ("probe@0.15+check_layer=2", r"'probe' takes no parameter\(s\) check_layer"),
        ("hkvd@0.15+probe_layer=2", r"'hkvd' takes no parameter\(s\) probe_layer"),
        ("probe@0.15+selection=magic", "unknown selection 'magic'; registered: "),
        ("probe@0.15+max_new_tokens=3", "sampling.max_new_tokens"),
        ("probe@0.15+eviction_policy=3", "eviction_policy must be"),
        ("probe@0.15+dtype=bfloat16", "only full takes a dtype"),
        ("auto+dtype=float32", "only full takes a dtype"),
        ("full+dtype=auto", "name a dtype"),
        ("full+dtype=float8", "dtype"),
        ("probe@0.15+model=x", "same model"),
        ("full+num_threads=1", "same model"),
        ("full+recompute_ratio=0.3", "reference"),
        ("full+dtype=float32+recompute_ratio=0.3", "takes only a dtype"),
        ("hf+mode=full", "transformers"),
        ("probe@", "nothing after"),
        ("probe@x", "not a number"),
        ("probe@1.5", r"\[0, 1\]"),
        ("nope@0.1", "unknown method"),
        ("auto@0.2", "no @ argument"),
        ("epic@0.1,epic@0.1", "twice"),
    ],
)
def test_bad_specs_are_refused_by_name(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_methods(spec)


def test_config_overrides_name_where_they_were_written():
    assert config_overrides(['cache_dir="/tmp/x"', "disk_tier=true"]) == {"cache_dir": "/tmp/x", "disk_tier": True}
    with pytest.raises(InvalidRequestError, match="--config"):
        config_overrides(["memory_budget_bytes=-1"])
    # a run's --config: a bare parameter configures the configured selection (the probe by default)
    assert config_overrides(["probe_layer=12"]) == {"selection_params": {"probe_layer": 12}}
    assert config_overrides(["selection=hkvd", "check_layer=2"]) == {
        "selection": "hkvd",
        "selection_params": {"check_layer": 2},
    }
    with pytest.raises(InvalidRequestError, match=r"--config: selection 'probe' takes no parameter\(s\) check_layer"):
        config_overrides(["check_layer=2"])


def test_an_override_runs_on_an_engine_of_its_own_over_the_shared_store(tmp_path, tiny_engine):
    """Workload (a): ``blend@0.3+selection=recency`` takes its selection from its own engine's config
    and finds the chunks warmed into the run's store: it does exactly what ``recency@0.3`` does."""
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(1, passages=3, words=12)))
    opts = dict(dataset=str(data), n=1, top_k=3, max_new_tokens=3, workloads="a", plots=False, progress=False)
    res = run_bench(
        BenchOptions(**opts, methods="full,recency@0.3,blend@0.3+selection=recency,blend@0.3", out=str(tmp_path / "o")),
        engine=tiny_engine,
    )
    rows = {(r["request"], r["method"]): r for r in res["records"]}
    same, over, probe = rows[0, "recency@0.3"], rows[0, "blend@0.3+selection=recency"], rows[0, "blend@0.3"]
    assert over["chunk_hits"] == 3  # the run's store: warmed there, found here
    for key in ("text", "recomputed_tokens", "compute_fraction", "answer_drift_full"):
        assert over[key] == same[key]
    assert probe["compute_fraction"] != over["compute_fraction"]  # the default selection differs
    with pytest.raises(InvalidRequestError, match="store"):
        run_bench(
            BenchOptions(**opts, methods="full,blend@0.3+memory_budget_bytes=1000", out=str(tmp_path / "x")),
            engine=tiny_engine,
        )
