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


# Builds a tiny engine (the model made on a helper thread, so that only kvrag could give the main thread
# an OpenMP pool), runs requests, then one large op on the main thread: prints the process's OS threads
# just before and just after that op. A pool the op creates adds threads; one the main thread already
# had does not. "control": the main thread runs a large op before the engine is built.
POOL = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from benchmarks.tiny import make_docs, make_tiny_model, make_tokenizer

    def tasks():
        return len(os.listdir("/proc/self/task"))

    def settled():  # threads of a finished pool leave shortly after it ends
        seen = tasks()
        for _ in range(40):
            time.sleep(0.05)
            now = tasks()
            if now == seen:
                return now
            seen = now
        return seen

    big = torch.empty(1 << 22)  # no op ran: filling it is the first large op of the main thread
    if sys.argv[1] == "control":
        big.fill_(2)
    box = {}
    def make():
        box["tok"] = make_tokenizer()
        # wide enough that the engine's own ops (the gate's self-test, the packing) run in parallel
        box["model"] = make_tiny_model(len(box["tok"]), layers=2, hidden_size=512, intermediate_size=1024)
    maker = threading.Thread(target=make)
    maker.start()
    maker.join()
    from kvrag import Engine
    engine = Engine.from_model(box["model"], box["tok"], cache_dir=sys.argv[2])  # no gate verdict cached yet
    docs = make_docs(3)
    engine.warm(docs)
    engine.generate(chunks=docs[::-1], suffix="Q: what? A:", max_new_tokens=4)
    engine.close()
    before = settled()
    big.fill_(3)
    print(before, settled())
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ CPUs")
def test_building_and_running_an_engine_leaves_the_callers_thread_without_an_openmp_pool(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    runs = {}
    for mode in ("engine", "control"):
        out = subprocess.run(
            [sys.executable, "-c", POOL, mode, str(tmp_path / mode)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout.split()
        runs[mode] = (int(out[-2]), int(out[-1]))
    before, after = runs["engine"]
    assert after > before  # the main thread's first large op made its pool: kvrag had left it none
    before, after = runs["control"]
    assert after == before  # the control: a thread that has a pool gets no new one


def test_on_own_thread_returns_the_result_and_raises_the_error_of_a_thread_that_ends():
    import threading

    ran_on = []

    def work():
        ran_on.append(threading.current_thread())
        return 7

    assert host.on_own_thread(work) == 7
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def fail():
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        host.on_own_thread(fail)
