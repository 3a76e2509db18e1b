"""llama.cpp's server on the same GGUF, the CPU engine users would otherwise run (Ollama runs it).

The benchmarks never ship llama.cpp: they start a ``llama-server`` built on the machine (give its
path, or set ``LLAMA_SERVER``) with the same threads, its prompt cache on and ``--cache-reuse``
(KV shifting of reused chunks of the cached prompt), and read each answer's timings from the
server itself: ``prompt_ms`` is its time to the first token, ``predicted_per_second`` its decode.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvrag.errors import InvalidRequestError

__all__ = ["LlamaServer", "Completion", "find_server"]


def find_server(path: str | None = None) -> Path:
    """The ``llama-server`` binary: ``path``, else ``$LLAMA_SERVER``, else one on ``PATH``."""
    given = path or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not given or not Path(given).is_file():
        raise InvalidRequestError(
            "no llama-server: build llama.cpp on this machine (its CMake target llama-server) and give "
            "--llama-server PATH or set LLAMA_SERVER"
        )
    return Path(given)


@dataclass(slots=True)
class Completion:
    """One answer of the server, with its own timings."""

    text: str
    prompt_tokens: int  # tokens it evaluated (the rest came from its prompt cache)
    cached_tokens: int
    prompt_s: float  # its time to the first token
    decode_tokens: int
    decode_s: float
    wall_s: float  # the request's wall time, seen from here

    @property
    def tokens_per_s(self) -> float | None:
        return (self.decode_tokens - 1) / self.decode_s if self.decode_tokens > 1 and self.decode_s > 0 else None


class LlamaServer:
    """A ``llama-server`` on a GGUF, started and stopped with the ``with`` block.

    Args:
        binary: the ``llama-server`` executable.
        model: the GGUF file.
        threads: its threads (the engine's, for a fair comparison).
        context: its context window.
        flash_attn: ``"on"``, ``"off"`` or ``"auto"`` (the server's own choice).
        extra: more command-line arguments.
    """

    def __init__(
        self,
        binary: Path,
        model: Path,
        *,
        threads: int,
        context: int = 8192,
        flash_attn: str = "auto",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.binary, self.model, self.threads, self.context = binary, model, threads, context
        self.flash_attn, self.extra = flash_attn, extra
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        return [
            str(self.binary),
            "-m", str(self.model),
            "-t", str(self.threads), "-tb", str(self.threads),
            "-c", str(self.context),
            "-fa", self.flash_attn,
            "--cache-reuse", "256",
            "--parallel", "1",
            "--host", "127.0.0.1", "--port", str(port),
            "--no-webui",
            *self.extra,
        ]  # fmt: skip

    def __enter__(self) -> LlamaServer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen(self.command(port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InvalidRequestError(f"llama-server exited: {self.proc.stderr.read().decode()[-800:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise InvalidRequestError("llama-server did not come up within 10 minutes")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def complete(self, prompt: str, *, max_tokens: int, cache: bool = True, ignore_eos: bool = False) -> Completion:
        """Greedy completion of a prompt string (special tokens in it are parsed as the model's)."""
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "cache_prompt": cache,
            "ignore_eos": ignore_eos,
            "stream": False,
        }
        req = urllib.request.Request(
            f"{self.url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            data = json.loads(r.read())
        wall = time.perf_counter() - t0
        t = data.get("timings", {})
        return Completion(
            text=data.get("content", ""),
            prompt_tokens=int(t.get("prompt_n", 0)),
            cached_tokens=int(data.get("tokens_cached", 0) or t.get("cache_n", 0)),
            prompt_s=float(t.get("prompt_ms", 0.0)) / 1000,
            decode_tokens=int(t.get("predicted_n", 0)),
            decode_s=float(t.get("predicted_ms", 0.0)) / 1000,
            wall_s=wall,
        )

    def erase_cache(self) -> None:
        """Forget the cached prompt (the next request starts cold)."""
        req = urllib.request.Request(f"{self.url}/slots/0?action=erase", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30):
                pass
        except OSError:  # an older server without slot actions: a new prompt evicts the old one anyway
            pass
