"""kvrag's own int4-weight × int8-activation product for a CPU decode step (``int4_cpu.cpp``).

``y = x @ W.T`` for a few rows ``x`` [M, K] (bfloat16) with ``W`` [N, K] in 4-bit codes ``q`` (0..15)
in groups of :data:`GROUP` inputs, each group with a scale and a low end (``w = scale * q + low``,
both float16). The activations are quantized inside the call to int8 per row and group of 32 (scale
``max|x| / 127``), so the products are integer dot products (AVX512-VNNI ``vpdpbusd``, or AVX2
``vpmaddubsw``), as llama.cpp's are; torch's ``_weight_int4pack_mm_for_cpu`` instead unpacks to
bfloat16 and multiplies in bfloat16, which is compute-bound on 2 cores (docs/journal/real-models.md).

Scales and lows are float16, not bfloat16: float16 keeps 3 more mantissa bits, every x86 CPU with
AVX2 converts it in one instruction (F16C), and a 4-bit group's scale and low lie well inside its
range (both are clamped to it; a scale under float16's smallest subnormal rounds to 0 and leaves
the group at its low end: its weights were equal to within that scale).

The kernel is compiled at first use (:func:`kvrag.kernels.native.load_library`: the system's C++
compiler, ``-O3 -march=native``, a few seconds, kept under kvrag's cache directory). Where it cannot
be built (no compiler, a CPU without AVX2), :func:`int4_kernel` returns None and why; callers keep
torch's kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.kernels.native import load_library, load_once

__all__ = ["GROUP", "ISAS", "Int4Kernel", "int4_kernel", "pack_int4", "int4_mm_ref"]

#: Input features per group (one scale and one low end per group; the activations' groups too).
GROUP = 32

#: The SIMD paths by name, widest first (``isa=`` of :meth:`Int4Kernel.mm`).
ISAS = ("avx512-vnni", "avx2")
_ISA_CODE = {"avx512-vnni": 2, "avx2": 1}

_SOURCE = Path(__file__).with_name("int4_cpu.cpp")


@dataclass(frozen=True)
class Int4Kernel:
    """The built kernel: :meth:`mm` runs it; ``isas`` are the SIMD paths it has (widest first)."""

    lib: ctypes.CDLL
    isas: tuple[str, ...]
    path: Path

    @property
    def isa(self) -> str:
        """The path :meth:`mm` takes by default (the widest built)."""
        return self.isas[0]

    def mm(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        lows: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        isa: str | None = None,
        checked: bool = False,
    ) -> torch.Tensor:
        """``x`` [M, K] (bfloat16) times the weight packed by :func:`pack_int4` (``codes`` [N, K/2]
        uint8, ``scales``/``lows`` [N, K/32] float16): [M, N] in ``out_dtype`` (bfloat16 or float32).

        ``isa``: one of :attr:`isas` (tests force the AVX2 path); None: the widest. ``checked``: the
        weight tensors were checked once already (:meth:`check`: a decode step's ~100 calls skip it).
        Raises ValueError on shapes or dtypes the layout cannot take."""
        if not checked:
            self.check(codes, scales, lows, x.shape[-1] if x.dim() == 2 else 0)
        if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"the int4 kernel takes x as a 2-D bfloat16 CPU tensor, got {tuple(x.shape)} {x.dtype}")
        m, k = x.shape
        n = codes.shape[0]
        if k != codes.shape[1] * 2:
            raise ValueError(f"the int4 kernel's weights take K = {codes.shape[1] * 2} inputs, got x of K = {k}")
        if out_dtype is not torch.bfloat16 and out_dtype is not torch.float32:
            raise ValueError(f"the int4 kernel writes bfloat16 or float32, not {out_dtype}")
        which = self.isa if isa is None else isa
        if which not in self.isas:
            raise ValueError(f"the int4 kernel was built without the {isa!r} path here (it has {', '.join(self.isas)})")
        x = x.contiguous()
        y = torch.empty(m, n, dtype=out_dtype)
        rc = self.lib.kvrag_int4_mm(
            x.data_ptr(),
            m,
            k,
            codes.data_ptr(),
            scales.data_ptr(),
            lows.data_ptr(),
            n,
            y.data_ptr(),
            int(out_dtype is torch.float32),
            _ISA_CODE[which],
        )
        if rc != 0:  # the checks above refuse these first; a mismatch between the two is a bug here
            raise RuntimeError(f"kvrag's int4 kernel refused the call (code {rc})")
        return y

    @staticmethod
    def check(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, k: int | None = None) -> None:
        """One clear error (ValueError) for packed weights the kernel cannot take (``k``: the inputs
        they must take; None: as many as ``codes`` holds)."""
        k = codes.shape[1] * 2 if k is None and codes.dim() == 2 else (k or 0)
        if k == 0 or k % GROUP:
            raise ValueError(f"the int4 kernel needs the inputs in whole groups of {GROUP}, got K = {k}")
        n = codes.shape[0] if codes.dim() == 2 else -1
        want = {"codes": (codes, torch.uint8, (n, k // 2)), "scales": (scales, torch.float16, (n, k // GROUP))}
        want["lows"] = (lows, torch.float16, (n, k // GROUP))
        for name, (t, dtype, shape) in want.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(
                    f"the int4 kernel's {name} must be a contiguous {dtype} CPU tensor of shape {shape} for K = {k}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (integers 0..15, K a multiple of :data:`GROUP`) in the kernel's layout:
    [N, K/2] uint8, each group's 16 bytes holding element j in the low nibble and j + 16 in the high."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"4-bit packing needs the inputs in whole groups of {GROUP}, got K = {k}")
    q = codes.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def int4_mm_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float64 sums): the test oracle. [M, N] float64."""
    m, k = x.shape
    g = k // GROUP
    xf = x.float().reshape(m, g, GROUP)
    amax = xf.abs().amax(-1)  # [M, G]
    # 127 / amax in float32 as the kernel divides (a Python number over a tensor multiplies by a reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    p = torch.round(xf * inv[..., None])  # int8 codes, ties to even
    dx = (amax / 127.0).double()  # [M, G]
    c = codes.reshape(codes.shape[0], g, GROUP // 2)
    q = torch.cat((c & 0x0F, c >> 4), dim=2).double()  # [N, G, 32]: element j low, j + 16 high
    dots = torch.einsum("mgj,ngj->mng", p.double(), q)  # exact integers
    scaled = (dots * dx[:, None, :] * scales.double()[None]).sum(-1)
    return scaled + (dx * p.double().sum(-1)) @ lows.double().T


def int4_kernel() -> tuple[Int4Kernel | None, str]:
    """The kernel (built and loaded once per process), or None and why it is not there."""
    return load_once(_SOURCE, _load)


def _load() -> tuple[Int4Kernel | None, str]:
    lib, why = load_library(_SOURCE)
    if lib is None:
        return None, why
    lib.kvrag_int4_isa.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvrag_int4_mm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.kvrag_int4_mm.restype = ctypes.c_int
    isas = ISAS if lib.kvrag_int4_isa() == 2 else ISAS[1:]
    return Int4Kernel(lib, isas, Path(lib._name)), f"kvrag's int4×int8 kernel ({isas[0]})"
