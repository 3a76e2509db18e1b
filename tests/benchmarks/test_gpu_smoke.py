"""``python -m benchmarks.gpu_smoke`` on the CPU with its tiny random model: every check passes."""

from __future__ import annotations


def test_gpu_smoke_passes_on_cpu(capsys, one_thread):
    from benchmarks.gpu_smoke import main

    rc = main(["--device", "cpu", "--new-tokens", "6", "--reps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out and out.count("\nPASS ") == 8, out
    assert "TIMING cpu" in out and "gpu_smoke: all checks passed" in out
