"""Paged KV-cache bookkeeping (PagedAttention, Kwon et al., 2023, arXiv:2309.06180) with prefix caching.

Blocks hold `block_size` tokens. A full block is keyed by a SHA-256 digest of its tokens chained to the key of the
block before it, so a key names a whole prefix; requests with a common prefix share those blocks (reference counted).
Keys are a cryptographic hash of an unambiguous encoding (`block_hash`), so no one can craft a prompt whose blocks take
another prompt's KV, and they are the same in every process and after a restart. A prompt's optional `cache_salt` is
mixed into its first block's key (`root_hash`), and through the chain into every later one: prompts share cached
blocks only when their salts are equal (vLLM's `cache_salt`, which keeps tenants' prefixes apart). A block whose last
user leaves goes to the back of the free queue but keeps its key, so it can still be hit until it is reused: eviction
is least-recently-freed first, and only ever of unreferenced blocks. A block freed without a key (a partly filled
tail, or one that held only rejected draft tokens) goes to the front: it holds nothing to hit, so it is reused first
(at the back, every verification step that grew a block table evicted a cached prefix while the block it gave back
sat unused).

Retention (adaptive/retention.py): the keys of a finished agent turn can be protected until a deadline. An unreferenced
protected block waits in a second queue that is evicted only once the plain free queue is empty, oldest protection
first, so protection reorders eviction and never keeps a block from a request that needs it: protected blocks count
as free. A protection past its deadline is dropped and its block rejoins the plain queue at the back, an ordinary
cached block again (at the front it was evicted before the blocks that hold nothing, so with the cache nearly empty a
finished turn's prefix was lost as soon as its hold ran out, and the adaptive server's prefix hit rate fell below
plain LRU's). A prefix hit on a protected block is a retention hit, and tells which turn it came back to. A block
holding image or video placeholders also keys on those media's content hashes and where they start.

Lower tiers (kv_tiers.py, optional): a keyed block the pool evicts is handed to the replica's `TierIndex`, which keeps
its contents in host memory (and later on disk), a protected block's hold going with it; a lookup whose device run of
hits stops at a block a lower tier holds takes free blocks for the tier's run and plans the copies back (counted as
prefix hits, and per tier).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from reasoning_engine.cache_groups import CacheGroup, num_pools, single_group
from reasoning_engine.engine.kv_events import KVEventLog
from reasoning_engine.engine.kv_tiers import TierIndex
from reasoning_engine.engine.request import Request
from reasoning_engine.multimodal.inputs import MediaItem, media_keys

MAX_CACHE_SALT_LENGTH = 256  # characters: room for a tenant id or a random token, bounded since the server takes it
ROOT_DOMAIN = b"reasoning-engine kv-prefix v1\0"  # the first block's parent: what these keys are (and their version)
_UNSALTED_ROOT = hashlib.sha256(ROOT_DOMAIN + b"\0").digest()


@dataclass
class Protection:
    until: float  # monotonic deadline
    origin: str  # the finished turn it keeps (a session key, or the turn's own id)


class BlockPool:
    """One space of block ids: their reference counts, prefix keys and free queues. The caches of the pool's groups
    hold num_blocks + 2 blocks: past the pool, the worker's padding block (num_blocks) and the null block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # table entries of blocks a sliding group gave back point here; nothing writes it and the attention
        # kernels' window masks never read it
        self.null_block = num_blocks + 1
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group a block was last allocated to (whose map holds its key)
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.protected_free: OrderedDict[int, None] = OrderedDict()  # unreferenced protected blocks, oldest first

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.protected_free)


