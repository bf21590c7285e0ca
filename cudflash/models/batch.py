"""The inputs of one model forward: which tokens, at which positions, written to which KV slots."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudflash.backends.base import AttentionMeta


@dataclass(slots=True)
class ForwardBatch:
    ids: Any  # int32 [T] token ids (device)
    positions: Any  # int32 [T] absolute positions (device)
    slots: Any  # int32 [T] paged-cache slot of each row (device)
    meta: AttentionMeta  # per-sequence row ranges, context lengths and block tables
    # Hybrid targets: each sequence's GDN state slot (host int32 [n], -1: none), and how many leading sequences are
    # prefill chunks (they commit their states in the forward; the others are verified and commit after acceptance).
    state_slots: np.ndarray | None = None
    chunked_seqs: int = 0
    state_slots_device: Any = None  # int32 [n]: state_slots on the backend (staged with the step), or None


@dataclass(slots=True)
class KVCache:
    k: Any  # [num_layers, num_blocks, block_size, kv_heads, head_dim]
    v: Any  # [num_layers, num_blocks, block_size, kv_heads, head_dim]
