"""The correctness gate: a self-test at load that the fused path is exact for the loaded weights.

Position-independent reuse is where model families differ (RoPE base and pairing, RoPE per
layer, sliding windows, q/k norms, biases, embedding scaling). Before ``blend`` or ``reuse`` may
run on a model, two checks compare the engine with transformers' own forward on random token ids
(a sink token, a prefix, a chunk, a question):

* ``placement``: the chunk's KV, computed alone behind the sink and stored without RoPE, is
  placed by the fused path (``reuse``) where the prefix puts it; on every layer its keys and
  values must equal what transformers computes for the sink and the chunk at those positions.
* ``ratio 1.0``: the fused prefill at recompute ratio 1.0 must give transformers' logits for the
  last token (within the tolerance below, and a greedy token the reference ranks first unless
  the two are tied within kvrag's error).

Each tensor is judged on its own (each layer's keys, each layer's values, the logits), and what
"equal" means depends on the dtype, each judged by its own noise:

* **float32**: kvrag against transformers, both in float32: ``max |a - b| / max |b|`` within
  1e-3. Two float32 computations of the same thing agree to ~1e-6; a wrong RoPE or norm is off
  by 1e-1 or more.
* **bfloat16 / float16**: two computations in a reduced dtype differ by their rounding, which
  grows along the layers (transformers' own bf16 keys are ~3e-3 off its float32 keys on
  SmolLM2's first layer, ~4e-2 on deep ones), so no fixed tolerance separates noise from a bug.
  The reference is transformers in float32 over the *same* weights (upcasting is exact, so only
  the arithmetic differs), each module brought to float32 just before it runs and back after
  (:func:`_in_float32`: the round trip is exact, and no float32 copy of the model is held). The
  *floor* is transformers' own error in the engine's dtype against that reference, tensor by
  tensor, on the same ids, in norm (``||a - b|| / ||b||``: the largest element's error is one
  extreme of the noise and jumps between runs, the norm is steady enough to judge a layer
  alone). kvrag passes when each of its errors is within :data:`FLOOR_MULTIPLE`
  times the floor of the same tensor (the floor taken as at least the dtype's unit roundoff).
  Measured on CPU (SmolLM2, Gemma 3 270M, the tiny test models of every family, several id
  seeds): kvrag's error is at most 1.4x the floor (its ratio 1.0 logits *are* transformers' bf16
  logits); a RoPE with a wrong base (20k for 10k) is 70-120x the floor on the first layer, where
  the floor is smallest.

The verdict is cached per model fingerprint (it includes the compute dtype), kvrag KV format,
gate version and adapter signature (the numbers the adapter derived from the config: RoPE
frequencies, windows, scale, family, dtype) in ``<cache_dir>/gate.json``, so it runs once per
model and dtype. A failed check makes the engine refuse ``blend`` and ``reuse`` with an error
naming the model and the check; ``full`` and ``prefix`` still work. Nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.dtypes import dtype_name
from kvrag.engine.model.loading import KV_FORMAT_VERSION, atomic_write_text
from kvrag.engine.model.runner import KVBuffer, KVCapture, forward
from kvrag.engine.reuse.budget import Budget
from kvrag.engine.reuse.fusion import PrefillOptions, prefill
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.reuse.segments import Segment
from kvrag.engine.store.base import KVRecord
from kvrag.errors import UnsupportedModelError

log = logging.getLogger(__name__)

__all__ = ["GateResult", "GATE_VERSION", "FLOAT32_TOL", "FLOOR_MULTIPLE", "self_test", "load_gate"]

#: Version of the self-test; part of the cache key so a changed test runs again.
#: 2: reduced dtypes judged against a float32 reference and transformers' own error floor.
GATE_VERSION = 2
_SEED = 1  # the random ids (version 1 seeded them with its version number: the same ids still)
_PREFIX, _CHUNK, _QUESTION = 24, 32, 8  # random tokens; the chunk moves by the prefix's length
#: float32: max |a - b| / max |b| of kvrag against transformers (as in version 1).
FLOAT32_TOL = 1e-3
#: bfloat16/float16: kvrag's error against the float32 reference may be this many times
#: transformers' own on the same tensor (measured: at most 1.4x; a wrong RoPE base: 70-120x).
FLOOR_MULTIPLE = 3.0
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class GateResult:
    """The verdict of the self-test: ``ok``, or the failed ``check`` and what was measured.

    Attributes:
        ok: both checks passed.
        check: the failed check (``placement`` or ``ratio 1.0``), empty when ``ok``.
        detail: what the failed check measured, in words.
        dtype: the compute dtype judged.
        measured: per check, its closest call (the tensor nearest its tolerance): kvrag's error
            against the reference (``"placement"``, ``"ratio 1.0"``), the layer (``"... layer"``),
            transformers' own error there in the engine's dtype (``"... floor"``, reduced dtypes
            only) and the tolerance applied (``"... allowed"``); relative errors (module docstring).
    """

    ok: bool
    check: str = ""
    detail: str = ""
    dtype: str = ""
    measured: dict = field(default_factory=dict)

    def require(self, model: str, mode: str, budget: Budget) -> None:
        """Raise if ``mode`` with ``budget`` would reuse cached KV on a model that failed the gate."""
        if self.ok or mode not in ("blend", "reuse") or budget.reuses_nothing(mode):
            return
        raise UnsupportedModelError(
            f"mode={mode!r} is refused for model {model!r}: kvrag's self-test at load failed the "
            f"{self.check!r} check ({self.detail}), so reused KV would not be exact for this model; "
            "mode='full' and mode='prefix' still work"
        )

    def summary(self) -> str:
        """One line: the verdict, then each check's closest call: kvrag's error there,
        transformers' own in this dtype (reduced dtypes) and the tolerance applied."""
        parts = []
        m = self.measured
        for check in ("placement", "ratio 1.0"):
            if check not in m:
                continue
            where = f" on layer {int(m[check + ' layer'])}" if check + " layer" in m else ""
            floor = f", transformers' own {m[check + ' floor']:.1e}" if check + " floor" in m else ""
            parts.append(f"{check} {m[check]:.1e}{where}{floor}, allowed {m[check + ' allowed']:.1e}")
        verdict = "passed" if self.ok else f"failed {self.check!r} ({self.detail})"
        return f"{verdict} in {self.dtype or '?'}" + (": " + "; ".join(parts) if parts else "")


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius): the error of a whole tensor. The largest element's
    error (:func:`_max_rel_error`) is one extreme of the rounding noise and jumps between runs;
    the norm averages over the elements and is steady, so a layer can be judged alone against
    transformers' own error there."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the float32 check's error (no noise to average out there,
    and one wrong element counts in full)."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def plain_cache(hf_model):
    """A fresh ``DynamicCache`` and the keyword arguments that hand it to ``hf_model``'s forward
    (``cache=`` since transformers 5.x, ``past_key_values=`` before). A plain cache keeps every
    position, also on sliding-window layers; the forward fills it in place."""
    from transformers import DynamicCache

    cache = DynamicCache()
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    return {name: cache}, cache


