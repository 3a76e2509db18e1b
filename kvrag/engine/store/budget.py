"""The memory tier's default byte budget: a share of the machine's memory.

``EngineConfig(memory_budget_bytes="auto")`` (the default) lets the memory tier fill
:data:`MEMORY_SHARE` of the memory the process may use: the machine's physical memory, or the
container's limit (cgroup) where that is smaller. A quarter leaves the rest to the model, the
running requests' KV, the application (its index and embedder) and the machine's other processes;
it is a cap, not a reservation: nothing is allocated until KV is kept. A machine already short of
memory when the engine starts gets less: never more than half of the memory then available.
Where nothing can be read (no ``/proc``, no ``sysconf``), the budget is :data:`FALLBACK_BYTES`.

The share is the process's, not each engine's: engines made in one process with ``"auto"`` (a
bench comparing methods, an app serving two models) split it. Each new one gets what the live ones
have not claimed (:func:`claim_auto`), at least :data:`MIN_AUTO_BYTES`; a claim ends when its
store is closed or collected. Without that, six engines each took a quarter of a 24 GB machine
and filled it past its memory once their stores filled (a bench run killed by the kernel).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

__all__ = [
    "MEMORY_SHARE",
    "FALLBACK_BYTES",
    "MIN_AUTO_BYTES",
    "MachineMemory",
    "machine_memory",
    "memory_budget",
    "claim_auto",
    "release_auto",
    "claimed_auto",
]

#: Share of the machine's memory the memory tier may fill by default.
MEMORY_SHARE = 0.25
#: Share of the memory available at start-up that the default budget never passes.
AVAILABLE_SHARE = 0.5
#: The default budget where the machine's memory cannot be read (2 GiB).
FALLBACK_BYTES = 2 * 1024**3
#: The least an ``"auto"`` budget gets when the engines before it have claimed the share (256 MiB).
MIN_AUTO_BYTES = 256 * 1024**2

# the live "auto" budgets of this process: owner (a store) -> bytes
_claims: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_claims_lock = threading.Lock()

# cgroup v2, then v1: a container's memory limit ("max", or a huge number, when there is none)
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class MachineMemory(NamedTuple):
    """Bytes of memory; either ``None`` where it cannot be read."""

    total: int | None  # what the process may use: physical memory, or the cgroup limit if smaller
    available: int | None  # free for new allocations now (Linux's MemAvailable)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def machine_memory() -> MachineMemory:
    """The memory this process may use (physical, or the cgroup limit if smaller) and the memory
    available now (``MemAvailable``; Linux only)."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    limits = [n for n in map(_read_int, _CGROUP_LIMITS) if n is not None and n > 0]
    if limits and (total is None or min(limits) < total):
        total = min(limits)
    if total is not None and total <= 0:
        total = None
    return MachineMemory(total, _meminfo_available())


def memory_budget(setting: int | str = "auto", memory: MachineMemory | None = None, claimed: int = 0) -> int:
    """The memory tier's budget in bytes for ``EngineConfig.memory_budget_bytes``.

    Args:
        setting: a byte count (kept as is) or ``"auto"``: :data:`MEMORY_SHARE` of ``memory.total``
            (of ``memory.available`` where the total is unknown) less ``claimed`` but at least
            :data:`MIN_AUTO_BYTES`, then at most :data:`AVAILABLE_SHARE` of ``memory.available``;
            :data:`FALLBACK_BYTES` less ``claimed`` when neither is known.
        memory: the machine's memory (default: :func:`machine_memory`, read now).
        claimed: bytes the process's live ``"auto"`` budgets hold already (:func:`claimed_auto`).
    """
    if setting != "auto":
        return int(setting)
    total, available = memory if memory is not None else machine_memory()
    base = total if total is not None else available
    if base is None:
        return max(FALLBACK_BYTES - claimed, MIN_AUTO_BYTES)
    budget = max(MEMORY_SHARE * base - claimed, MIN_AUTO_BYTES)  # the floor is against the other claims only
    if available is not None:
        budget = min(budget, AVAILABLE_SHARE * available)
    return int(budget)


def claimed_auto() -> int:
    """Bytes held by this process's live ``"auto"`` budgets."""
    with _claims_lock:
        return sum(_claims.values())


def claim_auto(owner: object, memory: MachineMemory | None = None) -> int:
    """An ``"auto"`` budget for ``owner`` (a store), out of what the process's live ones left.

    The claim lasts until :func:`release_auto` or until ``owner`` is garbage-collected."""
    with _claims_lock:
        claimed = sum(_claims.values())
        budget = memory_budget("auto", memory, claimed)
        if claimed and budget <= MIN_AUTO_BYTES:
            log.warning(
                "kvrag: the engines of this process have claimed the memory share of the KV stores "
                "(memory_budget_bytes='auto'); this one gets %d MiB. Set memory_budget_bytes to size them.",
                MIN_AUTO_BYTES // 1024**2,
            )
        _claims[owner] = budget
        return budget


def release_auto(owner: object) -> None:
    """``owner``'s ``"auto"`` budget returns to the process's share (a no-op if it holds none)."""
    with _claims_lock:
        _claims.pop(owner, None)
