"""The tier's one clock: the Redis server's. Roles on different hosts compare times
(a request's deadline, set by an api and checked by a scheduler; a heartbeat's
time, read by `pipeline status`), and hosts' clocks drift or are set wrong, so each
role reads the server's TIME and keeps its own clock's offset from it."""

from __future__ import annotations

import logging
import time

from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

# a reading whose round trip took longer says little about when TIME ran
MAX_TRUSTED_RTT_S = 0.5


class RedisClock:
    """This host's clock, corrected to the Redis server's (`now_s`), after `sync`.
    Until a first reading (or where the server refuses TIME), it is this host's."""

    def __init__(self) -> None:
        self.offset_s = 0.0  # the server's clock less this host's
        self.rtt_s: float | None = None  # the round trip of the reading kept
        self.refused = False

    def now_s(self) -> float:
        return time.time() + self.offset_s

    def now_ms(self) -> int:
        return int(self.now_s() * 1000)

    async def sync(self, redis) -> None:
        """One TIME reading, its server time taken as of the round trip's midpoint
        (off by half the round trip at most). Redis errors other than a refusal
        reach the caller, as its other commands' do."""
        sent = time.time()
        try:
            seconds, microseconds = await redis.time()
        except ResponseError as error:  # an ACL or a managed Redis may refuse TIME
            if not self.refused:
                self.refused = True
                log.warning("Redis refused TIME (%s): this host's clock is used", error)
            return
        received = time.time()
        rtt_s = received - sent
        if rtt_s > MAX_TRUSTED_RTT_S and self.rtt_s is not None:
            return
        self.offset_s = seconds + microseconds / 1e6 - (sent + received) / 2
        self.rtt_s = rtt_s
