"""``kvrag serve`` as a command: a real process over a saved tiny model, API keys from a file."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from kvrag import cli  # noqa: E402
from kvrag.client import Client  # noqa: E402
from kvrag.errors import InvalidRequestError, ServerError  # noqa: E402
from kvrag.server.cli import main as serve_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_arguments_fail_before_loading_anything(tmp_path, capsys):
    assert serve_main(["--config", "no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert serve_main(["--config", "mode=turbo"]) == 2
    keys = tmp_path / "keys.json"
    keys.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="JSON object"):
        serve_main(["--api-keys-file", str(keys)])
    assert cli.main(["--help"]) == 0 and "kvrag serve" in capsys.readouterr().out


def test_log_level_sets_kvrags_loggers(capsys):
    kvrag_log = logging.getLogger("kvrag")
    level, handlers = kvrag_log.level, list(kvrag_log.handlers)
    try:
        assert serve_main(["--log-level", "debug", "--config", "mode=turbo"]) == 2
        assert logging.getLogger("kvrag.server").getEffectiveLevel() == logging.DEBUG
    finally:
        kvrag_log.setLevel(level)
        kvrag_log.handlers[:] = handlers


@pytest.mark.slow
def test_kvrag_serve_process(tmp_path, tiny_model, tiny_tokenizer):
    model_dir = tmp_path / "tiny-llama"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "team-1"}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "kvrag.cli", "serve", "--port", str(port), "--model", str(model_dir)]
    command += ["--config", f"cache_dir={tmp_path / 'cache'}", "--max-stop-strings", "4"]
    command += ["--served-model-name", "tiny", "--api-keys-file", str(keys), "--log-level", "warning"]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        with Client(f"http://127.0.0.1:{port}", api_key="k1") as client:
            for _ in range(600):  # up to 2 minutes to import torch and load the model (bounded)
                if client.health() or process.poll() is not None:
                    break
                time.sleep(0.2)
            assert client.health(), (tmp_path / "serve.log").read_text()
            gen = client.complete("the king of the river city", model="tiny", max_new_tokens=3)
            assert gen.stats.completion_tokens == 3 and gen.finish_reason == "length"
            with pytest.raises(InvalidRequestError, match="max_stop_strings"):  # the limit set by its flag
                client.complete("the king", stop=["a", "b", "c", "d", "e"])
            assert client.model_card()["id"] == "tiny"
        with Client(f"http://127.0.0.1:{port}") as anonymous, pytest.raises(ServerError) as info:
            anonymous.complete("the king")
        assert info.value.status_code == 401
    finally:
        process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown; the engine is closed after it
        try:
            assert process.wait(timeout=60) == 0
        finally:
            process.kill()
            log.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_http_nice_lowers_the_http_threads_below_the_engine_thread(tiny_model, tiny_tokenizer):
    import threading

    from kvrag import Engine
    from kvrag.server.cli import GIL_SWITCH_S, lower_http_priority

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict = {}

    def front():  # as kvrag serve's main thread: builds the engine, then lowers itself, then serves
        engine = Engine.from_model(tiny_model, tiny_tokenizer, thread_linger_s=None)
        try:
            seen["lowered"], seen["front"] = lower_http_priority(3), nice()
            child = threading.Thread(target=lambda: seen.setdefault("child", nice()))  # e.g. a threadpool's worker
            child.start()
            child.join()
            ran = engine._run_internal(lambda pause: nice(), 1)  # on the engine thread
            seen["engine"] = ran
        finally:
            engine.close()

    switch = sys.getswitchinterval()
    thread = threading.Thread(target=front)
    thread.start()
    thread.join(60)
    lowered_switch, _ = sys.getswitchinterval(), sys.setswitchinterval(switch)
    assert lowered_switch == pytest.approx(GIL_SWITCH_S)
    base = nice()
    assert seen == {"lowered": True, "front": min(19, base + 3), "child": min(19, base + 3), "engine": base}
    assert not lower_http_priority(0)
