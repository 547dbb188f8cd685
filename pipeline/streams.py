"""Every Redis key, in the order a request travels, and the one stream client.

    {prefix}:requests          Submit       api -> group "schedulers", pulled when there is room
    {prefix}:requests:priority Submit       the same for service_tier "priority", pulled first,
    {prefix}:requests:flex     Submit       and for "flex", pulled last (Keys.lanes)
    {prefix}:control           Cancel       api -> every scheduler (fan-out, plain XREAD)
    {prefix}:tokens            TokenBatch   scheduler -> group "detokenizers", one per model step
    {prefix}:replies:{front}   ReplyBatch   detokenizer -> the one api worker owning the request
    {prefix}:alive:{role}:{id} JSON         every worker's heartbeat, short TTL
    {prefix}:workers           sorted set   the alive keys, scored by their last heartbeat:
                                            where status and /metrics find them (no SCAN)
    {prefix}:dead              DeadLetter   any worker, with the reason
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.clock import RedisClock
from pipeline.messages import FIELD, encode
from pipeline.redis_url import async_client

log = logging.getLogger("pipeline.streams")
SCHEDULERS = "schedulers"
# OpenAI's service tiers, most urgent first: each has its own requests stream (a lane),
# and schedulers pull the lanes in this order, so a request waits only behind its own
# lane and those before it
TIERS = ("priority", "default", "flex")
DETOKENIZERS = "detokenizers"
CONTROL_MAXLEN = 10_000  # fan-out stream: nobody pends on it, so a plain cap is safe
# a worker silent this long leaves Keys.workers (scored by the Redis clock)
WORKERS_KEPT_S = 3600.0


@dataclass(frozen=True)
class Keys:
    prefix: str

    @property
    def requests(self) -> str:
        """The default tier's lane (the only one before there were tiers)."""
        return f"{self.prefix}:requests"

    def lane(self, tier: str) -> str:
        return self.requests if tier == "default" else f"{self.prefix}:requests:{tier}"

    @property
    def lanes(self) -> list[str]:
        """Every tier's lane, most urgent first (TIERS)."""
        return [self.lane(tier) for tier in TIERS]

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def tokens(self) -> str:
        return f"{self.prefix}:tokens"

    def replies(self, frontend_id: str) -> str:
        return f"{self.prefix}:replies:{frontend_id}"

    def frontend_of(self, reply_to: str) -> str:
        return reply_to.removeprefix(f"{self.prefix}:replies:")

    def response(self, response_id: str) -> str:
        """A stored Responses API response (api/responses_store.py)."""
        return f"{self.prefix}:response:{response_id}"

    def alive(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}:alive:{role}:{worker_id}"

    def alive_pattern(self, role: str = "*") -> str:
        return f"{self.prefix}:alive:{role}:*"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    def admitted(self, request_id: str) -> str:
        return f"{self.prefix}:admitted:{request_id}"


Entry = tuple[str, bytes]  # (entry id, message bytes; b"" when malformed or trimmed away)


def _entries(raw: Sequence) -> list[Entry]:
    """Entries as redis-py parses them ({name: value} fields) or as they come
    off the wire (flat [name, value, ...])."""
    out = []
    for entry_id, fields in raw:
        if entry_id is None:  # Redis 6.2 reports a trimmed pending entry as nil
            continue
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append((entry_id, (fields or {}).get(FIELD, b"")))
    return out


def _streams(reply) -> list:
    """[(stream, entries)] of an XREAD or XREADGROUP reply (RESP3 off the wire: a map)."""
    return list(reply.items()) if isinstance(reply, dict) else reply or []


def group_entries(reply) -> list[Entry]:
    """An XREADGROUP reply of one stream, parsed by redis-py or raw."""
    return _entries(_streams(reply)[0][1]) if reply else []


def read_entries(reply) -> list[tuple[str, list[Entry]]]:
    """An XREAD reply, parsed by redis-py or raw."""
    return [(_text(key), _entries(raw)) for key, raw in _streams(reply)]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


# New entries of group ARGV[1] for consumer ARGV[2] from the streams in KEYS, each
# drained before the next is read, up to ARGV[2 + i] entries from the first i streams
# together: an XREADGROUP of them all would take up to its count from every one. Its
# reply has XREADGROUP's shape, [[stream, entries], ...].
_PULL_IN_ORDER = """
local taken, out = 0, {}
for i, key in ipairs(KEYS) do
    local left = tonumber(ARGV[2 + i]) - taken
    if left > 0 then
        local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left,
                                'STREAMS', key, '>')
        if read then
            out[#out + 1] = read[1]
            taken = taken + #read[1][2]
        end
    end
end
return out
"""


