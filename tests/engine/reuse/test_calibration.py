"""Calibration of ``recompute_ratio="auto"``: the constants' math, where they are kept, and
:meth:`Engine.calibrate` measuring them on a tiny engine."""

from __future__ import annotations

import json

import pytest
import torch

from kvrag import CalibrationQuestion, Engine, InvalidRequestError
from kvrag.engine.reuse import calibration
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


def test_a_calibration_is_found_for_its_model_fingerprint(tmp_path, tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        assert engine.auto_threshold is None and engine.auto_alpha == 1.0
        layer = engine.adapter.n_layers // 4 + 1  # the probe's default layer
        assert engine._probe_key() == calibration.probe_key(layer, 16, "kv")
        calibration.save(tmp_path, engine.fingerprint, engine._probe_key(), 0.25, {"alpha": 2.0})
    finally:
        engine.close()
    again = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        assert (again.auto_threshold, again.auto_alpha) == (0.25, 2.0)
        g = again.generate(["a document about rivers and castles"] * 1, "x", "y", max_new_tokens=1)
        assert g.stats.recompute_ratio >= 0.0
    finally:
        again.close()


def _questions() -> list[CalibrationQuestion]:
    docs = make_docs(6, words=50, seed=3)
    return [
        CalibrationQuestion(chunks=[docs[2], docs[0], docs[1]], retrieved=docs[:3], prefix=PREFIX, suffix=SUFFIX),
        CalibrationQuestion(chunks=[docs[5], docs[3], docs[4]], retrieved=docs[3:], prefix=PREFIX, suffix=SUFFIX),
    ]


def test_engine_calibrate_measures_saves_and_uses_the_constants(tmp_path, tiny_model, tiny_tokenizer):
    seen = []
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        res = engine.calibrate(_questions(), target=0.2, progress=lambda done, total: seen.append((done, total)))
        assert seen == [(1, 2), (2, 2)] and res.questions == 2 and res.blocks > 0
        assert res.threshold > 0 and res.alpha > 0
        assert (engine.auto_threshold, engine.auto_alpha) == (res.threshold, res.alpha)  # used at once
        assert engine.store.stats()["entries"] == 0  # emptied after each question
        saved = json.loads(res.path.read_text())[res.probe]
        assert saved["threshold"] == res.threshold
        assert {k: saved[k] for k in ("alpha", "target", "questions")} == {
            "alpha": res.alpha,
            "target": 0.2,
            "questions": 2,
        }
    finally:
        engine.close()
    again = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        assert (again.auto_threshold, again.auto_alpha) == (res.threshold, res.alpha)
    finally:
        again.close()


def test_engine_calibrate_refuses_bad_input_with_one_clear_error(tmp_path, tiny_engine, tiny_model, tiny_tokenizer):
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
            tiny_engine.calibrate(questions, **kwargs)
    disk = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), disk_tier=True)
    try:
        with pytest.raises(InvalidRequestError, match="disk_tier"):
            disk.calibrate([q])
    finally:
        disk.close()


# -- the foreign share per quality ------------------------------------------------------------------------


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


def test_calibrated_shares_are_kept_per_model_and_selection_and_replace_the_built_in_ones(tmp_path):
    from kvrag.config import EngineConfig

    fp = "f" * 64
    assert calibration.load_shares(tmp_path, fp, "recency") == (None, {})
    shares = {"fast": 0.05, "balanced": 0.2, "faithful": 0.45}
    calibration.save_shares(tmp_path, fp, "recency", True, shares, {"n": 2})
    calibration.save(tmp_path, fp, "layer=2,stride=16,deviation=kv", 0.3, {})  # other keys kept side by side
    assert calibration.load_shares(tmp_path, fp, "recency") == (True, shares)
    assert calibration.load_shares(tmp_path, fp, "probe") == (None, {})
    path = tmp_path / "calibration" / f"{fp}.json"
    data = json.loads(path.read_text())
    data["foreign=recency"]["shares"] = {"fast": -1, "balanced": "x", "faithful": 0.5, "other": 0.1}
    path.write_text(json.dumps(data))
    assert calibration.load_shares(tmp_path, fp, "recency") == (True, {"faithful": 0.5})  # bad values dropped
    data["foreign=recency"]["switch"] = "yes"
    path.write_text(json.dumps(data))
    assert calibration.load_shares(tmp_path, fp, "recency") == (None, {})  # a damaged entry: not calibrated
    cfg, calibrated = EngineConfig(), {"fast": 0.05, "balanced": 0.2, "faithful": 0.45}
    assert cfg.quality_shares() == (0.15, 0.13)
    assert cfg.quality_shares("faithful", calibrated) == (0.30, 0.45)
    assert cfg.quality_shares(calibrated=calibrated) == (0.15, 0.2)
    assert EngineConfig(other_context_ratio=0.3).quality_shares(calibrated=calibrated) == (
        0.15,
        0.3,
    )  # a set ratio wins


def test_engine_calibrate_qualities_measures_saves_and_uses_the_shares(tmp_path, tiny_model, tiny_tokenizer):
    seen = []
    docs = make_docs(4, words=50, seed=5)
    questions = _questions() + [
        CalibrationQuestion(chunks=[docs[1], docs[0]], retrieved=docs[:2], prefix=PREFIX, suffix=SUFFIX)
    ]
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    try:
        assert engine.foreign_shares == {}
        got = engine.calibrate_qualities(
            questions, max_new_tokens=4, shares=(0.1, 0.5, 1.0), progress=lambda d, t: seen.append((d, t))
        )
        assert seen == [(1, 3), (2, 3), (3, 3)] and got.questions == 3 and got.selection == "recency"
        assert set(got.drifts) == {0.1, 0.5, 1.0} and got.drifts[1.0] < 1e-3  # everything recomputed: no drift
        picked = [got.shares[q] for q in ("fast", "balanced", "faithful") if q in got.shares]
        assert picked == sorted(picked) and all(0 < x <= 1.0 for x in picked)
        assert set(got.shares) == ({q for q, ok in got.reached.items() if ok} if got.switch else set())
        assert (engine.foreign_calibrated, engine.foreign_shares) == (got.switch, got.shares)  # used at once
        assert engine.store.stats()["entries"] == 0
        saved = json.loads(got.path.read_text())["foreign=recency"]
        assert saved["shares"] == got.shares and saved["switch"] == got.switch and saved["questions"] == 3
        assert saved["reference"]["share"] == 0.15
    finally:
        engine.close()
    for switch in (True, False):  # a later engine of the model follows what was saved
        shares = {"balanced": 0.42} if switch else {}
        calibration.save_shares(tmp_path, got.path.stem, "recency", switch, shares, {})
        again = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
        try:
            assert (again.foreign_calibrated, again.foreign_shares) == (switch, shares)
            blend = again.info().blend
            assert ("42% of each foreign chunk" in blend) if switch else ("other company" not in blend)
            assert again._foreign_switch(None, "auto") is switch
        finally:
            again.close()


def test_engine_calibrate_qualities_refuses_bad_input_with_one_clear_error(tmp_path, tiny_model, tiny_tokenizer):
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
                engine.calibrate_qualities(questions, **kwargs)
    finally:
        engine.close()
    none = ({"other_context_selection": None}, "(foreign|other_context)_selection")  # engine.py's message: either name
    for settings, match in (none, ({"disk_tier": True}, "disk_tier")):
        other = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), **settings)
        try:
            with pytest.raises(InvalidRequestError, match=match):
                other.calibrate_qualities(qs)
        finally:
            other.close()
