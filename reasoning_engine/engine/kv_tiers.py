"""Host-memory and disk tiers under the prefix cache (as vLLM's KV offloading and LMCache keep evicted prefixes).

A cached block (one named by its chained SHA-256 prefix key, kv_cache.py) that the device pool evicts is copied to a
bounded host-memory store; the host store's own LRU victims are written to a folder (one file per block, bounded
bytes) or dropped; a block evicted under retention's protection (adaptive/retention.py) keeps its deadline there and
leaves host memory only after every unprotected block. A prefix lookup that misses on the device but finds the next
blocks in a lower tier takes fresh device blocks and copies the contents back before the step, instead of recomputing
them.

Two halves. The driver's `TierIndex` (one per data-parallel replica, owned by its BlockManager) knows which keys each
tier holds, enforces the bounds and plans the copies as an ordered list of ops; every rank of the replica runs that
list on its own shard (`BlockStore`, held by each `ModelWorker`), in order, before the step's forward pass. Order is
what makes it safe: a block's contents are saved before anything writes the block, and a host entry is dropped or
spilled only after the loads planned before it have read it. A disk read is the one synchronous op (the driver must
know before admitting a request whether every rank read a sound file): it runs the pending ops first (the saves of the
blocks it is about to overwrite among them), then reads the files straight into the device blocks. While a lookup
plans its loads the host keys it reads are pinned, so the host store may hold the blocks that lookup evicted from the
device past its bound until the ops of that schedule have run (each step starts within it).

Disk files: `<dir>/<identity>/dp<replica>/<key hex>.<tp rank>.kv`, where identity is a SHA-256 over what the bytes of a
block depend on (the checkpoint's config and weight files' names and sizes, dtype, load format, block size, each cache
tensor's row shape and dtype, tensor-parallel size). A file holds a header (magic, identity, key, rank, payload length)
and the SHA-256 of header and payload, checked on read: a damaged, truncated or foreign file is skipped (a miss),
counted and deleted, never loaded. A restarted engine with the same folder indexes the files it finds (oldest first
in its LRU) and serves repeated prefixes from them.

Scope: models whose KV cache is one full-attention group (dense GQA and MLA models, with their draft models' caches,
which mirror group 0's blocks). Hybrid models' other groups (sliding windows, linear-attention state) are not tiered,
so the engine leaves the tiers off for them rather than serve a prefix some group could not read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"REKVBLK1"
_HEADER = struct.Struct("<8s32s32sIQ")  # magic, identity, key, tp rank, payload bytes; then SHA-256(header + payload)
_ALIGN = 16  # each tensor's row starts at a multiple of this in an entry, so it can be viewed in its own dtype

# op kinds, run in order by each rank's BlockStore
SAVE, LOAD, DROP, SPILL, UNLINK = "save", "load", "drop", "spill", "unlink"
TierOp = tuple  # (SAVE, block, key) | (LOAD, key, block) | (DROP, key) | (SPILL, key) | (UNLINK, key)


@dataclass
class TierCounters:
    host_hit_tokens: int = 0  # prompt tokens copied back from the host tier instead of recomputed
    disk_hit_tokens: int = 0  # prompt tokens read from the disk tier (then copied back through the host tier)
    host_stored_blocks: int = 0  # blocks copied from the device to the host tier
    disk_stored_blocks: int = 0  # blocks written from the host tier to disk
    damaged_entries: int = 0  # disk files skipped for a bad checksum, header or length


class TierIndex:
    """The driver's view of one replica's lower tiers: host keys (LRU, at most `host_blocks`), disk keys (LRU, at most
    `disk_bytes`), and the ops planned since the workers last ran them."""

    def __init__(self, host_blocks: int, disk_bytes: int = 0, file_bytes: int = 0,
                 disk_entries: Sequence[tuple[bytes, int]] = (),
                 fetch: Callable[[list[TierOp], list[bytes], list[int]], list[bool]] | None = None) -> None:
        """`file_bytes`: one block's file (rank 0's); `disk_entries`: (key, bytes) of files already on disk, oldest
        first; `fetch(ops, keys, blocks)`: run the ops, then read these keys' files into these device blocks on every
        rank; per key whether every rank read a sound file."""
        if host_blocks < 1:
            raise ValueError("kv_offload_size: the host tier must hold at least one block")
        self.host_blocks = host_blocks
        self.disk_bytes = disk_bytes
        self.file_bytes = file_bytes
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.disk: OrderedDict[bytes, int] = OrderedDict()
        self.disk_used = 0
        self.pinned: set[bytes] = set()  # host keys a lookup is loading back: not evicted until it is done
        self.held_until: dict[bytes, float] = {}  # host keys of a protected turn (retention): evicted last till then
        self.ops: list[TierOp] = []
        self.counters = TierCounters()
        self._fetch = fetch
        for key, size in disk_entries:
            self._add_disk(key, size)

    @property
    def uses_disk(self) -> bool:
        return self.disk_bytes > 0

    def take_ops(self) -> list[TierOp]:
        ops, self.ops = self.ops, []
        return ops

    def evicted(self, block: int, key: bytes, hold_until: float | None = None) -> None:
        """The device pool is reusing `block`, which held `key`: keep its contents in the host tier (`hold_until`: the
        monotonic deadline of the retention protection the block had, kept here: an agent's context waits out its
        tool call in host memory, evicted only after every unprotected host block)."""
        if hold_until is not None:
            self.held_until[key] = hold_until
        if key in self.host:
            self.host.move_to_end(key)  # the same prefix's contents are there already
            return
        self.ops.append((SAVE, block, key))
        self.host[key] = None
        self.counters.host_stored_blocks += 1
        self._trim_host()

    def holds(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def load(self, keys: list[bytes], blocks: list[int]) -> None:
        """Plan the copies of host-tier `keys` into device `blocks` (the caller took them from the free pool)."""
        for key, block in zip(keys, blocks):
            self.host.move_to_end(key)
            self.ops.append((LOAD, key, block))

    def pin(self, keys: list[bytes]) -> None:
        """Keep these host keys from eviction until `unpin`: a lookup is about to plan their loads."""
        self.pinned.update(keys)

    def read_disk(self, keys: list[bytes], blocks: list[int]) -> list[bool]:
        """Run the planned ops, then have every rank read these keys' files straight into device `blocks`; per key
        whether every rank's file was sound. A damaged entry is forgotten and counted."""
        found = self._fetch(self.take_ops(), keys, blocks)
        for key, ok in zip(keys, found):
            size = self.disk.pop(key, 0)
            if ok:
                self.disk[key] = size  # most recently used
            else:
                self.disk_used -= size
                self.counters.damaged_entries += 1
        return found

    def unpin(self) -> None:
        self.pinned.clear()
        self._trim_host()

    def _trim_host(self) -> None:
        """Evict the least recently used unpinned host keys past the bound: to disk where there is one."""
        excess = len(self.host) - self.host_blocks
        if excess <= 0:
            return
        now = time.monotonic()
        victims: list[bytes] = []
        for held in (False, True):  # least recently used first: unprotected keys, then protected ones
            for key in self.host:
                if len(victims) == excess:
                    break
                if key not in self.pinned and (self.held_until.get(key, 0.0) > now) == held:
                    victims.append(key)
        for key in victims:
            del self.host[key]
            self.held_until.pop(key, None)
            if not self.uses_disk:
                self.ops.append((DROP, key))
            elif key in self.disk:
                self.disk.move_to_end(key)
                self.ops.append((DROP, key))
            else:
                self.ops.append((SPILL, key))
                self.counters.disk_stored_blocks += 1
                self._add_disk(key, self.file_bytes)

    def _add_disk(self, key: bytes, size: int) -> None:
        self.disk[key] = size
        self.disk_used += size
        while self.disk_used > self.disk_bytes and self.disk:
            old, old_size = self.disk.popitem(last=False)
            self.disk_used -= old_size
            self.ops.append((UNLINK, old))


