"""Per-model calibration of ``recompute_ratio="auto"``: the probe deviation from which a block is
recomputed, and the share of foreign KV each ``quality`` recomputes.

A probe's KV deviation has a scale of its own for every model (and probe layer, block size and
deviation kind), and so has Cache-Craft's fix overhead. :meth:`kvrag.Engine.calibrate` (the
``kvrag calibrate`` command) measures, on dev questions, the threshold and the ``alpha`` that make
``auto`` recompute what a fixed budget would in the favourable case, and writes them here:
``<cache_dir>/calibration/<model fingerprint>.json``. The bundled model's values may ship with kvrag
(``kvrag/engine/reuse/data/calibration.json``), keyed the same way.

How much a chunk's KV computed behind other passages drifts, and how much recomputing buys back,
is a model's own too. :meth:`kvrag.Engine.calibrate_qualities` warms each question's passages behind
passages of other questions, measures the answer drift (mean |log p| difference per token of the
full prefill's answer, teacher-forced) of ``other_context_selection`` at a grid of shares against that of
CacheBlend's probe at 15%, and keeps per quality the least share whose mean drift reaches the
quality's target (:data:`QUALITY_TARGETS`), under the key ``foreign=<selection>`` of the same file;
where the selection needs more than the probe's budget to drift no more than it, foreign KV is left
to the probe on that model (``switch`` false).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from kvrag.errors import InvalidRequestError

log = logging.getLogger(__name__)

__all__ = [
    "probe_key",
    "load",
    "save",
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
    "foreign_key",
    "load_shares",
    "save_shares",
]


def probe_key(probe_layer: int, probe_stride: int, deviation: str) -> str:
    """The probe settings a threshold belongs to."""
    return f"layer={probe_layer},stride={probe_stride},deviation={deviation}"


def _read(path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shipped() -> dict:
    try:
        text = resources.files("kvrag.engine.reuse").joinpath("data/calibration.json").read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def _entry(data, probe: str) -> dict:
    entry = data.get(probe) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        return {}
    return {k: v for k in ("threshold", "alpha") if (v := _number(entry.get(k))) is not None}


def load(cache_dir: Path, fingerprint: str, probe: str) -> dict:
    """The calibrated ``threshold`` and ``alpha`` for this model and probe (either may be missing):
    the user's own (``kvrag calibrate``) first, then the one shipped with kvrag."""
    mine = _entry(_read(Path(cache_dir) / "calibration" / f"{fingerprint}.json"), probe)
    return mine or _entry(_shipped().get(fingerprint), probe)


def _write(cache_dir: Path, fingerprint: str, key: str, entry: dict) -> Path:
    """Set ``key``'s entry in this model's calibration file (atomically; other keys kept)."""
    path = Path(cache_dir) / "calibration" / f"{fingerprint}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def save(cache_dir: Path, fingerprint: str, probe: str, threshold: float, facts: dict) -> Path:
    """Record a calibrated threshold (with ``alpha`` and what they were measured on) for this model and probe."""
    return _write(cache_dir, fingerprint, probe, {"threshold": float(threshold), **facts})


# -- the shares of foreign KV per quality ---------------------------------------------------------------

#: Shares of a foreign chunk's tokens the quality calibration tries (``other_context_selection`` at each).
QUALITY_GRID = (0.05, 0.10, 0.13, 0.20, 0.30, 0.45, 0.60, 0.80)
#: Each quality's target: the mean answer drift on foreign KV, as a multiple of the drift of
#: CacheBlend's probe at 15% on the same prompts. ``fast``: no worse than CacheBlend; ``balanced``:
#: 15% below it (issue 35's line); ``faithful``: half of it.
QUALITY_TARGETS = {"fast": 1.0, "balanced": 0.85, "faithful": 0.5}
#: The reference the targets are multiples of: (selection, share).
QUALITY_REFERENCE = ("probe", 0.15)


def foreign_key(selection: str) -> str:
    """The calibration file's key of the shares measured for ``other_context_selection``."""
    return f"foreign={selection}"


def load_shares(cache_dir: Path, fingerprint: str, selection: str) -> tuple[bool | None, dict[str, float]]:
    """``(switch, shares)`` calibrated for this model and selection: whether foreign KV runs
    ``selection`` at all (``None``: not calibrated), and the share of a foreign chunk per quality
    (may be empty). The user's own first, then the one shipped with kvrag; values outside (0, 1]
    are dropped."""
    key = foreign_key(selection)

    def entry(data) -> tuple[bool | None, dict[str, float]]:
        got = data.get(key) if isinstance(data, dict) else None
        if not isinstance(got, dict) or not isinstance(got.get("switch"), bool):
            return None, {}
        shares = got.get("shares") if isinstance(got.get("shares"), dict) else {}
        return got["switch"], {q: x for q, v in shares.items() if q in QUALITY_TARGETS and (x := _number(v)) and x <= 1}

    mine = entry(_read(Path(cache_dir) / "calibration" / f"{fingerprint}.json"))
    return mine if mine[0] is not None else entry(_shipped().get(fingerprint))


def save_shares(
    cache_dir: Path, fingerprint: str, selection: str, switch: bool, shares: dict[str, float], facts: dict
) -> Path:
    """Record the calibrated switch and shares (with what they were measured on) for this model and selection."""
    return _write(cache_dir, fingerprint, foreign_key(selection), {"switch": switch, "shares": dict(shares), **facts})


def drift(got: Sequence[float], ref: Sequence[float]) -> float:
    """Answer drift: mean |Δ log p| per token of the full prefill's answer, teacher-forced, against
    the full prefill's own log-probabilities (the benchmarks' fidelity measure too).

    More sensitive than ROUGE-L: two methods whose greedy answers read the same can still differ
    in how sure they are of every token, and one flipped token no longer hides the rest.
    """
    if len(got) != len(ref) or not ref:
        raise ValueError("log-probabilities of different continuations")
    return sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)


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


# -- the public types of Engine.calibrate ----------------------------------------------------------------


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
    """What :meth:`kvrag.Engine.calibrate` measured and where it wrote it.

    Attributes:
        threshold: the probe deviation from which ``recompute_ratio="auto"`` recomputes a block.
        alpha: Cache-Craft's alpha for ``selection="craft"`` with ``"auto"``.
        probe: the probe settings they belong to (layer, block size, deviation kind).
        path: the file they were written to (per model fingerprint, under the cache directory).
        questions: questions measured.
        blocks: probed blocks the threshold was set from.
        seconds: time the calibration took.
    """

    threshold: float
    alpha: float
    probe: str
    path: Path
    questions: int
    blocks: int
    seconds: float


@dataclass(frozen=True, slots=True)
class QualityCalibration:
    """What :meth:`kvrag.Engine.calibrate_qualities` measured and where it wrote it.

    Attributes:
        switch: whether prompts of foreign KV run ``selection`` from now on (else the probe, as in
            own company: on this model ``selection`` needs more than the probe's budget for its drift).
        shares: per quality whose target some share reached, the share of a foreign chunk ``"auto"``
            recomputes from now on (the others keep the built-in one); empty without the switch.
        reached: per quality, whether some share of the grid reached its target.
        reference: mean answer drift of :data:`QUALITY_REFERENCE` on these prompts.
        drifts: mean answer drift of ``selection`` per share tried.
        selection: the selection measured (``EngineConfig.other_context_selection``).
        path: the file they were written to.
        questions: questions measured (those whose full prefill answered something).
        seconds: time the calibration took.
    """

    switch: bool
    shares: dict[str, float]
    reached: dict[str, bool]
    reference: float
    drifts: dict[float, float]
    selection: str
    path: Path
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
