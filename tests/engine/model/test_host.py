"""glibc malloc's thresholds (``kvrag.engine.model.host``): fixed once per process, so freed large
blocks are reused instead of faulting in fresh pages; the environment's settings and ``tune_malloc=False``
are respected. The allocator is process-wide: what changes it runs in a child process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from kvrag.engine.model import host

GLIBC = host.glibc()

# allocates, fills and frees a 48 MB block 6 times; prints the minor page faults of the last 5
FAULTS = textwrap.dedent(
    """
    import resource, sys
    from kvrag.engine.model import host
    line = host.tune_malloc(sys.argv[1] == "on")
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(48 << 20)
    del block
    before = faults()
    for _ in range(5):
        block = bytearray(48 << 20)  # zero-filled: every page touched
        del block
    print(faults() - before)
    print(line)
    """
)


def _faults(mode: str, **env) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, mode], env={**environ, **env}, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return int(out[0]), out[1]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_large_blocks_are_reused_once_tuned():
    untuned, line_off = _faults("off")
    tuned, line_on = _faults("on")
    assert untuned > 5 * 10_000  # each 48 MB block (12,288 pages) came fresh from the kernel
    assert tuned < 1_000  # the same block reused from the heap
    assert line_off == "the allocator's defaults (tune_malloc off)"
    assert line_on.startswith("glibc malloc: mmap above 64 MiB, trim past 256 MiB free")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize(
    "env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}]
)
def test_thresholds_the_environment_sets_are_left_alone(env):
    faults, line = _faults("on", **env)
    assert line.startswith("glibc malloc as the environment sets it (")
    assert faults > 5 * 10_000  # the environment's small threshold still maps every block afresh


def test_the_first_call_decides_for_the_process(monkeypatch):
    monkeypatch.setattr(host, "_done", None)
    monkeypatch.setattr(host, "_tune", lambda: "tuned")
    assert host.tune_malloc(False) == "the allocator's defaults (tune_malloc off)"
    assert host._done is None  # off changes nothing, and a later engine may still ask
    assert host.tune_malloc(True) == "tuned"
    assert host.tune_malloc(False) == "tuned"  # set for the process: an engine cannot undo it


def test_another_platform_is_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert host._tune() == "the platform's allocator, unchanged (not Linux with glibc)"
