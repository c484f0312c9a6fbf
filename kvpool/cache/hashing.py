"""Stable block keys for the prefix index.

A full block's key is ``H(parent key, salt, token ids)``: it names the block's content *and
everything before it*, so two blocks with equal tokens after different prefixes get
different keys (their KV differs). The key is computed once per block, when the block fills.

The hash is BLAKE2b truncated to 64 bits over a fixed little-endian encoding, so a key is the
same in every process and on every machine (unlike Python's salted ``hash``). 64 bits are
enough because a key is never trusted alone: the index verifies every candidate token by
token (see ``prefix_index``). Tests inject a deliberately weak hash through ``HashFn``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import NewType

BlockHash = NewType("BlockHash", int)
"""64-bit key of a full block: covers the parent's key, the salt and the block's tokens."""

Salt = str | bytes | None
"""Tenant isolation: equal tokens under different salts never share a block."""

HashFn = Callable[[BlockHash | None, bytes, Sequence[int]], BlockHash]
"""``(parent key or None for the first block, salt bytes, token ids) -> key``."""

_ROOT = b"\xff" * 8  # stands for "no parent"; no 64-bit key is hashed as these bytes + flag
_ROOT_HEAD = _ROOT + b"\x00"
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def salt_bytes(salt: Salt) -> bytes:
    """Canonical bytes of a salt (``None`` and ``b""`` both mean: no tenant)."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    return bytes(salt)


def hash_block(parent: BlockHash | None, salt: bytes, token_ids: Sequence[int]) -> BlockHash:
    """The default, stable 64-bit block key."""
    head = _ROOT_HEAD if parent is None else parent.to_bytes(8, "little") + b"\x01"
    packed = array(_TOKEN_TYPECODE, token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    data = b"".join((head, len(salt).to_bytes(4, "little"), salt, packed.tobytes()))
    return BlockHash(int.from_bytes(blake2b(data, digest_size=8).digest(), "little"))