@dataclass(slots=True)
class _Probe:
    """The gate's prompt: sink + prefix + chunk + question, and the chunk alone behind the sink."""

    ids: torch.Tensor  # [n]
    alone: torch.Tensor  # [m]: sink + chunk
    sink: int  # tokens of the sink
    start: int  # where the chunk sits in ``ids``
    end: int


def _transformers_run(hf_model, probe: _Probe) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """What transformers computes for the probe: per layer the chunk's (keys, values) [Hkv, C, D]
    behind the sink at the chunk's place in the prompt, and the prompt's last-token logits [V]."""
    shifted = torch.arange(probe.start - probe.sink, probe.end, device=probe.ids.device)[None]
    kw, cache = plain_cache(hf_model)
    hf_model(probe.alone[None], position_ids=shifted, use_cache=True, **kw)
    kv = [(layer.keys[0, :, probe.sink :], layer.values[0, :, probe.sink :]) for layer in cache.layers]
    logits = hf_model(probe.ids[None], logits_to_keep=1).logits[0, -1].float()
    return kv, logits


@contextlib.contextmanager
def _in_float32(hf_model):
    """Within the block, ``hf_model`` (in a reduced dtype) computes in float32: each leaf module with
    weights is brought to float32 just before its forward and back to its dtype right after, so at
    most one module's weights are in float32 at a time (the LM head, or a layer's MLP) instead of a
    float32 copy of the whole model. The conversion up is exact (every bf16 or fp16 value is a
    float32 value), and after its forward a module gets its own tensors back (not a conversion
    down: a fresh copy of every weight, while the engine still holds the originals), so the weights
    after the block are the ones before, the same storage."""
    kept: dict[torch.nn.Parameter, torch.Tensor] = {}  # each weight's own tensor while it is in float32

    def up(module, args) -> None:
        for p in module.parameters(recurse=False):
            own = kept.setdefault(p, p.data)
            p.data = own.to(torch.float32)

    def down(module, args=None, out=None) -> None:
        for p in module.parameters(recurse=False):
            if p in kept:
                p.data = kept.pop(p)

    modules = [m for m in hf_model.modules() if next(m.parameters(recurse=False), None) is not None]
    hooks = [h for m in modules for h in (m.register_forward_pre_hook(up), m.register_forward_hook(down))]
    try:
        yield hf_model
    finally:
        for hook in hooks:
            hook.remove()
        for module in modules:  # a forward interrupted between its hooks
            down(module)


@dataclass(slots=True)
class _Comparison:
    """kvrag's error against the reference on one tensor, transformers' own there, and the bound."""

    layer: int  # -1: the logits
    err: float
    floor: float | None  # None in float32: kvrag is compared with transformers directly
    allowed: float

    @property
    def closeness(self) -> float:
        """err / allowed (NaN counts as infinitely far)."""
        ratio = self.err / self.allowed if self.allowed > 0 else float("inf")
        return ratio if ratio == ratio else float("inf")


def _compare(layer: int, ours: torch.Tensor, ref: torch.Tensor, theirs: torch.Tensor | None, dtype) -> _Comparison:
    if theirs is None:
        return _Comparison(layer, _max_rel_error(ours, ref), None, FLOAT32_TOL)
    err, floor = _rel_error(ours, ref), _rel_error(theirs, ref)
    if not math.isfinite(floor):  # transformers itself overflows in this dtype: nothing to judge by
        return _Comparison(layer, err, floor, 0.0)
    # the floor is at least one rounding of the dtype (its unit roundoff): never a zero tolerance
    return _Comparison(layer, err, floor, FLOOR_MULTIPLE * max(floor, torch.finfo(dtype).eps / 2))


def _verdict(check: str, comparisons: list[_Comparison], dtype: str) -> tuple[bool, str, dict[str, float]]:
    """Whether every comparison is within its bound; the closest call, in words and numbers."""
    c = max(comparisons, key=lambda c: c.closeness)
    measured = {check: c.err, f"{check} allowed": c.allowed}
    if c.layer >= 0:
        measured[f"{check} layer"] = float(c.layer)
    if c.floor is not None:
        measured[f"{check} floor"] = c.floor
    ok = c.err <= c.allowed
    where = f"layer {c.layer}" if c.layer >= 0 else "last-token logits"
    if c.floor is None:
        detail = f"{where} off by {c.err:.2e} relative (allowed {c.allowed:.0e} in {dtype})"
    elif not math.isfinite(c.floor):
        detail = f"{where}: transformers' own {dtype} forward is not finite, so {dtype} cannot be judged"
    else:
        detail = (
            f"{where} off by {c.err:.2e} relative (allowed {c.allowed:.2e}: {FLOOR_MULTIPLE:g}x transformers' "
            f"own {c.floor:.2e} in {dtype})"
        )
    return ok, "" if ok else detail, measured


