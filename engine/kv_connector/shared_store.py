"""SharedKVStore: a node-wide KV block store in POSIX shared memory (files on tmpfs), safe across processes.

Layout: `<root>/<namespace>/<block hash hex>`, one file per block: a 96-byte header (format version,
namespace, the block hash it was stored under, payload length, a BLAKE2b checksum of header and payload),
then `block_bytes` of KV. The namespace digests the model identity, dtype and KV layout
(`KVLayout.namespace`) so a different model can never read another's blocks; the cache salt is inside the
block hash chain. The default root is `/dev/shm/affinity-serve-kv-<uid>`: tmpfs, one per user.

- Content: a read verifies every header field and the checksum. A file that fails (flipped bytes, another
  key's block, truncated, an older format, a symbolic link or anything but a regular file, a foreign owner)
  is a miss: counted by reason, logged once, and removed, so the next store of that block repairs it. (A
  hard link is a regular file: read and verified like any other.)
- Files: every open is relative to the namespace directory's fd (opened at start, checked; opened again,
  with the same checks, when the directory is removed or replaced while serving) with O_NOFOLLOW;
  a write goes to a fresh O_EXCL temporary in that directory, then a rename makes it appear whole: a
  reader sees a complete block or none, without taking a lock. No fsync unless asked (`fsync=True`): the
  store is a cache on tmpfs, and a torn file on a disk-backed root fails its checksum.
- Access: private mode (default) makes directories 0700 and files 0600 and refuses a root or namespace
  directory that another user owns or that others may write (`UnsafeSharedStoreError`, naming the path
  and the problem). Group mode (`group=`) shares the store with one group's members: directories 02770,
  files 0660, owned by that group; never writable by others.
- Writers serialize on `fcntl.flock` of `<namespace>/.lock`, which guards `.index` (the block count) and
  eviction: past `capacity_blocks`, the least recently used tenth goes (a read refreshes a block's mtime).
No server, no daemon: the kernel's tmpfs and file locks are the mechanism.
"""
from __future__ import annotations

import enum
import errno
import fcntl
import grp
import hashlib
import logging
import os
import pwd
import secrets
import shutil
import stat
import struct
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager

from affinity_serve.engine.hashing import BlockHash

logger = logging.getLogger(__name__)

#: 1 was the headerless format (a file of exactly block_bytes); 2 adds the header below
FORMAT_VERSION = 2
_MAGIC = b"AFKV"
# magic, version, hash length, payload length, namespace (16 bytes), block hash (padded to 32)
_PREFIX = struct.Struct("<4sHHQ16s32s")
_DIGEST_BYTES = 32
HEADER_BYTES = _PREFIX.size + _DIGEST_BYTES          # 96
_COUNT = struct.Struct("<Q")
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_STALE_TMP_S = 600.0                                   # a temporary this old belongs to a dead writer
_ALIVE = ".alive"                                      # its mtime: the last time a replica used the namespace
ALIVE_REFRESH_S = 600.0                                # a replica marks its namespace in use at most this often
_REMOVING = ".removing-"                               # a namespace being removed (renamed first)
_MAX_LOGGED = 10_000                                   # file names whose rejection was logged (bounded)


class UnsafeSharedStoreError(ValueError):
    """The store's root or namespace directory is not safe to use (wrong owner, mode or file type)."""


class StoreWriteError(OSError):
    """A `write_many` stopped at an OS error (a full filesystem: ENOSPC): `written` and `evicted` say what it
    did before (and, evicting to make room, after) the error."""

    def __init__(self, error: OSError, written: list, evicted: list):
        super().__init__(error.errno, error.strerror)
        self.error = error
        self.written = written
        self.evicted = evicted


class BlockRead(enum.Enum):
    """What one block read found."""

    OK = "ok"
    MISSING = "missing"          # no file (never stored, or evicted since the lookup)
    DAMAGED = "damaged"          # a file failed verification: removed, counted, logged once


def default_shared_root() -> str:
    """One root per user: `/dev/shm/affinity-serve-kv-<uid>` (the temp dir without /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"affinity-serve-kv-{os.geteuid()}")


def resolve_group(group: str | int | None) -> int | None:
    """A group name or id as a gid (None: private mode)."""
    if group is None:
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise UnsafeSharedStoreError(f"shared store group {group!r} does not exist on this node") from None


def _describe_problem(st: os.stat_result, gid: int | None) -> str | None:
    """Why a directory or file (its lstat/fstat) must not be trusted, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return f"mode {mode:04o} lets every user write it"
    if gid is None:
        if st.st_uid != os.geteuid():
            return f"it is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
        if mode & stat.S_IWGRP:
            return f"mode {mode:04o} lets group {st.st_gid} write it (group sharing is opt-in: shared_group)"
        return None
    if st.st_gid != gid:
        return f"its group is {st.st_gid}, not the shared group {gid}"
    if st.st_uid != os.geteuid() and not _is_member(st.st_uid, gid):
        return f"it is owned by uid {st.st_uid}, who is not a member of the shared group {gid}"
    return None


