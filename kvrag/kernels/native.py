"""Building kvrag's C++ CPU kernels at first use: a plain shared library per source, loaded through ctypes.

A kernel's source includes only ``<ATen/Parallel.h>`` from torch (its work goes to torch's own
intra-op pool), so it compiles in seconds with the system's C++ compiler (``-O3 -march=native``)
instead of the minute a torch extension takes. The library is kept under kvrag's cache directory,
keyed by the source and the shared headers beside it (``bf16.h``), the CPU's flags, torch's version
and the machine, and built again only when one of them changes. Where it cannot be built (not
x86-64 Linux, no compiler, a CPU without the instructions the source needs), :func:`load_library`
says why and the caller keeps PyTorch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

__all__ = ["load_library", "load_once"]

T = TypeVar("T")
_lock = threading.Lock()
_loaded: dict[Path, tuple] = {}  # source -> (kernel or None, why): one build and bind per process


def load_once(source: Path, make: Callable[[], tuple[T | None, str]]) -> tuple[T | None, str]:
    """``make()`` (which builds ``source`` with :func:`load_library` and binds its functions) run once
    per process and remembered: the kernel, or None and why it is not there. Any exception ``make``
    raises becomes the reason (the caller keeps PyTorch's path)."""
    with _lock:
        if source not in _loaded:
            try:
                _loaded[source] = make()
            except Exception as e:  # anything at all: the caller falls back
                log.debug("kvrag: %s not available", source.name, exc_info=True)
                _loaded[source] = None, f"{type(e).__name__}: {e}"
        return _loaded[source]


def load_library(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library built from ``source`` (compiled once for this machine, then read from the cache),
    or None and why it could not be built or loaded."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"built only on x86-64 Linux (this is {platform.system()} {platform.machine()})"
    target = _library_file(source)
    if not target.is_file():
        why = _compile(source, target)
        if why is not None:
            return None, why
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as e:
        return None, f"{source.stem} did not load ({e})"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _library_file(source: Path) -> Path:
    from kvrag.config import default_cache_dir

    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # the shared helpers it includes
    for part in (
        source.read_bytes(),
        *headers,
        _cpu_flags().encode(),
        torch.__version__.encode(),
        platform.machine().encode(),
    ):
        key.update(part + b"\0")
    return default_cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:24]}.so"


def _compile(source: Path, target: Path) -> str | None:
    """Build ``source`` into ``target`` (atomically: a concurrent build of the same file is harmless);
    None, or why it could not."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return "no C++ compiler found (g++, c++ or clang++; or set CXX)"
    root = Path(torch.__file__).parent
    openmp = "OpenMP" in torch.__config__.parallel_info().split("parallel backend:")[-1]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    cmd = [
        cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off",
        *(["-fopenmp"] if openmp else []),
        "-I", str(root / "include"), str(source), "-o", tmp,
        "-L", str(root / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}",
    ]  # fmt: skip
    log.warning("kvrag: compiling %s once for this machine (a few seconds): %s", source.name, target.name)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["?"]
            return f"{source.name} did not compile ({lines[0].strip()[:200]})"
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{source.name} did not compile ({type(e).__name__}: {e})"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("kvrag: %s compiled in %.1f s", source.name, time.perf_counter() - t0)
    return None
