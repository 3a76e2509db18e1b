"""The one table between dtype names and torch dtypes, and the choice of the compute dtype.

:mod:`kvrag.config` names the float dtypes (:data:`~kvrag.config.DTYPE_NAMES`; it imports
without torch); this module maps those names to torch, for the model loader, the stores and the
at-rest format alike.

It also decides what ``dtype="auto"`` (the default) means on this machine: bfloat16 where the
device computes it natively, float32 elsewhere. Prefill is compute bound, so the dtype the
hardware multiplies fastest sets the time to first token: on a CPU with AMX-BF16 a bf16 prefill
is about three times faster than a float32 one, on a CPU without bf16 units bf16 is *emulated* and
slower than float32. So the choice is detected, never guessed (:func:`native_bf16`), and an
explicit dtype is never overridden (:func:`resolve_dtype`).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.config import AUTO, DTYPE_NAMES
from kvrag.errors import InvalidRequestError

__all__ = [
    "FLOAT_DTYPES",
    "STORED_DTYPES",
    "DtypeChoice",
    "torch_dtype",
    "dtype_name",
    "native_bf16",
    "resolve_dtype",
    "weights_dtype",
]

#: Compute and at-rest dtypes of weights and KV, by the names ``EngineConfig`` accepts.
FLOAT_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
#: What a stored record's body may hold: those floats and integer token ids / statistics.
STORED_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, "int32": torch.int32, "int64": torch.int64}
_NAMES = {dtype: name for name, dtype in STORED_DTYPES.items()}
#: CPU flags (Linux ``/proc/cpuinfo``) of x86 units that multiply bf16 natively: AMX tiles, AVX512-BF16.
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The compute dtype an engine runs in, and why (shown by ``Engine.info()`` and logged at load).

    Attributes:
        name: ``float32``, ``bfloat16`` or ``float16``.
        why: one line: set explicitly, detected from the hardware, or the given model's own dtype.
    """

    name: str
    why: str

    @property
    def torch(self) -> torch.dtype:
        return FLOAT_DTYPES[self.name]


def torch_dtype(name: str, *, argument: str = "dtype") -> torch.dtype:
    """The torch dtype of a float dtype name (``float32``, ``bfloat16``, ``float16``).

    Raises:
        InvalidRequestError: ``name`` is not one of them (the message names ``argument``).
    """
    try:
        return FLOAT_DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidRequestError(f"{argument} must be one of {DTYPE_NAMES}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str | None:
    """The name of a dtype a stored record may hold, or ``None`` for any other."""
    return _NAMES.get(dtype)


@functools.cache
def _cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: str | torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and the evidence, in a few words.

    CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). CPU on Linux: the ``amx_bf16`` or
    ``avx512_bf16`` flag in ``/proc/cpuinfo`` and a torch built with oneDNN (whose kernels use
    those units). Anything else (macOS, Windows, Arm CPUs, MPS, ...) answers no: a bf16 that turns
    out to be emulated would be slower than float32, so only proven support counts.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        if torch.cuda.is_bf16_supported():
            return True, f"{torch.cuda.get_device_name(device)} supports bf16"
        return False, f"{torch.cuda.get_device_name(device)} has no native bf16"
    if device.type != "cpu":
        return False, f"no bf16 detection for {device.type} devices"
    if platform.system() != "Linux":
        return False, f"no bf16 detection on {platform.system() or 'this OS'} CPUs"
    found = [f for f in _BF16_CPU_FLAGS if f in _cpu_flags()]
    if not found:
        return False, f"the CPU has neither {' nor '.join(_BF16_CPU_FLAGS)}"
    if not torch.backends.mkldnn.is_available():
        return False, f"the CPU has {'/'.join(found)} but this torch lacks oneDNN"
    return True, f"the CPU has {'/'.join(found)}"


def resolve_dtype(dtype: str, device: str | torch.device) -> DtypeChoice:
    """The compute dtype for a requested one: an explicit name as is, ``"auto"`` by the hardware.

    ``"auto"`` is bfloat16 where :func:`native_bf16` finds native support, float32 elsewhere.

    Raises:
        InvalidRequestError: ``dtype`` is neither ``"auto"`` nor a dtype name.
    """
    if dtype != AUTO:
        torch_dtype(dtype)  # one clear error for a bad name
        return DtypeChoice(dtype, "set explicitly")
    native, evidence = native_bf16(device)
    if native:
        return DtypeChoice("bfloat16", f"auto: {evidence}")
    return DtypeChoice("float32", f"auto: {evidence}")


def weights_dtype(dtype: torch.dtype, requested: str) -> DtypeChoice:
    """The compute dtype of a model given in memory (``Engine.from_model``): its weights' own.

    kvrag never converts a model it is handed (the caller may still use it). ``"auto"`` accepts
    the weights' dtype; an explicit name must match it.

    Raises:
        InvalidRequestError: the weights are not a float dtype kvrag computes in, or their dtype
            is not the explicit ``requested`` one.
    """
    name = dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise InvalidRequestError(f"the model's weights are {dtype}; kvrag computes in one of {DTYPE_NAMES}")
    if requested == AUTO:
        return DtypeChoice(name, "the given model's own dtype")
    if requested != name:
        torch_dtype(requested)
        raise InvalidRequestError(
            f"dtype={requested!r} but the given model's weights are {name}: convert the model first "
            f"(model.to(torch.{requested})) or pass dtype='auto' to compute in its own dtype"
        )
    return DtypeChoice(name, "set explicitly")
