"""Damage a disk KV tier on purpose and count crashes and wrong answers (both must be 0).

``damaged``: writes entries into a disk tier and damages each file behind the index's back
(truncated, extended, bits flipped, bytes overwritten, a header spliced onto another entry's body,
random bytes behind a valid magic; ``tests/engine/store/helpers.py: damage``), then reads each one back.
A read is a miss (the entry is dropped) or the exact record; anything else is a wrong answer, and
an exception out of the store is a crash.

``kills``: a writer process (forked, so no interpreter start per kill) stores large records in a
loop and is killed with SIGKILL at a random moment, often mid-write; then a fresh store on the
same directory reads back every record the writer could have written. Every read is a miss or
the exact record; every record the writer reported stored (``put`` returned True) must still be
there; the directory must accept new writes afterwards. ``missing`` counts records never
committed (the one being written when the kill came, and the next that never started);
``dropped`` counts entries found damaged on read and removed (0 when a kill leaves only orphan
files that no index row points at).

    python -m benchmarks.acceptance.store_damage --entries 1000 --kills 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import tempfile
import time

import torch

from kvrag.engine.store import serial
from kvrag.engine.store.disk import DiskStore
from tests.engine.store.helpers import DAMAGE, damage, entry_path, key, record, same, token_ids


def damaged_entries(directory: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    store = DiskStore(directory, 1 << 34, dtype="float32")
    out = {"entries": n, "crashes": 0, "wrong": 0, "misses": 0, "exact_hits": 0, "by_damage": {}}
    for i in range(n):
        tokens, layers, stats = rng.randint(1, 64), rng.randint(1, 6), rng.random() < 0.3
        rec = record(i, tokens=tokens, layers=layers, stats=stats)
        k = key(i, tokens=tokens)
        store.put(k, rec)
        twin = record(i + 1, tokens=tokens, layers=layers, stats=stats)  # same layout: a splice's donor
        other = serial.encode(key(i + 1, tokens=tokens), twin, store.dtype)
        how = rng.choice(DAMAGE)
        path = entry_path(store, k)
        with open(path, "rb") as f:
            blob = f.read()
        with open(path, "wb") as f:
            f.write(damage(blob, how, rng, other))
        tally = out["by_damage"].setdefault(how, {"misses": 0, "exact_hits": 0})
        try:
            got = store.get(k, token_ids(i, tokens))
        except Exception as e:  # noqa: BLE001 - counted: the store must never raise for what it read
            out["crashes"] += 1
            print(f"crash on entry {i} ({how}): {e!r}", file=sys.stderr)
            continue
        if got is None:
            out["misses"] += 1
            tally["misses"] += 1
        elif same(got, rec):
            out["exact_hits"] += 1
            tally["exact_hits"] += 1
        else:
            out["wrong"] += 1
            print(f"wrong answer on entry {i} ({how})", file=sys.stderr)
    store.close()
    return out


_TOKENS = 1500  # ~3 MB per record in float32 (4 layers x 2 heads x 64 dims): writes take a while


def _write_forever(directory: str, start: int, report) -> None:
    """The child: store records start, start+1, ... and report each one stored."""
    store = DiskStore(directory, 1 << 34, dtype="float32")
    i = start
    while True:
        if store.put(key(i, tokens=_TOKENS), record(i, tokens=_TOKENS, dim=64)):
            os.write(report, f"{i}\n".encode())
        i += 1


def kills(directory: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    out = {"kills": n, "crashes": 0, "wrong": 0, "lost_acknowledged": 0, "verified": 0, "missing": 0, "dropped": 0}
    next_start = 0
    for round_ in range(n):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer; never returns
            os.close(read_fd)
            try:
                _write_forever(directory, next_start, write_fd)
            finally:
                os._exit(1)
        os.close(write_fd)
        # the first record stored (however slow the machine), then a random moment: mostly mid-write
        first = os.read(read_fd, 64) if select.select([read_fd], [], [], 60.0)[0] else b""
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd, "rb") as r:
            acknowledged = {int(line) for line in (first + r.read()).split()}
        last = max(acknowledged, default=next_start - 1) + 2  # the one mid-write, and one more
        store = DiskStore(directory, 1 << 34, dtype="float32")
        for i in range(next_start, last + 1):
            try:
                got = store.get(key(i, tokens=_TOKENS), token_ids(i, _TOKENS))
            except Exception as e:  # noqa: BLE001 - counted
                out["crashes"] += 1
                print(f"crash reading record {i} after kill {round_}: {e!r}", file=sys.stderr)
                continue
            if got is None:  # never committed (killed before its index row), or torn and dropped
                out["missing"] += 1
                out["lost_acknowledged"] += i in acknowledged
            elif same(got, record(i, tokens=_TOKENS, dim=64)):
                out["verified"] += 1
            else:
                out["wrong"] += 1
        probe = key(10**6 + round_, tokens=4)  # the directory still takes writes
        if not (store.put(probe, record(round_, tokens=4)) and same(store.get(probe), record(round_, tokens=4))):
            out["crashes"] += 1
        out["dropped"] += store.stats()["damaged"]  # entries found damaged on read, and removed
        store.close()
        next_start = last + 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=1000, help="damaged entries to read back")
    p.add_argument("--kills", type=int, default=50, help="writer processes killed with SIGKILL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # the forked writer must not inherit a busy thread pool
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        t0 = time.perf_counter()
        result = {"damaged": damaged_entries(os.path.join(tmp, "damaged"), a.entries, a.seed)}
        result["kill9"] = kills(os.path.join(tmp, "kills"), a.kills, a.seed)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    bad = sum(result[part][what] for part in ("damaged", "kill9") for what in ("crashes", "wrong"))
    return 1 if bad or result["kill9"]["lost_acknowledged"] else 0


if __name__ == "__main__":
    sys.exit(main())
