"""What a worker checks before it joins a tier, each role the same: that the tier
runs its model (pipeline.model_identity), that no live worker has its `--id`, and
whether Redis may evict the tier's keys (pipeline.eviction, a warning)."""

from __future__ import annotations

import asyncio
import time

from pipeline.config import RedisConfig
from pipeline.errors import ConfigError
from pipeline.eviction import warn_if_evicting
from pipeline.model_identity import ModelIdentity, check_tier_model
from pipeline.streams import Keys, StreamClient


async def check_before_joining(client: StreamClient, keys: Keys, role: str, worker_id: str,
                               identity: ModelIdentity, config: RedisConfig,
                               own_id: bool) -> None:
    """ConfigError where this worker must not join; `own_id`: its id was given."""
    await check_tier_model(client, keys.prefix, identity, role)
    if own_id:
        await claim_id(client, keys, role, worker_id, config)
    await warn_if_evicting(client.redis)


async def claim_id(client: StreamClient, keys: Keys, role: str, worker_id: str,
                   config: RedisConfig) -> None:
    """For a worker given its id (`--id`): where a record under that id is live, wait
    for it to expire (this worker restarted under its id, before its old record's
    TTL ran out); a record refreshed meanwhile is another live worker under the same
    id, a ConfigError: two consumers of one name take each other's entries for their
    own, and two apis of one id read each other's replies."""
    key = keys.alive(role, worker_id)
    first = await client.redis.get(key)
    deadline = time.monotonic() + config.alive_ttl_s + config.heartbeat_s
    while first is not None and time.monotonic() < deadline:
        await asyncio.sleep(config.heartbeat_s / 4)
        now = await client.redis.get(key)
        if now is None:
            return
        if now != first:
            raise ConfigError(f"a live {role} already has the id {worker_id!r} (its heartbeat "
                              f"goes on): each worker needs an id of its own (--id, "
                              f"PIPELINE_WORKER_ID; without it, a fresh one is drawn)")
