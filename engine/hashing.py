"""Prefix-cache block hashes: deterministic, collision-resistant, importable without torch.

A full block's hash is SHA-256 over (parent hash, the block's token ids, extra keys), so equal hashes
mean equal whole prefixes. The router computes the same hashes on the ingress to predict which replica
holds a prompt's prefix, so the encoding is fixed and never depends on a per-process seed:

    digest = sha256(b"AS1" || parent(32 bytes) || u32le(token) * n || extra)

`extra` carries the cache salt (first block only) so different tenants never share blocks. SHA-256 was
chosen over a faster non-cryptographic hash because a collision would silently serve another prompt's
KV; the cost is about 1 microsecond per 16-token block in CPython (see benchmarks/scheduler_step.py),
paid once per full block, never per token.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
_DOMAIN = b"AS1"
#: The parent "hash" of a request's first block: a constant, so hashes agree across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"affinity-serve/none-hash/v1").digest()
_UNPACKERS: dict[int, struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    s = _UNPACKERS.get(n)
    if s is None:
        s = _UNPACKERS[n] = struct.Struct(f"<{n}I")
    return s


def _encode_extra(cache_salt: str | None) -> bytes:
    if not cache_salt:
        return b""
    raw = cache_salt.encode("utf-8")
    return b"salt" + struct.pack("<I", len(raw)) + raw


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(_DOMAIN)
    h.update(parent if parent is not None else NONE_HASH)
    h.update(_packer(len(token_ids)).pack(*token_ids))
    if cache_salt:
        h.update(_encode_extra(cache_salt))
    return h.digest()


def hash_block_chain(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                     parent: BlockHash | None = None, start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    `parent` must be the hash of block `start_block - 1` (None when starting at 0). The salt enters
    block 0 only.
    """
    out: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   cache_salt if i == 0 else None)
        out.append(parent)
    return out


def check_block_hashes(block_hashes: Sequence[BlockHash], token_ids: Sequence[int], block_size: int,
                       cache_salt: str | None = None) -> str | None:
    """Why `block_hashes` cannot be `hash_block_chain(token_ids, block_size, cache_salt)`; None if they pass.

    Cheap, whatever the length: the count, the types, and the first and last links recomputed (two block
    hashes), which catches another block size, salt or prompt. A wrong link in the middle is not caught,
    so hashes must come from a trusted hasher (the ingress runs this module's code).
    """
    num_full = len(token_ids) // block_size
    if len(block_hashes) != num_full:
        return f"{len(block_hashes)} hashes for {num_full} full blocks of {block_size} tokens"
    if not all(type(h) is bytes and len(h) == 32 for h in block_hashes):
        return "hashes must be 32-byte strings"
    if num_full and hash_block_tokens(None, token_ids[:block_size], cache_salt) != block_hashes[0]:
        return "the first block's hash does not match (block size, salt or prompt differ)"
    last = num_full - 1
    if last > 0 and hash_block_tokens(block_hashes[last - 1], token_ids[last * block_size:num_full * block_size]
                                      ) != block_hashes[last]:
        return "the last block's hash does not match"
    return None
