"""Argument checks shared by the Triton wrappers: one clear error per bad input, before any launch.

Plain PyTorch (no Triton import), so the messages can be tested anywhere.
"""

from __future__ import annotations

import torch

__all__ = [
    "KERNEL_FLOATS",
    "INDEX_DTYPES",
    "check_tensor",
    "check_same_device",
    "check_launchable",
]

#: The float dtypes the kernels take: the compute dtypes of :mod:`kvrag.engine.model.dtypes` (its
#: ``FLOAT_DTYPES`` names them; the kernels sit below the model layer and list them here).
KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


def check_tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` is a tensor of ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device: {listed}")
    return first


def check_launchable(device: torch.device, kernel) -> None:
    """A Triton kernel can run on ``device``: CUDA, or CPU when Triton's interpreter is on."""
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if device.type == "cpu" and isinstance(kernel, InterpretedFunction):
        return
    raise RuntimeError(
        f"Triton kernels need CUDA tensors (got {device}); CPU tensors run only in Triton's interpreter, "
        "which needs TRITON_INTERPRET=1 set before kvrag's Triton modules are first imported. "
        "Use the PyTorch references (the default dispatch) on CPU."
    )
