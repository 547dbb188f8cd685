# The requests streams a scheduler pulls: one a service tier (Keys.lanes), the most
# urgent first. An entry is known by its lane and id (a Ref), which its ack names. Torch-free.

from __future__ import annotations

from pipeline.streams import SCHEDULERS, Keys, StreamClient, pull_in_order, read_entries

Ref = tuple[str, str]  # (lane, entry id)
Pulled = tuple[Ref, bytes]  # an entry read, with its message bytes


class Lanes:
    def __init__(self, keys: Keys, worker_id: str):
        self.streams = keys.lanes
        self.worker_id = worker_id

    def rank(self, lane: str) -> int:
        """0 for the most urgent tier's lane (TIERS' order)."""
        return self.streams.index(lane)

    async def join(self, client: StreamClient) -> None:
        for lane in self.streams:
            await client.ensure_group(lane, SCHEDULERS)
            await client.redis.xgroup_createconsumer(lane, SCHEDULERS, self.worker_id)

    def pull(self, room: list[int]) -> tuple:
        """The command reading new entries, lane by lane in order: up to `room[i]`
        from lanes 0..i together (Engine.can_admit)."""
        return pull_in_order(self.streams, SCHEDULERS, self.worker_id, room)

    def left(self, room: list[int], pulled: list[Pulled]) -> list[int]:
        """`room` once `pulled` are taken: each takes a place in its own lane's room
        and every less urgent one's."""
        ranks = [self.rank(lane) for (lane, _), _raw in pulled]
        return [left - sum(1 for taken in ranks if taken <= rank)
                for rank, left in enumerate(room)]

    @staticmethod
    def pulled(reply) -> list[Pulled]:
        """A `pull` reply's entries (or an XREADGROUP's of several lanes)."""
        return [((lane, entry_id), raw) for lane, entries in read_entries(reply)
                for entry_id, raw in entries]

    def acks(self, refs: list[Ref]) -> list[tuple]:
        """One XACK a lane that has any of `refs`."""
        return [("XACK", lane, SCHEDULERS, *ids) for lane in self.streams
                if (ids := [entry_id for at, entry_id in refs if at == lane])]

    async def wait_for_new(self, reader: StreamClient) -> list[Pulled]:
        """Blocks (the reader's block_ms at most) until any lane has a new entry; one
        from each lane that has one."""
        reply = await reader.redis.xreadgroup(
            SCHEDULERS, self.worker_id, dict.fromkeys(self.streams, ">"), count=1,
            block=reader.block_ms)
        return self.pulled(reply)
