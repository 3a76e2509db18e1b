"""Per-model calibration experiments of ``recompute_ratio="auto"`` (research: not in the wheel).

A probe's KV deviation has a scale of its own for every model (and probe layer, block size and
deviation kind), and so has Cache-Craft's fix overhead. :func:`calibrate` measures, on dev questions,
the threshold and the ``alpha`` that make ``auto`` recompute what a fixed budget would in the
favourable case: set them as ``auto_threshold=`` and ``selection_params={"alpha": ...}`` (``craft``)
to use them. On the dev set a calibrated threshold cost TTFT and bought no fidelity, so none is
set by default (docs/results.md).

How much a chunk's KV computed behind other passages drifts, and how much recomputing buys back,
is a model's own too. :func:`calibrate_qualities` warms each question's passages behind passages
of other questions, measures the answer drift (mean |log p| difference per token of the full
prefill's answer, teacher-forced) of ``other_context_selection`` at a grid of shares against that
of CacheBlend's probe at 15%, and keeps per quality the least share whose mean drift reaches the
quality's target (:data:`QUALITY_TARGETS`); where the selection needs more than the probe's budget
to drift no more than it, KV from another context is better left to the probe on that model
(``switch`` false: ``other_context_selection=None``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from benchmarks.metrics import drift
from kvrag import Engine, RequestOptions
from kvrag.engine.reuse.selection import configured_params
from kvrag.engine.serving.progress import progress_reporter
from kvrag.errors import InvalidRequestError

log = logging.getLogger(__name__)

__all__ = [
    "calibrate",
    "calibrate_qualities",
    "probe_key",
    "threshold_for",
    "alpha_for",
    "CalibrationQuestion",
    "CalibrationResult",
    "Measurements",
    "check_questions",
    "check_target",
    "QUALITY_GRID",
    "QUALITY_TARGETS",
    "QualityCalibration",
    "QualityMeasurements",
    "drift",
]


def probe_key(probe_layer: int, probe_stride: int, deviation: str) -> str:
    """The probe settings a threshold belongs to."""
    return f"layer={probe_layer},stride={probe_stride},deviation={deviation}"


# -- the shares of foreign KV per quality ---------------------------------------------------------------

#: Shares of a foreign chunk's tokens the quality calibration tries (``other_context_selection`` at each).
QUALITY_GRID = (0.05, 0.10, 0.13, 0.20, 0.30, 0.45, 0.60, 0.80)
#: Each quality's target: the mean answer drift on foreign KV, as a multiple of the drift of
#: CacheBlend's probe at 15% on the same prompts. ``fast``: no worse than CacheBlend; ``balanced``:
#: 15% below it (issue 35's line); ``faithful``: half of it.
QUALITY_TARGETS = {"fast": 1.0, "balanced": 0.85, "faithful": 0.5}
#: The reference the targets are multiples of: (selection, share).
QUALITY_REFERENCE = ("probe", 0.15)


@dataclass
class QualityMeasurements:
    """Answer drifts on foreign KV over the calibration questions.

    Attributes:
        reference: per question, the drift of :data:`QUALITY_REFERENCE`.
        drifts: share -> per question, the drift of ``other_context_selection`` at that share.
    """

    reference: list[float] = field(default_factory=list)
    drifts: dict[float, list[float]] = field(default_factory=dict)

    def add(self, reference: float, drifts: dict[float, float]) -> None:
        self.reference.append(reference)
        for share, d in drifts.items():
            self.drifts.setdefault(share, []).append(d)

    def reference_drift(self) -> float:
        """Mean drift of :data:`QUALITY_REFERENCE` over the questions."""
        return sum(self.reference) / len(self.reference)

    def means(self) -> dict[float, float]:
        """Mean drift per share, least share first."""
        return {s: sum(d) / len(d) for s, d in sorted(self.drifts.items())}

    def shares(self) -> tuple[bool, dict[str, float], dict[str, bool]]:
        """``(switch, shares, reached)``: whether foreign KV is worth its own selection on this model,
        per quality the least share whose mean drift reaches its target (never less than a faster
        quality's; only the qualities some share reached), and which did.

        The switch pays when some share no larger than the reference's reaches ``fast``'s target
        (the reference's own drift): else the selection needs more of the budget than CacheBlend's
        probe for the same drift, and foreign KV is better left to the probe (no shares then).

        Raises:
            InvalidRequestError: nothing was measured.
        """
        if not self.reference or not self.drifts:
            raise InvalidRequestError("the quality calibration measured nothing: give questions with an answer")
        ref = self.reference_drift()
        means = self.means()
        out: dict[str, float] = {}
        reached: dict[str, bool] = {}
        floor = 0.0
        for quality, factor in QUALITY_TARGETS.items():  # fastest first
            ok = [s for s, d in means.items() if d <= factor * ref and s >= floor]
            reached[quality] = bool(ok)
            if ok:
                out[quality] = floor = ok[0]
        switch = reached["fast"] and out["fast"] <= QUALITY_REFERENCE[1]
        return switch, out if switch else {}, reached


# -- the constants from what the probe measured --------------------------------------------------------


def threshold_for(sizes: torch.Tensor, deviation: torch.Tensor, target: float) -> float:
    """The deviation at which blocks above it (largest first) hold ``target`` of all tokens."""
    order = torch.argsort(deviation, descending=True)
    covered = torch.cumsum(sizes[order].float(), 0) / float(sizes.sum())
    at = int(torch.searchsorted(covered, torch.tensor(target)).clamp(max=len(order) - 1))
    return float(deviation[order][at])


def alpha_for(chunks: list[tuple[int, float]], target: float) -> float:
    """Cache-Craft's alpha: ``sum(min(size, alpha * fix * size)) = target * sum(size)`` (bisection)."""
    total = sum(s for s, _ in chunks)

    def spent(alpha: float) -> float:
        return sum(min(s, alpha * f * s) for s, f in chunks) / total

    lo, hi = 0.0, 1.0
    while spent(hi) < target and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) < target else (lo, mid)
    return hi


@dataclass
class Measurements:
    """What the probe measured over the calibration questions, and the constants it gives.

    Attributes:
        sizes: per question, the tokens of each probed block ([B] each).
        deviations: per question, each block's KV deviation at the probe layer ([B] each).
        chunks: ``(tokens, fix overhead)`` of every blended chunk (Cache-Craft's CFO without alpha).
    """

    sizes: list[torch.Tensor] = field(default_factory=list)
    deviations: list[torch.Tensor] = field(default_factory=list)
    chunks: list[tuple[int, float]] = field(default_factory=list)

    def add(self, measured: dict, chunks: list[tuple[int, float]]) -> None:
        """One question's prefill: what its blend pass measured (nothing when no chunk was blended,
        e.g. every one was reused exactly) and its blended chunks."""
        if "block_sizes" in measured:
            self.sizes.append(measured["block_sizes"])
            self.deviations.append(measured["block_deviation"])
        self.chunks += chunks

    @property
    def blocks(self) -> int:
        """Probed blocks in all."""
        return sum(len(s) for s in self.sizes)

    def constants(self, target: float) -> tuple[float, float]:
        """``(threshold, alpha)`` at which ``auto`` recomputes ``target`` of these cached tokens.

        Raises:
            InvalidRequestError: nothing was measured (no cached chunk of the questions was
                blended), so there is nothing to set them from.
        """
        if not self.blocks or not self.chunks:
            raise InvalidRequestError(
                "the calibration measured nothing (no cached chunk was blended): give questions with several "
                "passages, asked in another order than they were retrieved"
            )
        return threshold_for(torch.cat(self.sizes), torch.cat(self.deviations), target), alpha_for(self.chunks, target)


# -- the calibrations' types -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CalibrationQuestion:
    """One dev question of a calibration: its passages retrieved in one order, asked in another.

    Attributes:
        chunks: the passages in prompt order.
        retrieved: the same passages in retrieval order: warmed together in this order before the
            question is asked (the favourable case, as when a corpus is warmed as it is retrieved).
        prefix: text before the passages (system prompt, instructions, chat template head).
        suffix: text after them (the question, the chat template's assistant header).
    """

    chunks: Sequence[str]
    retrieved: Sequence[str]
    prefix: str = ""
    suffix: str = ""


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """What :func:`calibrate` measured.

    Attributes:
        threshold: the probe deviation from which ``recompute_ratio="auto"`` recomputes a block.
        alpha: Cache-Craft's alpha for ``selection="craft"`` with ``"auto"``.
        probe: the probe settings they belong to (layer, block size, deviation kind).
        questions: questions measured.
        blocks: probed blocks the threshold was set from.
        seconds: time the calibration took.
    """

    threshold: float
    alpha: float
    probe: str
    questions: int
    blocks: int
    seconds: float


@dataclass(frozen=True, slots=True)
class QualityCalibration:
    """What :func:`calibrate_qualities` measured.

    Attributes:
        switch: whether prompts of KV from another context should run ``selection`` (else the probe,
            as in their own context: on this model ``selection`` needs more than the probe's budget).
        shares: per quality whose target some share reached, the share of such a chunk ``"auto"``
            should recompute (the others keep the built-in one); empty without the switch.
        reached: per quality, whether some share of the grid reached its target.
        reference: mean answer drift of :data:`QUALITY_REFERENCE` on these prompts.
        drifts: mean answer drift of ``selection`` per share tried.
        selection: the selection measured (``EngineConfig.other_context_selection``).
        questions: questions measured (those whose full prefill answered something).
        seconds: time the calibration took.
    """

    switch: bool
    shares: dict[str, float]
    reached: dict[str, bool]
    reference: float
    drifts: dict[float, float]
    selection: str
    questions: int
    seconds: float


def check_questions(questions) -> list[CalibrationQuestion]:
    """Calibration questions, checked: a non-empty list, each one's ``retrieved`` the same passages as its ``chunks``.

    Raises:
        InvalidRequestError: naming the first question that is not a :class:`CalibrationQuestion`
            or whose two passage lists differ.
    """
    if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence) or not questions:
        raise InvalidRequestError("questions must be a non-empty list of CalibrationQuestion")
    for i, q in enumerate(questions):
        if not isinstance(q, CalibrationQuestion):
            raise InvalidRequestError(f"questions[{i}] is a {type(q).__name__}, not a CalibrationQuestion")
        if sorted(q.retrieved) != sorted(q.chunks):
            raise InvalidRequestError(f"questions[{i}]: retrieved must hold the same passages as chunks")
    return list(questions)


