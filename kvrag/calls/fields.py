"""The engine's reuse options as pydantic fields, for the LLMs' fields and the server's requests.

Names and descriptions are :class:`~kvrag.engine.options.RequestOptions`' (one list of options);
values are checked when the ``RequestOptions`` is made, so a bad one gets kvrag's own message.
Needs pydantic (the integrations and the server have it), so :mod:`kvrag.calls` does not import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvrag.engine.options import OPTION_DOCS

__all__ = ["ReuseFields"]


class ReuseFields(BaseModel):
    """``mode``, ``recompute_ratio``, ``selection``, ``quality`` and ``dedup``; ``None``: the engine's default."""

    mode: str | None = Field(default=None, description=OPTION_DOCS["mode"])
    recompute_ratio: float | Literal["auto"] | None = Field(default=None, description=OPTION_DOCS["recompute_ratio"])
    selection: str | None = Field(default=None, description=OPTION_DOCS["selection"])
    quality: str | None = Field(default=None, description=OPTION_DOCS["quality"])
    dedup: bool | None = Field(default=None, description=OPTION_DOCS["dedup"])
