"""The one table between dtype names and torch dtypes.

:mod:`kvrag.config` names the float dtypes (:data:`~kvrag.config.DTYPE_NAMES`; it imports
without torch); this module maps those names to torch, for the model loader, the stores and the
at-rest format alike.
"""

from __future__ import annotations

import torch

from kvrag.config import DTYPE_NAMES
from kvrag.errors import InvalidRequestError

__all__ = ["FLOAT_DTYPES", "STORED_DTYPES", "torch_dtype", "dtype_name"]

#: Compute and at-rest dtypes of weights and KV, by the names ``EngineConfig`` accepts.
FLOAT_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
#: What a stored record's body may hold: those floats and integer token ids / statistics.
STORED_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, "int32": torch.int32, "int64": torch.int64}
_NAMES = {dtype: name for name, dtype in STORED_DTYPES.items()}


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
