"""The benchmarks' engines per method: where their disk tiers live."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.engines import SCRATCH_PREFIX, scratch_dir


def test_scratch_dirs_of_dead_runs_are_swept_and_live_ones_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    left = tmp_path / f"{SCRATCH_PREFIX}{dead}-abc"
    (left / "0-prefix" / "kv").mkdir(parents=True)
    (left / "0-prefix" / "kv" / "data").write_bytes(b"x" * 1000)
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"  # another run of this process: in use
    live.mkdir()
    other = tmp_path / f"{SCRATCH_PREFIX}unnamed"  # not ours to judge
    other.mkdir()
    made = scratch_dir(str(tmp_path))
    try:
        assert not left.exists() and live.exists() and other.exists()
        assert os.path.basename(made.name).startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    finally:
        made.cleanup()
    assert not os.path.exists(made.name)
