"""Paged KV-cache bookkeeping (PagedAttention, Kwon et al., 2023, arXiv:2309.06180) with prefix caching.

Blocks hold `block_size` tokens. A full block is keyed by the hash of its tokens chained to the hash of the block
before it, so a key names a whole prefix; requests with a common prefix share those blocks (reference counted). A block whose last
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
holding image or video placeholders also keys on those media's content hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from reasoning_engine.engine.request import Request
from reasoning_engine.multimodal.inputs import MediaItem, media_keys


@dataclass
class Protection:
    until: float  # monotonic deadline
    origin: str  # the finished turn it keeps (a session key, or the turn's own id)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.protected: dict[int, Protection] = {}  # key -> protection
        self.protected_free: OrderedDict[int, None] = OrderedDict()  # unreferenced protected blocks, oldest first
        self._next_deadline = float("inf")
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.retention_hits = 0  # of those, tokens found in protected blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.protected_free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        total = (request.num_computed_tokens + num_tokens + self.block_size - 1) // self.block_size
        return max(0, total - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_needed(request, num_tokens) <= self.num_free_blocks

    def reads_prefix_cache(self, request: Request) -> bool:
        """Prompt logprobs need every prompt position's logits, so those requests compute their whole prompt."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None

    def match_prefix(self, request: Request) -> None:
        """Before admission: take the cached blocks of the longest computed prefix (leaving >= 1 token to run). A
        request that cannot be admitted gives them back (`free`) and looks again on its next try."""
        if not self.reads_prefix_cache(request):
            return
        tokens = request.all_token_ids
        hits: list[int] = []
        for i in range((len(tokens) - 1) // self.block_size):
            block = self.cached.get(self._block_hash(request, i, tokens))
            if block is None:
                break
            hits.append(block)
        for block in hits:
            self._take(block)
        request.block_table = hits
        request.num_computed_tokens = len(hits) * self.block_size

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
        for block in request.block_table[: request.num_cached_tokens // self.block_size]:
            protection = self.protected.get(self.block_keys[block])
            if protection is not None:
                self.retention_hits += self.block_size
                origins[protection.origin] = None
        return list(origins)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow the block table to hold num_computed_tokens + num_tokens tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(request, num_tokens)):
            queue = self.free_queue if self.free_queue else self.protected_free
            block, _ = queue.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:  # evict: the block is reused for other tokens
                del self.cached[key]
                self.protected.pop(key, None)
                self.block_keys[block] = None
            self.ref_counts[block] = 1
            request.block_table.append(block)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; the tail is freed first so shared prefixes are evicted last."""
        for block in reversed(request.block_table):
            self._release(block)
        request.block_table = []
        request.num_computed_tokens = 0

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first num_tokens tokens (drops rejected draft tokens' blocks)."""
        keep = (num_tokens + self.block_size - 1) // self.block_size
        for block in reversed(request.block_table[keep:]):
            self._release(block)
        del request.block_table[keep:]

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            key = self.block_keys[block]
            if key is None:  # nothing to hit: reuse it before evicting any cached prefix
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)
            else:
                (self.protected_free if key in self.protected else self.free_queue)[block] = None

    def protect(self, keys: list[int], until: float, origin: str) -> int:
        """Keep these cached prefix keys (a finished turn's full blocks) out of eviction until `until`, unless
        blocks run out; returns how many blocks are now protected for it."""
        count = 0
        for key in reversed(keys):  # tail first: under pressure a prefix loses its end before its start
            block = self.cached.get(key)
            if block is None:
                continue
            self.protected[key] = Protection(until, origin)
            if block in self.free_queue:
                del self.free_queue[block]
                self.protected_free[block] = None
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
            block = self.cached[key]
            if block in self.protected_free:
                del self.protected_free[block]
                self.free_queue[block] = None

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
            block = request.block_table[i]
            if self.block_keys[block] is None and key not in self.cached:
                self.block_keys[block] = key
                self.cached[key] = block

    @staticmethod
    def full_block_keys(request: Request) -> list[int]:
        """The prefix keys of the blocks the request filled (what a finished turn leaves; kept after it is freed)."""
        return list(request.block_hashes)

    def _block_hash(self, request: Request, index: int, tokens: list[int]) -> int:
        """Chained hash of block `index` of the request's tokens, memoised on the request (tokens never change)."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            hashes.append(_chain(hashes[-1] if hashes else None, tokens, len(hashes), self.block_size, request.media))
        return hashes[index]

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its `prefix_hashes`) this cache holds."""
        count = 0
        while count < len(hashes) and hashes[count] in self.cached:
            count += 1
        return count

    def reset_prefix_cache(self) -> None:
        for block, key in enumerate(self.block_keys):
            if key is not None and self.ref_counts[block] == 0:
                del self.cached[key]
                self.block_keys[block] = None
                if self.protected.pop(key, None) is not None:
                    del self.protected_free[block]
                    self.free_queue[block] = None

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            if block in self.free_queue:
                del self.free_queue[block]
            else:
                del self.protected_free[block]
        self.ref_counts[block] += 1


def _chain(previous: int | None, tokens: list[int], index: int, block_size: int,
           media: tuple[MediaItem, ...] = ()) -> int:
    start, stop = index * block_size, (index + 1) * block_size
    if media:
        return hash((previous, tuple(tokens[start:stop]), media_keys(media, start, stop)))
    return hash((previous, tuple(tokens[start:stop])))


def prefix_hashes(tokens: list[int], block_size: int, media: tuple[MediaItem, ...] = ()) -> list[int]:
    """The chained keys of a prompt's full blocks (but the last token's), as the prefix cache names them."""
    hashes: list[int] = []
    for index in range((len(tokens) - 1) // block_size):
        hashes.append(_chain(hashes[-1] if hashes else None, tokens, index, block_size, media))
    return hashes
