"""The calibration experiments of ``recompute_ratio="auto"`` (:mod:`benchmarks.calibration`): the
constants' math, and the measurements on a tiny engine (which they leave as they found it)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import calibration
from benchmarks.calibration import CalibrationQuestion, calibrate, calibrate_qualities
from kvrag import Engine, InvalidRequestError
from tests.helpers import PREFIX, SUFFIX, make_docs


def test_calibration_picks_the_threshold_and_alpha_that_spend_the_target():
    sizes = torch.tensor([10, 10, 10, 10])
    deviation = torch.tensor([0.1, 0.9, 0.5, 0.3])
    assert calibration.threshold_for(sizes, deviation, 0.5) == 0.5  # the blocks of 0.9 and 0.5 hold half the tokens
    alpha = calibration.alpha_for([(100, 0.5), (100, 0.1)], 0.15)
    assert abs(sum(min(s, alpha * f * s) for s, f in [(100, 0.5), (100, 0.1)]) / 200 - 0.15) < 1e-6


def test_measurements_pool_the_questions_and_refuse_when_nothing_was_measured():
    m = calibration.Measurements()
    with pytest.raises(InvalidRequestError, match="measured nothing"):
        m.constants(0.15)
    m.add({}, [])  # a question that blended nothing adds nothing
    m.add({"block_sizes": torch.tensor([10, 10]), "block_deviation": torch.tensor([0.1, 0.9])}, [(100, 0.5)])
    m.add({"block_sizes": torch.tensor([10, 10]), "block_deviation": torch.tensor([0.5, 0.3])}, [(100, 0.1)])
    assert m.blocks == 4
    threshold, alpha = m.constants(0.5)
    assert threshold == 0.5 and alpha == calibration.alpha_for([(100, 0.5), (100, 0.1)], 0.5)


def test_the_probe_settings_a_threshold_belongs_to(tiny_model, tiny_tokenizer):
    with Engine.from_model(tiny_model, tiny_tokenizer) as engine:
        layer = engine.adapter.n_layers // 4 + 1  # the probe's default layer
        assert calibration.probe_settings(engine) == calibration.probe_key(layer, 16, "kv")
    params = {"probe_layer": 2, "probe_stride": 8}
    with Engine.from_model(tiny_model, tiny_tokenizer, selection_params=params) as engine:
        assert calibration.probe_settings(engine) == "layer=2,stride=8,deviation=kv"


def _questions() -> list[CalibrationQuestion]:
    docs = make_docs(6, words=50, seed=3)
    return [
        CalibrationQuestion(chunks=[docs[2], docs[0], docs[1]], retrieved=docs[:3], prefix=PREFIX, suffix=SUFFIX),
        CalibrationQuestion(chunks=[docs[5], docs[3], docs[4]], retrieved=docs[3:], prefix=PREFIX, suffix=SUFFIX),
    ]


def test_calibrate_measures_the_constants(tmp_path, tiny_model, tiny_tokenizer):
    seen = []
    with Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path)) as engine:
        res = calibrate(engine, _questions(), target=0.2, progress=lambda done, total: seen.append((done, total)))
        assert seen == [(1, 2), (2, 2)] and res.questions == 2 and res.blocks > 0
        assert res.threshold > 0 and res.alpha > 0 and res.probe == calibration.probe_settings(engine)
        assert engine.store.stats()["entries"] == 0  # emptied after each question
        assert engine.config.auto_threshold is None  # measured, not set: a user sets auto_threshold=
    with Engine.from_model(tiny_model, tiny_tokenizer, auto_threshold=res.threshold) as engine:
        assert "measured per request" in engine.info().blend  # set, the probe measures each request


def test_calibrate_refuses_bad_input_with_one_clear_error(tmp_path, tiny_engine, tiny_model, tiny_tokenizer):
    q = _questions()[0]
    bad = [
        ([], {}, "non-empty list"),
        ("abc", {}, "non-empty list"),
        ([q, {"chunks": ["x"]}], {}, r"questions\[1\] is a dict"),
        ([CalibrationQuestion(chunks=q.chunks, retrieved=q.chunks[:2])], {}, "same passages"),
        ([q], {"target": 0}, "target must be"),
        ([q], {"target": 1.5}, "target must be"),
        ([q], {"target": True}, "target must be"),
    ]
    for questions, kwargs, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            calibrate(tiny_engine, questions, **kwargs)
    with Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), disk_tier=True) as disk:
        with pytest.raises(InvalidRequestError, match="disk_tier"):
            calibrate(disk, [q])


# -- the share of KV from another context per quality ----------------------------------------------------


def test_quality_shares_are_the_least_that_reach_each_target_never_below_a_faster_one():
    m = calibration.QualityMeasurements()
    with pytest.raises(InvalidRequestError, match="measured nothing"):
        m.shares()
    # the probe's drift 0.10; recency's falls with the share
    m.add(0.12, {0.1: 0.13, 0.2: 0.09, 0.4: 0.07, 0.6: 0.05})
    m.add(0.08, {0.1: 0.09, 0.2: 0.07, 0.4: 0.05, 0.6: 0.05})
    assert m.means() == pytest.approx({0.1: 0.11, 0.2: 0.08, 0.4: 0.06, 0.6: 0.05})
    switch, shares, reached = m.shares()
    # fast <= 0.10 -> 0.2: more than the probe's 15% for the probe's drift: no switch, no shares
    assert (switch, shares) == (False, {}) and all(reached.values())
    m.add(0.10, {0.1: 0.05, 0.2: 0.08, 0.4: 0.06, 0.6: 0.05})  # now 0.1 reaches the probe's drift (0.10)
    switch, shares, reached = m.shares()
    # fast <= 0.10 -> 0.1; balanced <= 0.085 -> 0.2; faithful <= 0.05 -> 0.6
    assert switch and shares == {"fast": 0.1, "balanced": 0.2, "faithful": 0.6} and all(reached.values())
    hard = calibration.QualityMeasurements()
    hard.add(0.10, {0.1: 0.09, 0.3: 0.09})
    switch, shares, reached = hard.shares()
    assert switch and shares == {"fast": 0.1}  # a quality no share reaches keeps the built-in share
    assert reached == {"fast": True, "balanced": False, "faithful": False}


def test_calibrate_qualities_measures_the_shares(tmp_path, tiny_model, tiny_tokenizer):
    seen = []
    docs = make_docs(4, words=50, seed=5)
    questions = _questions() + [
        CalibrationQuestion(chunks=[docs[1], docs[0]], retrieved=docs[:2], prefix=PREFIX, suffix=SUFFIX)
    ]
    with Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path)) as engine:
        got = calibrate_qualities(
            engine, questions, max_new_tokens=4, shares=(0.1, 0.5, 1.0), progress=lambda d, t: seen.append((d, t))
        )
        assert seen == [(1, 3), (2, 3), (3, 3)] and got.questions == 3 and got.selection == "recency"
        assert set(got.drifts) == {0.1, 0.5, 1.0} and got.drifts[1.0] < 1e-3  # everything recomputed: no drift
        picked = [got.shares[q] for q in ("fast", "balanced", "faithful") if q in got.shares]
        assert picked == sorted(picked) and all(0 < x <= 1.0 for x in picked)
        assert set(got.shares) == ({q for q, ok in got.reached.items() if ok} if got.switch else set())
        assert engine.store.stats()["entries"] == 0
        assert got.reference >= 0


def test_calibrate_qualities_refuses_bad_input_with_one_clear_error(tmp_path, tiny_model, tiny_tokenizer):
    qs = _questions()
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        bad = [
            (qs[:1], {}, "passages of other questions"),  # one question: no stranger to warm before its passages
            (qs, {"others": 4}, "passages of other questions"),
            (qs, {"shares": ()}, "non-empty list of shares"),
            (qs, {"shares": (0.1, 2.0)}, "in \\(0, 1\\]"),
            (qs, {"max_new_tokens": 0}, "max_new_tokens must be"),
            (qs, {"others": True}, "others must be"),
        ]
        for questions, kwargs, match in bad:
            with pytest.raises(InvalidRequestError, match=match):
                calibrate_qualities(engine, questions, **kwargs)
    finally:
        engine.close()
    for settings, match in (
        ({"other_context_selection": None}, "other_context_selection"),
        ({"disk_tier": True}, "disk_tier"),
    ):
        other = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), **settings)
        try:
            with pytest.raises(InvalidRequestError, match=match):
                calibrate_qualities(other, qs)
        finally:
            other.close()
