"""Acceptance of ``kvrag serve`` under concurrency (issue 18): many clients, greedy, mixed requests.

Starts ``kvrag serve`` as a process (the bundled model unless ``--model``), then sends the same
mixed requests three times: a *settle* pass (one at a time: the cache reaches its steady state), an
*alone* pass (one at a time: each request's reference output) and a *concurrent* pass
(``--clients`` threads, each sending its ``--requests`` requests back to back). The requests mix
chat and text completions, streamed and whole answers, modes (blend with the engine's default
ratio, blend at 0.3, reuse, prefix, full), passages warmed or met first here, and lengths.

    python -m benchmarks.acceptance.serve [--model M] [--clients 8] [--requests 25] [--config F=V ...]

Checks (PASS/FAIL lines; exit 1 if one fails): every concurrent output equals the same request's
alone output; no request failed; the server's resident memory after the concurrent pass stays
within ``--max-rss-growth`` of its size after the alone pass (bounded memory). Also prints how many
alone outputs differ from the settle pass (the cache's own drift, not concurrency's), wall times
and the server's peak queue.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.data import make_synthetic_dataset, passage_text  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []

#: (endpoint, engine options) of the request kinds, picked in turn
KINDS = [
    ("chat", {}),  # the engine's default mode and ratio
    ("chat", {"mode": "blend", "recompute_ratio": 0.3}),
    ("text", {"mode": "reuse"}),
    ("chat", {"mode": "prefix"}),
    ("text", {"mode": "full"}),
]


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_requests(n: int, seed: int) -> tuple[list[dict], list[str]]:
    """``n`` mixed request bodies over a small corpus, and the passages to warm first (half of them)."""
    rng = random.Random(seed)
    items = make_synthetic_dataset(12, passages=5, words=45, seed=seed)
    bodies = []
    for i in range(n):
        item = items[i % len(items)]
        passages = [passage_text(c) for c in item["ctxs"]]
        chosen = rng.sample(passages, rng.randint(2, 4))
        endpoint, options = KINDS[i % len(KINDS)]
        body = {
            "max_tokens": rng.choice((6, 12, 20)),
            "temperature": 0,
            "stream": rng.random() < 0.5,
            "documents": chosen,
            **options,
        }
        if endpoint == "chat":
            body["messages"] = [
                {"role": "system", "content": "Answer from the passages.\n\n" + "".join(chosen)},
                {"role": "user", "content": item["question"]},
            ]
        else:
            body["prompt"] = "Passages:\n" + "".join(chosen) + f"Question: {item['question']}\nAnswer:"
        bodies.append({"endpoint": endpoint, "body": body})
    corpus = sorted({passage_text(c) for item in items for c in item["ctxs"]})
    return bodies, corpus[::2]


def send(http: httpx.Client, url: str, request: dict) -> str:
    """The answer's text (streamed pieces joined); raises on an error."""
    endpoint, body = request["endpoint"], request["body"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"

    def text_of(choice: dict) -> str:
        if endpoint == "chat":
            part = choice.get("delta") if body["stream"] else choice.get("message")
            return (part or {}).get("content") or ""
        return choice.get("text") or ""

    if not body["stream"]:
        response = http.post(url + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return text_of(response.json()["choices"][0])
    pieces = []
    with http.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return "".join(pieces)
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            pieces += [text_of(c) for c in event.get("choices", [])]
    raise RuntimeError("the stream ended without [DONE]")


def one_at_a_time(url: str, requests: list[dict]) -> tuple[list[str | Exception], float]:
    out: list[str | Exception] = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as http:
        for r in requests:
            try:
                out.append(send(http, url, r))
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                out.append(exc)
    return out, time.perf_counter() - t0


def concurrently(url: str, requests: list[dict], clients: int) -> tuple[list[str | Exception], float, int]:
    out: list[str | Exception | None] = [None] * len(requests)
    peak = {"waiting": 0, "running": 0}
    done = threading.Event()

    def client(c: int) -> None:
        with httpx.Client(timeout=600) as http:
            for i in range(c, len(requests), clients):
                try:
                    out[i] = send(http, url, requests[i])
                except Exception as exc:  # noqa: BLE001
                    out[i] = exc

    def watch() -> None:  # the engine's queue, from the health endpoint
        with httpx.Client(timeout=30) as http:
            while not done.wait(0.2):
                try:
                    queue = http.get(url + "/health").json().get("queue", {})
                except (httpx.HTTPError, ValueError):
                    continue
                for key in peak:
                    peak[key] = max(peak[key], int(queue.get(key, 0)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    return out, time.perf_counter() - t0, peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25, help="requests per client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--max-rss-growth", type=float, default=0.25, help="allowed growth of the server's RSS")
    a = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvrag.cli", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--model", a.model] if a.model else []
    for pair in a.config:
        cmd += ["--config", pair]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    server = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(1)
        requests, warm = make_requests(a.clients * a.requests, a.seed)
        httpx.post(url + "/v1/documents", json={"documents": warm, "warm": True}, timeout=600).raise_for_status()
        print(f"{len(requests)} requests; {len(warm)} passages warmed; server pid {server.pid}", flush=True)

        settle, t_settle = one_at_a_time(url, requests)
        alone, t_alone = one_at_a_time(url, requests)
        rss_alone = rss_mb(server.pid)
        together, t_together, peak = concurrently(url, requests, a.clients)
        rss_together = rss_mb(server.pid)

        drift = sum(isinstance(x, str) and isinstance(y, str) and x != y for x, y in zip(settle, alone))
        print(f"settle pass {t_settle:.0f} s, alone pass {t_alone:.0f} s, concurrent pass {t_together:.0f} s")
        print(f"alone outputs that differ from the settle pass (cache drift): {drift}/{len(requests)}")
        failed = [(i, x) for i, x in enumerate(alone + together) if not isinstance(x, str)]
        check("no error", not failed, f"{len(failed)} failed" + (f", first: {failed[0][1]}" if failed else ""))
        same = sum(isinstance(x, str) and x == y for x, y in zip(together, alone))
        differ = [i for i, (x, y) in enumerate(zip(together, alone)) if x != y]
        for i in differ[:5]:
            print(f"  request {i} {requests[i]['endpoint']} {requests[i]['body'].get('mode', 'default')}:")
            print(f"    alone:      {alone[i]!r}\n    concurrent: {together[i]!r}")
        check("identical outputs", not differ, f"{same}/{len(requests)} concurrent outputs equal the alone ones")
        growth = rss_together / rss_alone - 1
        check(
            "bounded memory",
            growth <= a.max_rss_growth,
            f"server RSS {rss_alone:.0f} MB after the alone pass, {rss_together:.0f} MB after the concurrent one "
            f"({growth:+.1%}); peak queue: {peak['running']} running, {peak['waiting']} waiting",
        )
        print(f"load average now {os.getloadavg()[0]:.1f}")
    finally:
        server.terminate()
        server.wait(60)
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
