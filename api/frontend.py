"""The api worker's side of the wire: submits to {prefix}:requests, reads its
own {prefix}:replies:{frontend_id}, and hands each request its deltas in
order, exactly once. One `RequestState` per in-flight request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from redis.exceptions import ResponseError

from api.metrics import Metrics
from pipeline import logs
from pipeline.config import ApiConfig, RedisConfig
from pipeline.errors import RETRY, Overloaded, PipelineError, RequestTimeout, error_from_code
from pipeline.messages import (
    Cancel,
    Delta,
    Failed,
    FrontendGone,
    Sampling,
    Submit,
    replies_decoder,
)
from pipeline.model_identity import ModelIdentity
from pipeline.recovery import queue_depths
from pipeline.streams import CONTROL_MAXLEN, SCHEDULERS, TIERS, Keys, StreamClient
from pipeline.worker import retrying

log = logging.getLogger("pipeline.api")
EXPIRED = object()  # a request's deadline, as an event in its queue


@dataclass
class RequestState:
    submit: Submit
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    early: dict[int, Delta] = field(default_factory=dict)  # deltas that arrived before a gap filled
    finished: bool = False

    def accept(self, delta: Delta) -> list[Delta]:
        """Deltas now deliverable, in order; duplicates and stale attempts dropped."""
        if delta.attempt != self.submit.attempt or delta.offset < len(self.output_ids):
            return []
        self.early[delta.offset] = delta
        ready = []
        while (nxt := self.early.pop(len(self.output_ids), None)) is not None:
            self.output_ids.extend(nxt.token_ids)
            ready.append(nxt)
            if nxt.finish is not None:
                self.finished = True
                self.early.clear()
                break
        return ready


class Frontend:
    def __init__(self, redis_config: RedisConfig, config: ApiConfig,
                 metrics: Metrics | None = None, identity: ModelIdentity | None = None):
        """`identity`: the model this api tokenizes for, named in its liveness record
        and in each Submit (pipeline.model_identity)."""
        self.config = config
        self.identity = identity
        self.metrics = metrics or Metrics()
        self.redis_config = redis_config
        self.keys = Keys(redis_config.prefix)
        self.frontend_id = config.frontend_id or uuid.uuid4().hex[:12]
        self.reply_to = self.keys.replies(self.frontend_id)
        self.client = StreamClient(redis_config.url, block_ms=redis_config.read_block_ms,
                                   prefix=redis_config.prefix)
        self.states: dict[str, RequestState] = {}
        self._tasks: list[asyncio.Task] = []
        # unadmitted requests tier-wide in each lane (recovery.queue_depth), TIERS' order
        self.queue_depths = [0] * len(TIERS)
        self.num_resubmits = 0
        self.last_reply_id = "0-0"
        self.redis_run_id: str | None = None  # the server we talk to (_server_changed)
        self.joined = False  # a first heartbeat went through: its key exists since

    async def start(self) -> None:
        # the reply stream exists before any request names it: detokenizers
        # write with NOMKSTREAM, so a dead frontend's stream is never recreated
        await self.client.redis.xadd(self.reply_to, {"hello": self.frontend_id})
        await self._refresh_liveness()
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="replies"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._watch_queue(), name="queue"),
        ]

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop within `timeout_s` whatever Redis does; tell schedulers we are gone."""
        # cancel until done: redis-py 8 can let a cancelled command finish and swallow the
        # CancelledError, so a single cancel() can leave a `while True` loop running
        deadline = time.monotonic() + timeout_s
        tasks = list(self._tasks)
        while (pending := [t for t in tasks if not t.done()]) and time.monotonic() < deadline:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.1)
        if pending:
            log.warning("%d background tasks did not stop in time", len(pending))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._say_goodbye(), max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), 1.0)

    async def _say_goodbye(self) -> None:
        await self.client.add(self.keys.control, FrontendGone(self.reply_to),
                              maxlen=CONTROL_MAXLEN)
        alive = self.keys.alive("api", self.frontend_id)
        await self.client.redis.delete(self.reply_to, alive)
        await self.client.redis.zrem(self.keys.workers, alive)

    async def generate(
        self, prompt_ids: list[int], sampling: Sampling, request_id: str | None = None,
        timeout_s: float | None = None, stream_interval: int = 1,
        service_tier: str = "default", counted: bool = True,
    ) -> AsyncIterator[Delta]:
        """Submit one request and yield its deltas, as `stream_interval` gathers them
        (Submit's field: the first token, then N at a time; 0: one delta when it
        finishes); raises the request's error, or
        RequestTimeout once `timeout_s` (default: the config's) has passed.
        The deadline arrives as an event in the request's queue, not as a
        cancellation, so a caller may iterate this in its own task, suspended
        anywhere between deltas (a streaming response writing to its client).
        `service_tier` (TIERS) picks its lane: it waits behind that lane's requests and
        the more urgent lanes' only, which alone count toward max_queued_requests.
        `counted` False keeps a probe out of the metrics."""
        ahead = sum(self.queue_depths[:TIERS.index(service_tier) + 1])
        if ahead >= self.config.max_queued_requests:
            raise Overloaded(f"{ahead} requests are waiting for a scheduler; retry shortly")
        request_id = request_id or uuid.uuid4().hex
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        deadline_ms = int((self.client.clock.now_s() + timeout_s) * 1000)  # the tier's clock
        submit = Submit(request_id=request_id, reply_to=self.reply_to, prompt_ids=prompt_ids,
                        sampling=sampling, deadline_ms=deadline_ms,
                        stream_interval=stream_interval, service_tier=service_tier,
                        trace_id=logs.REQUEST_ID.get(),
                        fingerprint=self.identity.fingerprint if self.identity else None)
        state = RequestState(submit)
        self.states[request_id] = state
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(timeout_s, state.events.put_nowait, EXPIRED)
        generation = self.metrics.generation(len(prompt_ids), stream_interval != 0, service_tier,
                                             counted)
        outcome = "cancelled"  # unless it ends otherwise: the caller stopped reading
        try:
            async with asyncio.timeout_at(loop.time() + timeout_s):  # Redis down: no end
                # state.submit: a failover meanwhile may have made it a later attempt
                await retrying(lambda: self.client.add(self.keys.lane(service_tier),
                                                       state.submit), "submit")
            while True:
                event = await state.events.get()
                if event is EXPIRED:
                    raise TimeoutError
                if isinstance(event, Failed):
                    raise error_from_code(event.code, event.detail, event.param)
                generation.delta(len(event.token_ids))
                outcome = event.finish or outcome
                yield event
                if event.finish is not None:
                    return
        except TimeoutError:  # the submit's or the answer's
            outcome = RequestTimeout.code
            raise RequestTimeout(f"no answer within {timeout_s:g} s") from None
        except PipelineError as error:
            outcome = error.code
            raise
        finally:
            generation.end(outcome)
            expiry.cancel()
            del self.states[request_id]
            if not state.finished:  # in a task of our own: the caller may be cancelled
                self._spawn(self._cancel(request_id))

    async def _cancel(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.client.add(self.keys.control, Cancel([request_id]),
                                  maxlen=CONTROL_MAXLEN)

    async def _read_replies(self) -> None:
        reader = self.client.reader()
        try:
            while True:
                try:
                    batches = await reader.read({self.reply_to: self.last_reply_id}, count=256)
                except Exception as error:
                    log.warning("reply read failed (%s); retrying", error)
                    await asyncio.sleep(0.5)
                    continue
                for _stream, entries in batches:
                    for entry_id, raw in entries:
                        self.last_reply_id = entry_id
                        if raw:
                            self._dispatch(raw)
        finally:
            await reader.close()

    def _dispatch(self, raw: bytes) -> None:
        try:
            batch = replies_decoder.decode(raw)
        except Exception as error:
            log.error("undecodable reply entry dropped: %s", error)
            return
        for failure in batch.failures:
            state = self.states.get(failure.request_id)
            if state is None or failure.attempt != state.submit.attempt:
                continue
            if failure.code == RETRY:
                self._spawn(self._resubmit(state, died=failure.died))
            else:
                state.finished = True
                state.events.put_nowait(failure)
        for delta in batch.deltas:
            state = self.states.get(delta.request_id)
            if state is not None:
                for ready in state.accept(delta):
                    state.events.put_nowait(ready)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _resubmit(self, state: RequestState, died: bool = False) -> None:
        """Run a request again as a continuation: the new attempt starts after
        the tokens this client already has, so nothing is repeated or contradicted.
        `died`: its scheduler died running it (counted toward the poison limit)."""
        state.submit = msgspec.structs.replace(state.submit, attempt=state.submit.attempt + 1,
                                               deaths=state.submit.deaths + died,
                                               output_ids=list(state.output_ids))
        state.early.clear()
        self.num_resubmits += 1
        self.metrics.resubmits.inc()
        await retrying(lambda: self.client.add(self.keys.lane(state.submit.service_tier),
                                               state.submit), "resubmit")

    async def _refresh_liveness(self) -> None:
        """The heartbeat; and where the requests in flight may have been dropped since
        the last one, each resubmitted as a continuation (`_resubmit_all`)."""
        ttl_s = self.redis_config.alive_ttl_s
        info = {"role": "api", "id": self.frontend_id, "in_flight": len(self.states),
                "reply_to": self.reply_to, "stream_interval": self.config.stream_interval,
                **(self.identity.record() if self.identity else {})}
        was_alive = await self.client.heartbeat(self.keys.alive("api", self.frontend_id), info,
                                                ttl_s, self.keys.workers)
        why = await self._server_changed()
        if not was_alive and self.joined and why is None:
            # stalled or cut off from Redis past the TTL: the schedulers took this api
            # for dead and dropped its requests (recovery.gone_frontends)
            why = "its liveness key had lapsed, so schedulers dropped its requests"
        self.joined = True
        # a dead frontend's reply stream expires by itself
        if not await self.client.redis.pexpire(self.reply_to, int(ttl_s * 1000) * 6):
            log.warning("reply stream %s is gone (Redis lost its data); recreating it",
                        self.reply_to)
            await self.client.redis.xadd(self.reply_to, {"hello": self.frontend_id})
            self.last_reply_id = "0-0"
            why = why or "its reply stream was gone"  # its replies may be gone
        elif self.last_reply_id != "0-0":  # what we have read, nobody needs again
            await self.client.redis.xtrim(self.reply_to, minid=self.last_reply_id,
                                          approximate=True)
        if why is not None:
            await self._resubmit_all(why)

    async def _server_changed(self) -> str | None:
        """Why the requests in flight may be lost, where the Redis we talk to is
        another server than at the last heartbeat (its run_id: a replica promoted by a
        failover, or a restart). Its replication is asynchronous, so the last writes
        before it may be lost: a request's submission, tokens or replies, which nobody
        would ever write again. A continuation of each, past what its client has,
        loses nothing; the earlier attempts are cancelled (`Cancel.below`)."""
        try:
            run_id = (await self.client.redis.info("server")).get("run_id")
        except ResponseError as error:  # a managed Redis may refuse INFO: no watch then
            log.debug("INFO refused (%s): failovers not watched", error)
            run_id = None
        changed = None not in (run_id, self.redis_run_id) and run_id != self.redis_run_id
        self.redis_run_id = run_id
        if not changed:
            return None
        self.metrics.redis_changes.inc()
        return "Redis is another server now (a failover or a restart)"

    async def _resubmit_all(self, why: str) -> None:
        in_flight = [state for state in self.states.values() if not state.finished]
        log.warning("%s; resubmitting %d requests in flight", why, len(in_flight))
        for state in in_flight:
            await self._resubmit(state)
        if in_flight:  # another scheduler may still run an earlier attempt: stop it
            await self.client.add(self.keys.control, Cancel(
                [state.submit.request_id for state in in_flight],
                [state.submit.attempt for state in in_flight]), maxlen=CONTROL_MAXLEN)

    async def _watch_queue(self) -> None:
        while True:
            try:
                self.queue_depths = await queue_depths(self.client, self.keys.lanes, SCHEDULERS,
                                                       self.config.max_queued_requests)
            except Exception as error:
                log.debug("queue depth unavailable: %s", error)
            await asyncio.sleep(0.2)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.redis_config.heartbeat_s)
            try:
                await self._refresh_liveness()
            except Exception as error:
                log.warning("heartbeat failed: %s", error)
