"""What every worker role shares: an id, a heartbeat liveness key, and a
loop body that survives Redis going away (reconnect with backoff)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.config import RedisConfig
from pipeline.streams import Keys, StreamClient

log = logging.getLogger("pipeline.worker")
T = TypeVar("T")
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def run_loop(main: Awaitable[T]) -> T:
    """asyncio.run on uvloop where it is installed (uvicorn's loop for the api):
    per message, its loop and transports took ~half the CPU of asyncio's."""
    try:
        import uvloop
    except ImportError:  # not on Windows; asyncio's own loop works, only slower
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def heartbeat_forever(client: StreamClient, keys: Keys, role: str, worker_id: str,
                            config: RedisConfig, info: Callable[[], dict]) -> None:
    key = keys.alive(role, worker_id)
    while True:
        try:
            await client.heartbeat(key, {"role": role, "id": worker_id} | info(),
                                   config.alive_ttl_s, keys.workers)
        except REDIS_DOWN as error:
            log.warning("%s heartbeat failed: %s", worker_id, error)
        await asyncio.sleep(config.heartbeat_s)


async def leave_tier(client: StreamClient, keys: Keys, role: str, worker_id: str,
                     streams: list[str], group: str) -> None:
    """After a drain: gone from the tier at once, not a TTL later: the liveness key,
    its index member, and the group's consumer in each of `streams` where nothing is
    pending on it (an entry left pending keeps it, to be taken over as a dead
    worker's). Best effort: where Redis refuses, the key expires and the consumer is
    dropped anyway."""
    alive = keys.alive(role, worker_id)
    try:
        await client.redis.delete(alive)
        await client.redis.zrem(keys.workers, alive)
        for stream in streams:
            pending = await client.redis.xpending_range(stream, group, "-", "+", 1,
                                                        consumername=worker_id)
            if pending:
                log.warning("%s leaves with entries pending; they are taken over", worker_id)
            else:
                await client.redis.xgroup_delconsumer(stream, group, worker_id)
    except (RedisError, *REDIS_DOWN) as error:
        log.warning("%s drained, but could not leave the tier at once: %s", worker_id, error)
        return
    log.info("drained; %s left the tier", worker_id)


def backoff_s(failures: int) -> float:
    """Jittered exponential backoff, capped at 5 s."""
    return min(5.0, 0.1 * 2 ** min(failures, 6)) * (0.5 + random.random() / 2)


async def retrying(call: Callable[[], Awaitable], name: str):
    """`await call()` until Redis answers it."""
    failures = 0
    while True:
        try:
            return await call()
        except REDIS_DOWN as error:
            failures += 1
            log.warning("%s: Redis unavailable (%s); retrying", name, error)
            await asyncio.sleep(backoff_s(failures))


async def forever(step: Callable[[], Awaitable[None]], name: str,
                  on_reconnect: Callable[[], Awaitable[None]] | None = None,
                  until: Callable[[], bool] = lambda: False) -> None:
    """Run `step` in a loop until `until()`; after Redis trouble back off, then
    `on_reconnect` (recreate groups, re-read own pending entries) and go on. A group
    gone (NOGROUP), or a blocked read's stream deleted or its master demoted under it
    (UNBLOCKED), is trouble of that kind too."""
    while not until():
        try:
            await step()
        except REDIS_DOWN as error:
            log.warning("%s: Redis unavailable (%s); reconnecting", name, error)
            await asyncio.sleep(backoff_s(1))
        except ResponseError as error:
            if "NOGROUP" in str(error):
                log.warning("%s: consumer group gone (Redis restarted empty?); rejoining", name)
            elif str(error).startswith("UNBLOCKED"):  # a blocked read: its stream deleted,
                # or its master demoted to a replica
                log.warning("%s: %s (a slot's migration, a DEL, or a master demoted); "
                            "rejoining", name, error)
            else:
                raise
        else:
            continue
        if on_reconnect is not None:
            await retrying(on_reconnect, name)
