"""The correctness gate: a self-test at load that the fused path is exact for the loaded weights.

Position-independent reuse is where model families differ (RoPE base and pairing, RoPE per
layer, sliding windows, q/k norms, biases, embedding scaling). Before ``blend`` or ``reuse`` may
run on a model, two checks compare the engine with transformers' own forward on random token ids
(a sink token, a prefix, a chunk, a question):

* ``placement``: the chunk's KV, computed alone behind the sink and stored without RoPE, is
  placed by the fused path (``reuse``) where the prefix puts it; on every layer its keys and
  values must equal what transformers computes for the sink and the chunk at those positions.
* ``ratio 1.0``: the fused prefill at recompute ratio 1.0 must give transformers' logits for the
  last token (same greedy token, values within the dtype's tolerance).

The verdict is cached per model fingerprint, kvrag KV format, gate version and adapter
signature (the numbers the adapter derived from the config: RoPE frequencies, windows, scale,
family) in ``<cache_dir>/gate.json``, so it runs once per model. A failed check makes the engine
refuse ``blend`` and ``reuse`` with an error naming the model and the check; ``full`` and
``prefix`` still work. Nothing falls back silently.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.loading import KV_FORMAT_VERSION, atomic_write_text
from kvrag.engine.model.runner import KVBuffer, KVCapture, forward
from kvrag.engine.reuse.fusion import PrefillOptions, prefill
from kvrag.engine.reuse.planner import Plan, reuses_nothing
from kvrag.engine.reuse.segments import Segment
from kvrag.engine.store.base import KVRecord
from kvrag.errors import UnsupportedModelError

log = logging.getLogger(__name__)

__all__ = ["GateResult", "GATE_VERSION", "self_test", "load_gate"]

#: Version of the self-test; part of the cache key so a changed test runs again.
GATE_VERSION = 1
_PREFIX, _CHUNK, _QUESTION = 24, 32, 8  # random tokens; the chunk moves by the prefix's length
_TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # max |a - b| / max |b|
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class GateResult:
    """The verdict of the self-test: ``ok``, or the failed ``check`` and what was measured."""

    ok: bool
    check: str = ""
    detail: str = ""

    def require(self, model: str, mode: str, ratio: float | str) -> None:
        """Raise if ``mode`` would reuse cached KV on a model that failed the gate."""
        if self.ok or mode not in ("blend", "reuse") or reuses_nothing(mode, ratio):
            return
        raise UnsupportedModelError(
            f"mode={mode!r} is refused for model {model!r}: kvrag's self-test at load failed the "
            f"{self.check!r} check ({self.detail}), so reused KV would not be exact for this model; "
            "mode='full' and mode='prefix' still work"
        )


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def plain_cache(hf_model):
    """A fresh ``DynamicCache`` and the keyword arguments that hand it to ``hf_model``'s forward
    (``cache=`` since transformers 5.x, ``past_key_values=`` before). A plain cache keeps every
    position, also on sliding-window layers; the forward fills it in place."""
    from transformers import DynamicCache

    cache = DynamicCache()
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    return {name: cache}, cache


@torch.inference_mode()
def self_test(adapter: ModelAdapter, hf_model, sink_ids: list[int]) -> GateResult:
    """Run both checks (module docstring) on random token ids; the first failure is the verdict."""
    vocab = int(adapter.embed_weight.shape[0])
    g = torch.Generator().manual_seed(GATE_VERSION)
    sink = list(sink_ids) or [0]
    prefix, chunk, question = (
        torch.randint(0, vocab, (n,), generator=g).tolist() for n in (_PREFIX, _CHUNK, _QUESTION)
    )
    ids = torch.tensor(sink + prefix + chunk + question, device=adapter.device)
    n, start = int(ids.shape[0]), len(sink) + _PREFIX
    end = start + _CHUNK
    segments = [
        Segment("text", "", sink + prefix, 0),
        Segment("chunk", "", chunk, start),
        Segment("text", "", question, end),
    ]
    tol = _TOL.get(adapter.dtype, 3e-2)
    device = adapter.device

    # placement: the chunk computed alone behind the sink (position len(sink)), placed at ``start``
    alone = torch.tensor(sink + chunk, device=device)
    m = int(alone.shape[0])
    cap = KVCapture(adapter, len(sink), m)
    forward(adapter, KVBuffer(adapter, m), alone, torch.arange(m, device=device), m, capture=[cap])
    record = KVRecord(torch.tensor(chunk), cap.k, cap.v)
    plan = Plan(mode="reuse", ratio=0.0, segments=segments, chunk_records=[(start, record)])
    placed = prefill(adapter, plan, n, options=PrefillOptions()).buf
    shifted = torch.arange(start - len(sink), end, device=device)[None]
    kw, cache = plain_cache(hf_model)
    hf_model(alone[None], position_ids=shifted, use_cache=True, **kw)
    for layer, theirs in enumerate(cache.layers):
        for name, ours, want in (
            ("keys", placed.k[layer, :, start:end], theirs.keys[0, :, len(sink) :]),
            ("values", placed.v[layer, :, start:end], theirs.values[0, :, len(sink) :]),
        ):
            err = _rel_error(ours, want)
            if not err <= tol:
                return GateResult(False, "placement", f"layer {layer} {name} off by {err:.2e} relative (> {tol:g})")

    # ratio 1.0: the fused prefill equals transformers' forward
    plan = Plan(mode="blend", ratio=1.0, segments=segments)
    ours = adapter.logits(prefill(adapter, plan, n, options=PrefillOptions()).last_hidden)[0]
    theirs = hf_model(ids[None], logits_to_keep=1).logits[0, -1]
    err = _rel_error(ours, theirs)
    if not err <= tol or int(ours.argmax()) != int(theirs.argmax()):
        detail = (
            f"last-token logits off by {err:.2e} relative, greedy token {int(ours.argmax())} vs {int(theirs.argmax())}"
        )
        return GateResult(False, "ratio 1.0", detail)
    return GateResult(True)


def signature(adapter: ModelAdapter) -> str:
    """Digest of what the adapter derived from the config (a changed adapter is tested again)."""
    h = hashlib.sha256()
    facts = [adapter.family.name, adapter.scale, adapter.eps, adapter.windows, adapter.rope_kinds]
    facts += [adapter.n_layers, adapter.n_heads, adapter.n_kv_heads, adapter.head_dim, str(adapter.dtype)]
    h.update(json.dumps(facts, default=str).encode())
    for r in adapter.rotaries:
        h.update(r.inv_freq.cpu().numpy().tobytes())
        h.update(repr(r.scaling).encode())
    return h.hexdigest()


def load_gate(adapter: ModelAdapter, hf_model, sink_ids: list[int], *, fingerprint: str, cache_dir: Path) -> GateResult:
    """The gate's verdict for this model: from ``<cache_dir>/gate.json``, or the self-test run now
    and kept there (a cache that cannot be written only costs running it again next time)."""
    key = hashlib.sha256(f"{fingerprint}|kv{KV_FORMAT_VERSION}|gate{GATE_VERSION}|{signature(adapter)}".encode())
    key = key.hexdigest()
    path = Path(cache_dir) / "gate.json"
    cached = _read(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("ok"), bool):
        return GateResult(cached["ok"], str(cached.get("check", "")), str(cached.get("detail", "")))
    result = self_test(adapter, hf_model, sink_ids)
    if not result.ok:
        log.warning(
            "kvrag: the self-test failed the %r check (%s): blend and reuse are refused", result.check, result.detail
        )
    with _lock:
        verdicts = _read(path)
        verdicts[key] = asdict(result)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(verdicts))
        except OSError:
            pass
    return result


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
