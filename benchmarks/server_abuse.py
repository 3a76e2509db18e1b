"""Abuse of ``kvrag serve`` (issue 59): what an attack costs the server and a concurrent honest user.

``python -m benchmarks.server_abuse [--model DIR_OR_GGUF] [--attacks 20] [--out DIR]`` starts a
``kvrag serve`` process with an API key, then measures, client side:

1. the honest baseline: a small streamed request's per-token time (its second text piece to its
   last, over the gaps between), ``--repeats`` times;
2. 50 MB bodies sent without a key (announced, and chunked with no length) and with the key
   (announced past ``max_body_bytes``): time from the first byte sent to the answer's status
   line, the status (401 / 413), and the server's RSS before and after ``--attacks`` of each;
3. 5,000 stop strings of 40 characters: time to the 400;
4. the honest request's per-token time again while a thread sends one kind of attack back to back
   (each kind, then all in turn), and two controls: another process that only burns a core (the
   attacker's client costs a small machine that much whatever the server does), and a thread sending
   the cheapest request there is, ``GET /health``, back to back over new connections (what any
   connection flood costs the server, whatever it carries).

The attacker streams its body until the server answers (a real attacker does not stop), over a raw
socket so that the time is the server's. Results: a JSON line on stdout and ``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

__all__ = ["main"]

KEY = "abuse-bench-key"
BODY_BYTES = 50 << 20


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def big_body(port: int, *, key: bool, announce: bool) -> tuple[float, int]:
    """Stream a 50 MB body until the server answers; (seconds to the status line, status)."""
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    if key:
        head.append(f"Authorization: Bearer {KEY}")
    head.append(f"Content-Length: {BODY_BYTES}" if announce else "Transfer-Encoding: chunked")
    chunk = b'{"messages": [{"role": "user", "content": "' + b"x" * (64 << 10)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    t0 = time.perf_counter()
    pending, sent, answer = ("\r\n".join(head) + "\r\n\r\n").encode(), 0, b""
    try:
        while b"\r\n" not in answer:
            readable, writable, _ = select.select([sock], [sock] if sent < BODY_BYTES else [], [], 30)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
                continue
            if writable:
                if not pending:
                    piece = chunk[: BODY_BYTES - sent]
                    sent += len(piece)
                    pending = piece if announce else b"%x\r\n%s\r\n" % (len(piece), piece)
                try:
                    n = sock.send(pending)
                except (BlockingIOError, ConnectionError):
                    continue
                pending = pending[n:]
            elif not readable:
                break
        seconds = time.perf_counter() - t0
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return seconds, status


def health(port: int) -> tuple[float, int]:
    """One ``GET /health`` over a new connection (the control: a flood of the cheapest request)."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        answer = sock.recv(65536)
    return time.perf_counter() - t0, int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def stop_strings(url: str) -> tuple[float, int]:
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": ["s" * 40] * 5000}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return time.perf_counter() - t0, r.status_code


def per_token(url: str, tokens: int) -> float:
    """Seconds per token of one small streamed request: from its second piece to its last, over the
    gaps between (a mean: a front that delivers late sends tokens in bursts, whose gaps' median says
    nothing of the stream's pace)."""
    body = {"prompt": "The history of the river city begins with", "max_tokens": tokens, "stream": True}
    body["ignore_eos"] = True  # a fixed length (vLLM's extension, kvrag's too)
    stamps = []
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if len(stamps) < 3:
        raise RuntimeError(f"the honest request streamed {len(stamps)} events: too few to time")
    return (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def under_attack(url: str, a, attacks: list) -> list[float]:
    """The honest request's per-token times while one thread sends ``attacks`` back to back."""
    stop = threading.Event()

    def attacker():
        while not stop.is_set():
            for attack in attacks:
                attack()

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        return [per_token(url, a.tokens) for _ in range(a.repeats)]
    finally:
        stop.set()
        thread.join(60)


def under_busy_process(url: str, a) -> list[float]:
    """The control: per-token times while another process only burns a core (what the attacker's own
    client costs a small machine, whatever the server does)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        return [per_token(url, a.tokens) for _ in range(a.repeats)]
    finally:
        busy.kill()
        busy.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.server_abuse", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="DIR_OR_GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--attacks", type=int, default=20, help="attacks of each kind for the RSS figure")
    p.add_argument("--repeats", type=int, default=5, help="honest requests per per-token figure")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the honest request")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the server on CPU 0 with one thread, this client and the attackers on the others (Linux): on a "
        "small machine the attacker's own client otherwise takes the server's cores, and the honest request "
        "slows as much under a process that only burns a core (the control)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.pin:
        others = set(range(1, os.cpu_count() or 1))
        if not others:
            p.error("--pin needs two CPUs or more")
        os.sched_setaffinity(0, others)  # the busy control process inherits it
    tmp = Path(tempfile.mkdtemp(prefix="kvrag-abuse-"))
    (tmp / "keys.json").write_text(json.dumps({KEY: "bench"}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "kvrag.cli",
        "serve",
        "--port",
        str(port),
        "--api-keys-file",
        str(tmp / "keys.json"),
    ]
    command += ["--log-level", "warning", "--config", f"cache_dir={tmp / 'cache'}"]
    if a.model:
        command += ["--model", a.model]
    if a.pin:
        command = ["taskset", "-c", "0", *command, "--config", "num_threads=1"]
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        per_token(url, 4)  # warm-up
        baseline = [per_token(url, a.tokens) for _ in range(a.repeats)]
        out: dict = {"model": a.model or "bundled SmolLM2-135M", "cpu_count": os.cpu_count(), "pinned": a.pin}
        out["attacks"] = {}
        kinds = {
            "50MB_no_key_announced": lambda: big_body(port, key=False, announce=True),
            "50MB_no_key_chunked": lambda: big_body(port, key=False, announce=False),
            "50MB_key_announced": lambda: big_body(port, key=True, announce=True),
            "50MB_key_chunked": lambda: big_body(port, key=True, announce=False),
            "5000_stop_strings": lambda: stop_strings(url),
        }
        for name, attack in kinds.items():
            before = rss_bytes(proc.pid)
            runs = [attack() for _ in range(a.attacks)]
            after = rss_bytes(proc.pid)
            seconds = [s for s, _ in runs]
            out["attacks"][name] = {
                "statuses": sorted({st for _, st in runs}),
                "median_s": statistics.median(seconds),
                "max_s": max(seconds),
                "rss_before_mb": round(before / 2**20, 1),
                "rss_after_mb": round(after / 2**20, 1),
            }
        under = {"control: a busy process, no requests": under_busy_process(url, a)}
        under["control: GET /health back to back"] = under_attack(url, a, [lambda: health(port)])
        under.update({name: under_attack(url, a, [attack]) for name, attack in kinds.items()})
        under["all, in turn"] = under_attack(url, a, list(kinds.values()))
        base = statistics.median(baseline)
        out["per_token_s"] = {"baseline_median": base, "baseline": baseline}
        out["per_token_under_attack"] = {
            name: {"median_s": statistics.median(runs), "ratio": statistics.median(runs) / base, "runs": runs}
            for name, runs in under.items()
        }
        out["rss_end_mb"] = round(rss_bytes(proc.pid) / 2**20, 1)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
