# A tier on a Redis Cluster (redis+cluster://[[user]:password@]host:port[,host:port...];
# rediss+cluster:// for TLS, with pipeline/redis_tls.py's settings in its query):
# its prefix holds a hash tag ({pipeline}), so every key of the tier is in one slot and
# its transactions and Lua scripts run on one node, the master of that slot. A connection
# asks the cluster which node that is when it connects (CLUSTER SLOTS, of the nodes given
# or any learned since), and takes a reply saying the slot is served elsewhere now (MOVED,
# ASK, CLUSTERDOWN, TRYAGAIN, a demoted master's READONLY) for a lost connection, so that
# the tier's reconnect finds the new master after a failover or a slot's migration.

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    ReadOnlyError,
    TryAgainError,
)

from pipeline.redis_tls import tls_options

SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
ELSEWHERE = (MovedError, AskError, ClusterDownError, TryAgainError, ReadOnlyError)


@dataclass(frozen=True)
class ClusterUrl:
    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    tls: dict = field(default_factory=dict)  # redis_tls.tls_options: ssl=True and its files

    @property
    def login(self) -> dict:
        """Every connection's options: the credentials, and TLS's where asked."""
        return {"username": self.username, "password": self.password, **self.tls}


def cluster_url(url: str) -> ClusterUrl | None:
    """`url` read as a cluster's; None for any other scheme. A ValueError names what a
    cluster URL lacks."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        return None
    nodes = [host.rpartition(":") for host in parts.netloc.rpartition("@")[2].split(",")]
    if not all(name and port.isdigit() for name, _, port in nodes) or parts.path not in ("",
                                                                                      "/", "/0"):
        raise ValueError(f"a cluster URL is redis[s]+cluster://[[user]:password@]host:port"
                         f"[,host:port...][?TLS settings] (database 0, a cluster's only), "
                         f"not {url!r}")
    return ClusterUrl([(name, int(port)) for name, _, port in nodes],
                      unquote(parts.username) if parts.username else None,
                      unquote(parts.password) if parts.password else None,
                      tls_options(parts.query, SCHEMES[parts.scheme], url))


def tier_slot(prefix: str | None) -> int:
    """The one slot of a tier's keys; a ValueError where its prefix has no hash tag."""
    start = (prefix or "").find("{")
    if start < 0 or (prefix or "").find("}", start + 2) < 0:
        raise ValueError(f"on a Redis Cluster a tier's prefix holds a hash tag, so that its "
                         f"keys share one slot: --prefix '{{{prefix or 'pipeline'}}}', not "
                         f"{prefix!r}")
    return key_slot(f"{prefix}:".encode())


def master_of_slot(slots: list, slot: int) -> tuple[str, int] | None:
    """The master serving `slot`, in CLUSTER SLOTS' reply `slots`."""
    for start, end, master, *_replicas in slots:
        if start <= slot <= end:
            return _node(master)
    return None


def _known(slots: list) -> list[tuple[str, int]]:
    """Every node CLUSTER SLOTS' reply names, masters and replicas."""
    return [_node(node) for _start, _end, *nodes in slots for node in nodes]


def _node(entry: list) -> tuple[str, int]:
    host = entry[0]
    return host.decode() if isinstance(host, bytes) else host, int(entry[1])


class SlotFinder:
    """The master of one slot, asked of the cluster's nodes (those given first, then
    those learned) until one answers; kept until a connection finds it wrong."""

    def __init__(self, cluster: ClusterUrl, slot: int, timeout_s: float | None):
        self.cluster, self.slot, self.timeout_s = cluster, slot, timeout_s
        self.nodes = list(cluster.nodes)
        self.known: tuple[str, int] | None = None

    def forget(self) -> None:
        self.known = None

    async def master(self) -> tuple[str, int]:
        if self.known is None:
            self.known = await self._ask()
        return self.known

    async def _ask(self) -> tuple[str, int]:
        failures = []
        for host, port in list(self.nodes):
            client = redis.asyncio.Redis(host=host, port=port, socket_timeout=self.timeout_s,
                                         socket_connect_timeout=self.timeout_s,
                                         **self.cluster.login)
            try:
                slots = await client.execute_command("CLUSTER SLOTS")
            except redis.RedisError as error:
                failures.append(f"{host}:{port}: {error}")
                continue
            finally:
                await client.aclose()
            self.nodes += [node for node in _known(slots) if node not in self.nodes]
            if (found := master_of_slot(slots, self.slot)) is not None:
                return found
            failures.append(f"{host}:{port}: no master serves slot {self.slot}")
        raise ConnectionError("no node of the cluster named the master of the tier's slot ("
                              + "; ".join(failures) + ")")


class SlotConnection(redis.asyncio.Connection):
    """A connection to the master of the tier's slot, found again at each connect."""

    def __init__(self, *, finder: SlotFinder, **kwargs):
        self.finder = finder
        super().__init__(**kwargs)

    async def connect(self):
        """As redis-py's, each try asking the cluster again (not the same address
        tried again: the master that died, until the cluster promotes another). The
        pool calls it at each checkout: a connection to a master the finder no longer
        names connects anew, so that one MOVED moves them all."""
        await self.retry.call_with_retry(self._connect_to_master,
                                         lambda _error: asyncio.sleep(0))

    async def _connect_to_master(self):
        if self.is_connected:
            if self.finder.known in (None, (self.host, self.port)):
                return
            await self.disconnect()  # another connection found the slot's new master
        self.host, self.port = await self.finder.master()
        try:
            await self.connect_check_health(check_health=True, retry_socket_connect=False)
        except Exception:
            self.finder.forget()
            raise

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except ELSEWHERE as error:
            self.finder.forget()
            await self.disconnect()
            raise ConnectionError(f"the tier's slot is not served here now: {error}") from error


class TlsSlotConnection(SlotConnection, redis.asyncio.SSLConnection):
    """A SlotConnection over TLS (rediss+cluster://)."""


def async_cluster_client(cluster: ClusterUrl, prefix: str | None, *, max_connections: int,
                         timeout: float, **options) -> redis.asyncio.Redis:
    finder = SlotFinder(cluster, tier_slot(prefix), options.get("socket_connect_timeout"))
    login = dict(cluster.login)
    tls = login.pop("ssl", False)  # a pool's connections take TLS by their class
    return redis.asyncio.Redis.from_pool(redis.asyncio.BlockingConnectionPool(
        connection_class=TlsSlotConnection if tls else SlotConnection, finder=finder,
        max_connections=max_connections, timeout=timeout, **login, **options))


def sync_cluster_client(cluster: ClusterUrl, prefix: str | None, **options) -> redis.Redis:
    """A blocking client of the slot's master as the cluster names it now."""
    slot, failures = tier_slot(prefix), []
    for host, port in cluster.nodes:
        try:
            with redis.Redis(host=host, port=port, socket_timeout=5, socket_connect_timeout=5,
                             **cluster.login) as client:
                found = master_of_slot(client.execute_command("CLUSTER SLOTS"), slot)
        except redis.RedisError as error:
            failures.append(f"{host}:{port}: {error}")
            continue
        if found is not None:
            return redis.Redis(host=found[0], port=found[1], **cluster.login, **options)
    raise ConnectionError("no node of the cluster named the master of the tier's slot ("
                          + "; ".join(failures) + ")")