def check_target(target) -> float:
    """The share of cached tokens ``auto`` is to recompute in the favourable case: a number in (0, 1].

    Raises:
        InvalidRequestError: anything else.
    """
    ok = isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1
    if not ok:
        raise InvalidRequestError(f"target must be a share of the cached tokens in (0, 1], got {target!r}")
    return float(target)


# -- the experiments, over an engine of their own -------------------------------------------------------


def probe_settings(engine: Engine) -> str:
    """The probe settings of ``engine`` a threshold belongs to."""
    probe = configured_params(engine.config, "probe").resolved(engine.adapter.n_layers)
    return probe_key(probe.probe_layer, probe.probe_stride, probe.deviation)


def _check_engine(engine: Engine) -> None:
    if engine.config.disk_tier or engine.config.remote_url:
        raise InvalidRequestError(
            "calibrate empties the store after each question; use an engine without disk_tier and remote_url"
        )


def _prefill(engine: Engine, question: CalibrationQuestion, options: RequestOptions):
    """Prefill a question's prompt as a request does, its path not priced (the blend is measured,
    whatever the cost model would choose): ``(plan, budget, result)``."""
    req = engine.requests.build(chunks=question.chunks, prefix=question.prefix, suffix=question.suffix, options=options)
    req.priced = False
    n = req.num_tokens
    return req, engine._run_internal(lambda pause: engine.prefiller.run(req, capacity=n, pause=pause), n)


