"""The multi-process bench's pieces that need no worker processes."""

from __future__ import annotations

from benchmarks.multiproc import _done, fresh_barrier


def test_a_rerun_into_the_same_directory_starts_from_an_empty_barrier(tmp_path):
    old = fresh_barrier(tmp_path)
    for name in ("ready-0", "ready-1", "go"):
        (old / name).touch()
    (old / "done-0").write_text("250")
    assert _done(old) == 250
    barrier = fresh_barrier(tmp_path)
    assert barrier == old and list(barrier.iterdir()) == [] and _done(barrier) == 0


def test_the_reference_replay_sizes_entries_as_the_workers_hold_them():
    from benchmarks.multiproc import sizes_at_rest

    shape = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head dim
    plain = sizes_at_rest([100, 600], shape, "plain")
    assert plain == [t * (2 * 30 * 3 * 64 * 2 + 8) for t in (100, 600)]  # fp16 K and V + the token id
    int8 = sizes_at_rest([100, 600], shape, "int8")
    assert all(1.7 < p / q < 2.0 for p, q in zip(plain, int8))  # ~1.9x fewer bytes (docs/scale-out.md)
