# BlockAllocator: the paged KV cache's bookkeeping. Fixed-size blocks, one
# block table per request, and prefix reuse by chained hash: of whole blocks,
# shared, and of the part of a block a prompt has in common with a cached one,
# whose slots the engine copies into the request's own block (so a system prompt
# of 24 tokens is reused whole, not 16 of it). Torch-free; the engine owns the
# tensors these block ids index.

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # what the hash covers: checked on reuse
    parent: int | None = None  # the chain's hash before it (None: a first block)


@dataclass
class Table:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain over this request's full blocks
    promised: list[int] = field(default_factory=list)  # full prompt blocks it will compute


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


@dataclass(frozen=True)
class Copy:
    """The first `count` slots of cached block `source` into block `target`."""
    source: int
    target: int
    count: int


class BlockAllocator:
    """Free blocks are either blank (`blank`) or hold a cached prefix
    (`cached_free`, least recently used first); both count as free, and a
    cached one is evicted only when no blank one is left.
    `copies` are the partial reuses `allocate` granted, in order: the engine
    applies them before the next step writes any KV (`take_copies`). A source
    evicted later in the same schedule keeps its slots until that step."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blank: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.by_hash: dict[int, int] = {}
        # chain_hash(parent, a cached block's first n tokens), 0 < n < block_size: the
        # block last cached so (another with that start is lost when it is evicted)
        self.by_start: dict[int, int] = {}
        self.copies: list[Copy] = []
        # the hash of a prompt's full block that no cached block holds: the request
        # that will compute it (admitted, so its prefill is under way)
        self.promised: dict[int, str] = {}
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

    def _chain_before(self, found: list[int]) -> int | None:
        """The chain hash that the block after `found` (cached_prefix's) continues."""
        return self.blocks[found[-1]].block_hash if found else None

    def awaits_prefix(self, token_ids: list[int], found: list[int]) -> bool:
        """Whether the first full block of `token_ids` past `found` (cached_prefix's)
        is being computed for a running request: admitted once it is, the prompt
        reuses it instead of computing it again (a burst of prompts sharing a
        long prefix computes the prefix once)."""
        start, size = len(found) * self.block_size, self.block_size
        if start + size > len(token_ids) - 1:  # no full block left (the last token is run)
            return False
        block = tuple(token_ids[start:start + size])
        return chain_hash(self._chain_before(found), block) in self.promised

    def cached_start(self, token_ids: list[int], found: list[int]) -> tuple[int, int]:
        """(block id, count): the cached block whose first `count` tokens go on
        from `found` (cached_prefix's), the most such tokens; (-1, 0) if none.
        Never the last token."""
        start, previous = len(found) * self.block_size, self._chain_before(found)
        rest = tuple(token_ids[start:min(len(token_ids) - 1, start + self.block_size - 1)])
        for count in range(len(rest), 0, -1):
            block_id = self.by_start.get(chain_hash(previous, rest[:count]))
            if block_id is None:
                continue
            block = self.blocks[block_id]
            if block.parent == previous and block.token_ids[:count] == rest[:count]:
                return block_id, count
        return -1, 0

    def can_allocate(self, token_ids: list[int], hits: list[int] | None = None,
                     freeing: list[str] = ()) -> bool:
        """`hits`: cached_prefix(token_ids), where the caller has it already.
        `freeing`: as if those requests' blocks were freed first."""
        hits = self.cached_prefix(token_ids) if hits is None else hits
        num_hits_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(token_ids)) - len(hits)
        return needed <= self.num_free_blocks - num_hits_free + self._freed_by(freeing, hits)

    def _freed_by(self, request_ids: list[str], hits: list[int]) -> int:
        """Blocks that freeing `request_ids` would free, other than `hits` (a hit
        freed is one the prompt takes back, not one more for it)."""
        held: dict[int, int] = {}
        for request_id in request_ids:
            for block_id in self.tables[request_id].block_ids:
                held[block_id] = held.get(block_id, 0) + 1
        kept = set(hits)
        return sum(1 for block_id, count in held.items()
                   if count == self.blocks[block_id].ref_count and block_id not in kept)

    def allocate(self, request_id: str, token_ids: list[int],
                 found: list[int] | None = None, reuse: bool = True) -> int:
        """Give `request_id` blocks for all of `token_ids`; returns how many
        leading tokens already have KV in the cache (prefix reuse), or will have
        once its copy is applied. `found`: cached_prefix(token_ids), if known.
        `reuse` False: every token is computed (its prompt's logprobs are wanted)."""
        assert request_id not in self.tables
        table = Table()
        if not reuse:
            found = []
        found = self.cached_prefix(token_ids) if found is None else found
        for block_id in found:
            self._take(block_id)
            table.block_ids.append(block_id)
            table.hashes.append(self.blocks[block_id].block_hash)
        source, count = self.cached_start(token_ids, found) if reuse else (-1, 0)
        while len(table.block_ids) < self.blocks_needed(len(token_ids)):
            table.block_ids.append(self._take_blank())
        if count:
            self.copies.append(Copy(source, table.block_ids[len(found)], count))
        previous = self._chain_before(found)
        for start in range(len(found) * self.block_size,  # every full block it computes
                           len(token_ids) - self.block_size + 1, self.block_size):
            previous = chain_hash(previous, tuple(token_ids[start:start + self.block_size]))
            if previous not in self.promised:
                self.promised[previous] = request_id
                table.promised.append(previous)
        self.tables[request_id] = table
        return len(found) * self.block_size + count

    def take_copies(self) -> list[Copy]:
        copies, self.copies = self.copies, []
        return copies

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
        self._unpromise(request_id, table.promised)
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
            parent = table.hashes[-1] if table.hashes else None
            block_hash = chain_hash(parent, chunk)
            table.hashes.append(block_hash)
            self._unpromise(request_id, [block_hash])
            block = self.blocks[table.block_ids[index]]
            if block_hash not in self.by_hash and block.block_hash is None:
                block.block_hash, block.token_ids, block.parent = block_hash, chunk, parent
                self.by_hash[block_hash] = block.block_id
                for count in range(1, size):
                    self.by_start[chain_hash(parent, chunk[:count])] = block.block_id

    def _unpromise(self, request_id: str, hashes: list[int]) -> None:
        for block_hash in hashes:
            if self.promised.get(block_hash) == request_id:
                del self.promised[block_hash]

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
            for count in range(1, self.block_size):
                start = chain_hash(block.parent, block.token_ids[:count])
                if self.by_start.get(start) == block_id:
                    del self.by_start[start]
            block.block_hash, block.token_ids, block.parent = None, (), None
        self.blocks[block_id].ref_count = 1
        return block_id
