"""The multi-process bench's pieces that need no worker processes."""

from __future__ import annotations

from kvrag.bench.multiproc import _done, fresh_barrier


def test_a_rerun_into_the_same_directory_starts_from_an_empty_barrier(tmp_path):
    old = fresh_barrier(tmp_path)
    for name in ("ready-0", "ready-1", "go"):
        (old / name).touch()
    (old / "done-0").write_text("250")
    assert _done(old) == 250
    barrier = fresh_barrier(tmp_path)
    assert barrier == old and list(barrier.iterdir()) == [] and _done(barrier) == 0