def _is_member(uid: int, gid: int) -> bool:
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    return pw.pw_gid == gid or pw.pw_name in grp.getgrgid(gid).gr_mem


class _Modes:
    """Directory and file modes, and the group, of one sharing mode."""

    def __init__(self, gid: int | None):
        self.gid = gid
        self.dir = 0o700 if gid is None else 0o2770
        self.file = 0o600 if gid is None else 0o660

    def fix_fd(self, fd: int, st: os.stat_result, *, is_dir: bool) -> None:
        """Give a file or directory we own this mode's bits and group (tightens what an older store left)."""
        if st.st_uid != os.geteuid():
            return
        if self.gid is not None and st.st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        want = self.dir if is_dir else self.file
        if stat.S_IMODE(st.st_mode) != want:
            os.fchmod(fd, want)


def _open_dir(name: str, modes: _Modes, *, dir_fd: int | None = None, what: str, path: str) -> int:
    """Create (if missing) and open a directory without following links; refuse an unsafe one, give one we
    own this mode's bits (an older store's 0755 becomes 0700). `path`: the full path, for messages."""
    try:
        os.mkdir(name, modes.dir, dir_fd=dir_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise UnsafeSharedStoreError(f"refusing the shared KV store {what} {path!r}: it cannot be opened as a "
                                     f"directory without following links ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        problem = _describe_problem(st, modes.gid)
        if problem is not None:
            raise UnsafeSharedStoreError(f"refusing the shared KV store {what} {path!r}: {problem}. Remove it, "
                                         "or name another kv_connector.shared_dir")
        modes.fix_fd(fd, st, is_dir=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_shared_root(root: str, group: str | int | None = None) -> None:
    """Raise UnsafeSharedStoreError if `root` exists and is unsafe for this mode (nothing is created):
    a front end calls this before starting replicas, so a bad root fails once, clearly."""
    _check_existing_dir(root, "root", group)


def check_namespace_dir(root: str, namespace: str, group: str | int | None = None) -> None:
    """Raise UnsafeSharedStoreError if the namespace directory `<root>/<namespace>` exists and is unsafe for
    this mode (a link, not a directory, another owner, writable by others): the check a replica makes at
    start-up, without creating anything."""
    _check_existing_dir(os.path.join(os.path.abspath(root), namespace), "directory", group)


def _check_existing_dir(path: str, what: str, group: str | int | None) -> None:
    """The store's safety check of one existing directory (none there: nothing to check)."""
    modes = _Modes(resolve_group(group))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    head = f"refusing the shared KV store {what} {path!r}"
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedStoreError(f"{head}: it is not a directory (a link or a file). Remove it, or name "
                                     "another kv_connector.shared_dir")
    problem = _describe_problem(st, modes.gid)
    if problem is not None:
        raise UnsafeSharedStoreError(f"{head}: {problem}. Remove it, or name another kv_connector.shared_dir")


def _is_namespace(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _last_use(name: str, root_fd: int, st: os.stat_result) -> float:
    """When namespace directory `name` was last used: the latest of its own mtime (a block stored or
    evicted), `.alive` (a replica reading or writing it, refreshed every ALIVE_REFRESH_S) and `.index`."""
    times = [st.st_mtime]
    for f in (_ALIVE, ".index"):
        try:
            times.append(os.stat(f"{name}/{f}", dir_fd=root_fd, follow_symlinks=False).st_mtime)
        except OSError:          # never written (an older store, or nothing stored yet): the others decide
            continue
    return max(times)


def remove_stale_namespaces(root: str, keep: Sequence[str], ttl_s: float) -> list[str]:
    """Remove the namespace directories under `root` that nothing has used for `ttl_s` seconds (a model no
    replica serves any more: a redeploy with other weights, dtype or block size leaves its namespace
    behind), except those in `keep`; returns the names removed. Only this user's directories are touched,
    never a link; each is renamed out of the way first, so a replica that still holds it open sees it
    removed and reopens a fresh one (`SharedKVStore.check_dir`). Leftovers of an interrupted removal go too."""
    removed: list[str] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    except OSError:
        return removed
    try:
        now, uid = time.time(), os.getuid()
        with os.scandir(root_fd) as it:
            names = [e.name for e in it]
        for name in names:
            leftover = name.startswith(_REMOVING)
            if not leftover and (not _is_namespace(name) or name in keep):
                continue
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            age = now - _last_use(name, root_fd, st)
            if not leftover and age < ttl_s:
                continue
            target = name
            try:
                if not leftover:
                    target = f"{_REMOVING}{name}-{secrets.token_hex(4)}"
                    os.rename(name, target, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                shutil.rmtree(target, dir_fd=root_fd)
            except OSError as e:       # a replica wrote into it meanwhile, or it went: the next sweep retries
                logger.debug("shared KV store: could not remove %s/%s (%s)", root, target, e)
                continue
            if not leftover:
                removed.append(name)
                logger.info("shared KV store: removed namespace %s/%s, unused for %.1f days "
                            "(kv_connector.shared_namespace_ttl_s)", root, name, age / 86400)
    finally:
        os.close(root_fd)
    return removed


class SharedKVStore:
    def __init__(self, root: str, namespace: str, block_bytes: int, capacity_blocks: int, *,
                 group: str | int | None = None, fsync: bool = False):
        if capacity_blocks < 1:
            raise ValueError(f"the shared store needs >= 1 block, got {capacity_blocks}")
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, namespace)
        self.namespace = bytes.fromhex(namespace)
        if len(self.namespace) != 16:
            raise ValueError(f"a store namespace is 32 hex digits, got {namespace!r}")
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + block_bytes
        self.capacity_blocks = capacity_blocks
        #: eviction frees down to this many blocks (a tenth of the capacity) so a scan is rare
        self.low_water = max(0, capacity_blocks - max(1, capacity_blocks // 10))
        self.fsync = fsync
        self.modes = _Modes(resolve_group(group))
        #: blocks a read rejected, by kind: checksum, key (another key's block), version, truncated, link (a
        #: link or not a regular file), owner (another owner, or writable by others)
        self.damaged: Counter[str] = Counter()
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._dir_fd = self._lock_fd = -1
        self._reopen_error: str | None = None          # the last failed reopen's message (logged once)
        #: how many times the namespace directory was opened again (removed or replaced while serving)
        self.generation = 0
        self._dir_fd, self._lock_fd = self._open()
        self._alive_due = 0.0
        self._mark_alive()
        logger.info("shared KV store: namespace directory %s (capacity %d blocks of %d bytes)", self.dir,
                    capacity_blocks, self.file_bytes)

    def _mark_alive(self) -> None:
        """Refresh `.alive`'s mtime (at most every ALIVE_REFRESH_S): the namespace is in use, so a sweep of
        stale namespaces (`remove_stale_namespaces`, on another deployment's start-up) leaves it."""
        now = time.monotonic()
        if now < self._alive_due:
            return
        self._alive_due = now + ALIVE_REFRESH_S
        try:
            fd = self._open_own(_ALIVE, os.O_CREAT | os.O_WRONLY)
        except (OSError, UnsafeSharedStoreError) as e:
            logger.debug("shared KV store: cannot mark %s in use (%s)", self.dir, e)
            return
        try:
            os.utime(fd)
        except OSError as e:
            logger.debug("shared KV store: cannot mark %s in use (%s)", self.dir, e)
        finally:
            os.close(fd)

    def _open(self) -> tuple[int, int]:
        """Create (if missing), check and open the root and namespace directories and the lock file, as
        at start-up: (directory fd, lock fd). Raises UnsafeSharedStoreError for an unsafe path."""
        check_shared_root(self.root, self.modes.gid)
        parent = os.path.dirname(self.root)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
        root_fd = _open_dir(self.root, self.modes, what="root", path=self.root)
        try:
            dir_fd = _open_dir(os.path.basename(self.dir), self.modes, dir_fd=root_fd, what="directory",
                               path=self.dir)
        finally:
            os.close(root_fd)
        try:
            lock_fd = self._open_own(".lock", os.O_CREAT | os.O_RDWR, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        return dir_fd, lock_fd

    def check_dir(self) -> None:
        """Reopen the namespace directory if it was removed or replaced (see `_check_dir`)."""
        self._check_dir()

    def _check_dir(self) -> None:
        """Reopen the namespace directory if it was removed or replaced since it was opened (someone
        deleted the store while replicas were serving): without this, this replica's blocks would go into
        a directory no other replica sees until it restarts. One warning per occurrence."""
        try:
            now = os.stat(self.dir, follow_symlinks=False)
            held = os.fstat(self._dir_fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return
            what = "replaced"
        except FileNotFoundError:
            what = "removed"
        try:
            fds = self._open()
        except (OSError, UnsafeSharedStoreError) as e:
            message = str(e)
            if message != self._reopen_error:
                self._reopen_error = message
                logger.error("shared KV store: directory %s was %s while serving and cannot be reopened: %s. "
                             "This replica's stores fail until it can", self.dir, what, message)
            return
        self._reopen_error = None
        self.close()
        self._dir_fd, self._lock_fd = fds
        self.generation += 1
        self._alive_due = 0.0
        self._mark_alive()
        logger.warning("shared KV store: directory %s was %s while serving; reopened it (%s), blocks stored "
                       "before are gone and are recomputed", self.dir, what,
                       "recreated" if what == "removed" else "the new one")

    def _open_own(self, name: str, flags: int, *, dir_fd: int | None = None) -> int:
        """Open a bookkeeping file in the namespace directory (no links; refuse another owner's)."""
        fd = os.open(name, flags | _OPEN_FLAGS, self.modes.file, dir_fd=self._dir_fd if dir_fd is None else dir_fd)

        st = os.fstat(fd)
        problem = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _describe_problem(st, self.modes.gid)
        if problem is not None:
            os.close(fd)
            raise UnsafeSharedStoreError(f"refusing {os.path.join(self.dir, name)!r}: {problem}")
        self.modes.fix_fd(fd, st, is_dir=False)
        return fd

    # ------------------------------------------------------------------ the block file format
    def _header(self, block_hash: BlockHash, data: memoryview) -> bytes:
        if len(block_hash) > 32:
            raise ValueError(f"a block hash is at most 32 bytes, got {len(block_hash)}")
        prefix = _PREFIX.pack(_MAGIC, FORMAT_VERSION, len(block_hash), len(data), self.namespace, block_hash)
        digest = hashlib.blake2b(prefix, digest_size=_DIGEST_BYTES)
        digest.update(data)
        return prefix + digest.digest()

    def _verify(self, block_hash: BlockHash, header: bytes | bytearray, payload: memoryview) -> tuple[str, str] | None:
        """(kind, detail) of why a file's header and payload do not hold `block_hash`'s block, or None."""
        magic, version, hash_len, length, namespace, stored_hash = _PREFIX.unpack_from(header)
        if magic != _MAGIC or version != FORMAT_VERSION:
            return "version", f"format version {version if magic == _MAGIC else '?'}, not {FORMAT_VERSION}"
        if namespace != self.namespace or hash_len != len(block_hash) or stored_hash[:hash_len] != block_hash:
            return "key", "stored under another key"
        if length != self.block_bytes:
            return "truncated", f"payload of {length} bytes, not {self.block_bytes}"
        digest = hashlib.blake2b(bytes(header[:_PREFIX.size]), digest_size=_DIGEST_BYTES)
        digest.update(payload)
        if digest.digest() != bytes(header[_PREFIX.size:HEADER_BYTES]):
            return "checksum", "checksum mismatch"
        return None

    # ------------------------------------------------------------------ reads (no lock)
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether an entry exists under the block's name (a read verifies it)."""
        try:
            os.stat(block_hash.hex(), dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def read_into(self, block_hash: BlockHash, buf: memoryview) -> bool:
        """Fill `buf` (block_bytes) with the block; False if it is not in the store or failed verification."""
        return self.read(block_hash, buf) is BlockRead.OK

    def read(self, block_hash: BlockHash, buf: memoryview) -> BlockRead:
        """Fill `buf` (block_bytes) with the verified block. A file that fails verification is removed
        (the next store of the block writes it anew), counted in `damaged` by kind and logged once."""
        name = block_hash.hex()
        self._mark_alive()
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return BlockRead.MISSING
        except OSError as e:      # ELOOP: a symbolic link; EACCES: not ours
            return self._reject(name, None, "link", f"cannot be opened without following links ({e.strerror})")
        try:
            st = os.fstat(fd)
            problem = self._check_file(st)
            if problem is None:
                header = bytearray(HEADER_BYTES)
                n = os.readv(fd, [header, buf])
                problem = (("truncated", f"short read of {n} bytes") if n != self.file_bytes
                           else self._verify(block_hash, header, buf))
            if problem is not None:
                return self._reject(name, st, *problem)
            try:
                os.utime(fd)            # LRU: a read makes the block recent (on the fd: never a link's target)
            except OSError:
                pass                    # a group member's file we may not touch: its age stays
            return BlockRead.OK
        finally:
            os.close(fd)

    def _check_file(self, st: os.stat_result) -> tuple[str, str] | None:
        """(kind, detail) of why an open entry cannot be one of our block files, or None."""
        if not stat.S_ISREG(st.st_mode):
            return "link", "not a regular file"
        problem = _describe_problem(st, self.modes.gid)
        if problem is not None:
            return "owner", problem
        if st.st_size == self.block_bytes:
            return "version", "a headerless file (format version 1)"
        if st.st_size != self.file_bytes:
            return "truncated", f"{st.st_size} bytes, not {self.file_bytes}"
        return None

    def _reject(self, name: str, st: os.stat_result | None, kind: str, detail: str) -> BlockRead:
        self.damaged[kind] += 1
        if name not in self._logged:
            self._logged[name] = None
            if len(self._logged) > _MAX_LOGGED:
                self._logged.popitem(last=False)
            logger.warning("shared KV store: block file %s rejected (%s); removed, the block is recomputed",
                           os.path.join(self.dir, name), detail)
        self._remove(name, st)
        return BlockRead.DAMAGED

    def _remove(self, name: str, st: os.stat_result | None) -> None:
        """Unlink a rejected entry, unless a writer has replaced it since (then it is a new file)."""
        with self._locked():
            try:
                now = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if st is None:      # it could not be opened (a link, a file we may not read)
                replaced = stat.S_ISREG(now.st_mode) and _describe_problem(now, self.modes.gid) is None
            else:
                replaced = (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev)
            if replaced:
                return          # a writer's new file took its place: keep it (it is verified when read)
            try:
                os.unlink(name, dir_fd=self._dir_fd)        # a link itself goes, never its target
            except OSError:
                logger.warning("shared KV store: cannot remove %s", os.path.join(self.dir, name), exc_info=True)
                return
            try:
                self._write_count(max(0, self._read_count() - 1))
            except OSError:
                logger.debug("shared KV store: .index not rewritten after removing %s (a full filesystem?); "
                             "the next eviction recounts the files", name)

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
            fd = os.open(".index", os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS, dir_fd=self._dir_fd)
        except OSError:
            return len(self._list())
        try:
            return _COUNT.unpack(os.read(fd, _COUNT.size))[0]
        except struct.error:
            return len(self._list())
        finally:
            os.close(fd)

    def _write_count(self, n: int) -> None:
        self._write_file(".index", [_COUNT.pack(n)])

    def _write_file(self, name: str, parts: Sequence[bytes | memoryview]) -> None:
        """Write `name` whole: a fresh O_EXCL temporary in the directory (a name planted there is never
        written through), then a rename over `name` (which replaces a link, never its target)."""
        while True:
            tmp = f".tmp-{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, self.modes.file,
                             dir_fd=self._dir_fd)
                break
            except FileExistsError:
                continue
        try:
            try:
                if self.modes.gid is not None:
                    os.fchmod(fd, self.modes.file)      # the umask may have taken the group's bits
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self._dir_fd)
            except OSError:
                pass
            raise

    def _is_stored(self, name: str) -> bool | None:
        """True: a plausible block file is there (a read verifies it); False: nothing; None: something
        that is not one (a link, a wrong size, a foreign file), which a store replaces."""
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        ok = (stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes
              and _describe_problem(st, self.modes.gid) is None)
        return True if ok else None

    def write_many(self, items: Sequence[tuple[BlockHash, memoryview]]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Store blocks not already present (replacing entries that cannot be blocks); returns (hashes
        written, hashes evicted to make room).

        An OS error (a full filesystem) stops the writing; the store still evicts past its capacity (on a
        full filesystem, also the least recently used tenth, to make room) and keeps `.index` right, then
        raises `StoreWriteError` saying what was written and evicted."""
        for _, data in items:
            if len(data) != self.block_bytes:
                raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
        written: list[BlockHash] = []
        evicted: list[BlockHash] = []
        error: OSError | None = None
        self._check_dir()
        self._mark_alive()
        with self._locked():
            count = self._read_count()
            try:
                for h, data in items:
                    name = h.hex()
                    present = self._is_stored(name)
                    if present:
                        continue
                    self._write_file(name, [self._header(h, data), data])
                    if present is False:
                        count += 1
                    written.append(h)
            except OSError as e:
                error = e
            try:
                full = error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT)
                if count > self.capacity_blocks or full:
                    keep = self.low_water if not full else min(self.low_water, count - max(1, count // 10))
                    evicted, count = self._evict(keep)
                self._write_count(count)
            except OSError as e:
                error = error or e
        if error is not None:
            raise StoreWriteError(error, written, evicted)
        return written, evicted

    def _list(self) -> list[os.DirEntry]:
        with os.scandir(self._dir_fd) as it:
            return [e for e in it if not e.name.startswith(".")]

    def _evict(self, keep: int | None = None) -> tuple[list[BlockHash], int]:
        """Under the lock: drop least recently used blocks down to `keep` (default `low_water`); (evicted,
        count left). Temporaries of writers that died long ago go too."""
        self._remove_stale_temporaries()
        entries = self._list()
        entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
        n_drop = max(0, len(entries) - (self.low_water if keep is None else max(0, keep)))
        evicted = []
        for e in entries[:n_drop]:
            try:
                os.unlink(e.name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                continue
            h = _hash_of(e.name)
            if h is not None:
                evicted.append(h)
        return evicted, len(entries) - n_drop

    def _remove_stale_temporaries(self) -> None:
        cutoff = time.time_ns() - int(_STALE_TMP_S * 1e9)
        with os.scandir(self._dir_fd) as it:
            for e in it:
                if e.name.startswith(".tmp-") and e.stat(follow_symlinks=False).st_mtime_ns < cutoff:
                    try:
                        os.unlink(e.name, dir_fd=self._dir_fd)
                    except FileNotFoundError:
                        pass

    # ------------------------------------------------------------------ inspection
    def block_hashes(self) -> list[BlockHash]:
        hashes = (_hash_of(e.name) for e in self._list() if e.is_file(follow_symlinks=False))
        return [h for h in hashes if h is not None]

    def num_blocks(self) -> int:
        """The count the index file keeps (equal to the number of block files between writes)."""
        with self._locked():
            return self._read_count()

    def clear(self) -> None:
        with self._locked():
            for e in self._list():
                os.unlink(e.name, dir_fd=self._dir_fd)
            self._write_count(0)

    def close(self) -> None:
        for attr in ("_lock_fd", "_dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)


def _hash_of(name: str) -> BlockHash | None:
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None



class GroupedSharedStore:
    """A hybrid model's shared store: one `SharedKVStore` (namespace) per KV-cache group, addressed by the
    pool's cache keys (a hash in group 0, (group, hash) in the others); the same reads and writes as one
    store. Inspection (`block_hashes`) reports group 0's, as the pool's KV events do."""

    def __init__(self, stores: Sequence[SharedKVStore]):
        self.stores = list(stores)

    def _split(self, key) -> tuple[SharedKVStore, BlockHash]:
        if type(key) is tuple:
            return self.stores[key[0]], key[1]
        return self.stores[0], key

    def contains(self, key) -> bool:
        store, h = self._split(key)
        return store.contains(h)

    def read(self, key, buf: memoryview) -> BlockRead:
        store, h = self._split(key)
        return store.read(h, buf)

    def write_many(self, items: Sequence[tuple[object, memoryview]]) -> tuple[list, list]:
        by_group: dict[int, list[tuple[BlockHash, memoryview]]] = {}
        for key, data in items:
            g, h = key if type(key) is tuple else (0, key)
            by_group.setdefault(g, []).append((h, data))
        written: list = []
        evicted: list = []
        error: OSError | None = None
        for g, group_items in by_group.items():
            try:
                w, e = self.stores[g].write_many(group_items)
            except StoreWriteError as err:      # the other groups still write (and evict)
                w, e, error = err.written, err.evicted, error or err.error
            written.extend(h if not g else (g, h) for h in w)
            evicted.extend(h if not g else (g, h) for h in e)
        if error is not None:
            raise StoreWriteError(error, written, evicted)
        return written, evicted

    def block_hashes(self) -> list[BlockHash]:
        return self.stores[0].block_hashes()

    @property
    def generation(self) -> int:
        return sum(s.generation for s in self.stores)

    def check_dir(self) -> None:
        for s in self.stores:
            s.check_dir()

    def num_blocks(self) -> int:
        return sum(s.num_blocks() for s in self.stores)

    def clear(self) -> None:
        for s in self.stores:
            s.clear()

    def close(self) -> None:
        for s in self.stores:
            s.close()
