"""`pipeline status` and the api's /metrics: every live worker of a tier, read
from its liveness key."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable

import redis
from rich import box
from rich.console import Console
from rich.table import Column, Table

from pipeline.eviction import eviction_risk, evictions
from pipeline.recovery import queue_depths
from pipeline.redis_url import sync_client
from pipeline.streams import SCHEDULERS, TIERS, WORKERS_KEPT_S, Keys, StreamClient


def live_workers(redis_url: str, prefix: str) -> list[dict]:
    """Every live worker's record, found through the workers index; where the
    index is empty, by a SCAN: a tier whose workers predate the index."""
    client = sync_client(redis_url, prefix, socket_timeout=5)
    keys = Keys(prefix)
    try:
        found = client.zrangebyscore(keys.workers, server_now_s(client) - WORKERS_KEPT_S,
                                     "+inf")
        if not found:
            found = list(client.scan_iter(match=keys.alive_pattern(), count=1000))
        values = client.mget(sorted(found)) if found else []
    finally:
        client.close()
    return records(values)


async def read_live_workers(client: StreamClient, prefix: str) -> list[dict]:
    """As live_workers, on the caller's client (and its Redis clock): the alive keys
    the index has seen lately, read in one MGET (an expired one reads as nothing)."""
    keys = await client.redis.zrangebyscore(Keys(prefix).workers,
                                            client.clock.now_s() - WORKERS_KEPT_S, "+inf")
    return records(await client.redis.mget(sorted(keys)) if keys else [])


def server_now_s(client: redis.Redis) -> float:
    """The Redis clock (pipeline.clock), which heartbeats are timed by; this host's
    where the server refuses TIME."""
    try:
        seconds, microseconds = client.time()
    except redis.ResponseError:
        return time.time()
    return seconds + microseconds / 1e6


def server_facts(redis_url: str, prefix: str) -> tuple[float, str, list[str]]:
    """The Redis clock, a line about the server, and what its INFO warns of
    (pipeline.eviction); no line and no warnings where INFO is refused."""
    client = sync_client(redis_url, prefix, socket_timeout=5)
    try:
        try:
            info = client.info()  # its default sections: server, clients, memory, stats...
        except redis.ResponseError:
            info = {}
        warnings = [eviction_risk(info), evictions(info)] if info else []
        return server_now_s(client), _about(info), [w for w in warnings if w]
    finally:
        client.close()


def _about(info: dict) -> str:
    if not info:
        return ""
    limit = info.get("maxmemory_human") if info.get("maxmemory") else "no limit"
    return (f"Redis {info.get('redis_version')} ({info.get('role')}): "
            f"{info.get('used_memory_human')} used ({limit}), "
            f"{info.get('connected_clients')} clients")


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


def queued_requests(redis_url: str, prefix: str) -> dict[str, int]:
    """Requests no scheduler has admitted yet, by service tier (its lane), each exact
    up to QUEUE_LIMIT (capped at QUEUE_LIMIT + 1): Redis 7 counts them, on Redis 6
    they are fetched."""
    async def read() -> list[int]:
        client = StreamClient(redis_url, prefix=prefix)
        try:
            return await queue_depths(client, Keys(prefix).lanes, SCHEDULERS, QUEUE_LIMIT,
                                      exact=True)
        finally:
            await client.close()

    return dict(zip(TIERS, asyncio.run(read()), strict=True))


def print_status(redis_url: str, prefix: str, as_json: bool = False) -> int:
    """The tier's live workers, a table a role; `as_json`: one JSON object for
    scripts ({"prefix", "queued_requests", "queued_by_tier", "workers": [every
    liveness record], "redis_warnings": [what Redis's INFO warns of]})."""
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: rows whole
    try:
        workers = live_workers(redis_url, prefix)
        by_tier = queued_requests(redis_url, prefix)
        now_s, about, warnings = server_facts(redis_url, prefix)
    except redis.RedisError as error:
        console.print(f"[red]cannot reach Redis at {redis_url}: {error}[/red]")
        return 1
    queued = sum(by_tier.values())
    if as_json:
        print(json.dumps({"prefix": prefix, "queued_requests": queued,
                          "queued_by_tier": by_tier, "workers": workers,
                          "redis_warnings": warnings}))
        return 0
    by_role: dict[str, list[dict]] = {}
    for worker in sorted(workers, key=lambda w: str(w.get("id"))):
        by_role.setdefault(str(worker.get("role")), []).append(worker)
    counts = ", ".join(f"{len(by_role.get(r, []))} {r}" for r in ROLES)
    shown = f"over {QUEUE_LIMIT}" if queued > QUEUE_LIMIT else str(queued)
    tiers = ", ".join(f"{count} {tier}" for tier, count in by_tier.items() if count)
    console.print(f"tier {prefix!r}: {counts} live; {shown} requests queued"
                  + (f" ({tiers})" if tiers else ""))
    if about:
        console.print(about)
    for alert in _alerts(workers, by_role, warnings):
        console.print(f"[red]{alert}[/red]")
    seen = _seen(now_s)
    tables = [(role, role, {"seen": seen} | COLUMNS.get(role, {"record": _other}))
              for role in by_role] + [("scheduler", "engines and caches", ENGINE)]
    for role, title, columns in tables:
        if role not in by_role:
            continue
        # narrow terminals wrap a cell rather than cut it; an id stays whole
        table = Table(Column("id", no_wrap=True), *(Column(c, overflow="fold") for c in columns),
                      title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for worker in by_role[role]:
            table.add_row(str(worker.get("id")), *(show(worker) for show in columns.values()))
        console.print(table)
    return 0


def _alerts(workers: list[dict], by_role: dict[str, list[dict]], warnings: list[str]):
    """What an operator should see to, a line each."""
    yield from (f"no live {role}: {MISSING[role]}" for role in ROLES if role not in by_role)
    yield from warnings
    if skewed := _skewed_clocks(workers):
        yield ("hosts' clocks off the Redis server's (the tier runs on its; see to their "
               f"NTP): {skewed}")
    if models := _models(workers):
        yield f"the tier mixes models (a tier serves one): {models}"


def _skewed_clocks(workers: list[dict]) -> str:
    """The workers whose host's clock is over CLOCK_SKEW_S off the Redis clock."""
    return ", ".join(
        f"{w.get('role')} {w.get('id')} {-w['clock_offset_s']:+.1f} s"
        for w in workers if isinstance(w.get("clock_offset_s"), (int, float))
        and abs(w["clock_offset_s"]) > CLOCK_SKEW_S)


def _models(workers: list[dict]) -> str:
    """Each model fingerprint the workers name, with its name and who runs it."""
    found: dict[str, list[dict]] = {}
    for worker in workers:
        if worker.get("fingerprint"):
            found.setdefault(worker["fingerprint"], []).append(worker)
    return "; ".join(
        f"{group[0].get('model')!r} ({fingerprint}): "
        + ", ".join(f"{sum(w.get('role') == r for w in group)} {r}" for r in ROLES)
        for fingerprint, group in found.items()) if len(found) > 1 else ""


def _seen(now: float) -> Callable[[dict], str]:
    """How long ago the worker's last heartbeat was, and whether it is draining."""
    def show(worker: dict) -> str:
        at = worker.get("at")
        seen = f"{now - at:.1f} s" if isinstance(at, (int, float)) else "-"
        return seen + (", draining" if worker.get("draining") else "")

    return show


def _field(name: str, unit: str = "", scale: float = 1) -> Callable[[dict], str]:
    def show(worker: dict) -> str:
        value = worker.get(name)
        if isinstance(value, float):  # 1234.5 tok/s as 1234, 38.21 ms as 38.2
            value *= scale
            value = f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
        return "-" if value is None else f"{value}{unit}"

    return show


def _kv(worker: dict) -> str:
    free, total = worker.get("num_free_blocks"), worker.get("num_blocks")
    return f"{free}/{total}" if free is not None and total else "-"


def _other(worker: dict) -> str:
    return json.dumps({k: v for k, v in worker.items() if k not in ("role", "id", "at")})


ROLES = ("api", "scheduler", "detokenizer")
MISSING = {"api": "nothing takes HTTP requests",
           "scheduler": "requests queue until one joins",
           "detokenizer": "tokens wait in their stream until one joins"}
COLUMNS: dict[str, dict[str, Callable[[dict], str]]] = {
    "api": {"in flight": _field("in_flight"), "stream interval": _field("stream_interval")},
    "scheduler": {
        "run": _field("num_running"), "wait": _field("num_waiting"), "KV free": _kv,
        "tok/s": _field("output_tokens_per_s"), "step p50": _field("step_ms_p50", " ms"),
        "busy": _field("busy", "%", 100)},
    "detokenizer": {"batches": _field("batches")},
}
ENGINE = {name: _field(key) for name, key in (
    ("device", "device"), ("dtype", "dtype"), ("4-bit matmul", "4bit_matmul"),
    ("attention", "attention"), ("KV cache", "kv_cache_dtype"),
    ("prefix hits", "num_prefix_hit_tokens"), ("preempted", "num_preemptions"))}
QUEUE_LIMIT = 10_000
# a host's clock this far off the Redis server's is worth an operator's look: the
# tier's times do not depend on it (pipeline.clock), but its logs' times do
CLOCK_SKEW_S = 1.0
