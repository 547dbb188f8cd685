"""`pipeline serve`: one process per role on this machine, an embedded Redis
when no URL is given, crashed roles restarted, and nothing left behind on
SIGINT/SIGTERM (children also die with the supervisor via PDEATHSIG)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from pipeline.config import Config
from pipeline.embedded_redis import EmbeddedRedis, die_with_parent
from pipeline.models import resolve_model
from pipeline.status import live_workers

log = logging.getLogger("pipeline.serve")
class Children:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str) -> None:
        cmd = [sys.executable, "-m", "pipeline.cli", "worker", "--role", role]
        self.procs[name] = subprocess.Popen(cmd, env=os.environ | self.env,
                                            preexec_fn=die_with_parent)

    def restart_dead(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                log.error("%s exited with %s; restarting it", name, proc.returncode)
                self.start(name, name.split("-")[0])

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: each child drains (--drain-timeout-s). SIGINT: stop at once; sent
        twice, since uvicorn (the api) drains on one and quits on a second, as at
        a second Ctrl-C."""
        for _ in range(2 if sig == signal.SIGINT else 1):
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(sig)
            time.sleep(0.2)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _is_ready(url: str, redis_url: str, prefix: str) -> bool:
    try:
        if httpx.get(f"{url}/health", timeout=1.0).status_code != 200:
            return False
    except httpx.HTTPError:
        return False
    roles = {worker["role"] for worker in live_workers(redis_url, prefix)}
    return {"scheduler", "detokenizer"} <= roles


def _wait_ready(url: str, redis_url: str, prefix: str, children: Children,
                stopping: list) -> bool:
    while not stopping:
        children.restart_dead()
        if _is_ready(url, redis_url, prefix):
            return True
        time.sleep(0.25)
    return False


def serve_forever(config: Config, counts: dict[str, int],
                  env_for: Callable[[str], dict[str, str]]) -> int:
    stopping: list[int] = []  # the signals received
    signal.signal(signal.SIGTERM, lambda sig, _: stopping.append(sig))
    signal.signal(signal.SIGINT, lambda sig, _: stopping.append(sig))
    resolve_model(config.model)  # convert once here, not in every child
    embedded = None if config.redis.url else EmbeddedRedis()
    redis_url = embedded.start() if embedded else config.redis.url
    children = Children(env_for(redis_url))
    try:
        children.start("api", "api")  # one process; --api-workers forks uvicorn workers
        for role in ("scheduler", "detokenizer"):
            for i in range(counts[role]):
                children.start(f"{role}-{i}", role)
        url = f"http://{config.api.host}:{config.api.port}"
        if _wait_ready(url, redis_url, config.redis.prefix, children, stopping):
            names = config.api.served_model_names
            model = f"{config.model} as {names[0]}" if names else config.model
            print(f"pipeline serving {model} at {url}/v1 (Redis: {redis_url})", flush=True)
        while not stopping:
            children.restart_dead()
            time.sleep(0.2)
        return 0
    finally:
        # SIGTERM (systemd, a container's stop): the children drain; Ctrl-C: at once
        if stopping and stopping[0] == signal.SIGINT:
            children.stop(10.0, signal.SIGINT)
        else:
            children.stop(config.drain_timeout_s + 5)
        if embedded:
            embedded.stop()
