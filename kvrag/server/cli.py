"""``kvrag serve``: load the engine, then serve it over HTTP with uvicorn.

kvrag serve --host 127.0.0.1 --port 8000 [--model DIR_OR_GGUF] [--config FIELD=VALUE ...]
            [--served-model-name NAME] [--api-keys-file keys.json] [--trust-tenant-header [--tenant-header NAME]]
            [--max-body-bytes N --max-stop-strings N ...] [--log-level LEVEL]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

from kvrag.server.settings import Limits, ServerSettings, TenantMap

__all__ = ["main", "parser"]


#: Nice levels between the HTTP threads and the engine thread (``--http-nice``): a thread of nice 10
#: gets about a tenth of a core that a nice-0 thread also wants (Linux CFS weights 110 vs 1024).
HTTP_NICE = 10

#: Seconds a thread waiting for the GIL waits before the holder is asked to let go, with ``--http-nice``.
GIL_SWITCH_S = 0.0005


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrag serve",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/documents, "
        "/v1/models, /health, /metrics) over kvrag's engine.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        default=None,
        help="a local HF directory, a hub id already in the HF cache, or a .gguf (default: the bundled SmolLM2-135M)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig field, e.g. --config recompute_ratio=0.3 --config disk_tier=true; the default sampling "
        "and the selection's parameters field by field: --config sampling.max_new_tokens=128, "
        "--config selection_params.probe_layer=12 (repeatable)",
    )
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the engine's)")
    p.add_argument(
        "--api-keys-file",
        default=None,
        help='JSON object {"API_KEY": "namespace", ...}: every request then needs one of these keys, '
        "and each key's requests use its own cache namespace",
    )
    p.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="without API keys, take the tenant header's value as the request's cache namespace (only behind a "
        "gateway that authenticates users and sets it); off: a request sending it is refused, one shared cache",
    )
    p.add_argument(
        "--tenant-header", default="X-Kvrag-Tenant", help="the tenant header's name (default X-Kvrag-Tenant)"
    )
    limits = p.add_argument_group("limits", "what one request may bring (checked before any work; past one: 413/400)")
    defaults = Limits()
    for name, text in Limits.described().items():
        flag = "--" + name.replace("_", "-")
        limits.add_argument(flag, type=int, default=getattr(defaults, name), help=f"{text} (default %(default)s)")
    p.add_argument(
        "--http-nice",
        type=int,
        default=HTTP_NICE,
        metavar="N",
        help="run the HTTP threads N nice levels below the engine thread (Linux; 0: the same priority): a flood "
        "of requests, refused or not, then takes the CPU from the engine's decode steps only where it is idle "
        "(default %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="level of kvrag's loggers and uvicorn's",
    )
    return p


def lower_http_priority(nice: int) -> bool:
    """Lower the calling thread's scheduling priority by ``nice`` levels (threads it starts later
    inherit it); whether it did. Called on the thread that runs uvicorn's event loop after the engine
    thread was started from it (``thread_linger_s=None``), so the engine thread keeps the priority it
    had. Linux only: elsewhere ``PRIO_PROCESS`` names the whole process, the engine thread included."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    # A thread of low priority holding the GIL makes the engine thread wait until it lets go: the
    # interpreter asks it to after this interval (5 ms by default; a stop-string flood measured 1.07-1.20x
    # the decode's pace with 5 ms, 1.07x with 0.5 ms: docs/server.md)
    sys.setswitchinterval(GIL_SWITCH_S)
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except OSError as exc:  # a sandbox without setpriority: serve at one priority
        logging.getLogger("kvrag.server").warning("kvrag serve: --http-nice not applied (%s)", exc)
        return False
    return True


def _api_keys(path: str | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"kvrag serve: --api-keys-file {path}: {exc}") from None
    if not isinstance(keys, dict):
        raise SystemExit(f"kvrag serve: --api-keys-file {path} must hold a JSON object of key -> namespace")
    return keys


def _log_to_stderr(level: str) -> None:
    """kvrag's loggers at ``level``, written to stderr beside uvicorn's (once, whatever called first)."""
    logger = logging.getLogger("kvrag")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvrag serve``."""
    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvicorn

        from kvrag.server.app import create_app
    except ImportError as exc:  # the serve extra is not installed
        print(f"kvrag serve needs `pip install 'kvrag[serve]'` ({exc})", file=sys.stderr)
        return 2
    from kvrag.config import EngineConfig, parse_overrides
    from kvrag.engine import Engine
    from kvrag.errors import KvragError

    _log_to_stderr(a.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        tenants = TenantMap(
            api_keys=_api_keys(a.api_keys_file), header=a.tenant_header, trust_header=a.trust_tenant_header
        )
        limits = Limits(**{name: getattr(a, name) for name in Limits.described()})
        overrides = parse_overrides(a.config)
        if a.http_nice > 0:  # the engine thread starts now, from this thread, before its priority drops
            overrides.setdefault("thread_linger_s", None)
        config = EngineConfig(**overrides)
        engine = Engine.from_pretrained(a.model, config=config)
    except KvragError as exc:
        print(f"kvrag serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, ServerSettings(model_name=a.served_model_name, tenants=tenants, limits=limits))
    lower_http_priority(a.http_nice)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    finally:
        engine.close()
    return 0
