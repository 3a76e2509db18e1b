"""The examples run end to end as a user runs them: from a working directory outside the repository,
with kvrag importable and nothing else of the clone (no ``benchmarks``), on the bundled SmolLM2 and
the examples' own handbook (``examples/data``), small (one or two questions, a few tokens each).
Each prints what it promises: a full prefill's answer and kvrag's, with their timings and what was
reused (`make demo` runs ``langchain_rag.py`` on the shared dev set)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ("quickstart.py", "langchain_rag.py", "llama_index_rag.py", "multi_turn_chat.py", "agentic_rag.py")
TTFT = r"TTFT +\d+\.\d+ s"


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (at any depth of its code)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("script", sorted({*SCRIPTS, "_rag_data.py", "_compare.py"}))
def test_an_example_imports_kvrag_and_public_packages_only(script):
    assert "benchmarks" not in imported_modules(EXAMPLES / script)  # beside the package, not installed with it


def run_example(tmp_path: Path, script: str, *args: str) -> str:
    """Run ``examples/<script>`` from a directory outside the repository, with this checkout's kvrag
    (alone: a symlink on PYTHONPATH, so neither ``benchmarks`` nor another installed kvrag can stand in)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "kvrag").symlink_to(ROOT / "kvrag", target_is_directory=True)
    cwd = tmp_path / "user"
    cwd.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def lines(out: str, pattern: str) -> list[re.Match]:
    """Every line of ``out`` that ``pattern`` matches from its start."""
    return [m for m in map(re.compile(pattern).match, out.splitlines()) if m]


@pytest.mark.slow
def test_quickstart_answers_with_a_full_prefill_and_with_cached_chunks(tmp_path):
    out = run_example(tmp_path, "quickstart.py", "--questions", "1", "--max-new-tokens", "8")
    assert lines(out, r"Warmed 6 chunks \(\d+ tokens\) in \d+\.\d s$")
    assert [m.group(1) for m in lines(out, r"Q: (.+)$")] == ["When does the ferry leave Port Alder on Sundays?"]
    assert len(lines(out, rf"  full prefill  {TTFT} : \S")) == len(lines(out, rf"  kvrag blend   {TTFT} : \S")) == 1
    ((hits, chunks, cached, prompt),) = [
        tuple(map(int, m.groups()))
        for m in lines(out, r"  (\d+)/(\d+) chunks reused, (\d+)/(\d+) prompt tokens from cache, \d+ recomputed; ")
    ]
    assert hits == chunks == 6 and 0 < cached < prompt  # every document from the cache; the question computed


@pytest.mark.slow
def test_langchain_rag_shows_cached_and_full_answers_and_their_drift(tmp_path):
    out = run_example(tmp_path, "langchain_rag.py", "--data", "handbook", "--max-tokens", "8")
    assert out.startswith("6 passages from examples/data/handbook.json")
    assert len(lines(out, r"Q[12]: \S")) == 2 and len(lines(out, r"Q2 again \(another user asks it\): \S")) == 1
    reuse = r"\| (\d+)/(\d+) chunks reused, (\d+)/(\d+) prompt tokens from cache$"
    full = [tuple(map(int, m.groups())) for m in lines(out, rf"  full prefill {TTFT} {reuse}")]
    kvrag = [tuple(map(int, m.groups())) for m in lines(out, rf"  kvrag        {TTFT} {reuse}")]
    assert len(full) == len(kvrag) == 2
    assert all(hits == 0 and cached == 0 for hits, _, cached, _ in full)  # kvrag off
    hits, chunks, cached, prompt = kvrag[1]
    assert hits == chunks == 4 and 0 < cached < prompt  # Q2's documents came with Q1, in another order
    assert len(lines(out, r" {15}\S")) == 5  # the five answers, each under its timing
    rouge = lines(out, r"  ROUGE-L\(kvrag, full\) = (\d\.\d\d)(, answer drift (\d+\.\d{3}) nats/token)?$")
    assert len(rouge) == 3 and rouge[0].group(2) is None and all(m.group(3) for m in rouge[1:])
    ((exact, prompt),) = [
        tuple(map(int, m.groups()))
        for m in lines(
            out,
            rf"  kvrag        {TTFT} \| (\d+)/(\d+) prompt tokens reused exactly \(knowledge tree, the question's "
            r"tail\)",
        )
    ]
    # computed exactly while the engine was idle, all of it: the documents, the text between them, the question
    assert exact == prompt
    # said either way (bf16: bit for bit by construction from 1,024 tokens or with deterministic=True)
    assert lines(out, r"  identical to the full prefill's answer: (True|False) ")


