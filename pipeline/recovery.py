"""Liveness-driven recovery for the roles that read through a consumer group:
find consumers whose liveness key expired, take over their pending entries,
drop dead consumers once empty, and trim streams without losing pending work.
Works on Redis 6.2 (no XAUTOCLAIM deleted-id cleanup) and 7.x alike."""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import ResponseError

from pipeline.streams import Keys, StreamClient


@dataclass(frozen=True)
class Claimed:
    entry_id: str
    raw: bytes  # b"" when the entry body is gone (trimmed, or a Redis that lost data)
    times_delivered: int


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def dead_consumers(client: StreamClient, keys: Keys, stream: str, group: str, role: str,
                         me: str) -> list[tuple[str, int]]:
    """(name, pending) for every other consumer of `group` whose liveness key is gone."""
    consumers = [(_text(c["name"]), int(c["pending"]))
                 for c in await client.redis.xinfo_consumers(stream, group)]
    others = [(name, pending) for name, pending in consumers if name != me]
    if not others:
        return []
    async with client.redis.pipeline(transaction=False) as pipe:
        for name, _ in others:
            pipe.exists(keys.alive(role, name))
        alive = await pipe.execute()
    return [consumer for consumer, is_alive in zip(others, alive, strict=True) if not is_alive]


async def gone_frontends(client: StreamClient, keys: Keys, reply_tos: set[str]) -> set[str]:
    """The reply streams, among `reply_tos`, whose frontend's liveness key expired."""
    reply_tos = sorted(reply_tos)
    if not reply_tos:
        return set()
    async with client.redis.pipeline(transaction=False) as pipe:
        for reply_to in reply_tos:
            pipe.exists(keys.alive("api", keys.frontend_of(reply_to)))
        alive = await pipe.execute()
    return {r for r, is_alive in zip(reply_tos, alive, strict=True) if not is_alive}


async def take_over(client: StreamClient, stream: str, group: str, dead: str, me: str,
                    min_idle_ms: int, count: int = 500) -> list[Claimed]:
    """Move up to `count` of `dead`'s pending entries to `me`. `min_idle_ms`
    makes two live claimers race safely: only the first one gets each entry."""
    rows = await client.redis.xpending_range(stream, group, min="-", max="+", count=count,
                                             consumername=dead)
    if not rows:
        return []
    delivered = {_text(r["message_id"]): int(r["times_delivered"]) for r in rows}
    ids = await client.redis.xclaim(stream, group, me, min_idle_ms, list(delivered), justid=True)
    ids = [_text(i) for i in ids]
    if not ids:
        return []
    async with client.redis.pipeline(transaction=False) as pipe:
        for entry_id in ids:
            pipe.xrange(stream, entry_id, entry_id)
        bodies = await pipe.execute()
    claimed = []
    for entry_id, body in zip(ids, bodies, strict=True):
        raw = body[0][1].get(b"m", b"") if body else b""
        claimed.append(Claimed(entry_id, raw, delivered[entry_id] + 1))
    return claimed


async def drop_consumer(client: StreamClient, stream: str, group: str, name: str) -> None:
    """Forget a dead consumer; only ever called once its pending list is empty."""
    await client.redis.xgroup_delconsumer(stream, group, name)


async def keep_own(client: StreamClient, stream: str, group: str, me: str,
                   entry_ids: list[str]) -> set[str]:
    """Reset the idle time of our in-flight entries so nobody steals them, and
    return the ones still pending (an entry missing here was lost by Redis)."""
    if not entry_ids:
        return set()
    kept = await client.redis.xclaim(stream, group, me, 0, entry_ids, justid=True)
    return {_text(i) for i in kept}


async def trim_below_pending(client: StreamClient, stream: str) -> None:
    """XTRIM MINID to the oldest entry any group still needs: its oldest
    pending entry, or the next one it has not been delivered yet."""
    floors = []
    for group in await client.redis.xinfo_groups(stream):
        name = _text(group["name"])
        floor = _text(group["last-delivered-id"])
        if int(group["pending"]):
            summary = await client.redis.xpending(stream, name)
            floor = min(floor, _text(summary["min"]), key=_id_key)
        floors.append(floor)
    if floors:
        await client.redis.xtrim(stream, minid=min(floors, key=_id_key), approximate=True)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def queue_depth(client: StreamClient, stream: str, group: str, limit: int,
                      exact: bool = False) -> int:
    """Entries not yet delivered to any consumer of `group`, exact from `limit` on
    (where it is capped at limit + 1), so `depth >= limit` is always right. Below
    it, on Redis 6 (no lag), the stream's length less the group's pending entries,
    which counts acked ones not yet trimmed too: read without fetching an entry,
    where counting them fetched every queued prompt every time. `exact`: fetch
    them (up to limit + 1) on Redis 6 too, for a count read once, not polled. A stream
    not made yet (a lane nobody used) holds none."""
    [depth] = await queue_depths(client, [stream], group, limit, exact)
    return depth


async def queue_depths(client: StreamClient, streams: list[str], group: str, limit: int,
                       exact: bool = False) -> list[int]:
    """queue_depth of each stream, their groups read in one round trip (on Redis 7,
    the only one)."""
    async with client.redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    depths = []
    for stream, groups in zip(streams, replies, strict=True):
        if isinstance(groups, ResponseError):
            if "no such key" not in str(groups).lower():
                raise groups
            depths.append(0)
        else:
            depths.append(await _depth(client, stream, groups, group, limit, exact))
    return depths


async def _depth(client: StreamClient, stream: str, groups: list[dict], group: str,
                 limit: int, exact: bool) -> int:
    for info in groups:
        if _text(info["name"]) != group:
            continue
        if info.get("lag") is not None:  # Redis 7+: the server counts it
            return int(info["lag"])
        at_most = await client.redis.xlen(stream) - int(info["pending"])
        if at_most < limit and not exact:
            return max(0, at_most)
        ms, seq = _id_key(_text(info["last-delivered-id"]))
        after = await client.redis.xrange(stream, min=f"{ms}-{seq + 1}", max="+",
                                          count=limit + 1)
        return len(after)
    return await client.redis.xlen(stream)
