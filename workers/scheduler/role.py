"""The scheduler role's process: its engine on a thread of its own, joined to the
tier, stepping until cancelled or drained (SIGTERM, pipeline.roles), then gone."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from pipeline.config import Config
from pipeline.joining import check_before_joining
from pipeline.model_identity import identify
from pipeline.models import ModelFiles
from pipeline.streams import SCHEDULERS
from pipeline.tokenizer import Tokenizer
from pipeline.worker import forever, heartbeat_forever, leave_tier, retrying
from workers.scheduler.engine import Engine
from workers.scheduler.loop import Scheduler

log = logging.getLogger("pipeline.scheduler")


async def run(config: Config, model: ModelFiles, draining: asyncio.Event | None = None) -> None:
    """The scheduler until cancelled, or until `draining` is set and its drain is done."""
    # one thread runs the engine, always the same: torch.set_num_threads holds
    # for the thread that called it only (a fresh thread gets every core)
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine = await asyncio.get_running_loop().run_in_executor(
        engine_thread, Engine, model.path, config.scheduler)
    tokenizer = Tokenizer(model.path)
    identity = identify(model, tokenizer)
    scheduler = Scheduler(config, engine, tokenizer, engine_thread, draining, identity)
    await retrying(lambda: check_before_joining(
        scheduler.client, scheduler.keys, "scheduler", scheduler.worker_id, identity, config.redis,
        own_id=config.scheduler.scheduler_id is not None), "scheduler start")
    await retrying(scheduler.join, "scheduler join")
    log.info("scheduler %s pulling %s", scheduler.worker_id, ", ".join(scheduler.lanes.streams))
    beat = asyncio.create_task(heartbeat_forever(
        scheduler.client, scheduler.keys, "scheduler", scheduler.worker_id, config.redis,
        scheduler.info))
    try:
        await forever(scheduler.step, "scheduler", on_reconnect=scheduler.join,
                      until=lambda: scheduler.drained)
        beat.cancel()
        await leave_tier(scheduler.client, scheduler.keys, "scheduler", scheduler.worker_id,
                         scheduler.lanes.streams, SCHEDULERS)
    finally:
        beat.cancel()
        if scheduler.compiling.abandoned():
            exit_now("a grammar compile past --grammar-timeout is still running")


def exit_now(why: str) -> None:
    """Exit 0 at once, without waiting for this process's threads: `why` one of them
    would hold back the exit (xgrammar's compile cannot be stopped)."""
    log.warning("exiting without waiting: %s", why)
    logging.shutdown()
    os._exit(0)
