"""The engine's side of the second KV tier: opening the tier its config asks for, and
moving block bytes between the pool and the tier as the block manager reports (the
manager decides what moves, in order; see ``kvpool.cache.manager.TierEvent``)."""

from __future__ import annotations

import logging

import torch

from kvpool.cache import KVCacheManager
from kvpool.cache.tier import DiskTier, KVTier, MemoryTier, TierIdentity, file_identity
from kvpool.engine.config import EngineConfig
from kvpool.model.kv_store import PagedKVStore
from kvpool.model.llama import LlamaModel

log = logging.getLogger("kvpool.engine")


def open_tier(
    config: EngineConfig, model: LlamaModel, kv_dtype: str, block_bytes: int
) -> KVTier | None:
    """The tier ``config`` asks for (None: none). A disk tier is tied to the model file,
    the compute dtype, the geometry, the KV dtype and the block size."""
    if config.kv_offload_memory is not None:
        return MemoryTier(config.kv_offload_memory, block_bytes)
    if config.kv_offload_dir is None:
        return None
    if model.source_path is None:
        raise ValueError("a disk KV tier needs the model's file (load it with load_model)")
    cfg = model.config
    identity = TierIdentity(
        model=file_identity(model.source_path),
        compute_dtype=str(model.dtype).removeprefix("torch."),
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_dtype=kv_dtype,
        block_size=config.block_size,
        block_bytes=block_bytes,
    )
    return DiskTier(config.kv_offload_dir, config.kv_offload_size, identity)


@torch.inference_mode()
def apply_tier_events(manager: KVCacheManager, tier: KVTier, store: PagedKVStore) -> None:
    """Before a forward pass: in order, copy each evicted block's bytes out to the tier
    (the copy is all the step waits for; the tier writes behind) and each block found
    in the tier into the pool."""
    for event in manager.take_tier_events():
        if event.payload is None:
            if not tier.contains(event.digest):
                payload = store.read_block(event.block_id)
                tier.put(event.digest, event.salt, event.token_ids, payload)
        else:
            store.write_block(event.block_id, event.payload)
