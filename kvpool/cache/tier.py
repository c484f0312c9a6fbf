"""The second KV tier: cached blocks kept after the pool evicts them, on disk or in host
memory, found again by the same prefix and loaded instead of recomputed.

What a tier holds is the bytes of one pool block (every layer's K and V rows of its
slots, as ``PagedKVStore.read_block`` gives them) under the block's *prefix digest*: a
128-bit BLAKE2b chain over every block up to it, ``d_i = H(d_{i-1}, salt_i, tokens_i)``.
The digest names the whole prefix (a different earlier token, or another tenant's salt,
gives another digest), and, unlike the pool's 64-bit keys, it is collision resistant, so
an entry can be trusted across processes and restarts; on the way back the entry's own
salt and tokens are compared with the caller's as well, token by token, and the bytes
with their checksum.

Disk layout (``DiskTier``), one directory per identity (model file, compute dtype,
geometry, KV dtype, block size; a tier written for another model is ignored, with a
warning, never loaded):

    DIR/<identity digest>/tier.json        the identity, readable
    DIR/<identity digest>/pins.json        pinned prefixes, pinned again on start
    DIR/<identity digest>/blocks/<digest>.kvb

A block file is ``MAGIC | digest (16) | salt length (u16) | salt | token count (u32) |
tokens (u32 each) | payload length (u64) | payload | BLAKE2b-128 of all before it``,
written to a temporary name and renamed, so a file under its final name was written
whole; a file damaged later (a torn write the file system let through, a flipped byte,
a full disk) fails its checksum on the way back and is deleted, never served.

Writes are write-behind: ``put`` hands the bytes to a writer thread and returns; when
the writer falls behind by ``max_pending_bytes`` further blocks are dropped (counted),
never waited for. The tier keeps its own LRU order (a hit moves an entry to the back;
file times carry the order across restarts) and never holds more than its capacity.

Pure Python: no torch (the engine copies bytes in and out of the pool).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("kvpool.tier")

MAGIC = b"KVPBLK01"
DIGEST_BYTES = 16
ROOT_DIGEST = b"\x00" * DIGEST_BYTES  # the parent of a first block
_HEAD = struct.Struct("<H")  # salt length
_COUNT = struct.Struct("<I")  # token count
_PAYLOAD = struct.Struct("<Q")  # payload length
Payload = bytes | memoryview  # a block's bytes


def prefix_digest(parent: bytes, salt: bytes, token_ids: Sequence[int]) -> bytes:
    """The digest of a block whose prefix (every block before it) has digest
    ``parent`` (``ROOT_DIGEST`` for a first block)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(parent)
    h.update(len(salt).to_bytes(2, "little"))
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


@dataclass(frozen=True)
class TierIdentity:
    """What a tier's blocks are valid for: the same model file computed the same way
    into blocks of the same shape."""

    model: str  # digest of the model file (size and sampled contents)
    compute_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    block_bytes: int

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()


def file_identity(path: str | os.PathLike[str], sample: int = 4 << 20) -> str:
    """A digest of a model file: its size and its first and last ``sample`` bytes (a
    GGUF file's header and tensor table are at its start; any re-quantization changes
    its size or its data). Reads at most 8 MiB."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(sample))
        if size > 2 * sample:
            f.seek(size - sample)
        h.update(f.read(sample))
    return h.hexdigest()


@dataclass
class TierStats:
    kind: str  # "disk" or "memory"
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hit_blocks: int = 0  # blocks loaded into the pool instead of computed
    hit_tokens: int = 0  # the prompt tokens those blocks hold
    loads: int = 0  # fetches that returned verified bytes
    load_seconds: float = 0.0
    writes: int = 0  # blocks written (or kept, in memory)
    dropped_writes: int = 0  # blocks not written: the writer was too far behind
    refused: int = 0  # entries whose bytes or tokens did not verify (deleted)
    evictions: int = 0  # entries removed for room


def _header(digest: bytes, salt: bytes, tokens: Sequence[int], size: int) -> bytes:
    return b"".join(
        (
            MAGIC,
            digest,
            _HEAD.pack(len(salt)),
            salt,
            _COUNT.pack(len(tokens)),
            struct.pack(f"<{len(tokens)}I", *tokens),
            _PAYLOAD.pack(size),
        )
    )


def encode_block(digest: bytes, salt: bytes, tokens: Sequence[int], payload: Payload) -> bytes:
    """A block file's bytes (see the module docstring)."""
    body = _header(digest, salt, tokens, len(payload)) + bytes(payload)
    return body + hashlib.blake2b(body, digest_size=16).digest()


