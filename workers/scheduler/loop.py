"""The scheduler role: pulls Submits from {prefix}:requests and the other service
tiers' lanes (group "schedulers", the most urgent lane first) only when the engine has
room for them (a more urgent tier's where less urgent ones hold it: they make way),
reads Cancel/FrontendGone from {prefix}:control, and writes one TokenBatch per model
step to {prefix}:tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import msgspec

from pipeline.config import Config
from pipeline.errors import RETRY, PipelineError, RequestTimeout
from pipeline.messages import (
    Cancel,
    Failed,
    FrontendGone,
    StepOutput,
    Submit,
    TokenBatch,
    control_decoder,
    requests_decoder,
)
from pipeline.model_identity import ModelIdentity
from pipeline.recovery import (
    Claimed,
    dead_consumers,
    drop_consumer,
    gone_frontends,
    keep_own,
    take_over,
    trim_below_pending,
)
from pipeline.streams import DETOKENIZERS, SCHEDULERS, Keys, StreamClient, read_entries, xadd
from pipeline.tokenizer import Tokenizer
from pipeline.worker import new_worker_id
from workers.scheduler.checks import check_submit
from workers.scheduler.compiling import Compiles
from workers.scheduler.engine import Engine, EngineRequest, StepResult
from workers.scheduler.held import Running
from workers.scheduler.lanes import Lanes, Pulled, Ref
from workers.text import find_stop

log = logging.getLogger("pipeline.scheduler")
MAX_DEATHS = 3  # a request whose scheduler dies this many times is poison (drains aside)
ADMITTED_TTL_S = 30  # retried XADDs arrive within seconds; the keys must not pile up
PULL_EVERY_S = 0.01  # a step's reads of new requests, this far apart at least
STEP_EMA = 0.2  # weight of the last step in the average step time


class Scheduler:
    def __init__(self, config: Config, engine: Engine, tokenizer: Tokenizer,
                 engine_thread: ThreadPoolExecutor, draining: asyncio.Event | None = None,
                 identity: ModelIdentity | None = None):
        self.config = config
        self.identity = identity  # the model it runs (pipeline.model_identity)
        self.fingerprint = identity.fingerprint if identity else None
        self.engine = engine
        self.engine_thread = engine_thread
        self.tokenizer = tokenizer
        self.keys = Keys(config.redis.prefix)
        self.worker_id = config.scheduler.scheduler_id or new_worker_id("scheduler")
        self.lanes = Lanes(self.keys, self.worker_id)
        self.client = StreamClient(config.redis.url, block_ms=config.redis.read_block_ms,
                                   prefix=config.redis.prefix)
        self.reader = self.client.reader()
        self.running: dict[str, Running] = {}
        self.control_id = "$"
        self.failures: list[Failed] = []
        self.unsent: list[TokenBatch] = []
        self.to_ack: list[Ref] = []  # entries done with, acked with the tokens they wait for
        self.next_upkeep = 0.0
        self.num_expired = 0
        self.step_s = 0.0  # recent engine steps' average wall time (STEP_EMA)
        self.draining = draining or asyncio.Event()  # set on SIGTERM (pipeline.roles)
        self.drain_deadline: float | None = None
        self.drained = False
        # structured requests whose grammar is not compiled yet: the steps go on meanwhile
        self.compiling = Compiles(engine.grammars)
        self.compile_limit_s = config.scheduler.grammar_timeout_s

    async def join(self) -> None:
        await self.client.clock.sync(self.client.redis)  # deadlines are in the Redis clock
        await self.client.ensure_group(self.keys.tokens, DETOKENIZERS)
        await self.lanes.join(self.client)
        if self.control_id == "$":
            self.control_id = await self.client.last_id(self.keys.control)
        # entries we hold but do not run: we restarted under the same id, or lost them
        running = {run.entry for run in self.running.values()}
        for lane in self.lanes.streams:
            for entry in await take_over(self.client, lane, SCHEDULERS, self.worker_id,
                                         self.worker_id, 0):
                if (lane, entry.entry_id) not in running:
                    await self.turn_back(lane, entry)

    async def step(self) -> None:
        """One engine step, with this scheduler's Redis traffic done while it
        runs, in one round trip: the last step's tokens go out and new entries
        are read (they join the engine between steps, where it is safe to touch)."""
        if self.draining.is_set() and await self.drain():
            return
        if time.monotonic() >= self.next_upkeep:
            await self.upkeep()
        self.admit_compiled()
        # asked before the step: the engine is its thread's then
        # by lane: a full engine may still take a more urgent tier's requests
        room = [] if self.draining.is_set() else self.engine.can_admit()
        if not self.engine.has_work():  # idle: wait for work, nothing to overlap
            control, requests = await self.exchange(room)
            if any(room) and not requests and not self.compiling:
                requests = await self.lanes.wait_for_new(self.reader)
            await self.take(control, requests)
            if self.compiling and not requests:  # wait for a compile, a while at most
                await self.compiling.wait(PULL_EVERY_S * 5)
            return
        launched = time.perf_counter()
        running = asyncio.get_running_loop().run_in_executor(self.engine_thread,
                                                             self.engine.step)
        try:
            control, requests = await self.exchange(room)
            requests += await self.pull_while(running, self.lanes.left(room, requests))
        finally:  # never leave the engine running into the next call
            self.emit(await running)
            self.step_s += STEP_EMA * (time.perf_counter() - launched - self.step_s)
        await self.take(control, requests)

    async def drain(self) -> bool:
        """Draining (SIGTERM): no new requests; the running ones go on until they
        finish or the drain time is up, when the rest go back to their frontends
        to be resubmitted as continuations, as a dead scheduler's are (but at
        once, not a TTL later). True once that is sent: the scheduler is done."""
        now = time.monotonic()
        if self.drain_deadline is None:
            self.drain_deadline = now + self.config.drain_timeout_s
            log.info("draining: %d running requests, up to %g s", len(self.running),
                     self.config.drain_timeout_s)
        if self.running and now < self.drain_deadline:
            return False
        if self.running:
            log.warning("drain time up: %d requests go to other schedulers", len(self.running))
        for request_id, run in list(self.running.items()):
            self.engine.abort(request_id)
            self.to_ack.append(self.running.pop(request_id).entry)
            self.failures.append(Failed(request_id, run.submit.reply_to, RETRY,
                                        "its scheduler is shutting down", run.submit.attempt,
                                        died=False))
        await self.exchange()  # the last tokens, the hand-backs and every ack
        self.drained = True
        return True

    async def pull_while(self, running: asyncio.Future, room: list[int]) -> list[Pulled]:
        """Requests that arrive while the engine steps, pulled every half a
        step (the recent steps' average, PULL_EVERY_S at least) up to `room`
        (by lane, as `exchange`) while the engine has room of its own (for
        every tier: a full one takes a more urgent tier's at the next step,
        with no pulls between a full tier's steps), so that they join after
        this step, not the next: one read at the step's start left an arrival
        waiting 1.5 steps on average. Steps shorter than two such periods (a
        few decodes) are left alone: there the wait costs more than it saves."""
        taken: list[Pulled] = []
        if self.step_s < 2 * PULL_EVERY_S:
            return taken
        every = self.step_s / 2
        while room and room[-1] > 0:
            done, _ = await asyncio.wait({running}, timeout=every)
            if done:
                break
            _, read = await self.client.transaction([], then=self.lanes.pull(room))
            taken += (pulled := self.lanes.pulled(read))
            room = self.lanes.left(room, pulled)
        return taken

    async def exchange(self, room: list[int] | None = None) -> tuple[list, list[Pulled]]:
        """One round trip, in one write (StreamClient.transaction, past
        redis-py's per-command work): what earlier steps produced and
        failures since, oldest first; acks; control entries; without
        waiting, new requests: up to `room[i]` from lanes 0..i together (a
        more urgent lane may have room where the engine is full). One
        MULTI/EXEC: an entry is acked only with the tokens it waited for (a
        crash before they are on TOKENS must redeliver it; a write Redis
        refuses, out of memory, aborts it all). A batch stays queued until
        Redis took it (a lost reply means a duplicate the frontend drops)."""
        if self.failures:
            failures, self.failures = self.failures, []
            self.unsent.append(TokenBatch(self.worker_id, [], failures))
        sending, acks = len(self.unsent), list(self.to_ack)
        commands = [xadd(self.keys.tokens, batch) for batch in self.unsent]
        commands += (ack_commands := self.lanes.acks(acks))
        commands.append(("XREAD", "COUNT", 512, "STREAMS", self.keys.control, self.control_id))
        pulls = any(room or ())
        if pulls:
            commands.append(self.lanes.pull(room))
        replies, _ = await self.client.transaction(commands)
        del self.unsent[:sending]
        self.to_ack = self.to_ack[len(acks):]
        reads = replies[sending + len(ack_commands):]
        control = [entry for _stream, entries in read_entries(reads[0]) for entry in entries]
        if control:
            self.control_id = control[-1][0]
        return control, self.lanes.pulled(reads[1]) if pulls else []

    async def take(self, control: list, requests: list[Pulled]) -> None:
        for _entry_id, raw in control:
            self.on_control(raw)
        decoded = []
        for entry, raw in requests:
            try:
                decoded.append((entry, requests_decoder.decode(raw)))
            except msgspec.DecodeError as error:
                await self.client.dead_letter(*entry, raw, str(error), self.keys.dead_letters)
                self.to_ack.append(entry)
        if not decoded:
            return
        # which of them this tier sees first, all in one round trip: a burst of 64
        # arrivals took 64 in turn before the first step, with the engine idle (64 SET
        # NX on an idle host: 7.6-9.4 ms in turn, 1.2-1.4 ms in one pipeline)
        async with self.client.redis.pipeline(transaction=False) as pipe:
            for _entry_id, submit in decoded:
                pipe.set(self.keys.admitted(f"{submit.request_id}:{submit.attempt}"),
                         self.worker_id, nx=True, ex=ADMITTED_TTL_S)
            firsts = await pipe.execute()
        for (entry, submit), first in zip(decoded, firsts, strict=True):
            self.admit(entry, submit, bool(first))

    async def upkeep(self) -> None:
        """Once a heartbeat: keep our entries, drop abandoned work, rescue the dead's."""
        self.next_upkeep = time.monotonic() + self.config.redis.heartbeat_s
        kept = set()
        for lane in self.lanes.streams:
            kept |= {(lane, entry_id) for entry_id in await keep_own(
                self.client, lane, SCHEDULERS, self.worker_id,
                [run.entry[1] for run in self.running.values() if run.entry[0] == lane])}
        lost = [r for r, run in self.running.items() if run.entry not in kept]
        gone = await gone_frontends(self.client, self.keys,
                                    {run.submit.reply_to for run in self.running.values()})
        abandoned = [r for r, run in self.running.items() if run.submit.reply_to in gone]
        for request_id in set(lost) | set(abandoned):
            # lost: Redis lost the entry, so its frontend resubmits; abandoned: nobody listens
            self.engine.abort(request_id)
            self.to_ack.append(self.running.pop(request_id).entry)
        for lane in self.lanes.streams:
            await self.rescue(lane)
            await trim_below_pending(self.client, lane)

    async def rescue(self, lane: str) -> None:
        """Requests a dead scheduler held in `lane` go back to their frontends, which
        resubmit them as continuations of what their clients already saw."""
        min_idle_ms = int(self.config.redis.alive_ttl_s * 1000)
        for name, pending in await dead_consumers(self.client, self.keys, lane, SCHEDULERS,
                                                  "scheduler", self.worker_id):
            if not pending:
                await drop_consumer(self.client, lane, SCHEDULERS, name)
                continue
            claimed = await take_over(self.client, lane, SCHEDULERS, name, self.worker_id,
                                      min_idle_ms)
            for entry in claimed:
                await self.turn_back(lane, entry)
            log.warning("took over %d requests of dead scheduler %s", len(claimed), name)

    async def turn_back(self, lane: str, entry: Claimed) -> None:
        self.to_ack.append((lane, entry.entry_id))
        try:
            submit = requests_decoder.decode(entry.raw)
        except msgspec.DecodeError as error:
            await self.client.dead_letter(lane, entry.entry_id, entry.raw,
                                          f"undecodable after its scheduler died: {error}",
                                          self.keys.dead_letters)
            return
        if submit.deaths + 1 >= MAX_DEATHS:
            reason = f"{MAX_DEATHS} schedulers died running this request; not retried"
            log.warning("dead-lettered %s: %s", submit.request_id, reason,
                        extra={"request_id": submit.trace_id})
            await self.client.dead_letter(lane, entry.entry_id, entry.raw, reason,
                                          self.keys.dead_letters)
            self.failures.append(Failed(submit.request_id, submit.reply_to, "internal", reason,
                                        submit.attempt))
            return
        log.info("handed %s back to its api: its scheduler died", submit.request_id,
                 extra={"request_id": submit.trace_id})
        self.failures.append(Failed(submit.request_id, submit.reply_to, RETRY,
                                    "its scheduler died", submit.attempt))

    def on_control(self, raw: bytes) -> None:
        try:
            message = control_decoder.decode(raw)
        except msgspec.DecodeError as error:
            log.error("undecodable control entry ignored: %s", error)
            return
        match message:
            case Cancel(request_ids, None):
                doomed = [r for r in request_ids if r in self.running]
            case Cancel(request_ids, below):
                doomed = [r for r, attempt in zip(request_ids, below, strict=False)
                          if r in self.running and self.running[r].submit.attempt < attempt]
            case FrontendGone(reply_to):
                doomed = [r for r, run in self.running.items() if run.submit.reply_to == reply_to]
        for request_id in doomed:
            self.engine.abort(request_id)
            self.to_ack.append(self.running.pop(request_id).entry)

    def admit(self, entry: Ref, submit: Submit, first: bool) -> None:
        """`first`: no scheduler took this attempt before (take's SET NX)."""
        if not first:  # a retried XADD delivered it twice: run it once
            self.to_ack.append(entry)
            return
        if (old := self.running.get(submit.request_id)) is not None:
            if old.submit.attempt > submit.attempt:  # an earlier attempt's late copy
                self.to_ack.append(entry)
                return
            self.engine.abort(submit.request_id)  # a newer attempt supersedes it
            del self.running[submit.request_id]
            self.to_ack.append(old.entry)
        try:
            if submit.deadline_ms is not None and submit.deadline_ms < self.client.clock.now_ms():
                self.num_expired += 1
                raise RequestTimeout("the request expired before a scheduler could start it")
            check_submit(submit, self.tokenizer.vocab_size, self.fingerprint)
            run = Running(submit, entry, list(submit.output_ids), len(submit.output_ids))
            if self.compiling.needed(submit.sampling.structure):
                self.compiling.start(run)
            else:
                self.engine.add(self.engine_request(run))
        except PipelineError as error:
            self.refuse(submit, entry, error)
            return
        self.running[submit.request_id] = run

    def admit_compiled(self) -> None:
        """Structured requests whose grammar is ready join the engine; a refused one
        (a bad schema, a compile past `compile_limit_s`) fails back to its sender."""
        for run, error in self.compiling.done(self.compile_limit_s):
            submit = run.submit
            if self.running.get(submit.request_id) is not run:  # cancelled, or a newer attempt
                continue
            try:
                if error is not None:
                    raise error
                self.engine.add(self.engine_request(run))
            except PipelineError as refused:
                del self.running[submit.request_id]
                self.refuse(submit, run.entry, refused)

    def engine_request(self, run: Running) -> EngineRequest:
        submit = run.submit
        return EngineRequest(submit.request_id, submit.prompt_ids, list(submit.output_ids),
                             submit.sampling, rank=self.lanes.rank(run.entry[0]))

    def refuse(self, submit: Submit, entry: Ref, error: PipelineError) -> None:
        log.info("refused %s: %s", submit.request_id, error.detail,
                 extra={"request_id": submit.trace_id})
        self.failures.append(Failed(submit.request_id, submit.reply_to, error.code,
                                    error.detail, submit.attempt, param=error.param))
        self.to_ack.append(entry)

    def output_for(self, result: StepResult) -> StepOutput | None:
        run = self.running.get(result.request_id)
        if run is None or not result.new_ids:
            return None
        sampling = run.submit.sampling
        run.output_ids.extend(result.new_ids)
        run.held_logprobs.extend(result.logprobs or [])
        if result.prompt_logprobs is not None:
            run.held_prompt_logprobs = result.prompt_logprobs
        if run.cached_tokens is None:
            run.cached_tokens = result.cached_tokens
        finish, matched = result.finish, None
        if sampling.stop and len(run.output_ids) >= sampling.min_tokens:
            matched = find_stop(self.tokenizer, run.output_ids, len(result.new_ids),
                                sampling.stop, sampling.skip_special_tokens)
            if matched is not None:
                finish = "stop"
                if result.finish is None:
                    self.engine.abort(result.request_id)
        if finish is not None:
            self.to_ack.append(self.running.pop(result.request_id).entry)
        if not run.due(finish):
            return None
        return run.release(finish, matched, with_logprobs=result.logprobs is not None)

    def emit(self, results: list[StepResult]) -> None:
        """Queue a step's outputs for the next flush."""
        outputs = [out for r in results if (out := self.output_for(r)) is not None]
        if outputs:
            self.unsent.append(TokenBatch(self.worker_id, outputs, [], self.fingerprint))

    def info(self) -> dict:
        identity = self.identity.record() if self.identity else {"model": self.config.model}
        return {**identity, **self.engine.describe(),
                "num_expired": self.num_expired, "draining": self.draining.is_set()} | asdict(
            self.engine.stats())
