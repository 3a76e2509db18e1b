"""The examples start from a clone whatever the working directory (`make demo` runs one): their imports
resolve (the clone's benchmarks/ is beside the package, not installed with it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["langchain_rag.py", "llama_index_rag.py", "multi_turn_chat.py"])
def test_an_example_starts_from_any_working_directory(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout
