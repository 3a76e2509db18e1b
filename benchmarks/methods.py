"""Benchmark methods by name: a registry of runners over the engine's public API.

A method turns one :class:`~benchmarks.data.Request` into a :class:`Outcome` (timings, answer,
what the engine did). ``hf`` is the peer baseline: transformers' own forward over the same token
ids, in the same process and threads. ``full``, ``prefix``, ``reuse`` and ``blend`` are the engine's
modes; ``blend@0.3`` names a recompute ratio, ``blend`` alone uses the engine's configured default;
``probe``, ``hkvd``, ``recency`` and ``epic`` are ``blend`` with that selection. A spec may add
EngineConfig overrides and selection parameters for its method alone: ``probe@0.15+probe_layer=12``
(:mod:`benchmarks.specs`); ``full+dtype=float32`` is a full prefill in float32 beside a run in the
machine's dtype (bf16 where it computes it natively), the reference of the tables' "× fp32 full".
``probe`` and ``recency`` are kvrag's own; ``hkvd``, ``epic``, ``focus``, ``craft``, ``query`` (research
baselines) and ``random`` (an ablation) are registered by :mod:`benchmarks.selections`, imported here.

New methods (Cache-Craft, reordering, ...) plug in with :func:`register_method`::

    register_method("craft", lambda spec, ctx: MyRunner(...), description="Cache-Craft")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import benchmarks.selections  # noqa: F401  (registers the research selections: hkvd, epic, focus, craft, query, random)
from benchmarks.specs import MethodSpec, check_selection_params, parse_spec, split_specs
from kvrag.engine.model.host import on_own_thread
from kvrag.errors import InvalidRequestError

__all__ = [
    "Outcome",
    "Method",
    "MethodSpec",
    "register_method",
    "available_methods",
    "parse_methods",
    "engine_token_ids",
    "ttft_ratios",
]


@dataclass(slots=True)
class Outcome:
    """What one method did on one request."""

    ttft_s: float
    total_s: float
    text: str | None = None  # None: the method produces no answer (hf: first token only)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    candidate_tokens: int = 0  # cached chunk tokens that could have been recomputed
    compute_fraction: float = 1.0
    chunk_hits: int = 0
    chunk_misses: int = 0
    extra: dict = field(default_factory=dict)


def ttft_ratios(outcomes: dict[str, Outcome]) -> str:
    """Each method's TTFT against ``full``'s on one request, for a progress bar (``probe@0.15 0.16x ...``)."""
    full = outcomes["full"].ttft_s
    return " ".join(f"{k} {o.ttft_s / full:.2f}x" for k, o in outcomes.items() if k != "full" and full)


class Method:
    """A runnable method. Subclasses implement :meth:`run`; :meth:`score` is optional.

    Attributes:
        name: the name results are filed under (``blend@0.15``).
        answers: produces an answer text (fidelity metrics apply).
        exact_prefix_writer: stores whole prompts in the exact-prefix cache; such methods run after
            the others on a request, so they cannot serve the others' lookups (see workloads).
        uses_store: reads/writes chunk KV (a stream workload gives it its own engine and store).
        overrides: EngineConfig overrides of this method (its spec's ``+field=value``); a method
            with overrides runs on an engine of its own (:mod:`benchmarks.engines`).
    """

    answers = True
    exact_prefix_writer = False
    uses_store = True
    conversational = False

    def __init__(self, name: str, overrides: dict | None = None) -> None:
        self.name = name
        self.overrides = dict(overrides or {})

    def run(self, engine, req, *, max_new_tokens: int) -> Outcome:
        raise NotImplementedError

    def score_tokens(self, engine, req, continuation: str) -> list[float] | None:
        """Per-token log-likelihoods of ``continuation`` after the request's prompt (None: not supported)."""
        return None

    def score(self, engine, req, continuation: str) -> float | None:
        """Log-likelihood of ``continuation`` after the request's prompt (None: not supported)."""
        per_token = self.score_tokens(engine, req, continuation)
        return None if per_token is None else float(sum(per_token))

    def end(self, engine, conversation: str) -> None:
        """A conversation is over (methods that keep per-conversation state free it here)."""


class EngineMethod(Method):
    """One of the engine's prefill modes through ``Engine.generate`` / ``Engine.score``."""

    def __init__(
        self,
        name: str,
        mode: str,
        ratio: float | str | None = None,
        selection: str | None = None,
        overrides: dict | None = None,
        order: str | None = None,
    ) -> None:
        super().__init__(name, overrides)
        self.mode, self.ratio, self.selection = mode, ratio, selection
        self.order = order  # chunk order of chunks= requests (CRAFT's "frequency"), None: as given
        self.exact_prefix_writer = mode == "prefix"
        self.uses_store = mode != "full"

    def _kwargs(self, req) -> dict:
        return {}

    def _order(self, req) -> dict:
        return {"chunk_order": self.order} if self.order is not None and req.prompt is None else {}

    def run(self, engine, req, *, max_new_tokens: int) -> Outcome:
        common = dict(
            mode=self.mode,
            recompute_ratio=self.ratio,
            selection=self.selection,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            **self._kwargs(req),
            **self._order(req),
        )
        if req.prompt is not None:
            g = engine.generate(prompt=req.prompt, **common)
        else:
            g = engine.generate(req.chunks, req.prefix, req.suffix, **common)
        s = g.stats
        candidates = sum(c.tokens for c in s.chunks if c.source == "store")
        return Outcome(
            ttft_s=g.ttft_s,
            total_s=g.total_s,
            text=g.text,
            token_ids=list(g.token_ids),
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            recomputed_tokens=s.recomputed_tokens,
            candidate_tokens=candidates,
            compute_fraction=s.compute_fraction,
            chunk_hits=s.chunk_hits,
            chunk_misses=s.chunk_misses,
            extra={
                "dtype": engine.config.dtype,
                "finish_reason": g.finish_reason,
                "prefix_tokens": s.prefix_tokens,
                "recompute_ratio": s.recompute_ratio,
                "auto": s.auto,
                "path": getattr(s, "path", ""),
                "selection": getattr(s, "selection", ""),
                "completion_tokens": s.completion_tokens,
                "conversation_tokens": getattr(s, "conversation_tokens", 0),
                "deduplicated_chunks": getattr(s, "deduplicated_chunks", 0),
                # exact: an exact prefix or an exact chunk variant (tree); blended: chunk KV fused in place
                "exact_tokens": s.exact_tokens,
                "exact_chunks": sum(c.source in ("prefix", "tree") for c in s.chunks),
                "blended_chunks": sum(c.source == "store" for c in s.chunks),
                "blended_tokens": candidates,
                # how foreign the blended KV was: Cache-Craft's beta, token-weighted (0: all other company)
                "blended_overlap": _weighted(s.chunks, "overlap"),
                "blended_fix": _weighted(s.chunks, "fix"),
            },
        )

    def score_tokens(self, engine, req, continuation: str) -> list[float] | None:
        if req.prompt is not None:
            res = engine.score(
                continuation, prompt=req.prompt, mode=self.mode, recompute_ratio=self.ratio, selection=self.selection
            )
        else:
            res = engine.score(
                continuation,
                req.chunks,
                req.prefix,
                req.suffix,
                mode=self.mode,
                recompute_ratio=self.ratio,
                selection=self.selection,
                **self._order(req),
            )
        return res.token_logprobs


class ConversationMethod(EngineMethod):
    """``blend`` as a turn of a conversation (``conversation_id``): the previous turn's KV is kept
    and reused, and chunks an earlier turn already placed in the context are dropped (CRAFT)."""

    conversational = True

    def _kwargs(self, req) -> dict:
        conv = req.meta.get("conversation")
        return {} if conv is None else {"conversation_id": f"{self.name}/{conv}"}

    def end(self, engine, conversation: str) -> None:
        engine.end_conversation(f"{self.name}/{conversation}")


def _weighted(chunks, field: str) -> float | None:
    """The blended chunks' ``field``, weighted by their tokens (``None``: nothing blended)."""
    blended = [c for c in chunks if c.source == "store" and getattr(c, field) is not None]
    total = sum(c.tokens for c in blended)
    return sum(c.tokens * getattr(c, field) for c in blended) / total if total else None


def engine_token_ids(engine, req) -> list[int]:
    """The prompt's token ids as the engine builds them: each part tokenised on its own, in order,
    with the tokenizer's BOS first when the tokenizer adds one and the prompt does not start with it.
    """
    tok = engine.tokenizer
    if req.prompt is not None:
        parts = [text for _, text in engine.split_prompt(req.prompt)]
    else:
        parts = [req.prefix, *req.chunks, req.suffix]
    ids: list[int] = []
    for text in parts:
        if text:
            ids.extend(tok(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tok, "bos_token_id", None)
    with_special = tok("a", add_special_tokens=True)["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    if bos is not None and len(with_special) > len(plain) and with_special[0] == bos:
        first = next((t for t in parts if t), "")
        if not first.startswith(tok.bos_token or "\0"):
            ids.insert(0, bos)
    return ids


class HFForward(Method):
    """Transformers' own forward over the same token ids (``logits_to_keep=1``): the peer baseline.

    Its TTFT is the forward plus the greedy pick of the first token; it produces no answer text.
    The forward runs on a thread of its own, as the engine's prefill does, once the engine's idle thread
    has ended (two OpenMP pools on the cores would slow it: ``kvrag.engine.model.host``).
    """

    answers = False
    uses_store = False

    def run(self, engine, req, *, max_new_tokens: int) -> Outcome:
        model = engine.hf_model
        ids = torch.tensor([engine_token_ids(engine, req)], dtype=torch.long, device=model.device)  # [1, N]

        def forward() -> tuple[int, float]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model(input_ids=ids, logits_to_keep=1, use_cache=True)
                token = int(out.logits[0, -1].argmax())
            return token, time.perf_counter() - t0

        # on a thread that ends: the harness's thread keeps no OpenMP pool beside the engine's
        # (kvrag.engine.model.host), and the engine's idle thread ends first: its pool does not share the cores
        engine._worker.release(timeout=30)
        token, ttft = on_own_thread(forward, name="hf-forward")
        n = int(ids.shape[1])
        return Outcome(
            ttft_s=ttft,
            total_s=ttft,
            token_ids=[token],
            prompt_tokens=n,
            chunk_misses=len(req.chunks),
            extra={"dtype": engine.config.dtype},
        )


Factory = Callable[[MethodSpec], Method]
_REGISTRY: dict[str, tuple[Factory, str]] = {}


def register_method(base: str, factory: Factory, *, description: str = "", replace: bool = False) -> None:
    """Make ``base`` (and ``base@x``) a method name. ``factory(spec)`` builds the runner."""
    if not base or "@" in base or "," in base:
        raise ValueError(f"bad method name {base!r}")
    if base in _REGISTRY and not replace:
        raise ValueError(f"method {base!r} is already registered")
    _REGISTRY[base] = (factory, description)


def available_methods() -> dict[str, str]:
    """Registered method names and their descriptions."""
    return {k: d for k, (_, d) in _REGISTRY.items()}


def _no_arg(spec: MethodSpec) -> None:
    if spec.arg is not None:
        raise InvalidRequestError(f"method {spec.base!r} takes no @ argument (got {spec.name!r})")


def _no_overrides(spec: MethodSpec, why: str) -> None:
    if spec.overrides:
        raise InvalidRequestError(f"method {spec.name!r}: {spec.base} takes no +FIELD=VALUE overrides ({why})")


def _overrides(spec: MethodSpec, selection: str | None = None) -> dict:
    """The spec's EngineConfig overrides, the selection's parameters checked: parameters given for a
    method that names its selection (``hkvd@0.15+check_layer=2``) configure that selection.

    ``dtype`` is refused: a method that reads the store in another dtype than the run's would find
    none of the chunk KV the run warmed (keys carry the dtype); only ``full`` takes one.
    """
    out = dict(spec.overrides)
    if "dtype" in out:
        raise InvalidRequestError(
            f"method {spec.name!r}: only full takes a dtype of its own (full+dtype=float32, a reference); "
            "chunk KV is keyed by dtype, so this method would find nothing the run warmed: set the run's "
            "dtype with --config dtype=..."
        )
    if "selection_params" in out and selection is not None:
        out.setdefault("selection", selection)
    try:
        check_selection_params(out)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"method {spec.name!r}: {exc}") from None
    return out


def _engine_mode(mode: str) -> Factory:
    def make(spec: MethodSpec) -> Method:
        _no_arg(spec)
        if mode == "full":  # the reference; full+dtype=float32 is another reference beside it
            if set(dict(spec.overrides)) - {"dtype"}:
                _no_overrides(spec, "it is the reference every method is paired with; it takes only a dtype")
            return EngineMethod(spec.name, mode, overrides=dict(spec.overrides), order=spec.order)
        return EngineMethod(spec.name, mode, overrides=_overrides(spec), order=spec.order)

    return make


def _ratio_arg(spec: MethodSpec) -> float | str | None:
    if spec.arg is None or spec.arg == "auto":  # auto: each request recomputes what it measures it needs
        return spec.arg
    try:
        ratio = float(spec.arg)
    except ValueError:
        raise InvalidRequestError(f"method {spec.name!r}: {spec.arg!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise InvalidRequestError(f"{spec.name}: the recompute ratio must be in [0, 1]")
    return ratio


def _blend(selection: str | None) -> Factory:
    def make(spec: MethodSpec) -> Method:
        return EngineMethod(
            spec.name, "blend", _ratio_arg(spec), selection, _overrides(spec, selection), order=spec.order
        )

    return make


def _auto(spec: MethodSpec) -> Method:
    _no_arg(spec)
    return EngineMethod(spec.name, "blend", "auto", None, _overrides(spec), order=spec.order)


def _hf(spec: MethodSpec) -> Method:
    _no_arg(spec)
    _no_overrides(spec, "it runs transformers' own forward")
    return HFForward(spec.name)


def _conv(spec: MethodSpec) -> Method:
    return ConversationMethod(spec.name, "blend", _ratio_arg(spec), overrides=_overrides(spec))


register_method("hf", _hf, description="transformers' own forward on the same token ids (TTFT only)")
register_method("full", _engine_mode("full"), description="full prefill: the fidelity reference")
register_method("prefix", _engine_mode("prefix"), description="exact reuse of the longest cached prompt prefix")
register_method("reuse", _engine_mode("reuse"), description="cached chunk KV as is (recompute ratio 0)")
register_method("blend", _blend(None), description="fusion with the configured selection; blend@r sets the ratio")
register_method(
    "auto",
    _auto,
    description="fusion with recompute_ratio='auto' (each request recomputes what it measures it needs) and the "
    "configured selection; probe@auto etc. name the selection",
)
register_method(
    "hkvd", _blend("hkvd"), description="fusion recomputing CacheBlend's HKVD tokens; hkvd@r sets the ratio"
)
register_method(
    "probe",
    _blend("probe"),
    description="fusion recomputing the blocks of chunk tokens a deep-layer "
    "probe finds most changed; probe@r sets the ratio",
)
register_method(
    "recency", _blend("recency"), description="fusion recomputing the tokens nearest the question; recency@r"
)
register_method(
    "epic",
    _blend("epic"),
    description="fusion recomputing the first tokens of every cached chunk (EPIC's LegoLink); epic@r",
)
register_method(
    "focus",
    _blend("focus"),
    description="fusion recomputing whole the chunks the question attends to (Cache-Craft's focused chunks), "
    "then the probe's blocks; focus@r",
)
register_method(
    "craft",
    _blend("craft"),
    description="fusion recomputing each chunk's share by Cache-Craft's fix overhead (CFO); craft@r",
)
register_method(
    "random",
    _blend("random"),
    description="ablation: the probe's passes and blocks, picked in a random order (what the ranking buys); random@r",
)
register_method(
    "conv",
    _conv,
    description="blend within a conversation (kept KV of earlier turns, dedup); "
    "workload c; elsewhere it is plain blend",
)


def parse_method(name: str) -> MethodSpec:
    """One spec, ``base[@arg][+field=value]...`` (:mod:`benchmarks.specs`)."""
    return parse_spec(name, _REGISTRY)


def parse_methods(names: str | list[str]) -> list[Method]:
    """``"hf,full,blend@0.3,probe@0.15+probe_layer=12"`` -> runners, in order, duplicates refused;
    ``full`` is always included (every ratio and fidelity metric is against it)."""
    if isinstance(names, str):
        names = split_specs(names)
    specs = [parse_method(n) for n in names]
    seen = set()
    for s in specs:
        if s.name in seen:
            raise InvalidRequestError(f"method {s.name!r} is listed twice")
        seen.add(s.name)
    if "full" not in seen:
        specs.insert(0, MethodSpec("full", "full"))
    return [_REGISTRY[s.base][0](s) for s in specs]