class BlockManager:
    """One data-parallel replica's block pools (one per `CacheGroup.pool`; usually one, shared by every group). Each
    request has a block table per group (`Request.block_tables`) of ids in that group's pool; a sliding group's
    entries before its window are its pool's `null_block`. Prefix-cache keys name the same prefix in every group;
    each group keeps its own key -> block map. `ref_counts`, `block_keys`, `free_queue`, `protected_free` and
    `null_block` are pool 0's (the only pool's, for most models)."""

    def __init__(self, num_blocks: int | Sequence[int], block_size: int, enable_prefix_caching: bool = True,
                 groups: list[CacheGroup] | None = None) -> None:
        """`num_blocks`: the blocks of each pool (an int: one pool)."""
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        self.groups = groups if groups else single_group(1)
        if len(counts) != num_pools(self.groups):
            raise ValueError(f"num_blocks: one count per cache pool ({num_pools(self.groups)}), got {counts}")
        self.pools = [BlockPool(n) for n in counts]
        self.num_blocks = sum(counts)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_pool = [self.pools[g.pool] for g in self.groups]
        self.group_cached: list[dict[bytes, int]] = [{} for _ in self.groups]
        self.group_used = [0] * len(self.groups)  # referenced blocks per group
        self.protected: dict[bytes, Protection] = {}  # key -> protection
        self._next_deadline = float("inf")
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.retention_hits = 0  # of those, tokens found in protected blocks
        self.tiers: TierIndex | None = None  # host / disk tiers under group 0 (one full-attention group only)
        self.events = KVEventLog()  # what group 0 stores and evicts, for an external router (kv_events.py)

    @property
    def null_block(self) -> int:
        return self.pools[0].null_block

    @property
    def ref_counts(self) -> list[int]:
        return self.pools[0].ref_counts

    @property
    def block_keys(self) -> list[bytes | None]:
        return self.pools[0].block_keys

    @property
    def free_queue(self) -> OrderedDict[int, None]:
        return self.pools[0].free_queue

    @property
    def protected_free(self) -> OrderedDict[int, None]:
        return self.pools[0].protected_free

    def null_of(self, group: int) -> int:
        """The null block of group `group`'s pool."""
        return self.group_pool[group].null_block

    @property
    def cached(self) -> dict[bytes, int]:
        """Group 0's prefix-cache keys and their blocks (the only group's, for a model with one kind of layer)."""
        return self.group_cached[0]

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fullest pool's share in use (the one that runs out first)."""
        return max(1.0 - pool.num_free / pool.num_blocks for pool in self.pools)

    def group_usage(self) -> list[float]:
        """Per group, the fraction of its pool its requests reference."""
        return [used / pool.num_blocks for used, pool in zip(self.group_used, self.group_pool)]

    def held_blocks(self, request: Request) -> int:
        """Blocks in the request's tables (null entries left out)."""
        return sum(1 for g, table in enumerate(request.block_tables) for block in table if block != self.null_of(g))

    def _new_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Per pool, the new blocks num_computed_tokens + num_tokens tokens take."""
        total = (request.num_computed_tokens + num_tokens + self.block_size - 1) // self.block_size
        tables = request.block_tables
        needed = [0] * len(self.pools)
        for g, group in enumerate(self.groups):
            needed[group.pool] += max(0, total - (len(tables[g]) if g < len(tables) else 0))
        return needed

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks over all groups for num_computed_tokens + num_tokens tokens."""
        return sum(self._new_blocks(request, num_tokens))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return all(n <= pool.num_free for n, pool in zip(self._new_blocks(request, num_tokens), self.pools))

    def reads_prefix_cache(self, request: Request) -> bool:
        """Prompt logprobs need every prompt position's logits, so those requests compute their whole prompt."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None

    def match_prefix(self, request: Request) -> None:
        """Before admission: take the cached blocks of the longest computed prefix (leaving >= 1 token to run) that
        every group holds what it reads of: a full group every block of it, a sliding group those of its window at
        the prefix's end. A request that cannot be admitted gives them back (`free`) and looks again next try."""
        if not self.reads_prefix_cache(request):
            return
        tokens = request.all_token_ids
        bs = self.block_size
        hits = (len(tokens) - 1) // bs
        for g, group in enumerate(self.groups):  # a full group needs every block: its run of hits bounds the rest
            if group.kind == "full":
                hits = min(hits, self._hit_run(g, request, tokens, hits))
        while hits > 0 and not all(self._holds(g, request, tokens, group.first_needed_block(hits * bs, bs), hits)
                                   for g, group in enumerate(self.groups) if group.kind != "full"):
            hits -= 1
        tables = []
        for g, group in enumerate(self.groups):
            first = group.first_needed_block(hits * bs, bs)
            table = [self.null_of(g)] * first
            for i in range(first, hits):
                block = self.group_cached[g][self._block_hash(request, i, tokens)]
                self._take(g, block)
                table.append(block)
            tables.append(table)
        request.block_tables = tables
        if self.tiers is not None:
            hits = self._match_tiers(request, tokens, hits, (len(tokens) - 1) // bs)
        request.num_computed_tokens = hits * bs

    def _match_tiers(self, request: Request, tokens: list[int], hits: int, limit: int) -> int:
        """Extend a one-group prefix hit past its device run: blocks still on the device are taken; blocks a lower
        tier holds get free blocks, filled from disk now or from host memory by a planned copy before the step.
        Returns the blocks hit in all."""
        tiers, pool, cached = self.tiers, self.group_pool[0], self.group_cached[0]
        run: list[tuple[bytes, int | None]] = []  # (key, its device block, or None: in a lower tier)
        budget = pool.num_free
        for i in range(hits, limit):
            key = self._block_hash(request, i, tokens)
            block = cached.get(key)
            if block is None and not tiers.holds(key):
                break
            cost = 1 if block is None or pool.ref_counts[block] == 0 else 0
            if cost > budget:
                break
            budget -= cost
            run.append((key, block))
        if all(block is not None for _, block in run):
            return hits  # nothing below the device: the next lookup's device run reaches these
        tiers.pin([key for key, block in run if block is None and key in tiers.host])
        for _, block in run:  # device blocks first, so that taking the tier's blocks cannot evict them
            if block is not None:
                self._take(0, block)
        blocks = [block if block is not None else self._pop_free(0) for _, block in run]
        disk = [i for i, (key, block) in enumerate(run) if block is None and key not in tiers.host]
        found = tiers.read_disk([run[i][0] for i in disk], [blocks[i] for i in disk]) if disk else []
        stop = next((i for i, ok in zip(disk, found) if not ok), len(run))  # a damaged entry ends the run
        for block in reversed(blocks[stop:]):
            self._release(0, block)
        loads = [(key, block) for (key, device), block in zip(run[:stop], blocks) if device is None]
        host = [(key, block) for key, block in loads if key in tiers.host]
        for i, ((key, device), block) in enumerate(zip(run[:stop], blocks), start=hits):
            if device is None:
                pool.block_keys[block] = key
                cached[key] = block
                self.events.stored(key, request.block_hashes[i - 1] if i else None,
                                   "host" if key in tiers.host else "disk")
        request.block_tables[0].extend(blocks[:stop])
        tiers.load([key for key, _ in host], [block for _, block in host])
        tiers.unpin()
        tiers.counters.host_hit_tokens += len(host) * self.block_size
        tiers.counters.disk_hit_tokens += (len(loads) - len(host)) * self.block_size
        return hits + stop

    def _hit_run(self, group: int, request: Request, tokens: list[int], limit: int) -> int:
        """How many leading blocks of the request group `group` has cached (at most `limit`)."""
        cached = self.group_cached[group]
        count = 0
        while count < limit and self._block_hash(request, count, tokens) in cached:
            count += 1
        return count

    def _holds(self, group: int, request: Request, tokens: list[int], start: int, stop: int) -> bool:
        cached = self.group_cached[group]
        return all(self._block_hash(request, i, tokens) in cached for i in range(start, stop))

    def record_prefix_lookup(self, request: Request) -> list[str]:
        """Count a request's prompt in the hit rate once, at its first admission: the retries of a request that did
        not fit yet and its re-admissions after preemption are not new queries. Returns the finished turns whose
        protected blocks it found (retention hits)."""
        if not self.reads_prefix_cache(request):
            return []
        request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        self.prefix_queries += request.num_prompt_tokens
        self.prefix_hits += request.num_cached_tokens
        origins: dict[str, None] = {}
        pool = self.group_pool[0]
        for block in request.block_table[: request.num_cached_tokens // self.block_size]:
            protection = self.protected.get(pool.block_keys[block]) if block != pool.null_block else None
            if protection is not None:
                self.retention_hits += self.block_size
                origins[protection.origin] = None
        return list(origins)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow every group's block table to hold num_computed_tokens + num_tokens tokens (caller checked
        can_allocate)."""
        total = (request.num_computed_tokens + num_tokens + self.block_size - 1) // self.block_size
        while len(request.block_tables) < len(self.groups):
            request.block_tables.append([])
        for g, table in enumerate(request.block_tables):
            for _ in range(total - len(table)):
                table.append(self._pop_free(g))

    def _pop_free(self, group: int) -> int:
        """Take the next free block of the group's pool for it (referenced once), evicting the prefix it held (to
        the lower tiers, if any)."""
        pool = self.group_pool[group]
        block, _ = (pool.free_queue if pool.free_queue else pool.protected_free).popitem(last=False)
        key = pool.block_keys[block]
        if key is not None:  # evict: the block is reused for other tokens
            del self.group_cached[pool.block_group[block]][key]
            if pool.block_group[block] == 0:
                self.events.removed(key)
            pool.block_keys[block] = None
            protection = self.protected.get(key)
            if not any(key in cached for cached in self.group_cached):
                self.protected.pop(key, None)
            if self.tiers is not None:
                self.tiers.evicted(block, key, protection.until if protection is not None else None)
        pool.ref_counts[block] = 1
        pool.block_group[block] = group
        self.group_used[group] += 1
        return block

    def slide(self, request: Request) -> int:
        """Give back the blocks of sliding groups that no query at num_computed_tokens or later reads (their
        entries become the null block); returns how many entries were cleared. Run before each step's allocation."""
        cleared = 0
        for g, group in enumerate(self.groups):
            if group.kind == "full" or g >= len(request.block_tables):
                continue
            table, null = request.block_tables[g], self.null_of(g)
            stop = min(group.first_needed_block(request.num_computed_tokens, self.block_size), len(table))
            first = stop
            while first > 0 and table[first - 1] != null:
                first -= 1
            for i in range(first, stop):  # oldest first: under pressure the oldest cached window goes first
                self._release(g, table[i])
                table[i] = null
            cleared += stop - first
        return cleared

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; the tail is freed first so shared prefixes are evicted last."""
        for g, table in enumerate(request.block_tables):
            for block in reversed(table):
                if block != self.null_of(g):
                    self._release(g, block)
        request.block_tables = [[] for _ in self.groups]
        request.num_computed_tokens = 0

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first num_tokens tokens (drops rejected draft tokens' blocks)."""
        keep = (num_tokens + self.block_size - 1) // self.block_size
        for g, table in enumerate(request.block_tables):
            for block in reversed(table[keep:]):
                if block != self.null_of(g):
                    self._release(g, block)
            del table[keep:]

    def _release(self, group: int, block: int) -> None:
        pool = self.group_pool[group]
        pool.ref_counts[block] -= 1
        if pool.ref_counts[block] == 0:
            self.group_used[pool.block_group[block]] -= 1
            key = pool.block_keys[block]
            if key is None:  # nothing to hit: reuse it before evicting any cached prefix
                pool.free_queue[block] = None
                pool.free_queue.move_to_end(block, last=False)
            else:
                (pool.protected_free if key in self.protected else pool.free_queue)[block] = None

    def protect(self, keys: list[bytes], until: float, origin: str) -> int:
        """Keep these cached prefix keys (a finished turn's full blocks) out of eviction until `until`, unless
        blocks run out; returns how many keys are now protected for it (in any group)."""
        count = 0
        for key in reversed(keys):  # tail first: under pressure a prefix loses its end before its start
            blocks = [(pool, cached[key]) for pool, cached in zip(self.group_pool, self.group_cached) if key in cached]
            if not blocks:
                continue
            self.protected[key] = Protection(until, origin)
            for pool, block in blocks:
                if block in pool.free_queue:
                    del pool.free_queue[block]
                    pool.protected_free[block] = None
            count += 1
        self._next_deadline = min(self._next_deadline, until)
        return count

    def expire(self, now: float) -> None:
        """Drop protections past their deadline; their free blocks rejoin the plain queue as ordinary cached blocks."""
        if now < self._next_deadline:
            return
        self._next_deadline = float("inf")
        for key, protection in list(self.protected.items()):
            if protection.until > now:
                self._next_deadline = min(self._next_deadline, protection.until)
                continue
            del self.protected[key]
            for pool, cached in zip(self.group_pool, self.group_cached):
                block = cached.get(key)
                if block is not None and block in pool.protected_free:
                    del pool.protected_free[block]
                    pool.free_queue[block] = None

    def cache_full_blocks(self, request: Request, start_block: int = 0) -> None:
        """Register blocks from start_block that are now full of computed tokens, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= start_block:
            return
        tokens = request.all_token_ids
        for i in range(start_block, full):
            key = self._block_hash(request, i, tokens)
            for table, cached, pool in zip(request.block_tables, self.group_cached, self.group_pool):
                block = table[i]
                if block != pool.null_block and pool.block_keys[block] is None and key not in cached:
                    pool.block_keys[block] = key
                    cached[key] = block
                    if cached is self.group_cached[0]:
                        self.events.stored(key, request.block_hashes[i - 1] if i else None)

    @staticmethod
    def full_block_keys(request: Request) -> list[bytes]:
        """The prefix keys of the blocks the request filled (what a finished turn leaves; kept after it is freed)."""
        return list(request.block_hashes)

    def _block_hash(self, request: Request, index: int, tokens: list[int]) -> bytes:
        """Chained key of block `index` of the request's tokens, memoised on the request (tokens never change)."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            hashes.append(_chain(hashes[-1] if hashes else None, tokens, len(hashes), self.block_size, request.media,
                                 request.cache_salt))
        return hashes[index]

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its `prefix_hashes`) group 0 of this cache holds."""
        count = 0
        while count < len(hashes) and hashes[count] in self.cached:
            count += 1
        return count

    def _take(self, group: int, block: int) -> None:
        pool = self.group_pool[group]
        if pool.ref_counts[block] == 0:
            if block in pool.free_queue:
                del pool.free_queue[block]
            else:
                del pool.protected_free[block]
            self.group_used[pool.block_group[block]] += 1
        pool.ref_counts[block] += 1


def check_cache_salt(value: object) -> str | None:
    """A prompt's `cache_salt` as given (None: no salt), or ValueError naming it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"cache_salt: must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt: must be 1 to {MAX_CACHE_SALT_LENGTH} characters, got {len(value)}")
    return value