def calibrate(
    engine: Engine,
    questions: Sequence[CalibrationQuestion],
    *,
    target: float = 0.15,
    progress: bool | Callable[[int, int], None] = False,
) -> CalibrationResult:
    """Measure the model's constants of ``recompute_ratio="auto"``: the probe threshold and ``alpha``.

    Each question's passages are warmed together in retrieval order, then the question is prefilled
    with them in prompt order, blended by the probe at ``target`` (the favourable case); the constants
    are those at which ``auto`` recomputes ``target`` of the cached tokens there. The store is emptied
    after each question: calibrate on an engine of its own (one with a disk or remote tier is refused).
    """
    questions, target = check_questions(questions), check_target(target)
    _check_engine(engine)
    t0 = time.perf_counter()
    measured = Measurements()
    options = RequestOptions(max_new_tokens=0, mode="blend", recompute_ratio=target, selection="probe")
    with progress_reporter(progress, "calibrate", unit="question") as report:
        for done, q in enumerate(questions, 1):
            engine.warm(q.retrieved)
            engine.flush()
            _, (plan, _, res) = _prefill(engine, q, options)
            measured.add(
                res.measured, [(u.length, u.fix) for u in plan.chunks if u.source == "store" and u.fix is not None]
            )
            engine.store.clear()
            if report is not None:
                report(done, len(questions))
    threshold, alpha = measured.constants(target)
    seconds = time.perf_counter() - t0
    return CalibrationResult(threshold, alpha, probe_settings(engine), len(questions), measured.blocks, seconds)


