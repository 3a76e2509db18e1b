"""``python -m benchmarks calibrate``: the same prompts as the benchmark's, one clear error per bad
argument, and a whole run over a saved tiny model."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.__main__ import main as bench_main
from benchmarks.calibrate import calibration_questions, main, prompt_parts, read_questions
from benchmarks.data import PromptFormat, load_dataset, make_synthetic_dataset, request_order
from kvrag import cli
from tests.helpers import make_tokenizer

NO_SYSTEM_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template: str | None = "keep"):
    tok = make_tokenizer()
    if template != "keep":
        tok.chat_template = template
    return tok


@pytest.fixture
def qa(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(make_synthetic_dataset(3, passages=4, words=30)))
    return path


@pytest.mark.parametrize("template", ["keep", None, NO_SYSTEM_ROLE], ids=["chat", "completion", "no-system-role"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"system": ""}, {"answer_hint": ""}, {"system": "Be brief.", "instructions": "Passages:", "answer_hint": "?"}],
)
def test_prompts_are_the_benchmarks(template, settings):
    tok = _tokenizer(template)
    fmt = PromptFormat(tok, **settings)
    assert prompt_parts(tok, **settings) == (fmt.head, fmt.question_head, fmt.tail)


def test_questions_are_the_benchmarks_requests(qa):
    tok = _tokenizer()
    fmt, rng = PromptFormat(tok), random.Random(7)
    mine = calibration_questions(read_questions(qa, 3), tok, top_k=3, seed=7)
    for item, q in zip(load_dataset(qa, 3), mine):
        order = request_order(len(item.passages), 3, True, rng)
        req = fmt.request(item, order, workload="calibrate", request=item.index)
        assert (q.prefix, list(q.chunks), q.suffix) == (req.prefix, req.chunks, req.suffix)
        assert list(q.retrieved) == [item.passages[i] for i in sorted(order)]  # warmed in retrieval order


def test_bad_arguments_fail_before_the_model_loads(tmp_path, qa, capsys):
    missing = str(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text(json.dumps([{"question": "q?", "ctxs": []}]))
    cases = [
        (["--dataset", missing], "dataset not found"),
        (["--dataset", str(qa), "--n", "0"], "--n, --top-k and --max-new-tokens must be >= 1"),
        (["--dataset", str(qa), "--n", "1"], "needs --n 2 or more"),
        (["--dataset", str(qa), "--n", "4"], "has 3 questions, 4 were asked for"),
        (["--dataset", str(qa), "--target", "2"], "target must be"),
        (["--dataset", str(qa), "--config", "no_such_field=1"], "no_such_field"),
        (
            ["--dataset", str(tmp_path / "list.json"), "--n", "1", "--what", "threshold"],
            "'ctxs' must be a non-empty list",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("python -m benchmarks calibrate: ") and message in err, err
    assert bench_main(["calibrate", "--dataset", missing]) == 2  # the benchmarks' command line runs it
    assert capsys.readouterr().err.startswith("python -m benchmarks calibrate: dataset not found")
    assert cli.main(["calibrate"]) == 2 and "unknown command" in capsys.readouterr().err  # not in the wheel


def test_the_calibration_prints_the_constants_and_the_settings_that_use_them(
    tmp_path, qa, tiny_model, tiny_tokenizer, capsys
):
    model_dir = tmp_path / "tiny-llama"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    argv = ["calibrate", "--dataset", str(qa), "--n", "2", "--top-k", "3", "--model", str(model_dir)]
    assert bench_main(argv + ["--config", f"cache_dir={tmp_path / 'cache'}"]) == 0
    out, err = capsys.readouterr()
    assert "python -m benchmarks calibrate: question 2/2" in err
    assert "threshold" in out and "alpha" in out and "to use them: auto_threshold=" in out
    assert "recency on KV from another context): drift 0.05: " in out and "probe@15%: " in out
    assert not (tmp_path / "cache" / "calibration").exists()  # nothing written where an engine would read it
