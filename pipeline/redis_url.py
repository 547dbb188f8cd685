# Clients for a Redis URL: those redis-py reads (redis://, rediss://, unix://), a
# cluster's (pipeline/redis_cluster.py), and Sentinel's,
# redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db] (rediss+sentinel:
# TLS to the sentinels and the master, with pipeline/redis_tls.py's settings;
# ?sentinel_tls=false: to the master alone), whose master is asked of the sentinels, so
# that after a failover each connection that fails finds the new one (a demoted master's
# READONLY counts as a lost connection, as it does on a plain URL: ReadOnlyIsLost). The
# credentials are the master's; the sentinels are reached without.

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import ConnectionError, ReadOnlyError

from pipeline.redis_cluster import async_cluster_client, cluster_url, sync_cluster_client
from pipeline.redis_tls import tls_options

SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: dict = field(default_factory=dict)  # redis_tls.tls_options: ssl=True and its files
    sentinels_tls: bool = True  # with tls: the sentinels are reached over TLS too

    @property
    def ssl(self) -> bool:
        return bool(self.tls.get("ssl"))

    @property
    def master_options(self) -> dict:
        return {"db": self.db, "username": self.username, "password": self.password,
                **self.tls}

    def sentinel_options(self, **sockets) -> dict:
        """A sentinel connection's options: `sockets`' timeouts, and TLS's where the
        master's is TLS and the URL did not say sentinel_tls=false."""
        return {**sockets, **(self.tls if self.sentinels_tls else {})}


def sentinel_url(url: str) -> SentinelUrl | None:
    """`url` read as Sentinel's; None for any other scheme. A ValueError names what a
    Sentinel URL lacks."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        return None
    sentinels = [_address(host) for host in parts.netloc.rpartition("@")[2].split(",") if host]
    path = [unquote(part) for part in parts.path.split("/") if part]
    if not sentinels or not path or len(path) > 2:
        raise ValueError(f"a Sentinel URL is {next(iter(SCHEMES))}://[[user]:password@]"
                         f"host:port[,host:port...]/service[/db][?TLS settings], not {url!r}")
    settings = parse_qsl(parts.query, keep_blank_values=True)
    sentinels_tls = [value for name, value in settings if name == "sentinel_tls"]
    if sentinels_tls not in ([], ["true"], ["false"]):
        raise ValueError(f"sentinel_tls is true (the default) or false, once: {url!r}")
    query = urlencode([(name, value) for name, value in settings if name != "sentinel_tls"])
    return SentinelUrl(sentinels, path[0], int(path[1]) if len(path) > 1 else 0,
                       unquote(parts.username) if parts.username else None,
                       unquote(parts.password) if parts.password else None,
                       tls_options(query, SCHEMES[parts.scheme], url),
                       sentinels_tls != ["false"])


def _address(host: str) -> tuple[str, int]:
    """host, host:port, [v6] or [v6]:port."""
    if host.startswith("["):
        name, _, port = host[1:].partition("]")
        port = port.lstrip(":")
    else:
        name, _, port = host.partition(":")
    return name, int(port) if port else SENTINEL_PORT


class BlockingSentinelPool(SentinelConnectionPool, redis.asyncio.BlockingConnectionPool):
    """Sentinel's pool, waiting for a free connection as BlockingConnectionPool does."""


class ReadOnlyIsLost:
    """A connection that takes a demoted master's READONLY for a lost connection: a
    managed Redis fails over by moving its endpoint's name to the promoted replica,
    and a connection still open to the old master finds it a replica. Dropped, it
    connects anew, through the name, to the new master."""

    async def read_response(self, *args, **kwargs):
        try:
            return await super().read_response(*args, **kwargs)
        except ReadOnlyError as error:
            await self.disconnect()
            raise ConnectionError(f"the server is a replica now: {error}") from error


class ReadOnlyIsLostTcp(ReadOnlyIsLost, redis.asyncio.Connection):
    pass


class ReadOnlyIsLostTls(ReadOnlyIsLost, redis.asyncio.SSLConnection):
    pass


class ReadOnlyIsLostUnix(ReadOnlyIsLost, redis.asyncio.UnixDomainSocketConnection):
    pass


FOLLOWING = {redis.asyncio.Connection: ReadOnlyIsLostTcp,
             redis.asyncio.SSLConnection: ReadOnlyIsLostTls,
             redis.asyncio.UnixDomainSocketConnection: ReadOnlyIsLostUnix}


def async_client(url: str, *, max_connections: int, timeout: float, prefix: str | None = None,
                 **options) -> redis.asyncio.Redis:
    """An asyncio client whose pool holds `max_connections` at most, a command waiting
    `timeout` for one; `options` are each connection's (socket_timeout, ...). `prefix`:
    the tier's, whose slot a cluster's client serves (pipeline/redis_cluster.py)."""
    if (cluster := cluster_url(url)) is not None:
        return async_cluster_client(cluster, prefix, max_connections=max_connections,
                                    timeout=timeout, **options)
    found = sentinel_url(url)
    if found is None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **options)
        pool.connection_class = FOLLOWING.get(pool.connection_class, pool.connection_class)
        return redis.asyncio.Redis.from_pool(pool)
    manager = Sentinel(found.sentinels, sentinel_kwargs=found.sentinel_options(
        socket_timeout=options.get("socket_timeout"),
        socket_connect_timeout=options.get("socket_connect_timeout")))
    return redis.asyncio.Redis.from_pool(BlockingSentinelPool(
        found.service, manager, max_connections=max_connections, timeout=timeout,
        **found.master_options, **options))


def async_plain(url: str, **options) -> redis.asyncio.Redis:
    """An asyncio client with redis-py's own pool (of a cluster: its first node's)."""
    if (cluster := cluster_url(url)) is not None:
        host, port = cluster.nodes[0]
        return redis.asyncio.Redis(host=host, port=port, **cluster.login, **options)
    found = sentinel_url(url)
    if found is None:
        return redis.asyncio.Redis.from_url(url, **options)
    return Sentinel(found.sentinels, sentinel_kwargs=found.sentinel_options(
        socket_timeout=options.get("socket_timeout"))).master_for(
        found.service, **found.master_options, **options)


def sync_client(url: str, prefix: str | None = None, **options) -> redis.Redis:
    """A blocking client (`pipeline status`, tests); `prefix` as async_client's."""
    if (cluster := cluster_url(url)) is not None:
        return sync_cluster_client(cluster, prefix, **options)
    found = sentinel_url(url)
    if found is None:
        return redis.Redis.from_url(url, **options)
    return redis.Sentinel(found.sentinels, sentinel_kwargs=found.sentinel_options(
        socket_timeout=options.get("socket_timeout"))).master_for(
        found.service, **found.master_options, **options)