@torch.inference_mode()
def self_test(adapter: ModelAdapter, hf_model, sink_ids: list[int]) -> GateResult:
    """Run both checks (module docstring) on random token ids; the first failure is the verdict.

    In a reduced dtype the reference runs module by module in float32 over the same weights
    (:func:`_in_float32`); it runs once per model and dtype (the verdict is cached).
    """
    vocab = int(adapter.embed_weight.shape[0])
    g = torch.Generator().manual_seed(_SEED)
    sink = list(sink_ids) or [0]
    prefix, chunk, question = (
        torch.randint(0, vocab, (n,), generator=g).tolist() for n in (_PREFIX, _CHUNK, _QUESTION)
    )
    device = adapter.device
    ids = torch.tensor(sink + prefix + chunk + question, device=device)
    n, start = int(ids.shape[0]), len(sink) + _PREFIX
    probe = _Probe(ids, torch.tensor(sink + chunk, device=device), len(sink), start, start + _CHUNK)
    segments = [
        Segment("text", "", sink + prefix, 0),
        Segment("chunk", "", chunk, start),
        Segment("text", "", question, probe.end),
    ]

    # kvrag, placement: the chunk computed alone behind the sink (position len(sink)), placed at ``start``
    m = int(probe.alone.shape[0])
    cap = KVCapture(adapter, len(sink), m)
    forward(adapter, KVBuffer(adapter, m), probe.alone, torch.arange(m, device=device), m, capture=[cap])
    record = KVRecord(torch.tensor(chunk), cap.k, cap.v)
    plan = Plan(mode="reuse", segments=segments, chunk_records=[(start, record)])
    placed = prefill(adapter, plan, n, options=PrefillOptions()).buf
    ours_kv = [
        (placed.k[layer, :, start : probe.end], placed.v[layer, :, start : probe.end])
        for layer in range(adapter.n_layers)
    ]
    # kvrag, ratio 1.0: the fused prefill recomputing everything
    plan = Plan(mode="blend", segments=segments, full=True)  # ratio 1.0 recomputes every token
    ours_logits = adapter.logits(prefill(adapter, plan, n, options=PrefillOptions()).last_hidden)[0]

    # the reference (float32), and transformers in this dtype: its error there is the floor
    theirs_kv, theirs_logits = _transformers_run(hf_model, probe)
    if adapter.dtype == torch.float32:
        ref_kv, ref_logits = theirs_kv, theirs_logits
        theirs_kv, theirs_logits = [(None, None)] * adapter.n_layers, None
    else:
        with _in_float32(hf_model) as reference:
            ref_kv, ref_logits = _transformers_run(reference, probe)
    name = dtype_name(adapter.dtype) or str(adapter.dtype)
    dt = adapter.dtype

    # placement: every layer's keys and values, each against transformers' own error on that layer
    comparisons = [
        _compare(layer, ours[i], ref[i], theirs[i], dt)
        for layer, (ours, ref, theirs) in enumerate(zip(ours_kv, ref_kv, theirs_kv))
        for i in (0, 1)
    ]
    ok, detail, measured = _verdict("placement", comparisons, name)
    if not ok:
        return GateResult(False, "placement", detail, name, measured)

    # ratio 1.0: the fused prefill's logits against the reference's
    ok, detail, logits_measured = _verdict(
        "ratio 1.0", [_compare(-1, ours_logits, ref_logits, theirs_logits, dt)], name
    )
    measured.update(logits_measured)
    ours_top, ref_top = int(ours_logits.argmax()), int(ref_logits.argmax())
    # another greedy token only where kvrag's own (accepted) error explains it: a near tie
    gap = float(ref_logits[ref_top] - ref_logits[ours_top])
    if ok and gap > 2 * float((ours_logits - ref_logits).abs().max()):
        ok, detail = False, f"greedy token {ours_top} where the reference's is {ref_top} ({gap:.2e} better)"
    if not ok:
        return GateResult(False, "ratio 1.0", detail, name, measured)
    return GateResult(True, dtype=name, measured=measured)


def signature(adapter: ModelAdapter) -> str:
    """Digest of what the adapter derived from the config (a changed adapter is tested again)."""
    h = hashlib.sha256()
    facts = [adapter.family.name, adapter.scale, adapter.eps, adapter.windows, adapter.rope_kinds]
    facts += [adapter.n_layers, adapter.n_heads, adapter.n_kv_heads, adapter.head_dim, str(adapter.dtype)]
    if adapter.device.type != "cpu":  # another device runs other kernels (Triton on CUDA): its own verdict
        facts.append(adapter.device.type)
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
    cached = _from_json(_read(path).get(key))
    if cached is not None:
        return cached
    result = self_test(adapter, hf_model, sink_ids)
    if result.ok:
        log.info("kvrag: the self-test %s", result.summary())
    else:
        log.warning("kvrag: the self-test %s: blend and reuse are refused", result.summary())
    with _lock:
        verdicts = _read(path)
        verdicts[key] = asdict(result)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(verdicts))
        except OSError:
            pass
    return result


def _from_json(entry) -> GateResult | None:
    """A cached verdict, or None for an absent or damaged one (then the test runs again)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
        return None
    measured = entry.get("measured", {})
    try:
        measured = {str(k): float(v) for k, v in measured.items()}
    except (AttributeError, TypeError, ValueError):
        return None
    fields = (str(entry.get(name, "")) for name in ("check", "detail", "dtype"))
    return GateResult(entry["ok"], *fields, measured)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
