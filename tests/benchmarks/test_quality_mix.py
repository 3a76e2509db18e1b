"""The model-free per-request quality mix (what a perfect dial could reach, and a signal's rule)."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality_mix import main, oracle, requests_of, rule, summary
from kvrag.errors import InvalidRequestError

# request -> method -> (TTFT x full, drift, beta); requests 0..4 are first asks, 5 a return
RUN = {
    0: {"cheap": (0.2, 0.10, 0.6), "dear": (0.8, 0.02, 0.6)},
    1: {"cheap": (0.2, 0.05, 0.1), "dear": (0.8, 0.04, 0.1)},
    2: {"cheap": (0.2, 0.30, 0.2), "dear": (0.8, 0.10, 0.2)},
    3: {"cheap": (0.3, 0.06, 0.5), "dear": (0.8, 0.05, 0.5)},
    4: {"cheap": (0.2, 0.08, 0.9), "dear": (0.8, 0.08, 0.9)},
    5: {"cheap": (0.1, 0.50, 0.0), "dear": (0.9, 0.00, 0.0)},
}


def records() -> list[dict]:
    out = []
    for q, row in RUN.items():
        for m, (t, d, beta) in row.items():
            out.append(
                {
                    "request": q,
                    "method": m,
                    "occurrence": 1 if q == 5 else 0,
                    "ttft_ratio_full": t,
                    "answer_drift_full": d,
                    "blended_overlap": beta,
                }
            )
    out.append({"request": 0, "method": "full", "occurrence": 0, "ttft_ratio_full": 1.0})
    return out


def test_the_oracle_keeps_the_cheap_half_where_it_loses_least_drift():
    table = requests_of(records(), ["cheap", "dear"])
    assert sorted(table) == [0, 1, 2, 3, 4]  # first asks only
    choice = oracle(table, ["cheap", "dear"], cap=0.25)
    # 3 of 5 under the cap: request 3's cheap setting is over it; of 0, 1, 2, 4 the cheap setting
    # loses 0.08, 0.01, 0.20 and 0.00 drift: 4, 1 and 0 stay cheap, 2 and 3 take the dear one
    assert choice == {0: "cheap", 1: "cheap", 2: "dear", 3: "dear", 4: "cheap"}
    s = summary(table, choice)
    assert s["ttft_ratio_median"] <= 0.25 and s["methods"] == {"cheap": 3, "dear": 2}
    assert s["drift_mean"] == pytest.approx((0.10 + 0.05 + 0.10 + 0.05 + 0.08) / 5)
    # no other choice with the median under the cap drifts less (all 2^5 choices)
    for bits in range(32):
        other = {q: "dear" if bits >> i & 1 else "cheap" for i, q in enumerate(table)}
        o = summary(table, other)
        if o["ttft_ratio_median"] <= 0.25:
            assert o["drift_mean"] >= s["drift_mean"] - 1e-12
    with pytest.raises(InvalidRequestError, match="at <= 0.1x full"):
        oracle(table, ["cheap", "dear"], cap=0.1)


def test_the_rule_spends_where_the_signal_is_low_and_the_command_prints_every_choice(tmp_path, capsys):
    table = requests_of(records(), ["cheap", "dear"], kind="all")
    assert len(table) == 6
    assert rule(table, "cheap", "dear", "blended_overlap", 0.25) == {
        0: "cheap",
        1: "dear",
        2: "dear",
        3: "cheap",
        4: "cheap",
        5: "dear",
    }
    with pytest.raises(InvalidRequestError, match="no request"):
        requests_of(records(), ["cheap", "nowhere"])
    (tmp_path / "results.json").write_text(json.dumps({"records": records()}))
    assert main([str(tmp_path), "--methods", "cheap,dear", "--thresholds", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "5 requests (first asks)" in out and "| oracle, median ≤ 0.25 | 0.200 |" in out
    assert "| dear where blended_overlap < 0.25, else cheap |" in out
    # two runs of the same stream: each method from one of them
    one, two = tmp_path / "run1", tmp_path / "run2"  # run1 ran dear (and full), run2 cheap
    for d, m in ((one, "cheap"), (two, "dear")):
        d.mkdir()
        d.joinpath("results.json").write_text(json.dumps({"records": [r for r in records() if r["method"] != m]}))
    assert main([str(one), str(two), "--methods", "cheap,dear", "--thresholds", "0.25"]) == 0
    assert "| oracle, median ≤ 0.25 | 0.200 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(two), "--methods", "cheap,dear"])
