"""`pipeline status` and the api's /metrics: every live worker of a tier, read
from its liveness key."""

from __future__ import annotations

import json
import time

import redis
import redis.asyncio
from rich.console import Console
from rich.table import Table

from pipeline.streams import WORKERS_KEPT_S, Keys


def live_workers(redis_url: str, prefix: str) -> list[dict]:
    """Every live worker's record, found through the workers index; where the
    index is empty, by a SCAN: a tier whose workers predate the index."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    keys = Keys(prefix)
    try:
        found = client.zrangebyscore(keys.workers, time.time() - WORKERS_KEPT_S, "+inf")
        if not found:
            found = list(client.scan_iter(match=keys.alive_pattern(), count=1000))
        values = client.mget(sorted(found)) if found else []
    finally:
        client.close()
    return records(values)


async def read_live_workers(client: redis.asyncio.Redis, prefix: str) -> list[dict]:
    """As live_workers, on the caller's client: the alive keys the index has
    seen lately, read in one MGET (an expired one reads as nothing)."""
    keys = await client.zrangebyscore(Keys(prefix).workers, time.time() - WORKERS_KEPT_S,
                                      "+inf")
    return records(await client.mget(sorted(keys)) if keys else [])


def records(values: list[bytes | None]) -> list[dict]:
    """The liveness values that still exist and read as JSON objects."""
    found = []
    for value in values:
        try:
            record = json.loads(value) if value else None
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def print_status(redis_url: str, prefix: str) -> int:
    console = Console()
    try:
        workers = live_workers(redis_url, prefix)
    except redis.RedisError as error:
        console.print(f"[red]cannot reach Redis at {redis_url}: {error}[/red]")
        return 1
    table = Table(title=f"tier {prefix!r}: {len(workers)} live workers")
    for column in ("role", "id", "load"):
        table.add_column(column)
    for worker in workers:
        load = {k: v for k, v in worker.items() if k not in ("role", "id", "at")}
        table.add_row(str(worker.get("role")), str(worker.get("id")), json.dumps(load))
    console.print(table)
    return 0
