"""The detokenizer role: reads TokenBatches from {prefix}:tokens (group
"detokenizers"), turns ids into text, and writes one ReplyBatch per frontend
per batch to {prefix}:replies:{frontend_id} (NOMKSTREAM). Stateless."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import msgspec

from pipeline.config import Config
from pipeline.joining import check_before_joining
from pipeline.messages import Cancel, Delta, Failed, ReplyBatch, TokenBatch, tokens_decoder
from pipeline.model_identity import identify
from pipeline.models import ModelFiles
from pipeline.recovery import dead_consumers, drop_consumer, take_over, trim_below_pending
from pipeline.status import read_live_workers
from pipeline.streams import CONTROL_MAXLEN, DETOKENIZERS, Keys, StreamClient, xadd
from pipeline.tokenizer import Tokenizer
from pipeline.worker import (
    REDIS_DOWN,
    forever,
    heartbeat_forever,
    leave_tier,
    new_worker_id,
    retrying,
)
from workers.text import step_text

log = logging.getLogger("pipeline.detokenizer")
REPLIES_MAXLEN = 10_000  # a frontend trims what it read; this only bounds a stalled one
DRAIN_IDLE_S = 1.0  # a draining detokenizer that read nothing this long may leave


def replies_for(tokenizer: Tokenizer, batch: TokenBatch,
                fingerprint: str | None = None) -> dict[str, ReplyBatch]:
    """Group a step's outputs by the frontend that owns each request. A batch of
    another model's tokens than `fingerprint`'s fails each of its requests
    (`model_mismatch`): decoded with this vocabulary, they would be garbled text."""
    deltas: dict[str, list[Delta]] = defaultdict(list)
    failures: dict[str, list[Failed]] = defaultdict(list)
    for out in batch.outputs:
        if is_foreign(batch, fingerprint):
            failures[out.reply_to].append(Failed(
                out.request_id, out.reply_to, "model_mismatch",
                f"its scheduler runs another model (fingerprint {batch.fingerprint}) than "
                f"the detokenizer ({fingerprint}): the tier mixes models (`pipeline status`)",
                out.attempt))
            continue
        text = step_text(tokenizer, out)
        deltas[out.reply_to].append(
            Delta(out.request_id, out.offset, out.new_ids, text, out.finish, out.logprobs,
                  out.attempt, out.prompt_logprobs, out.cached_tokens)
        )
    for failure in batch.failures:
        failures[failure.reply_to].append(failure)
    return {
        reply_to: ReplyBatch(deltas=deltas.get(reply_to, []), failures=failures.get(reply_to, []))
        for reply_to in deltas.keys() | failures.keys()
    }


def is_foreign(batch: TokenBatch, fingerprint: str | None) -> bool:
    return None not in (batch.fingerprint, fingerprint) and batch.fingerprint != fingerprint


class Detokenizer:
    def __init__(self, config: Config, tokenizer: Tokenizer, fingerprint: str | None = None):
        """`fingerprint`: its model's (pipeline.model_identity)."""
        self.config = config
        self.fingerprint = fingerprint
        self.foreign_schedulers: set[str] = set()  # of another model: logged once each
        self.keys = Keys(config.redis.prefix)
        self.tokenizer = tokenizer
        self.worker_id = config.detokenizer.detokenizer_id or new_worker_id("detokenizer")
        self.client = StreamClient(config.redis.url, block_ms=config.redis.read_block_ms,
                                   prefix=config.redis.prefix)
        self.reader = self.client.reader()
        self.start = "0"  # own pending entries first (a restart under the same id), then new
        self.num_batches = 0
        self.next_upkeep = 0.0
        # the last batches' replies, and their entries to ack, sent with the next read
        self.outbox: list[tuple[str, ReplyBatch]] = []
        self.answered: list[str] = []
        self.last_batch_at = 0.0  # monotonic time of the last batch read
        self.drain_deadline: float | None = None  # set on SIGTERM: see drained
        self.schedulers_busy = True  # while draining: a live scheduler has running requests

    async def join(self) -> None:
        await self.client.ensure_group(self.keys.tokens, DETOKENIZERS)
        await self.client.redis.xgroup_createconsumer(self.keys.tokens, DETOKENIZERS,
                                                      self.worker_id)
        self.start = "0"

    def drained(self, draining: asyncio.Event) -> bool:
        """After SIGTERM, done once no live scheduler has running requests and no
        batch came for DRAIN_IDLE_S (a whole tier stopping: its schedulers finish
        theirs first, and need a detokenizer for them), or the drain time is up."""
        if not draining.is_set():
            return False
        now = time.monotonic()
        if self.drain_deadline is None:
            self.drain_deadline = now + self.config.drain_timeout_s
            self.next_upkeep = now  # look at the schedulers now
            return False
        idle = now - self.last_batch_at >= DRAIN_IDLE_S
        return now >= self.drain_deadline or (idle and not self.schedulers_busy)

    async def upkeep(self) -> None:
        """Once a heartbeat: take over dead detokenizers' batches, trim the stream;
        while draining, see whether any scheduler still makes tokens."""
        self.next_upkeep = time.monotonic() + self.config.redis.heartbeat_s
        if self.drain_deadline is not None:
            self.schedulers_busy = any(
                w.get("role") == "scheduler" and w.get("num_running")
                for w in await read_live_workers(self.client, self.keys.prefix))
        min_idle_ms = int(self.config.redis.alive_ttl_s * 1000)
        for name, pending in await dead_consumers(self.client, self.keys, self.keys.tokens,
                                                  DETOKENIZERS, "detokenizer", self.worker_id):
            if pending:
                claimed = await take_over(self.client, self.keys.tokens, DETOKENIZERS, name,
                                          self.worker_id, min_idle_ms)
                log.warning("took over %d batches of dead detokenizer %s", len(claimed), name)
                self.start = "0"  # they are ours now: read our own pending list again
            else:
                await drop_consumer(self.client, self.keys.tokens, DETOKENIZERS, name)
        await trim_below_pending(self.client, self.keys.tokens)

    async def flush(self) -> None:
        """The last batches' replies and their acks, reading nothing more (a drain)."""
        writes = [xadd(key, message, maxlen=REPLIES_MAXLEN, nomkstream=True)
                  for key, message in self.outbox]
        if self.answered:
            writes.append(("XACK", self.keys.tokens, DETOKENIZERS, *self.answered))
        if writes:
            await self.client.transaction(writes)
        self.num_batches += len(self.answered)
        self.outbox, self.answered = [], []

    async def step(self) -> None:
        """Send the last batches' replies, acked with them (one MULTI/EXEC: a
        crash before they are written must redeliver), and read the next
        batches, in one round trip; then answer those."""
        entries = await self.reader.add_ack_and_read(
            self.outbox, self.keys.tokens, DETOKENIZERS, self.answered, self.worker_id,
            count=64, start=self.start, nomkstream=True, maxlen=REPLIES_MAXLEN)
        self.num_batches += len(self.answered)
        self.outbox, self.answered = [], []
        if time.monotonic() >= self.next_upkeep:
            await self.upkeep()
        if entries:
            self.last_batch_at = time.monotonic()
        if self.start == "0" and not entries:
            self.start = ">"
            return
        for entry_id, raw in entries:
            try:
                batch = tokens_decoder.decode(raw)
            except msgspec.DecodeError as error:
                await self.client.dead_letter(self.keys.tokens, entry_id, raw, str(error),
                                              self.keys.dead_letters)
                continue
            self.outbox.extend(replies_for(self.tokenizer, batch, self.fingerprint).items())
            if is_foreign(batch, self.fingerprint):
                await self.cancel_foreign(batch)
        self.answered = [entry_id for entry_id, _ in entries]

    async def cancel_foreign(self, batch: TokenBatch) -> None:
        """Another model's scheduler runs these requests (two workers of different
        models joined an empty tier at once): it is told to stop them."""
        if batch.scheduler_id not in self.foreign_schedulers:  # once each, not each step
            self.foreign_schedulers.add(batch.scheduler_id)
            log.error("scheduler %s runs another model (fingerprint %s) than this "
                      "detokenizer (%s): its requests fail", batch.scheduler_id,
                      batch.fingerprint, self.fingerprint)
        await self.client.add(self.keys.control, Cancel([out.request_id for out in batch.outputs]),
                              maxlen=CONTROL_MAXLEN)


