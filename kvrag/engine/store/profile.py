"""The engine's own prefill cost profile: T(alpha, beta), seconds to prefill with alpha cached and
beta non-cached tokens, by bilinear interpolation over a grid (RAGCache §5.1, Algorithm 1).

RAGCache profiles offline; kvrag profiles online, from the prefills the engine actually runs, so
the costs are this machine's, this model's and this mode's. Each observation is spread over the
four grid points around it with bilinear weights; a grid point's estimate is the weighted mean
of what landed on it. An estimate interpolates the grid points around the query that have data.
Before any data near the query, it falls back to the mean time per non-cached token seen so far.
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["CostProfile"]

_EDGES = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class CostProfile:
    """Prefill time as a function of cached and non-cached tokens (thread-safe)."""

    def __init__(self, edges: tuple[int, ...] = _EDGES) -> None:
        self.edges = tuple(edges)
        n = len(self.edges)
        self._sum = [[0.0] * n for _ in range(n)]
        self._w = [[0.0] * n for _ in range(n)]
        self._seconds = 0.0
        self._tokens = 0
        self._work_seconds = 0.0
        self._work = 0
        self.observations = 0
        self._lock = threading.Lock()

    def _cell(self, x: float) -> tuple[int, float]:
        """Lower grid index and the fraction of the way to the next one."""
        e = self.edges
        x = min(max(float(x), e[0]), e[-1])
        i = min(bisect.bisect_right(e, x) - 1, len(e) - 2)
        return i, (x - e[i]) / (e[i + 1] - e[i])

    def record(self, cached: int, computed: int, seconds: float, work: int = 0) -> None:
        """One prefill: ``cached`` tokens reused, ``computed`` tokens not cached, ``seconds`` spent,
        ``work`` token-layers computed (0 if unknown)."""
        if computed <= 0 or not seconds > 0:
            return
        (i, fa), (j, fb) = self._cell(cached), self._cell(computed)
        with self._lock:
            for di, wa in ((0, 1 - fa), (1, fa)):
                for dj, wb in ((0, 1 - fb), (1, fb)):
                    w = wa * wb
                    if w > 0:
                        self._sum[i + di][j + dj] += w * seconds
                        self._w[i + di][j + dj] += w
            self._seconds += seconds
            self._tokens += computed
            if work > 0:
                self._work_seconds += seconds
                self._work += work
            self.observations += 1

    def estimate(self, cached: int, computed: int) -> float | None:
        """Estimated seconds for a prefill of this shape, ``None`` before any observation."""
        if computed <= 0:
            return 0.0
        with self._lock:
            if not self.observations:
                return None
            (i, fa), (j, fb) = self._cell(cached), self._cell(computed)
            num = den = 0.0
            for di, wa in ((0, 1 - fa), (1, fa)):
                for dj, wb in ((0, 1 - fb), (1, fb)):
                    w, cell_w = wa * wb, self._w[i + di][j + dj]
                    if w > 0 and cell_w > 0:
                        num += w * self._sum[i + di][j + dj] / cell_w
                        den += w
            if den > 0.5:  # enough of the neighbourhood is known: interpolate
                return num / den
            return computed * self._seconds / self._tokens

    def full_prefill(self, tokens: int, n_layers: int) -> float | None:
        """Seconds of a full prefill of ``tokens`` tokens: from the grid where full prefills of that
        size were seen, else from the mean time per token-layer of every prefill seen."""
        j, fb = self._cell(tokens)
        with self._lock:
            if self._w[0][j] > 0 and self._w[0][j + 1] > 0:
                return (1 - fb) * self._sum[0][j] / self._w[0][j] + fb * self._sum[0][j + 1] / self._w[0][j + 1]
            if self._work:
                return tokens * n_layers * self._work_seconds / self._work
        return self.estimate(0, tokens)

    def seconds_per_token(self, cached: int, computed: int) -> float | None:
        """``T(cached, computed) / computed``: PGDSF's cost per non-cached token."""
        t = self.estimate(cached, computed)
        return None if t is None or computed <= 0 else t / computed

    def to_dict(self) -> dict:
        """A JSON-able copy (to reuse a measured profile elsewhere, e.g. in a simulation)."""
        with self._lock:
            return {
                "edges": list(self.edges),
                "sum": self._sum,
                "w": self._w,
                "seconds": self._seconds,
                "tokens": self._tokens,
                "work_seconds": self._work_seconds,
                "work": self._work,
                "observations": self.observations,
            }

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        prof = cls(tuple(int(e) for e in d["edges"]))
        n = len(prof.edges)
        prof._sum = [[float(x) for x in row[:n]] for row in d["sum"][:n]]
        prof._w = [[float(x) for x in row[:n]] for row in d["w"][:n]]
        prof._seconds, prof._tokens = float(d["seconds"]), int(d["tokens"])
        prof._work_seconds, prof._work = float(d["work_seconds"]), int(d["work"])
        prof.observations = int(d["observations"])
        return prof

    def stats(self) -> dict:
        with self._lock:
            return {
                "observations": self.observations,
                "seconds_per_token": self._seconds / self._tokens if self._tokens else None,
            }
