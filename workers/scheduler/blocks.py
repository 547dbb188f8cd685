# BlockAllocator: the paged KV cache's bookkeeping. Fixed-size blocks, one
# block table per request, and prefix reuse of full blocks by chained hash.
# Torch-free; the engine owns the tensors these block ids index.

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # what the hash covers: checked on reuse


@dataclass
class Table:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain over this request's full blocks


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


class BlockAllocator:
    """Free blocks are either blank (`blank`) or hold a cached prefix
    (`cached_free`, least recently used first); both count as free, and a
    cached one is evicted only when no blank one is left."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blank: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.by_hash: dict[int, int] = {}
        self.tables: dict[str, Table] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.blank) + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id].block_ids

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached run of full blocks of `token_ids`.
        The last token is never covered: its logits must be computed."""
        found, previous, size = [], None, self.block_size
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            chunk = tuple(token_ids[start:start + size])
            previous = chain_hash(previous, chunk)
            block_id = self.by_hash.get(previous)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            found.append(block_id)
        return found

    def can_allocate(self, token_ids: list[int]) -> bool:
        hits = self.cached_prefix(token_ids)
        num_hits_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(token_ids)) - len(hits)
        return needed <= self.num_free_blocks - num_hits_free

    def allocate(self, request_id: str, token_ids: list[int]) -> int:
        """Give `request_id` blocks for all of `token_ids`; returns how many
        leading tokens already have KV in the cache (prefix reuse)."""
        assert request_id not in self.tables
        table = Table()
        for block_id in self.cached_prefix(token_ids):
            self._take(block_id)
            table.block_ids.append(block_id)
            table.hashes.append(self.blocks[block_id].block_hash)
        num_cached = len(table.block_ids) * self.block_size
        while len(table.block_ids) < self.blocks_needed(len(token_ids)):
            table.block_ids.append(self._take_blank())
        self.tables[request_id] = table
        return num_cached

    def may_append(self, request_id: str, num_tokens: int) -> bool:
        """Can the request grow to `num_tokens` tokens?"""
        missing = self.blocks_needed(num_tokens) - len(self.tables[request_id].block_ids)
        return missing <= self.num_free_blocks

    def append(self, request_id: str, num_tokens: int) -> None:
        table = self.tables[request_id]
        while len(table.block_ids) < self.blocks_needed(num_tokens):
            table.block_ids.append(self._take_blank())

    def free(self, request_id: str) -> None:
        """Release the request's blocks; hashed ones stay reusable until evicted.
        The tail goes first so the head of a prefix is evicted last."""
        table = self.tables.pop(request_id)
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self.blank.append(block_id)
            else:
                self.cached_free[block_id] = None

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publish the hashes of blocks that became full with computed KV."""
        table, size = self.tables[request_id], self.block_size
        while len(table.hashes) < num_computed // size:
            index = len(table.hashes)
            chunk = tuple(token_ids[index * size:(index + 1) * size])
            block_hash = chain_hash(table.hashes[-1] if table.hashes else None, chunk)
            table.hashes.append(block_hash)
            block = self.blocks[table.block_ids[index]]
            if block_hash not in self.by_hash and block.block_hash is None:
                block.block_hash, block.token_ids = block_hash, chunk
                self.by_hash[block_hash] = block.block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free[block_id]
        block.ref_count += 1

    def _take_blank(self) -> int:
        if self.blank:
            block_id = self.blank.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            del self.by_hash[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id
