"""Would a temperature on the cached chunks' keys bring their KV closer? A research harness for ``benchmarks``.

Not a kvrag feature. Training-free parallel-context methods (APE: Adaptive Parallel Encoding, ICLR 2025) rescale the
attention a prompt's later tokens pay to independently computed context. Here each selection
``ksNNN`` reuses every cached chunk as is (nothing recomputed, like ``reuse``) with its keys
multiplied by NNN/100 on every layer, i.e. the attention logits on cached chunk keys divided by a
temperature 100/NNN; the prefix and the question keep theirs. ``ks100`` is ``reuse`` exactly. They
register with kvrag's selection registry (no parameters) when this module is imported.
Chunks computed in other company (docs/journal/fidelity.md, "Nor does a temperature on the cached keys"):

    python -m benchmarks.research.key_temperature --dataset ../shared/data/musique_dev.json --n 10 \\
        --top-k 6 --workloads a --warm-company other --config num_threads=1 --score auto --methods \\
        full,reuse,blend@0.15+selection=ks100,blend@0.15+selection=ks090,blend@0.15+selection=ks110,\\
        blend@0.15+selection=ks080,blend@0.15+selection=ks120
"""

from __future__ import annotations

import sys

from kvrag.engine.reuse.selection.base import BlendPass, register_selection

SCALES = {"ks080": 0.8, "ks090": 0.9, "ks100": 1.0, "ks110": 1.1, "ks120": 1.2}


class ScaledKeys:
    """A plan's cached KV source whose chunk spans' keys come out multiplied by ``scale``."""

    def __init__(self, inner, scale: float, spans: list[tuple[int, int]]):
        self.inner, self.scale, self.spans = inner, scale, spans

    def fill(self, layer: int, buf) -> None:
        self.inner.fill(layer, buf)
        for a, b in self.spans:
            buf.k[layer, :, a:b] *= self.scale

    def __getattr__(self, name):
        return getattr(self.inner, name)


def scaled_reuse(scale: float):
    def strategy(p: BlendPass):
        p.source = ScaledKeys(p.source, scale, p.spans)
        return p.run(p.all_pos[p.uncached], last_row_only=True)

    return strategy


for _name, _scale in SCALES.items():
    register_selection(_name, scaled_reuse(_scale))


if __name__ == "__main__":
    from benchmarks.__main__ import main

    sys.exit(main(sys.argv[1:]))