def root_hash(cache_salt: str | None) -> bytes:
    """The parent key of a prompt's first block: SHA-256 of ROOT_DOMAIN, then 0x00 without a salt, or 0x01, the
    salt's UTF-8 length (uint32 LE) and its UTF-8 bytes (a lone surrogate, which JSON can carry, kept as is)."""
    if cache_salt is None:
        return _UNSALTED_ROOT
    salt = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(ROOT_DOMAIN + b"\1" + struct.pack("<I", len(salt)) + salt).digest()


def block_hash(parent: bytes, tokens: Sequence[int], media: Sequence[tuple[str, int]] = ()) -> bytes:
    """The key of one full block: SHA-256 (32 bytes) of
        parent            32 bytes: the previous block's key, or `root_hash(cache_salt)` for the first block
        len(tokens)       uint32 LE, then each token as int64 LE
        len(media)        uint32 LE, then per item its start relative to the block (int64 LE: negative when it began
                          in an earlier block), its content hash's length (uint32 LE) and the hash (UTF-8)
    Every field has a fixed width or a length before it, so two different blocks never encode alike."""
    parts = [parent, struct.pack(f"<I{len(tokens)}qI", len(tokens), *tokens, len(media))]
    for content_hash, start in media:
        encoded = content_hash.encode()
        parts.append(struct.pack("<qI", start, len(encoded)) + encoded)
    return hashlib.sha256(b"".join(parts)).digest()


def _chain(previous: bytes | None, tokens: list[int], index: int, block_size: int,
           media: tuple[MediaItem, ...] = (), cache_salt: str | None = None) -> bytes:
    start, stop = index * block_size, (index + 1) * block_size
    parent = previous if previous is not None else root_hash(cache_salt)
    return block_hash(parent, tokens[start:stop], media_keys(media, start, stop) if media else ())


def prefix_hashes(tokens: list[int], block_size: int, media: tuple[MediaItem, ...] = (),
                  cache_salt: str | None = None) -> list[bytes]:
    """The chained keys of a prompt's full blocks (but the last token's), as the prefix cache names them."""
    hashes: list[bytes] = []
    for index in range((len(tokens) - 1) // block_size):
        hashes.append(_chain(hashes[-1] if hashes else None, tokens, index, block_size, media, cache_salt))
    return hashes