@pytest.mark.slow
def test_llama_index_rag_shows_cached_and_full_answers_and_the_acceptance_checks(tmp_path):
    out = run_example(tmp_path, "llama_index_rag.py", "--data", "handbook", "--max-new-tokens", "8", "--warmup", "0")
    assert out.startswith("Data: examples/data/handbook.json\nQ1: Who built the lighthouse at Gull Point?\n")
    assert "(their top-6 share 6 passages, in another order)" in out
    assert [m.group(0) for m in lines(out, r"Q1 \(cold\)$|Q2$")] == ["Q1 (cold)", "Q2"]
    assert len(lines(out, rf"  full prefill  {TTFT} : \S")) == len(lines(out, rf"  kvrag         {TTFT} : \S")) == 2
    stats = [tuple(map(int, m.groups())) for m in lines(out, r"  (\d+) chunk hits, (\d+) misses; (\d+)/(\d+) prompt")]
    assert len(stats) == 2 and stats[0][:3] == (0, 6, 0)  # Q1 cold: every passage a miss
    assert stats[1][:2] == (6, 0) and 0 < stats[1][2] < stats[1][3]  # Q2: every passage from the cache
    assert len(lines(out, r"  ROUGE-L kvrag vs full: \d\.\d{3}$")) == 2
    assert lines(out, r"PASS  Q2 chunk hits: \[6\] \(need >= 4\)$")
    checks = lines(out, r"(PASS|FAIL)  (TTFT Q2 / cold Q1 \(kvrag\)|ROUGE-L Q2 kvrag vs mode=full): ")
    assert len(checks) == 2  # (timings and an 8-token answer: printed, not asserted)


@pytest.mark.slow
def test_multi_turn_chat_reuses_the_conversation(tmp_path):
    out = run_example(tmp_path, "multi_turn_chat.py", "--data", "handbook", "--max-tokens", "8", "--turns", "2")
    assert "layout: docs-first" in out
    assert [m.group(1) for m in lines(out, r"turn (\d): \S")] == ["1", "2"]
    figures = r"\| prompt +(\d+) tokens, +(\d+) from cache \((\d+) from the conversation\), (\d+) chunks deduplicated$"
    full = [tuple(map(int, m.groups())) for m in lines(out, rf"  full prefill {TTFT} {figures}")]
    kvrag = [tuple(map(int, m.groups())) for m in lines(out, rf"  kvrag        {TTFT} {figures}")]
    assert len(full) == len(kvrag) == 2 and all(cached == 0 for _, cached, _, _ in full)
    assert [p for p, *_ in full] == [p for p, *_ in kvrag]  # the same prompts, kvrag off and on
    prompt, cached, conversation, _ = kvrag[1]
    assert 0 < conversation <= cached < prompt  # turn 2 reuses turn 1's KV (the history) and the documents'
    assert len(lines(out, r" {15}\S")) == 4  # the answers


def test_agentic_rag_without_a_tool_capable_model_says_so_and_exits_cleanly(tmp_path):
    out = run_example(tmp_path, "agentic_rag.py")  # the bundled SmolLM2's template renders no tools
    assert out.startswith("This example needs a model whose chat template renders tools")
    assert "--model PATH.gguf" in out


def test_agentic_rag_searches_first_answers_last_and_reads_the_answer_tools_argument():
    import importlib.util

    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    spec = importlib.util.spec_from_file_location("agentic_rag", EXAMPLES / "agentic_rag.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    call = {"name": "search", "args": {"query": "q"}, "id": "c1", "type": "tool_call"}
    asked = [HumanMessage("q?")]
    searched = [*asked, AIMessage("", tool_calls=[call]), ToolMessage("docs", tool_call_id="c1")]
    assert [example.tool_choice(m, 2) for m in (asked, searched, searched * 2)] == ["search", "any", "answer"]
    answered = AIMessage("", tool_calls=[{**call, "name": "answer", "args": {"text": "Exeter College"}}])
    assert example.final_answer([*searched, answered]) == "Exeter College"
    assert example.final_answer([*asked, AIMessage("free text")]) == "free text"