def pull_in_order(streams: Sequence[str], group: str, consumer: str,
                  counts: Sequence[int]) -> tuple:
    """The command (for StreamClient.transaction) that reads new entries of `streams`
    for `consumer`, the first stream's before the second's, and so on: up to
    `counts[i]` from streams 0..i together (a stream whose count the earlier ones
    used up is not read). read_entries parses its reply."""
    return ("EVAL", _PULL_IN_ORDER, len(streams), *streams, group, consumer, *counts)


def xadd(stream: str, message, *, maxlen: int | None = None, nomkstream: bool = False) -> tuple:
    """The XADD of one message, as a command for StreamClient.transaction."""
    trim = ("MAXLEN", "~", maxlen) if maxlen is not None else ()
    return ("XADD", stream, *(("NOMKSTREAM",) if nomkstream else ()), *trim, "*", FIELD,
            encode(message))


def resp(commands: Sequence[tuple]) -> bytes:
    """Commands of str, bytes and int arguments as RESP, the bytes redis-py's
    pack_commands sends for them, in ~a fifth of its time (5.5 us against 26
    for a scheduler's exchange of five)."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
            elif not isinstance(arg, bytes):
                raise TypeError(f"a Redis argument must be str, bytes or int, not {type(arg)}")
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


MAX_CONNECTIONS = 32  # a client's connections to Redis; a command takes ~0.1 ms of one
POOL_WAIT_S = 5.0  # a command waits this long for a free one, then fails as Redis down would


class StreamClient:
    """The Redis stream client every role uses. Blocking reads get their own
    connection (`reader()`), so a long BLOCK never starves XADD/XACK traffic."""

    def __init__(self, url: str, *, block_ms: int = 1000, prefix: str | None = None):
        """`prefix`: the tier's, which a Redis Cluster's client needs (its slot)."""
        self.url, self.block_ms, self.prefix = url, block_ms, prefix
        # socket timeout above the longest BLOCK: a blocked read must not look like a dead socket.
        # A burst of commands (an api submitting 256 requests at once) waits for one of
        # MAX_CONNECTIONS rather than failing: redis-py's plain pool raises "Too many
        # connections" past 100, which callers took for Redis being down and backed off.
        self.redis = async_client(
            url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S, prefix=prefix,
            socket_timeout=max(5.0, 2 * block_ms / 1000), socket_connect_timeout=5.0,
            health_check_interval=30,
        )
        self.clock = RedisClock()  # synced at each heartbeat
        self.instance = uuid.uuid4().hex[:12]  # this process's, in its liveness record

    def reader(self) -> StreamClient:
        return StreamClient(self.url, block_ms=self.block_ms, prefix=self.prefix)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            await self.redis.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def add(self, stream: str, message, *, maxlen: int | None = None) -> str:
        entry_id = await self.redis.xadd(
            stream, {FIELD: encode(message)}, maxlen=maxlen, approximate=True
        )
        return entry_id.decode()

    async def add_ack_and_read(
        self, items: Sequence[tuple[str, object]], stream: str, group: str,
        entry_ids: Sequence[str], consumer: str, *, count: int, start: str = ">",
        nomkstream: bool = False, maxlen: int | None = None,
    ) -> list[Entry]:
        """A batch's worth of entries and the ack of what they answer, in one
        MULTI/EXEC (the ack never lands without them: a write Redis refuses,
        out of memory, aborts it all), then read_group (blocking for new
        entries), in one round trip: a worker that answers entries as it
        reads them pays for one command a batch, not two (the detokenizer
        under load at 64 streams: ~0.45 ms of CPU a redis-py call). When it
        raises, what the read took stays pending: it is not lost, the caller
        finds it again by reading its own pending entries (start "0")."""
        writes = [xadd(key, message, maxlen=maxlen, nomkstream=nomkstream)
                  for key, message in items]
        if entry_ids:
            writes.append(("XACK", stream, group, *entry_ids))
        block = ("BLOCK", self.block_ms) if start == ">" else ()
        _, read = await self.transaction(writes, then=(
            "XREADGROUP", "GROUP", group, consumer, "COUNT", count, *block, "STREAMS", stream,
            start))
        return group_entries(read)

    async def transaction(self, commands: Sequence[tuple], then: tuple | None = None
                          ) -> tuple[list, object]:
        """`commands` in one MULTI/EXEC and then `then` (which may block, as
        nothing in a transaction does), in one write and one round trip,
        without redis-py's per-command work (a pipeline of four: 94 us of CPU
        against 146). Their raw replies; the first error among them is raised.
        A connection left with replies unread (an error, a cancel) is closed,
        never reused out of step; so is one to a master demoted to a replica (as
        redis_url.ReadOnlyIsLost: a lost connection)."""
        wire = [("MULTI",), *commands, ("EXEC",)] if commands else []
        if then is not None:
            wire.append(then)
        pool = self.redis.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(resp(wire))
            # one timeout for them all, not redis-py's one a reply (~6 us each)
            async with asyncio.timeout(connection.socket_timeout):
                replies = [await connection.read_response(timeout=math.inf) for _ in wire]
            if commands and any(isinstance(r, ReadOnlyError) for r in replies[len(commands) + 1]
                                or ()):  # a script's write in EXEC: a demoted master's
                raise RedisConnectionError("the server is a replica now (READONLY)")
        except BaseException as error:
            await connection.disconnect()
            if isinstance(error, TimeoutError):  # asyncio's: Redis stopped answering
                raise RedisTimeoutError(f"no reply within {connection.socket_timeout} s") \
                    from error
            raise
        finally:
            await pool.release(connection)
        results = replies[len(commands) + 1] if commands else []
        if results is None:  # nil: Redis discarded the transaction
            raise ResponseError("EXEC discarded the transaction")
        for result in results:
            if isinstance(result, ResponseError):
                raise result
        return results, replies[-1] if then is not None else None

    async def read_group(
        self, stream: str, group: str, consumer: str, *, count: int, wait: bool = True,
        start: str = ">",
    ) -> list[Entry]:
        """New entries for this consumer (`start=">"`), or its own pending ones (`"0"`)."""
        reply = await self.redis.xreadgroup(
            group, consumer, {stream: start}, count=count,
            block=self.block_ms if wait and start == ">" else None,
        )
        return group_entries(reply)

    async def read(self, streams: dict[str, str], *, count: int, wait: bool = True):
        """Plain XREAD over several streams: [(stream, [entries])]; sent as
        `transaction` sends, past redis-py's per-command work (an api reads
        its reply stream once a step: at concurrency 1, once a token)."""
        block = ("BLOCK", self.block_ms) if wait else ()
        _, reply = await self.transaction([], then=("XREAD", "COUNT", count, *block, "STREAMS",
                                                    *streams, *streams.values()))
        return read_entries(reply)

    async def last_id(self, stream: str) -> str:
        """The id of the newest entry, so a fan-out reader starts after it."""
        info = await self.redis.xrevrange(stream, count=1)
        return info[0][0].decode() if info else "0-0"

    async def heartbeat(self, key: str, info: dict, ttl_s: float, index: str) -> bool:
        """The liveness key, and its place in `index` (Keys.workers), whose members
        of over WORKERS_KEPT_S ago are dropped: the key's TTL says who is alive.
        It reads the Redis clock first, so the record's time is the tier's. True
        where the key was still there: False, after a first heartbeat, means the
        others have taken this worker for dead (SET's GET, Redis 6.2). A record
        another process wrote means two live workers share an id: an error, each
        time (pipeline.joining refuses a second one at start, unless both start
        at once)."""
        await self.clock.sync(self.redis)
        now = self.clock.now_s()
        record = info | {"at": now, "instance": self.instance,
                         "clock_offset_s": round(self.clock.offset_s, 3)}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, json.dumps(record), px=int(ttl_s * 1000), get=True)
            pipe.zadd(index, {key: now})
            pipe.zremrangebyscore(index, "-inf", now - WORKERS_KEPT_S)
            previous, *_ = await pipe.execute()
        if _instance(previous) not in (None, self.instance):
            log.error("another live worker writes %s too: each worker needs an id of its own "
                      "(--id)", key)
        return previous is not None

    async def dead_letter(self, stream: str, entry_id: str, raw: bytes, reason: str,
                          dead_key: str) -> None:
        await self.redis.xadd(
            dead_key, {"stream": stream, "id": entry_id, "reason": reason, FIELD: raw},
            maxlen=10_000, approximate=True,
        )


def _instance(record: bytes | None) -> str | None:
    """The process that wrote a liveness record, where it says."""
    try:
        found = json.loads(record) if record else None
    except ValueError:
        return None
    return found.get("instance") if isinstance(found, dict) else None