def decode_block(data: bytes) -> tuple[bytes, bytes, list[int], Payload] | None:
    """``(digest, salt, tokens, payload)`` of a whole block file, or None when it is
    not one (wrong magic, lengths or checksum)."""
    if len(data) < len(MAGIC) + DIGEST_BYTES + 16 or not data.startswith(MAGIC):
        return None
    body, checksum = data[:-16], data[-16:]
    if hashlib.blake2b(body, digest_size=16).digest() != checksum:
        return None
    try:
        at = len(MAGIC)
        digest = body[at : at + DIGEST_BYTES]
        at += DIGEST_BYTES
        (salt_len,) = _HEAD.unpack_from(body, at)
        at += _HEAD.size
        salt = body[at : at + salt_len]
        at += salt_len
        (count,) = _COUNT.unpack_from(body, at)
        at += _COUNT.size
        tokens = list(struct.unpack_from(f"<{count}I", body, at))
        at += 4 * count
        (size,) = _PAYLOAD.unpack_from(body, at)
        at += _PAYLOAD.size
    except struct.error:
        return None
    if len(body) - at != size:
        return None
    return digest, salt, tokens, memoryview(data)[at : at + size]  # (no copy)


class KVTier:
    """The interface the engine uses; ``MemoryTier`` and ``DiskTier`` implement it.

    Thread safety: the engine's thread calls everything; a ``DiskTier``'s writer thread
    shares the index under a lock."""

    kind = "tier"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if capacity_bytes < block_bytes:
            raise ValueError(
                f"a KV tier of {capacity_bytes} bytes holds no block of {block_bytes} bytes"
            )
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # digest -> stored bytes
        self._bytes = 0
        self.stats_ = TierStats(self.kind, capacity_bytes=capacity_bytes)

    # -- the engine's calls ------------------------------------------------------------
    def contains(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._entries

    def fetch(self, digest: bytes, salt: bytes, tokens: Sequence[int]) -> Payload | None:
        """The block's bytes, verified (checksum, digest, salt, tokens, size), or None
        (a miss, or an entry that did not verify: then it is deleted and counted)."""
        start = time.perf_counter()
        with self._lock:
            if digest not in self._entries:
                return None
            self._entries.move_to_end(digest)
        found = self._read(digest)
        ok = (
            found is not None
            and found[0] == digest
            and found[1] == salt
            and found[2] == list(tokens)
            and len(found[3]) == self.block_bytes
        )
        if not ok:
            self.stats_.refused += 1
            log.warning("KV tier: block %s did not verify; deleted, not served", digest.hex())
            self._drop(digest)
            return None
        self.stats_.loads += 1
        self.stats_.load_seconds += time.perf_counter() - start
        assert found is not None
        return found[3]

    def put(self, digest: bytes, salt: bytes, tokens: Sequence[int], payload: Payload) -> None:
        """Keep a block evicted from the pool (nothing when the tier has it already)."""
        if len(payload) != self.block_bytes or self.contains(digest):
            return
        self._store(digest, bytes(salt), list(tokens), payload)

    def clear(self) -> int:
        """Forget every block; returns how many."""
        with self._lock:
            digests = list(self._entries)
        for digest in digests:
            self._drop(digest)
        return len(digests)

    def stats(self) -> TierStats:
        with self._lock:
            self.stats_.blocks = len(self._entries)
            self.stats_.bytes = self._bytes
        return TierStats(**asdict(self.stats_))

    def save_pins(self, pins: list[dict[str, object]]) -> None:
        """Pinned prefixes to pin again on start (a disk tier keeps them)."""

    def load_pins(self) -> list[dict[str, object]]:
        return []

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every accepted write is done (tests, shutdown)."""

    def close(self) -> None:
        self.flush()

    # -- the storage's part ------------------------------------------------------------
    def _admit(self, digest: bytes, size: int) -> list[bytes]:
        """Index an entry of ``size`` bytes; returns the digests evicted for room."""
        evicted = []
        with self._lock:
            if digest in self._entries:
                return evicted
            while self._entries and self._bytes + size > self.capacity_bytes:
                old, old_size = self._entries.popitem(last=False)
                self._bytes -= old_size
                evicted.append(old)
            self._entries[digest] = size
            self._bytes += size
        self.stats_.evictions += len(evicted)
        return evicted

    def _forget(self, digest: bytes) -> bool:
        with self._lock:
            size = self._entries.pop(digest, None)
            if size is not None:
                self._bytes -= size
        return size is not None

    def _read(self, digest: bytes) -> tuple[bytes, bytes, list[int], Payload] | None:
        raise NotImplementedError

    def _store(self, digest: bytes, salt: bytes, tokens: list[int], payload: Payload) -> None:
        raise NotImplementedError

    def _drop(self, digest: bytes) -> None:
        raise NotImplementedError


class MemoryTier(KVTier):
    """Blocks kept in host memory (the natural tier beside a GPU's pool; on the CPU it
    is memory the pool could have had, but it survives a reset of the prefix cache)."""

    kind = "memory"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        super().__init__(capacity_bytes, block_bytes)
        self._data: dict[bytes, tuple[bytes, list[int], Payload]] = {}

    def _read(self, digest: bytes) -> tuple[bytes, bytes, list[int], Payload] | None:
        entry = self._data.get(digest)
        return None if entry is None else (digest, *entry)

    def _store(self, digest: bytes, salt: bytes, tokens: list[int], payload: Payload) -> None:
        for old in self._admit(digest, len(payload)):
            self._data.pop(old, None)
        self._data[digest] = (salt, tokens, payload)
        self.stats_.writes += 1

    def _drop(self, digest: bytes) -> None:
        self._forget(digest)
        self._data.pop(digest, None)


class DiskTier(KVTier):
    """Blocks in files under ``root`` (see the module docstring), reopened on start."""

    kind = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        identity: TierIdentity,
        *,
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        super().__init__(capacity_bytes, identity.block_bytes)
        self.identity = identity
        self.root = Path(root)
        self.dir = self.root / identity.digest()
        self.blocks_dir = self.dir / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self._check_identity()
        self.max_pending_bytes = max(max_pending_bytes, identity.block_bytes)
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[bytes, bytes, list[int], Payload] | None] = queue.Queue()
        self._reopen()
        self._writer = threading.Thread(target=self._write_loop, name="kvpool-tier", daemon=True)
        self._writer.start()

    # -- opening -------------------------------------------------------------------
    def _check_identity(self) -> None:
        meta = self.dir / "tier.json"
        mine = asdict(self.identity)
        if meta.exists():
            try:
                theirs = json.loads(meta.read_text())
            except (OSError, ValueError):
                theirs = None
            if theirs != mine:  # only a digest collision could bring another one here
                log.warning("KV tier %s was written for %s; starting it afresh", self.dir, theirs)
                for path in self.blocks_dir.glob("*.kvb"):
                    path.unlink(missing_ok=True)
        _write_atomic(meta, json.dumps(mine, indent=1).encode())
        others = [p for p in self.root.iterdir() if p.is_dir() and p != self.dir]
        if others:
            log.warning(
                "KV tier %s: %d directories of other models or settings are ignored (%s)",
                self.root, len(others), ", ".join(p.name for p in others[:4]),
            )  # fmt: skip

    def _reopen(self) -> None:
        """Rebuild the index from the files, oldest use first; leftovers of writes that
        never finished (temporary names) are deleted. Contents are verified on fetch."""
        found = []
        for path in self.blocks_dir.iterdir():
            if path.suffix != ".kvb":
                path.unlink(missing_ok=True)  # a write cut short
                continue
            try:
                digest = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                path.unlink(missing_ok=True)
                continue
            if len(digest) == DIGEST_BYTES:
                found.append((st.st_mtime_ns, digest, st.st_size))
        found.sort()
        for _, digest, size in found:
            for old in self._admit(digest, size):
                (self.blocks_dir / f"{old.hex()}.kvb").unlink(missing_ok=True)
        if found:
            log.info("KV tier %s: %d blocks reopened", self.dir, len(self._entries))

    # -- storage -----------------------------------------------------------------
    def _path(self, digest: bytes) -> Path:
        return self.blocks_dir / f"{digest.hex()}.kvb"

    def _read(self, digest: bytes) -> tuple[bytes, bytes, list[int], Payload] | None:
        path = self._path(digest)
        try:
            data = path.read_bytes()
            os.utime(path)  # the LRU order, kept across restarts
        except OSError:
            return None
        return decode_block(data)

    def _store(self, digest: bytes, salt: bytes, tokens: list[int], payload: Payload) -> None:
        with self._lock:
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.stats_.dropped_writes += 1
                return
            self._pending_bytes += len(payload)
        self._queue.put((digest, salt, tokens, payload))

    def _write_loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # below the steps' threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            digest, salt, tokens, payload = item
            try:
                head = _header(digest, salt, tokens, len(payload))
                checksum = hashlib.blake2b(head, digest_size=16)
                checksum.update(payload)
                _write_atomic(self._path(digest), head, payload, checksum.digest())
                size = len(head) + len(payload) + 16
                for old in self._admit(digest, size):
                    self._path(old).unlink(missing_ok=True)
                self.stats_.writes += 1
            except OSError as exc:  # a full disk: the block is simply not kept
                log.warning("KV tier: writing block %s failed: %s", digest.hex(), exc)
                self.stats_.dropped_writes += 1
            finally:
                with self._lock:
                    self._pending_bytes -= len(payload)
                self._queue.task_done()

    def _drop(self, digest: bytes) -> None:
        self._forget(digest)
        self._path(digest).unlink(missing_ok=True)

    # -- pins, shutdown ------------------------------------------------------------
    def save_pins(self, pins: list[dict[str, object]]) -> None:
        _write_atomic(self.dir / "pins.json", json.dumps(pins).encode())

    def load_pins(self) -> list[dict[str, object]]:
        try:
            pins = json.loads((self.dir / "pins.json").read_text())
        except (OSError, ValueError):
            return []
        return pins if isinstance(pins, list) else []

    def flush(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)  # the writer's own progress, not a readiness guess

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)


def _write_atomic(path: Path, *parts: bytes | memoryview) -> None:
    """Write ``parts`` under a temporary name, then rename: a reader sees the old file or
    the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