async def run(config: Config, model: ModelFiles, draining: asyncio.Event | None = None) -> None:
    """The detokenizer until cancelled, or until `draining` is set (SIGTERM) and its
    drain is done: then its last replies and acks go out and it leaves the tier."""
    draining = draining or asyncio.Event()
    tokenizer = Tokenizer(model.path)
    identity = identify(model, tokenizer)
    detokenizer = Detokenizer(config, tokenizer, identity.fingerprint)
    await retrying(lambda: check_before_joining(
        detokenizer.client, detokenizer.keys, "detokenizer", detokenizer.worker_id, identity,
        config.redis, own_id=config.detokenizer.detokenizer_id is not None), "detokenizer start")
    await retrying(detokenizer.join, "detokenizer join")
    log.info("detokenizer %s reading %s", detokenizer.worker_id, detokenizer.keys.tokens)
    beat = asyncio.create_task(heartbeat_forever(
        detokenizer.client, detokenizer.keys, "detokenizer", detokenizer.worker_id, config.redis,
        lambda: {"batches": detokenizer.num_batches} | identity.record()))
    try:
        await forever(detokenizer.step, "detokenizer", on_reconnect=detokenizer.join,
                      until=lambda: detokenizer.drained(draining))
        beat.cancel()
        try:
            await detokenizer.flush()
        except REDIS_DOWN as error:  # its batches are taken over after the TTL instead
            log.warning("its last replies could not be sent: %s", error)
        await leave_tier(detokenizer.client, detokenizer.keys, "detokenizer",
                         detokenizer.worker_id, [detokenizer.keys.tokens], DETOKENIZERS)
    finally:
        beat.cancel()
