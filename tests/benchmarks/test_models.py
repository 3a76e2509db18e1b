"""``python -m benchmarks models``: llama.cpp's stages alone (``--no-kvrag``) summarize and print."""

from __future__ import annotations

from benchmarks.models import _row_line, main, summarize


def _llama_row(q: int, first: float, reordered: float, f1: float) -> dict:
    ask = lambda t, f=0.0: {"ttft_s": t, "text": "x", "tokens_per_s": 5.0, "f1": f}  # noqa: E731
    return {"question": q, "llama_first": ask(first), "llama_reordered": ask(reordered, f1),
            "llama_exact": ask(0.05), "llama_decode": {"tokens": 64, "tokens_per_s": 8.0 + q}}  # fmt: skip


def test_llama_cpp_alone_gives_its_medians_and_a_row_line():
    rows = [_llama_row(0, 40.0, 38.0, 0.5), _llama_row(1, 50.0, 44.0, 0.0)]
    s = summarize(rows)
    assert s["questions"] == 2 and s["ttft_s"] == {"llama_first": 45.0, "llama_reordered": 41.0, "llama_exact": 0.05}
    assert s["decode_tokens_per_s"] == {"llama": 8.5} and s["quality"]["llama_reordered"]["f1"] == 0.25
    assert _row_line(rows[0]).startswith("q0: llama.cpp first 40.00 s, reordered 38.00")


def test_both_engines_off_is_refused(capsys, tmp_path):
    assert main(["--model", "m.gguf", "--dataset", "d.json", "--no-llama", "--no-kvrag", "--out", str(tmp_path)]) == 2
    assert "leave nothing to run" in capsys.readouterr().err


def test_quick_rows_summarize_the_stages_that_ran():
    ask = lambda t: {"ttft_s": t, "text": "x", "tokens": [1], "tokens_per_s": 3.0, "f1": 0.0}  # noqa: E731
    row = {"question": 0, "kvrag_first": ask(60.0), "kvrag_blend": ask(12.0),
           "kvrag_decode": {"tokens": 32, "tokens_per_s": 4.0}, **_llama_row(0, 90.0, 85.0, 0.0)}  # fmt: skip
    s = summarize([row])
    assert s["ttft_s"] == {"kvrag_first": 60.0, "kvrag_blend": 12.0, "llama_first": 90.0, "llama_reordered": 85.0,
                           "llama_exact": 0.05}  # fmt: skip
    assert s["decode_tokens_per_s"] == {"kvrag": 4.0, "llama": 8.0} and s["paired"]["blend_over_first"] == 0.2
    assert (
        _row_line(row)
        == "q0: kvrag first 60.00 s, blend 12.00, llama.cpp first 90.00, reordered 85.00; decode 4.0 vs 8.0 tok/s"
    )
    alone = {k: v for k, v in row.items() if not k.startswith("llama")}
    assert _row_line(alone) == "q0: kvrag first 60.00 s, blend 12.00; decode 4.0 tok/s"
    assert summarize([alone])["decode_tokens_per_s"] == {"kvrag": 4.0}
