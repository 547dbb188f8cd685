"""Real worker processes for tests: each role started the way a user starts
it (`pipeline worker --role ...`), logs kept per process, all stopped after."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pipeline.redis_url import sync_client
from pipeline.status import live_workers
from pipeline.tokenizer import Tokenizer


def load_bench_script(name: str):
    """bench/NAME.py as a module (bench/ is not a package), with bench/ on the path
    as when the script runs, so that it can import the scripts beside it."""
    bench = Path(__file__).resolve().parent.parent / "bench"
    if str(bench) not in sys.path:
        sys.path.append(str(bench))
    path = bench / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def worker_env() -> dict[str, str]:
    """This environment less its PIPELINE_* settings: a worker gets only the options
    a test gives it, whatever the shell running the tests has set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def delete_prefix(redis_url: str, prefix: str) -> None:
    client = sync_client(redis_url, prefix)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


class Tier:
    """One tier (a key prefix on one Redis) and the processes serving it."""

    def __init__(self, redis_url: str, prefix: str, log_dir: Path, **options: str):
        self.redis_url = redis_url
        self.prefix = prefix
        self.log_dir = log_dir
        self.options = {"dtype": "float32", "log-level": "warning"} | options
        self.procs: list[subprocess.Popen] = []
        self.api_ports: list[int] = []

    def start(self, role: str, *, env: dict[str, str] | None = None,
              **options) -> subprocess.Popen:
        """`env`: more environment variables for this worker alone."""
        cmd = [sys.executable, "-m", "pipeline.cli", "worker", "--role", role,
               "--redis-url", self.redis_url, "--prefix", self.prefix]
        for name, value in (self.options | options).items():
            cmd += [f"--{name}"] if value is True else [f"--{name}", str(value)]  # True: a flag
        log = open(self.log_dir / f"{role}-{len(self.procs)}.log", "w")
        env = worker_env() | {"TOKENIZERS_PARALLELISM": "false"} | (env or {})
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def start_api(self, *, env: dict[str, str] | None = None, **options) -> str:
        port = free_port()
        self.start("api", env=env, port=port, **options)
        self.api_ports.append(port)
        return f"http://127.0.0.1:{port}"

    def start_one_of_each(self, **api_options) -> str:
        """A scheduler, a detokenizer and an api, ready; returns the api's URL."""
        self.start("scheduler")
        self.start("detokenizer")
        url = self.start_api(**api_options)
        self.wait_ready()
        return url

    def wait_ready(self, schedulers: int = 1, detokenizers: int = 1, timeout_s: float = 120):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited early ({proc.args}); logs in "
                                       f"{self.log_dir}")
            roles = [w["role"] for w in live_workers(self.redis_url, self.prefix)]
            apis_up = all(_healthy(port) for port in self.api_ports)
            if (roles.count("scheduler") >= schedulers and roles.count("detokenizer")
                    >= detokenizers and apis_up):
                return
            time.sleep(0.2)
        raise TimeoutError(f"tier not ready after {timeout_s}s; logs in {self.log_dir}")

    @contextmanager
    def extra_api(self, **options) -> Iterator[tuple[str, subprocess.Popen]]:
        """Another api on this tier, with `options`, ready: its URL and process;
        stopped after, and taken off the tier's lists (a session's tier checks
        that every process and api of its own is up)."""
        url = self.start_api(**options)
        proc, port = self.procs[-1], self.api_ports[-1]
        try:
            self.wait_ready()
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(timeout=20)
            self.procs.remove(proc)
            self.api_ports.remove(port)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        delete_prefix(self.redis_url, self.prefix)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def tokenizer_with_template(model_files, directory: Path, template: str) -> Tokenizer:
    """The served model's tokenizer with another chat template, in `directory`."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_files.path / name, directory / name)
    (directory / "chat_template.jinja").write_text(template)
    return Tokenizer(directory)