def calibrate_qualities(
    engine: Engine,
    questions: Sequence[CalibrationQuestion],
    *,
    max_new_tokens: int = 16,
    others: int = 3,
    shares: Sequence[float] = QUALITY_GRID,
    seed: int = 0,
    progress: bool | Callable[[int, int], None] = False,
) -> QualityCalibration:
    """Measure the model's share of KV from another context per ``quality``.

    For each question its full prefill answers (greedy, ``max_new_tokens``); then each of its passages
    is warmed on its own behind ``others`` passages of other questions, and that answer is scored
    (teacher-forced) under full prefill, under CacheBlend's probe at 15% and under
    ``other_context_selection`` at each of ``shares``. Per quality the least share whose mean answer
    drift reaches the quality's target (:data:`QUALITY_TARGETS`) is kept. The store is emptied before
    and after each question: calibrate on an engine of its own.
    """
    questions = check_questions(questions)
    selection = engine.config.other_context_selection
    if selection is None:
        raise InvalidRequestError("config.other_context_selection is None: no share to calibrate")
    _check_engine(engine)
    for name, value in (("max_new_tokens", max_new_tokens), ("others", others)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
    ok = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1  # noqa: E731
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence) or not shares or not all(map(ok, shares)):
        raise InvalidRequestError(f"shares must be a non-empty list of shares in (0, 1], got {shares!r}")
    grid = sorted({float(x) for x in shares})
    pool = list(dict.fromkeys(p for q in questions for p in q.retrieved))
    fewest = min(sum(p not in set(q.chunks) for p in pool) for q in questions)
    if fewest < others:  # checked before any work
        raise InvalidRequestError(
            f"the quality calibration needs {others} passages of other questions before each passage; "
            f"a question has {fewest} (give more questions or fewer others)"
        )
    rng = random.Random(seed)
    ref_selection, ref_share = QUALITY_REFERENCE
    t0 = time.perf_counter()
    measured = QualityMeasurements()

    def scored(answer: str, q: CalibrationQuestion, ref: list[float] | None, mode: str, sel=None, ratio=None):
        options = RequestOptions(max_new_tokens=0, temperature=0.0, mode=mode, recompute_ratio=ratio, selection=sel)
        req = engine.requests.build(chunks=q.chunks, prefix=q.prefix, suffix=q.suffix, options=options)
        req.priced = False  # the blend is measured, whatever the cost model would choose
        cont = engine.prompt_tokenizer.tokenize(answer)
        tokens = req.num_tokens + len(cont)
        got = engine._run_internal(lambda pause: engine.prefiller.score(req, cont, time.perf_counter(), pause), tokens)
        return got.token_logprobs if ref is None else drift(got.token_logprobs, ref)

    with progress_reporter(progress, "calibrate qualities", unit="question") as report:
        for done, q in enumerate(questions, 1):
            engine.store.clear()
            full = engine.generate(
                q.chunks, q.prefix, q.suffix, mode="full", max_new_tokens=max_new_tokens, temperature=0.0
            )
            engine.flush()
            engine.store.clear()  # nothing the full prefill wrote back is found by the blends
            if full.text.strip():
                mine = set(q.chunks)
                strangers = [p for p in pool if p not in mine]
                for passage in q.chunks:
                    engine.warm(rng.sample(strangers, others) + [passage])
                engine.flush()
                ref = scored(full.text, q, None, "full")
                measured.add(
                    scored(full.text, q, ref, "blend", ref_selection, ref_share),
                    {s: scored(full.text, q, ref, "blend", selection, s) for s in grid},
                )
            if report is not None:
                report(done, len(questions))
    engine.store.clear()
    switch, chosen, reached = measured.shares()
    return QualityCalibration(
        switch,
        chosen,
        reached,
        measured.reference_drift(),
        measured.means(),
        selection,
        len(measured.reference),
        time.perf_counter() - t0,
    )
