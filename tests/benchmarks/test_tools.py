"""The benchmark commands beside the harness: the store simulator, the registry lookup
microbenchmark and the GPU kernel benchmark (``python -m benchmarks store-sim | registry | kernels``)."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.__main__ import main as bench_main
from kvrag.engine.reuse.documents import DocumentFinder
from kvrag.engine.store.profile import CostProfile

# -- store-sim ------------------------------------------------------------------------------------


def test_steady_state_simulation_stays_within_budgets(tmp_path):
    from benchmarks.store_sim import simulate, summarize, zipf_stream

    rng = random.Random(0)
    passages = [[rng.randrange(5000) for _ in range(rng.randint(50, 80))] for _ in range(60)]
    prof = CostProfile()
    for a in (0, 200, 400):
        for b in (20, 200, 500):
            prof.record(a, b, 0.001 * b + 0.0001 * a)
    measured = {"profile": prof.to_dict(), "throughput": 1e9, "kv_bytes_per_token": 23040}
    stream = zipf_stream(60, 120, 5, 1.0, seed=1)
    out = {}
    for policy in ("lru", "pgdsf"):
        res = simulate(
            passages,
            stream,
            policy,
            measured,
            memory_fraction=0.2,
            disk_fraction=0.5,
            extra_tokens=20,
            workdir=str(tmp_path),
        )
        assert all(r["memory_bytes"] <= r["memory_budget"] and r["disk_bytes"] <= r["disk_budget"] for r in res)
        out[policy] = summarize(res)
        assert len(out[policy]) == 5 and all(0 <= w["hit_rate"] <= 1 and w["speedup"] >= 1 for w in out[policy])
    assert out["pgdsf"][-1]["memory_hit_rate"] >= out["lru"][-1]["memory_hit_rate"]


# -- registry ---------------------------------------------------------------------------------------


def test_registry_benchmark_prompt_holds_its_passages_among_filler():
    from benchmarks.registry_lookup import make_passages, make_prompt

    passages, filler = make_passages(6, seed=0), make_passages(40, seed=1)
    assert len(set(passages)) == 6 and all(480 <= len(p) <= 530 for p in passages)
    prompt = make_prompt(passages, filler)
    assert 15_000 <= len(prompt) <= 17_000
    positions = [prompt.index(p) for p in passages]
    assert positions == sorted(positions) and positions[0] > 1000  # spread out, filler in between
    reg = DocumentFinder()
    reg.register(passages + make_passages(50, seed=2))  # other registered texts are not in the prompt
    assert [t for kind, t in reg.split(prompt) if kind == "chunk"] == passages


def test_registry_command_runs(capsys):
    assert bench_main(["registry", "--sizes", "10", "300", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "6 registered passages inside" in out
    assert "300 registered" in out and "s per split()" in out


# -- kernels ----------------------------------------------------------------------------------------


def test_kernels_command_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench_main(["kernels"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_kernel_cases_check_and_time_on_the_kernels_device(triton_device, capsys):
    """The GPU benchmark's parity checks and timing loop, at a tiny shape, where the tests run the
    kernels (the GPU if any, else the CPU in Triton's interpreter)."""
    from benchmarks import kernels

    cases = kernels.cases(
        heads=4, kv_heads=2, head_dim=32, seq=40, ratio=0.2, dtype=torch.float16, device=triton_device
    )
    rows = kernels.run(cases, triton_device, reps=1, warmup=0)
    assert [r["case"] for r in rows] == [c.name for c in cases] and all(r["triton_ms"] > 0 for r in rows)
    assert "attention scattered (Tq=8)" in capsys.readouterr().out


# -- acceptance.zero_hit ----------------------------------------------------------------------------


@pytest.mark.model
def test_zero_hit_pairs_a_default_call_that_found_nothing_with_a_full_one(tmp_path, capsys):
    """Every pair's default call found nothing, took the full path, and the report says so."""
    import json

    from benchmarks.acceptance import zero_hit
    from benchmarks.data import make_synthetic_dataset

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(make_synthetic_dataset(2, passages=3, words=20)))
    out = tmp_path / "pairs.json"
    zero_hit.main(["--dataset", str(data), "--skip", "0", "--n", "2", "--top-k", "3", "--clear", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["question"] for r in rows] == [0, 1]
    assert all(r["found"] == 0 and r["path"] == "full" and r["default"] > 0 and r["full"] > 0 for r in rows)
    assert "2 requests with nothing found" in capsys.readouterr().out


# -- the acceptance commands ----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["rag", "chat_engine"])
def test_an_acceptance_command_refuses_a_directory_for_out_before_it_runs(command, tmp_path, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"benchmarks.acceptance.{command}")
    monkeypatch.setattr("sys.argv", [command, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_an_acceptance_command_names_a_missing_dev_set_and_returns_a_found_one(tmp_path, monkeypatch):
    import argparse

    from benchmarks.acceptance import parse_checked

    ap = argparse.ArgumentParser()
    ap.add_argument("--data")
    monkeypatch.setattr("sys.argv", ["rag"])
    with pytest.raises(SystemExit, match="the dev set is not there: pass --data"):
        parse_checked(ap, lambda data: None)
    found = tmp_path / "qa.json"
    monkeypatch.setattr("sys.argv", ["rag", "--data", str(found)])
    args, path = parse_checked(ap, lambda data: found if data == str(found) else None)
    assert path == found and args.data == str(found)


def _call(ratio: float, noise: float, path: str = "blend") -> dict:
    from benchmarks.acceptance.chat_engine import paired

    before, after = 1.0 - noise / 2, 1.0 + noise / 2  # mean 1: the ratio is the TTFT itself
    row = paired(ratio, before, after)
    row.update(conversation=0, turn=1, kind="answer", path=path)
    return row


def test_chat_check_passes_a_call_over_the_line_by_less_than_its_references_differ():
    from benchmarks.acceptance.chat_engine import paired, verdict

    row = paired(1.2, 1.0, 1.0)
    assert row["full_ttft_s"] == 1.0 and row["ratio"] == pytest.approx(1.2) and row["noise"] == 0.0
    ok, f = verdict([_call(1.12, 0.10), _call(0.4, 0.02)], 1.05)  # 1.12 <= 1.05 + 0.10: within the noise
    assert ok and not f["over"] and f["worst"]["ratio"] == pytest.approx(1.12)
    ok, f = verdict([_call(1.12, 0.05), _call(0.4, 0.02)], 1.05)  # 0.02 past the line and its noise
    assert not ok and len(f["over"]) == 1


def test_chat_check_fails_a_systematic_cost_on_the_calls_that_reuse_nothing():
    from benchmarks.acceptance.chat_engine import verdict

    noisy = [_call(1.10, 0.10, "full"), _call(1.09, 0.08, "full"), _call(1.0, 0.0, "full"), _call(0.3, 0.0)]
    ok, f = verdict(noisy, 1.05)
    assert not f["over"] and f["on_full"] == 3 and f["median_full"] == pytest.approx(1.09) and not ok
    ok, _ = verdict([_call(1.04, 0.0, "full"), _call(0.98, 0.0, "full")], 1.05)
    assert ok
