"""A Redis that evicts keys under memory pressure drops the tier's without an error:
a lane's stream (queued requests gone), a reply stream (resubmitted), a liveness
key (a live worker taken for dead). Only `noeviction` is safe: a full Redis then
refuses writes, which every role handles (nothing acked, retried). Managed Redis
services often default to a `volatile-*` policy, which evicts keys with a TTL:
liveness keys and reply streams. Each role warns at start; `pipeline status`
shows it in red."""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

log = logging.getLogger("pipeline.worker")


def eviction_risk(memory: dict) -> str | None:
    """What INFO memory says of eviction, where Redis may evict: None where it
    never does (noeviction, or no memory limit)."""
    policy = memory.get("maxmemory_policy")
    limit = memory.get("maxmemory") or 0
    if policy in (None, "noeviction") or not limit:
        return None
    return (f"Redis evicts keys past its maxmemory ({memory.get('maxmemory_human', limit)}, "
            f"maxmemory-policy {policy}): the tier's streams and liveness keys among them, "
            f"requests lost without an error. Set maxmemory-policy noeviction")


def evictions(stats: dict) -> str | None:
    evicted = stats.get("evicted_keys") or 0
    return f"Redis has evicted {evicted} keys since it started" if evicted else None


async def warn_if_evicting(redis) -> None:
    """A warning in the log where Redis may evict (a refused INFO: none)."""
    try:
        risk = eviction_risk(await redis.info("memory"))
    except ResponseError:
        return
    if risk:
        log.warning("%s", risk)
