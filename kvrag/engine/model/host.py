"""How the engine meets the CPU host: glibc malloc's two thresholds, and OpenMP's thread pools.

**malloc.** A prefill allocates and frees tens of megabytes per layer (the MLP's gate/up product alone is
``tokens x 2 x intermediate`` values). By default glibc serves a block above its mmap threshold (which
starts at 128 KiB and grows to at most 32 MiB) with fresh pages from the kernel, and hands the top of its
heap back once more than twice the threshold lies free there. So every prefill touches hundreds of
megabytes of new pages, and each page's first touch is a minor fault.

:func:`tune_malloc` fixes both thresholds once per process (mmap above 64 MiB, trim past 256 MiB
free), so freed temporaries are reused by the next layer and the next request, and the faults all but
disappear. The cost: up to 256 MiB freed at the top of the heap stays
with the process, and blocks of up to 64 MiB come from the heap (a KV store's entries are smaller
and already did, once glibc's own threshold had grown). Only on Linux with glibc, only for engines
computing on the CPU; a threshold the user set (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or the ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``) is left as set.
``EngineConfig.tune_malloc=False`` turns it off. While an engine is built (:func:`loading_memory`: the
load-time self-test, the decode weights) blocks above 16 MiB come from mmap instead, so a build's
temporaries go back to the kernel when freed, not into holes between the weights built beside them
(what it saves: docs/journal/real-models.md).

**OpenMP.** PyTorch's CPU ops run on GNU OpenMP (libgomp), which gives every thread that runs a
parallel op its own pool of worker threads, kept until that thread ends. While the pooled threads of
the whole process outnumber its CPUs, libgomp all but stops its workers spinning between parallel
regions: each region then waits for a sleeping worker to wake. A decode step of the bundled model is
~300 short regions, so a step on the engine thread runs markedly slower while another thread holds a
pool; a prefill's few long regions hardly notice. The engine computes on its own thread
(:mod:`kvrag.engine.serving.worker`), so :func:`on_own_thread` loads the model and builds the engine on
a thread that ends when it is done: the caller's thread keeps no pool of kvrag's making, and the
engine thread's pool is the only one while the caller runs no torch ops of its own (an embedder on the
same thread brings its pool back: see the README's note on threads). Measurements: docs/results.md
("Threads", "Other micro-benchmarks") and docs/journal/figures-from-code.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "glibc", "loading_memory", "on_own_thread", "tune_malloc"]

T = TypeVar("T")

#: Blocks above this come from mmap (glibc's own threshold grows to 32 MiB at most).
MMAP_THRESHOLD = 64 << 20
#: Free memory at the top of the heap kept past this is handed back to the kernel.
TRIM_THRESHOLD = 256 << 20
#: The mmap threshold while an engine is built (:func:`loading_memory`).
LOADING_MMAP_THRESHOLD = 16 << 20

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")

_lock = threading.Lock()
_done: str | None = None  # what the first call did, for every later one
_libc = None  # glibc, once _tune set its thresholds (loading_memory moves them for a while)


def tune_malloc(enabled: bool = True) -> str:
    """Fix glibc malloc's mmap and trim thresholds for this process (once), if ``enabled``.

    Returns one line for :meth:`Engine.info <kvrag.engine.engine.Engine.info>`: what the process's
    allocator does now and why. A process-wide setting: the first engine that asks sets it; an
    engine with ``enabled=False`` after that reports it, it cannot undo it.
    """
    global _done
    with _lock:
        if _done is not None:
            return _done
        if not enabled:
            return "the allocator's defaults (tune_malloc off)"
        _done = _tune()
        return _done


@contextlib.contextmanager
def loading_memory():
    """Within the block, blocks above :data:`LOADING_MMAP_THRESHOLD` come from mmap, and after it
    the freed heap goes back to the kernel (``malloc_trim``): for building an engine, whose
    temporaries (float32 copies of weights, quantization chunks) sit between long-lived tensors.
    Only where :func:`tune_malloc` set the thresholds (it restores them after); else nothing."""
    with _lock:
        libc = _libc
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.malloc_trim(0)


def glibc() -> bool:
    """Whether this process runs on Linux with glibc (whose ``mallopt`` thresholds this module sets)."""
    if platform.system() != "Linux":
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, OSError, ValueError):  # musl and others have no such name
        return False


def _tune() -> str:
    global _libc
    if not glibc():
        return "the platform's allocator, unchanged (not Linux with glibc)"
    named = [name for name in _ENV if name in os.environ]
    named += [name for name in _TUNABLES if name in os.environ.get("GLIBC_TUNABLES", "")]
    if named:
        return f"glibc malloc as the environment sets it ({', '.join(named)})"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "glibc malloc, unchanged (mallopt not found)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "glibc malloc, unchanged (mallopt refused the thresholds)"
    _libc = libc
    return (
        f"glibc malloc: mmap above {MMAP_THRESHOLD >> 20} MiB, trim past {TRIM_THRESHOLD >> 20} MiB free"
        " (a prefill's temporaries reuse memory instead of faulting in fresh pages)"
    )


def on_own_thread(fn: Callable[[], T], name: str = "kvrag-load", *, threads: int | None = None) -> T:
    """``fn()`` run on a new thread that ends when it returns: its result, or its error raised here.

    The thread's OpenMP pool ends with it, so the caller's thread is left without one (see the module
    note). A caller interrupted while it waits (Ctrl-C) gets the interruption at once; the thread, a
    daemon, finishes ``fn`` on its own and its result is dropped. ``threads``: torch's intra-op threads
    set on the caller's thread afterwards too (an engine's ``num_threads``, as if built there).
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller, raised there
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    if threads:
        import torch  # this module imports without torch

        torch.set_num_threads(threads)
    return box["result"]
