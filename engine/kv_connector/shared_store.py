"""SharedKVStore: a node-wide KV block store in POSIX shared memory (files on tmpfs), safe across processes.

Layout: `<root>/<namespace>/<block hash hex>`, one file of `block_bytes` per block, where the namespace
digests the model identity, dtype and KV layout (`KVLayout.namespace`) so a different model can never read
another's blocks (and the cache salt is inside the block hash chain). `<root>` defaults to
`/dev/shm/affinity-serve-kv`: tmpfs, i.e. shared memory that every process on the node can map or read.

- A write goes to a temporary file, then `os.replace` makes it appear whole: a reader sees a complete block
  or none, without taking a lock. A reader that loses a race with eviction gets "not found" and the
  engine recomputes.
- Writers serialize on `fcntl.flock` of `<namespace>/.lock`, which guards `.index` (the block count) and
  eviction: past `capacity_blocks`, the least recently used tenth goes (a read refreshes a block's mtime).
No server, no daemon: the kernel's tmpfs and file locks are the mechanism.
"""
from __future__ import annotations

import fcntl
import os
import struct
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager

from engine.hashing import BlockHash

_COUNT = struct.Struct("<Q")


def default_shared_root() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "affinity-serve-kv")


class SharedKVStore:
    def __init__(self, root: str, namespace: str, block_bytes: int, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"the shared store needs >= 1 block, got {capacity_blocks}")
        self.dir = os.path.join(root, namespace)
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        #: eviction frees down to this many blocks (a tenth of the capacity) so a scan is rare
        self.low_water = max(0, capacity_blocks - max(1, capacity_blocks // 10))
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.dir, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
        self._index_path = os.path.join(self.dir, ".index")
        self._tmp_suffix = f".tmp{os.getpid()}"

    # ------------------------------------------------------------------ reads (no lock)
    def _path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.dir, block_hash.hex())

    def contains(self, block_hash: BlockHash) -> bool:
        return os.path.exists(self._path(block_hash))

    def read_into(self, block_hash: BlockHash, buf: memoryview) -> bool:
        """Fill `buf` (block_bytes) with the block; False if it is not (or no longer) in the store."""
        path = self._path(block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(buf)
            os.utime(path)                   # LRU: a read makes the block recent
        except FileNotFoundError:
            return False
        return n == self.block_bytes

    # ------------------------------------------------------------------ writes (locked)
    @contextmanager
    def _locked(self):
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_count(self) -> int:
        try:
            with open(self._index_path, "rb") as f:
                return _COUNT.unpack(f.read(_COUNT.size))[0]
        except (FileNotFoundError, struct.error):
            return len(self._list())

    def _write_count(self, n: int) -> None:
        tmp = self._index_path + self._tmp_suffix
        with open(tmp, "wb") as f:
            f.write(_COUNT.pack(n))
        os.replace(tmp, self._index_path)

    def write_many(self, items: Sequence[tuple[BlockHash, memoryview]]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Store blocks not already present; returns (hashes written, hashes evicted to make room)."""
        written: list[BlockHash] = []
        evicted: list[BlockHash] = []
        with self._locked():
            count = self._read_count()
            for h, data in items:
                if len(data) != self.block_bytes:
                    raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
                path = self._path(h)
                if os.path.exists(path):
                    continue
                tmp = path + self._tmp_suffix
                with open(tmp, "wb", buffering=0) as f:
                    f.write(data)
                os.replace(tmp, path)
                count += 1
                written.append(h)
            if count > self.capacity_blocks:
                evicted, count = self._evict()
            self._write_count(count)
        return written, evicted

    def _list(self) -> list[os.DirEntry]:
        with os.scandir(self.dir) as it:
            return [e for e in it if not e.name.startswith(".") and ".tmp" not in e.name]

    def _evict(self) -> tuple[list[BlockHash], int]:
        """Under the lock: drop least recently used blocks down to `low_water`; (evicted, count left)."""
        entries = self._list()
        entries.sort(key=lambda e: e.stat().st_mtime_ns)
        n_drop = max(0, len(entries) - self.low_water)
        evicted = []
        for e in entries[:n_drop]:
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                continue
            evicted.append(bytes.fromhex(e.name))
        return evicted, len(entries) - len(evicted)

    # ------------------------------------------------------------------ inspection
    def block_hashes(self) -> list[BlockHash]:
        return [bytes.fromhex(e.name) for e in self._list()]

    def num_blocks(self) -> int:
        """The count the index file keeps (equal to the number of block files between writes)."""
        with self._locked():
            return self._read_count()

    def clear(self) -> None:
        with self._locked():
            for e in self._list():
                os.unlink(e.path)
            self._write_count(0)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
