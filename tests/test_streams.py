"""StreamClient's one-round-trip answer-and-read against the machine's Redis, and
the RESP it packs."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.embedded_redis import EmbeddedRedis
from pipeline.messages import FIELD, Cancel, Delta, ReplyBatch, replies_decoder
from pipeline.status import live_workers, read_live_workers
from pipeline.streams import MAX_CONNECTIONS, WORKERS_KEPT_S, Keys, StreamClient, resp


@pytest.fixture
async def client(redis_url):
    client = StreamClient(redis_url, block_ms=50)
    yield client
    await client.close()


def batch(offset: int) -> ReplyBatch:
    return ReplyBatch(deltas=[Delta("r", offset, [offset], str(offset), None, None, 0)],
                      failures=[])


async def test_answers_are_written_and_acked_with_the_next_read(client, prefix):
    source, reply = f"{prefix}:source", f"{prefix}:reply"
    await client.ensure_group(source, "g")
    await client.redis.xadd(reply, {"hello": "x"})
    first = [(await client.redis.xadd(source, {FIELD: b"one"})).decode()]
    read = await client.add_ack_and_read([], source, "g", [], "c", count=10)
    assert read == [(first[0], b"one")]
    second = (await client.redis.xadd(source, {FIELD: b"two"})).decode()
    read = await client.add_ack_and_read([(reply, batch(0))], source, "g", first, "c",
                                         count=10, nomkstream=True, maxlen=100)
    assert read == [(second, b"two")]
    written = await client.redis.xrange(reply)
    assert replies_decoder.decode(written[-1][1][FIELD]) == batch(0)
    pending = await client.redis.xpending(source, "g")
    assert pending["pending"] == 1  # the first acked with its answer; the second not yet


async def test_own_pending_entries_are_read_again_from_zero_without_blocking(client, prefix):
    source = f"{prefix}:source"
    await client.ensure_group(source, "g")
    ids = [(await client.redis.xadd(source, {FIELD: bytes([i])})).decode() for i in range(3)]
    await client.add_ack_and_read([], source, "g", [], "c", count=10)  # all three pending
    again = await client.add_ack_and_read([], source, "g", ids[:1], "c", count=10, start="0")
    assert [entry_id for entry_id, _ in again] == ids[1:]
    assert await client.add_ack_and_read([], source, "g", [], "c", count=10) == []  # blocked 50 ms


async def test_an_error_reply_is_raised_and_the_client_goes_on(client, prefix):
    source, wrong = f"{prefix}:source", f"{prefix}:not-a-stream"
    await client.ensure_group(source, "g")
    await client.redis.set(wrong, "a string, so XADD fails inside the transaction")
    entry = (await client.redis.xadd(source, {FIELD: b"one"})).decode()
    await client.add_ack_and_read([], source, "g", [], "c", count=10)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await client.add_ack_and_read([(wrong, batch(0))], source, "g", [entry], "c", count=10)
    # every reply was read before the error was raised: the connection is in step
    assert await client.redis.ping()
    with pytest.raises(ResponseError, match="NOGROUP"):
        await client.add_ack_and_read([], f"{prefix}:no-such", "g", [], "c", count=10)
    later = (await client.redis.xadd(source, {FIELD: b"two"})).decode()
    assert await client.add_ack_and_read([], source, "g", [entry], "c", count=10) == [
        (later, b"two")]


async def test_a_burst_past_the_pool_waits_for_a_connection(client, prefix):
    """300 commands at once (an api submitting a burst of requests) all land, over at
    most MAX_CONNECTIONS connections: none fails with "Too many connections"."""
    stream = f"{prefix}:burst"
    await asyncio.gather(*(client.add(stream, Cancel([str(i)])) for i in range(300)))
    assert await client.redis.xlen(stream) == 300
    pool = client.redis.connection_pool
    opened = len(pool._available_connections) + len(pool._in_use_connections)
    assert opened <= MAX_CONNECTIONS


def test_resp_is_what_redis_py_sends(redis_url):
    commands = [("MULTI",), ("XADD", "k", "MAXLEN", "~", 10_000, "*", b"m", bytes(range(256))),
                ("XREADGROUP", "GROUP", "g", "c", "COUNT", 64, "BLOCK", 0, "STREAMS", "k", ">"),
                ("XACK", "k", "g", "1-1", "2-2"), ("EXEC",), ("SET", "ключ", "")]
    connection = redis.Redis.from_url(redis_url).connection_pool.make_connection()
    assert resp(commands) == b"".join(connection.pack_commands(commands))
    with pytest.raises(TypeError):
        resp([("SET", "k", 1.5)])


async def test_live_workers_come_from_the_index_without_a_scan(prefix):
    """A Redis shared with many other keys: status reads the workers index and one
    MGET (no SCAN); an expired key reads as gone; a member silent past
    WORKERS_KEPT_S leaves the index at the next heartbeat."""
    server = EmbeddedRedis()
    url = server.start()
    client = StreamClient(url, block_ms=50)
    try:
        keys = Keys(prefix)
        await client.redis.mset({f"other-tenant:{i}": i for i in range(5000)})
        for role, ttl_s in (("scheduler", 30.0), ("api", 0.2)):
            await client.heartbeat(keys.alive(role, f"{role}-1"), {"role": role, "id": f"{role}-1"},
                                   ttl_s, keys.workers)
        stale = keys.alive("detokenizer", "long-gone")
        await client.redis.zadd(keys.workers, {stale: time.time() - WORKERS_KEPT_S - 60})
        scans = _calls(url, "scan")
        assert sorted(w["role"] for w in live_workers(url, prefix)) == ["api", "scheduler"]
        await asyncio.sleep(0.3)  # the api's key expires
        assert [w["role"] for w in await read_live_workers(client, prefix)] == ["scheduler"]
        assert _calls(url, "scan") == scans
        assert await client.redis.zscore(keys.workers, stale) is not None
        await client.heartbeat(keys.alive("scheduler", "scheduler-1"),
                               {"role": "scheduler", "id": "scheduler-1"}, 30.0, keys.workers)
        assert await client.redis.zscore(keys.workers, stale) is None
    finally:
        await client.close()
        server.stop()


def test_a_tier_older_than_the_index_is_still_found(redis_url, prefix):
    """Workers that predate the index only set their liveness keys: with the index
    empty, `pipeline status` looks for those keys instead."""
    admin = redis.Redis.from_url(redis_url)
    admin.set(Keys(prefix).alive("scheduler", "old-1"),
              json.dumps({"role": "scheduler", "id": "old-1"}), px=30_000)
    assert [w["id"] for w in live_workers(redis_url, prefix)] == ["old-1"]


def _calls(url: str, command: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


async def test_a_redis_that_stops_answering_is_a_timeout_not_a_hang():
    """Writes paused (CLIENT PAUSE WRITE) past the socket timeout: the transaction
    raises redis' TimeoutError, which every role takes for Redis being down, and
    drops the connection; the next one works once Redis answers again."""
    server = EmbeddedRedis()
    url = server.start()
    client, admin = StreamClient(url, block_ms=50), redis.Redis.from_url(url)
    try:
        await client.transaction([("SET", "k", "1")])
        timeout_s = client.redis.connection_pool.connection_kwargs["socket_timeout"]
        admin.execute_command("CLIENT", "PAUSE", int(timeout_s * 1000) + 3000, "WRITE")
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await client.transaction([("SET", "k", "2")], then=("GET", "k"))
        assert timeout_s <= time.monotonic() - started < timeout_s + 2
        admin.execute_command("CLIENT", "UNPAUSE")
        _, value = await client.transaction([("SET", "k", "3")], then=("GET", "k"))
        assert value == b"3"
    finally:
        await client.close()
        admin.close()
        server.stop()