def model_identity(config_bytes: bytes, weight_files: Sequence[tuple[str, int]], fields: dict[str, object],
                   rows: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """SHA-256 of what a block's bytes depend on: the checkpoint (config.json, weight files' names and sizes),
    engine fields (dtype, load format, seed for random weights, block size, tensor-parallel size) and the cache rows'
    shapes and dtypes."""
    desc = {"config": hashlib.sha256(config_bytes).hexdigest(), "weights": [list(w) for w in weight_files],
            "fields": {k: str(v) for k, v in sorted(fields.items())},
            "rows": [[list(shape), str(dtype)] for shape, dtype in rows]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()


class BlockStore:
    """One rank's host-tier entries (key -> its shard of the block, every tiered cache tensor's row, one byte
    buffer) and its disk folder; runs the driver's ops in order."""

    def __init__(self, tensors: list[torch.Tensor], identity: bytes, tp_rank: int, folder: Path | None,
                 pin: bool = False) -> None:
        self.tensors = tensors
        self.identity = identity
        self.tp_rank = tp_rank
        self.folder = folder
        self.pin = pin
        self.offsets: list[int] = []
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            offset += -(-t[0].numel() * t.element_size() // _ALIGN) * _ALIGN
        self.entry_bytes = offset
        self.entries: dict[bytes, torch.Tensor] = {}
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + 32 + self.entry_bytes

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.{self.tp_rank}.kv"

    def run(self, ops: list[TierOp]) -> None:
        for op in ops:
            kind = op[0]
            if kind == SAVE:
                self.entries[op[2]] = self._read_block(op[1])
            elif kind == LOAD:
                entry = self.entries.get(op[1])
                if entry is None:
                    raise RuntimeError(f"KV host tier: block {op[1].hex()[:16]} planned for loading is not held")
                self._write_block(op[2], entry)
            elif kind == DROP:
                self.entries.pop(op[1], None)
            elif kind == SPILL:
                self._write_file(op[1], self.entries.pop(op[1]))
            elif kind == UNLINK:
                _remove(self.path(op[1]))

    def fetch(self, ops: list[TierOp], keys: list[bytes], blocks: list[int]) -> list[bool]:
        """Run `ops`, then read each key's file into its device block; per key whether the file was sound (a block
        whose file was not is left as it was)."""
        self.run(ops)
        found = []
        for key, block in zip(keys, blocks):
            entry = self._read_file(key)
            if entry is not None:
                self._write_block(block, entry)
            found.append(entry is not None)
        return found

    def _read_block(self, block: int) -> torch.Tensor:
        entry = torch.empty(self.entry_bytes, dtype=torch.uint8, pin_memory=self.pin)
        for t, offset in zip(self.tensors, self.offsets):
            row = t[block].reshape(-1).view(torch.uint8)
            entry[offset : offset + row.numel()].copy_(row)
        return entry

    def _write_block(self, block: int, entry: torch.Tensor) -> None:
        for t, offset in zip(self.tensors, self.offsets):
            row = t[block]
            size = row.numel() * row.element_size()
            row.copy_(entry[offset : offset + size].view(t.dtype).view(row.shape), non_blocking=False)

    def _write_file(self, key: bytes, entry: torch.Tensor) -> None:
        payload = entry.numpy().tobytes()
        header = _HEADER.pack(MAGIC, self.identity, key, self.tp_rank, len(payload))
        digest = hashlib.sha256(header + payload).digest()
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header + digest + payload)
            os.replace(tmp, path)
        except OSError as exc:  # a full or failing disk costs the block, not the engine: a later read is a miss
            logger.warning("KV disk tier: writing %s failed (%s); the block is dropped", path, exc)
            _remove(tmp)

    def _read_file(self, key: bytes) -> torch.Tensor | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            logger.warning("KV disk tier: %s cannot be read; treated as a miss", path)
            return None
        size = _HEADER.size
        sound = len(data) == size + 32 + self.entry_bytes
        if sound:
            magic, identity, stored_key, rank, length = _HEADER.unpack(data[:size])
            sound = (magic == MAGIC and identity == self.identity and stored_key == key and rank == self.tp_rank
                     and length == self.entry_bytes
                     and hashlib.sha256(data[:size] + data[size + 32 :]).digest() == data[size : size + 32])
        if not sound:
            logger.warning("KV disk tier: %s is damaged or from another model (checksum, header or length); "
                           "skipped and removed", path)
            _remove(path)
            return None
        return torch.frombuffer(bytearray(data[size + 32 :]), dtype=torch.uint8)


def _remove(path: Path) -> None:
    """Delete a block file if it is there; a folder that fails is logged, never raised into the step."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("KV disk tier: removing %s failed (%s)", path, exc)


def scan_disk(folder: Path, tp_rank: int = 0) -> list[tuple[bytes, int]]:
    """(key, bytes) of the block files in a replica's folder (rank `tp_rank`'s), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob(f"*.{tp_rank}.kv"):
        name = path.name.split(".")[0]
        try:
            key = bytes.fromhex(name)
            stat = path.stat()
        except (ValueError, OSError):
            continue
        if len(key) == 32:
            found.append((stat.st_mtime_ns, key, stat.st_size))
    return [(key, size) for _, key, size in sorted(found)]


def tiers_supported(groups: Sequence[object], has_linear_layers: bool) -> bool:
    """Whether the tiers cover this model's cache: one full-attention group and no linear-attention state."""
    return len(groups) == 1 and getattr(groups[0], "kind", None) == "full" and not has_linear_layers


def replica_folder(base: str | os.PathLike, identity: bytes, replica: int) -> Path:
    """Where a data-parallel replica's block files for this model identity live."""
    return Path(base) / identity.hex()[:32] / f"dp{replica}"


def all_ranks_found(results: Sequence[list[bool] | None]) -> list[bool]:
    """Per key, whether every rank of the replica (those that answered a list) read it."""
    answers = [r for r in results if r is not None]
    return [all(found) for found in zip(*answers)]
