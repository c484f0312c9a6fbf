"""kvpool.cache: the paged KV-cache block manager with prefix-aware reuse.

Pure Python: block ids and token ids only, no tensors (the model runtime owns those).
Importing this package never imports torch.
"""

from kvpool.cache.errors import (
    BudgetTooSmall,
    CacheError,
    NotPinned,
    OutOfBlocks,
    PinLimitExceeded,
    SequenceExists,
    UnknownSequence,
)
from kvpool.cache.geometry import KV_DTYPE_BYTES, ModelGeometry, kv_dtype_bytes
from kvpool.cache.hashing import BlockHash, HashFn, Salt, hash_block
from kvpool.cache.manager import Allocation, KVCacheManager, PinInfo, SeqId
from kvpool.cache.policy import Policy
from kvpool.cache.stats import CacheStats

__all__ = [
    "KV_DTYPE_BYTES",
    "Allocation",
    "BlockHash",
    "BudgetTooSmall",
    "CacheError",
    "CacheStats",
    "HashFn",
    "KVCacheManager",
    "ModelGeometry",
    "NotPinned",
    "OutOfBlocks",
    "PinInfo",
    "PinLimitExceeded",
    "Policy",
    "Salt",
    "SeqId",
    "SequenceExists",
    "UnknownSequence",
    "hash_block",
    "kv_dtype_bytes",
]
