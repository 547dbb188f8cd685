"""Fault-injection fixtures: a Redis server of the test's own (so it can be
killed and restarted), and tiers whose workers notice death within seconds."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

from pipeline.embedded_redis import redis_server_binary
from tests.harness import Tier, free_port

FAST_DEATH = {"alive-ttl-s": "2"}  # workers presumed dead after 2 s of silence


class RedisServer:
    """A real redis-server on a free port, restartable (its data is lost on restart)."""

    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        for _ in range(100):
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float = 1.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def _binaries() -> list:
    found = [pytest.param(str(redis_server_binary()), id="redis6.2-embedded")]
    system = shutil.which("redis-server")
    if system:
        found.append(pytest.param(system, id="redis7-system"))
    return found


@pytest.fixture(params=_binaries())
def own_redis(request, tmp_path):
    server = RedisServer(request.param, tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis7(tmp_path):
    server = RedisServer(shutil.which("redis-server") or str(redis_server_binary()), tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def embedded_redis(tmp_path):
    """The Redis 6.2 that `pipeline serve` embeds."""
    server = RedisServer(str(redis_server_binary()), tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def make_tier(tmp_path):
    tiers = []

    def make(redis_url: str, **options) -> Tier:
        log_dir = tmp_path / f"tier{len(tiers)}"
        log_dir.mkdir()
        tier = Tier(redis_url, f"fault-{uuid.uuid4().hex[:8]}", log_dir, **(FAST_DEATH | options))
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.stop()
