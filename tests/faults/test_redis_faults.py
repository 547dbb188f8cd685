"""Redis misbehaving under load: connections killed, the server restarted
empty. No worker exits; every request accepted by a live frontend completes."""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from redis.exceptions import ResponseError

from pipeline.embedded_redis import redis_server_binary
from pipeline.messages import FIELD, Delta, ReplyBatch
from pipeline.streams import StreamClient
from tests.faults.clients import prompts, report, stream_many
from tests.faults.conftest import FAST_DEATH, RedisServer
from tests.harness import Tier
from tests.redis_ha import Proxy, completion_text, story


def _start(make_tier, server, **options):
    tier = make_tier(server.url, **options)
    return tier, tier.start_one_of_each()


def _during_streams(url, texts, max_tokens, fault):
    async def main():
        started = asyncio.Event()
        run = asyncio.create_task(stream_many(url, texts, max_tokens, started))
        await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        await asyncio.to_thread(fault)
        outcomes = await run
        return outcomes, time.monotonic() - t0

    return asyncio.run(main())


def test_killed_connections_are_reconnected_and_nothing_is_lost(own_redis7, make_tier):
    own_redis = own_redis7
    tier, url = _start(make_tier, own_redis)
    texts = prompts(16)
    reference = asyncio.run(stream_many(url, texts, 32))

    def kill_clients():
        for _ in range(3):
            own_redis.client().client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.3)

    got, took_s = _during_streams(url, texts, 32, kill_clients)
    figures = report("CLIENT KILL x3", reference, got, took_s=round(took_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(proc.poll() is None for proc in tier.procs)


def test_a_redis_restart_that_lost_everything_is_survived_by_resubmission(own_redis7, make_tier):
    tier, url = _start(make_tier, own_redis7)
    texts = prompts(16)
    reference = asyncio.run(stream_many(url, texts, 32))
    got, took_s = _during_streams(url, texts, 32, lambda: own_redis7.restart(down_s=1.0))
    figures = report("redis restart (data lost)", reference, got, took_s=round(took_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(proc.poll() is None for proc in tier.procs)
    # and the tier still serves new work afterwards
    again = asyncio.run(stream_many(url, texts[:4], 8))
    assert all(o.finish == "length" for o in again)


def test_a_redis_back_without_its_last_writes_is_survived_by_resubmission(own_redis7,
                                                                        make_tier):
    """Redis dies and comes back from a snapshot taken a second before (its RDB file;
    an asynchronous replica that a failover promotes is behind its master the same
    way): the submissions, tokens, replies and acks since are gone, and the groups'
    reads roll back. Each frontend sees another server (its run_id) and resubmits
    what it has in flight, so requests begun before the snapshot and after it all end
    whole. (Without that, the ones begun after it waited for --request-timeout.)"""
    tier, url = _start(make_tier, own_redis7, **{"request-timeout": "60"})
    texts = prompts(12)
    reference = asyncio.run(stream_many(url, texts, 96))

    async def main():
        started = asyncio.Event()
        before = asyncio.create_task(stream_many(url, texts[:6], 96, started))
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.to_thread(own_redis7.client().save)  # what it comes back with
        after = asyncio.create_task(stream_many(url, texts[6:], 96))
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        await asyncio.to_thread(own_redis7.restart, 0.5)
        return [*await before, *await after], time.monotonic() - t0

    got, took_s = asyncio.run(main())
    figures = report("redis back from a snapshot (last writes lost)", reference, got,
                     took_s=round(took_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0, [o.error for o in got]
    assert all(proc.poll() is None for proc in tier.procs)
    scraped = httpx.get(f"{url}/metrics", timeout=10).text
    assert "pipeline_redis_server_changes_total 1.0" in scraped


def test_a_failover_behind_one_address_is_followed_by_every_role(tmp_path):
    """A managed Redis's failover, one endpoint whose name moves to the promoted
    replica (here a proxy): the old master is a replica now, so the connections still
    open to it are refused writes (READONLY) while new ones reach the new master.
    Every role takes READONLY for a lost connection and reconnects; a long request in
    flight ends with its undisturbed text."""
    binary = shutil.which("redis-server") or str(redis_server_binary())
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = RedisServer(binary, tmp_path / "old"), RedisServer(binary, tmp_path / "new")
    old.start()
    new.start()
    try:
        new.client().replicaof("127.0.0.1", old.port)
        deadline = time.monotonic() + 30
        while new.client().info("replication")["master_link_status"] != "up":
            assert time.monotonic() < deadline, "the replica did not catch up"
            time.sleep(0.1)
        with Proxy(old.port) as endpoint, ThreadPoolExecutor(1) as pool:
            tier = Tier(f"redis://127.0.0.1:{endpoint.port}/0", "fault-endpoint", tmp_path,
                        **FAST_DEATH)
            try:
                url = tier.start_one_of_each()
                before, undisturbed = completion_text(url), story(url)
                in_flight = pool.submit(story, url)
                time.sleep(1.0)
                assert not in_flight.done()
                new.client().replicaof("NO", "ONE")  # promoted
                old.client().replicaof("127.0.0.1", new.port)  # and the old master demoted
                endpoint.point_at(new.port)
                assert in_flight.result(timeout=120) == undisturbed
                assert completion_text(url) == before
                assert all(proc.poll() is None for proc in tier.procs)
            finally:
                tier.stop()  # before its Redis and the endpoint go
    finally:
        old.stop()
        new.stop()


@pytest.fixture
def unstarted_redis(tmp_path):
    """A Redis the test starts itself (stopped after the tiers on it)."""
    server = RedisServer(shutil.which("redis-server") or str(redis_server_binary()), tmp_path)
    yield server
    server.stop()


def test_every_role_started_before_its_redis_waits_for_it_then_serves(unstarted_redis,
                                                                      make_tier):
    """A tier whose Redis comes up last (no compose healthcheck, pods in any order):
    no worker exits while it waits, and all of them serve once it answers."""
    tier = make_tier(unstarted_redis.url)
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api()
    time.sleep(4)  # each has tried Redis and been refused a few times
    assert all(proc.poll() is None for proc in tier.procs)
    unstarted_redis.start()
    tier.wait_ready()
    got = asyncio.run(stream_many(url, prompts(2), 8))
    assert [o.finish for o in got] == ["length", "length"]


def test_a_batch_redis_refuses_for_memory_acks_nothing(own_redis7):
    """Replies and the ack of what they answer go in one MULTI/EXEC: when
    Redis refuses the writes (out of memory), the entry stays pending, so it
    is answered again once Redis has room, and nothing is lost."""
    async def main():
        client = StreamClient(own_redis7.url, block_ms=50)
        try:
            await client.ensure_group("tokens", "g")
            await client.redis.xadd("replies", {"hello": "x"})
            entry = (await client.redis.xadd("tokens", {FIELD: b"batch"})).decode()
            assert await client.add_ack_and_read([], "tokens", "g", [], "c", count=10) == [
                (entry, b"batch")]
            reply = ReplyBatch(deltas=[Delta("r", 0, [1], "a", None, None, 0)], failures=[])
            await client.redis.config_set("maxmemory", 1)  # every write refused
            with pytest.raises(ResponseError, match="maxmemory"):
                await client.add_ack_and_read([("replies", reply)], "tokens", "g", [entry], "c",
                                              count=10, nomkstream=True)
            await client.redis.config_set("maxmemory", 0)
            assert (await client.redis.xpending("tokens", "g"))["pending"] == 1
            assert await client.redis.xlen("replies") == 1  # only the hello
            await client.add_ack_and_read([("replies", reply)], "tokens", "g", [entry], "c",
                                          count=10, nomkstream=True)
            assert (await client.redis.xpending("tokens", "g"))["pending"] == 0
            assert await client.redis.xlen("replies") == 2
        finally:
            await client.close()

    asyncio.run(main())
