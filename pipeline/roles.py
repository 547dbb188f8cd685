"""Run one role in this process. Torch loads only for the scheduler."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace

from pipeline.config import Config
from pipeline.models import ModelFiles, resolve_model
from pipeline.worker import run_loop

log = logging.getLogger("pipeline.roles")


def _run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]],
                      drain_timeout_s: float = 0) -> None:
    """`main(draining)`. SIGTERM sets `draining`, and `main` should finish its
    work and return within `drain_timeout_s` (it is cancelled 5 s past that);
    with no drain time, a second signal, or SIGINT, it is cancelled at once."""
    async def runner() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        draining = asyncio.Event()

        def stop() -> None:
            task.cancel()
            # a cancel that lands inside a redis-py call can be swallowed: don't hang on it
            loop.call_later(5.0, os._exit, 0)

        def drain() -> None:
            if draining.is_set() or drain_timeout_s <= 0:
                stop()
                return
            log.info("draining for up to %g s (SIGINT or SIGTERM again stops at once)",
                     drain_timeout_s)
            draining.set()
            loop.call_later(drain_timeout_s + 5.0, stop)

        loop.add_signal_handler(signal.SIGTERM, drain)
        loop.add_signal_handler(signal.SIGINT, stop)
        try:
            await main(draining)
        except asyncio.CancelledError:
            log.info("stopping on signal")

    run_loop(runner())


def run_api(config: Config, model: ModelFiles, api_workers: int) -> None:
    import uvicorn

    from pipeline.config_io import config_to_json
    from pipeline.errors import ConfigError

    if api_workers > 1 and config.api.frontend_id is not None:
        raise ConfigError("--id names one frontend; it cannot be shared by --api-workers > 1")

    # uvicorn drains on SIGTERM (--drain-timeout-s), then raises the signal again
    # once it has put back this handler: a clean exit, with the `finally` below run
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        _wait_for_redis(config.redis.url)
        _check_tier(config, model)
    except KeyboardInterrupt:  # Ctrl-C while waiting: a stop, not a crash
        return
    metrics_dir = None
    if api_workers > 1:  # each worker's metrics in files there, merged by any one's /metrics
        metrics_dir = tempfile.mkdtemp(prefix="pipeline-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client
        config = replace(config, api=replace(config.api, metrics_dir=metrics_dir))
    # uvicorn workers are fresh processes: each rebuilds the app from this variable
    os.environ["PIPELINE_CONFIG_JSON"] = config_to_json(config)
    try:
        uvicorn.run("api.app:app_from_env", factory=True, host=config.api.host,
                    port=config.api.port, workers=api_workers if api_workers > 1 else None,
                    # its records go through pipeline.logs; info: the access log's level
                    log_config=None, log_level="info" if config.api.access_log else "warning",
                    access_log=config.api.access_log,
                    timeout_graceful_shutdown=config.drain_timeout_s)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _exit_on_signal(*_) -> None:
    raise SystemExit(0)


def _wait_for_redis(url: str) -> None:
    """Until Redis answers a PING (`retrying`, as the other roles wait to join): an
    api started before its Redis (no compose healthcheck, a pod) comes up when
    Redis does. Here, before uvicorn takes SIGTERM and SIGINT: its startup ignores
    them, so a wait in the app's lifespan could not be stopped."""
    from pipeline.redis_url import async_plain
    from pipeline.worker import retrying

    async def ping() -> None:
        client = async_plain(url, socket_connect_timeout=5, socket_timeout=5)
        try:
            await retrying(client.ping, "api start")
        finally:
            await client.aclose()

    asyncio.run(ping())


def _check_tier(config: Config, model: ModelFiles) -> None:
    """pipeline.joining's checks, once, before uvicorn starts (its workers share them)."""
    from pipeline.joining import check_before_joining
    from pipeline.model_identity import identify
    from pipeline.streams import Keys, StreamClient
    from pipeline.tokenizer import Tokenizer

    async def check() -> None:
        client = StreamClient(config.redis.url, prefix=config.redis.prefix)
        try:
            await check_before_joining(
                client, Keys(config.redis.prefix), "api", config.api.frontend_id or "",
                identify(model, Tokenizer(model.path)), config.redis,
                own_id=config.api.frontend_id is not None)
        finally:
            await client.close()

    asyncio.run(check())


def run_role(role: str, config: Config, api_workers: int = 1) -> None:
    model = resolve_model(config.model)
    match role:
        case "api":
            run_api(config, model, api_workers)
        case "scheduler":
            from workers.scheduler import role as scheduler

            _run_until_signal(lambda draining: scheduler.run(config, model, draining),
                              config.drain_timeout_s)
        case "detokenizer":
            from workers import detokenizer

            _run_until_signal(lambda draining: detokenizer.run(config, model, draining),
                              config.drain_timeout_s)
