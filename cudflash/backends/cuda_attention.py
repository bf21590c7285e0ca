"""Paged attention on the GPU: metadata upload, launch-shape choice and split-K for kernels/attention.cu.

One kernel serves all three forms (prefill, decode / verify, drafter): the G query heads sharing a KV head are
packed as rows, so the shape of the problem is only `max_q_len * G` packed rows per (sequence, KV head).

Decode and verify (causal, at most DECODE_MAX_Q new tokens per sequence, context buckets up to the tuning's
invariant_max_context) take one fixed launch shape so that a query row computes the same bits however many rows,
sequences or splits share the launch: a verify row then reproduces exactly the decode of that token, which is what
makes greedy speculative output equal autoregressive output on the GPU (rounding included), not merely close. That shape
is a 16-row tile whose four warps split the keys of each K/V tile (WN=4) and merge at the end, and a split of
the key range fixed by key position: split z holds keys [z * BN, (z + 1) * BN), one K/V tile, the most parallel
choice, and the merge kernel adds the splits in order (splits that saw no key of a row drop out exactly).
Its price grows with the context (a verify pass reads each K/V tile once per 16 packed rows rather than once
per 64, and writes a float32 partial per 64-key split), so only buckets up to invariant_max_context take it;
longer contexts go the fast way and agree with decoding up to bf16 rounding instead of bit for bit.

Prefill and the drafter (many rows, or non-causal) pick the shape for speed:
- many rows: 64-row tiles, each warp owns 16 rows (WM=4, WN=1);
- few rows: a 16- or 32-row tile, the warps split the keys of each K/V tile instead (WN=4 or 2);
and split the key range in equal shares across CTAs only when that leaves the GPU under-filled.
Every decision uses host-side integers from AttentionMeta, so nothing here synchronises with the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.base import AttentionMeta
from cudflash.backends.cuda_util import act_dtype, cdiv, f32, i32, i64, vec_rows
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError

BN = 64  # keys per K/V tile (ATTN_BN in attention.cu)
THREADS = 128
HEAD_DIMS = (64, 128, 256)
MAX_SPLITS = 64  # attn_combine holds two splits' lse per lane
DECODE_MAX_Q = 32  # causal runs of up to this many new tokens per sequence may take the row-invariant shape


@dataclass(slots=True)
class DeviceMeta:
    cu_seqlens: cupy.ndarray  # int32 [n + 1]
    context_lens: cupy.ndarray  # int32 [n]
    block_tables: cupy.ndarray  # int32 [n, max_blocks]
    tree_seq: cupy.ndarray | None = None  # int32 [n] (draft trees, AttentionMeta.tree_seq)
    tree_mask: cupy.ndarray | None = None  # int32 [T, W]


def upload_meta(meta: AttentionMeta) -> DeviceMeta:
    up = lambda a: None if a is None else cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    return DeviceMeta(up(meta.cu_seqlens_q), up(meta.context_lens), up(meta.block_tables), up(meta.tree_seq),
                      up(meta.tree_mask))


WARP_LAYOUTS = ((4, 1), (2, 2), (1, 4))  # (WM, WN) of the attn_fwd instantiations


def _layouts(d: int, gated: bool) -> tuple[str, ...]:
    """attn_fwd of each WARP_LAYOUTS entry, then attn_combine: one module per (head_dim, gated), so a model without
    the output gate compiles only the ungated kernels."""
    g = "true" if gated else "false"
    return (*(f"attn_fwd<{d}, {wm}, {wn}, {g}>" for wm, wn in WARP_LAYOUTS), f"attn_combine<{d}, {g}>")


def _forward_kernel(d: int, wm: int, wn: int, gated: bool, smem: int, tuning: CudaTuning) -> kernel_loader.Kernel:
    names = _layouts(d, gated)
    kern = kernel_loader.function("attention", names[WARP_LAYOUTS.index((wm, wn))], names, tuning=tuning)
    if smem > 48 * 1024:
        kern.reserve_shared(smem)  # opt in to more than the default 48 KiB
    return kern


def choose_layout(packed_rows: int) -> tuple[int, int]:
    """(WM, WN): warps along rows x warps along keys, for the longest run of packed query rows."""
    if packed_rows <= 16:
        return 1, 4
    if packed_rows <= 32:
        return 2, 2
    return 4, 1


_occupancy: dict[tuple[int, int], int] = {}


def ctas_per_sm(kern: kernel_loader.Kernel, smem: int) -> int:
    """Resident CTAs of this kernel per SM, from its register count and shared memory (Hopper limits)."""
    key = (id(kern), smem)
    if key not in _occupancy:  # a driver query per attribute: do it once per kernel
        regs = max(1, int(kern.raw.attributes.get("num_regs", 255)))
        by_regs = 65536 // (-(-regs // 8) * 8 * THREADS)
        by_smem = (228 * 1024) // (smem + 1024)  # 1 KiB per CTA is reserved by the system
        _occupancy[key] = max(1, min(by_regs, by_smem, 16))
    return _occupancy[key]


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BUCKET = 512


def batch_bucket(n: int) -> int | None:
    """The padded batch a CUDA graph is captured for (None: too many sequences for a graph)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def context_bucket(n: int) -> int:
    return max(MIN_CONTEXT_BUCKET, 1 << (n - 1).bit_length())


def choose_splits(base_ctas: int, max_context: int, slots: int) -> int:
    """How many CTAs share one key range: fill the resident slots once (a second, mostly idle wave costs more
    than it saves), each split keeping at least one K/V tile. (Attention asks for its old-key tiles before waiting
    on the kernel in front, so a split of one or two tiles has all its K/V in flight before q exists, and one-tile
    splits are the fastest.)

    Callers pass the bucketed batch and context (batch_bucket, context_bucket), as a CUDA graph captured for
    that bucket must: eager and graphed execution then split alike and round alike."""
    ktiles = cdiv(max_context, BN)
    if base_ctas * 2 > slots or ktiles < 4:
        return 1
    return max(1, min(slots // base_ctas, ktiles, MAX_SPLITS))


def attention(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, meta: AttentionMeta, scale: float,
              causal: bool, window: int, num_sms: int, tuning: CudaTuning,
              gate: cupy.ndarray | None = None) -> cupy.ndarray:
    """base.Backend.attention; gate [T, Hq D] (a row-strided view, e.g. the qkvg GEMM's float32 gate columns):
    applied by the kernel that writes the output (attention.cu's header)."""
    _, block_size, hk, d = k_cache.shape
    if d not in HEAD_DIMS:
        raise BackendError(f"cuda attention: head_dim {d} unsupported (expected one of {HEAD_DIMS})")
    if v_cache.shape != k_cache.shape or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise BackendError("cuda attention: k_cache and v_cache must be contiguous and of one shape")
    q, sq = vec_rows(q, "attention q")
    t, width = q.shape
    hq = width // d
    if hq * d != width or hq % hk:
        raise BackendError(f"cuda attention: q width {width} is not a multiple of {hk} KV heads x head_dim {d}")
    out = cupy.empty((t, width), dtype=act_dtype())
    gated = gate is not None
    if gated:
        if gate.shape != (t, width):
            raise BackendError(f"cuda attention: gate {gate.shape} for an output of {(t, width)}")
        if gate.dtype != cupy.float32 or gate.strides[1] != 4 or gate.strides[0] % 4:
            gate = cupy.ascontiguousarray(gate, dtype=cupy.float32)
    if t == 0:
        return out
    if meta.device is None:
        meta.device = upload_meta(meta)
    dm: DeviceMeta = meta.device
    n = len(meta.context_lens)
    group = hq // hk
    ctx_bucket = context_bucket(meta.max_context_len)
    if causal and meta.max_q_len <= DECODE_MAX_Q and ctx_bucket <= tuning.invariant_max_context:
        wm, wn = 1, 4  # decode / verify: the row-invariant shape, one K/V tile per split
        split_tiles = 1
        nsplit = cdiv(ctx_bucket, BN)
    else:
        wm, wn = choose_layout(meta.max_q_len * group)
        split_tiles = 0
    qtiles = cdiv(meta.max_q_len * group, 16 * wm)
    smem = (16 * wm * d + 4 * BN * d) * 2  # Q tile + double-buffered K and V tiles, bf16
    kern = _forward_kernel(d, wm, wn, gated, smem, tuning)
    if not split_tiles:
        nsplit = choose_splits(qtiles * (batch_bucket(n) or n) * hk, ctx_bucket, num_sms * ctas_per_sm(kern, smem))
    if nsplit > MAX_SPLITS:
        raise BackendError(f"cuda attention: {nsplit} key splits, at most {MAX_SPLITS}")
    if nsplit > 1:
        o_part = cupy.empty((nsplit, t, hq, d), dtype=cupy.float32)  # per-split normalised outputs
        lse_part = cupy.empty((nsplit, t, hq), dtype=cupy.float32)  # per-split log2-sum-exp
    else:
        o_part = lse_part = cupy.empty((1,), dtype=cupy.float32)  # unused placeholders
    # the gate's pointer and row stride (a placeholder pointer for the ungated kernels, which never read it)
    gating = (gate, i64(gate.strides[0] // 4)) if gated else (o_part, i64(0))
    tree_words = meta.tree_mask.shape[1] if meta.tree_mask is not None else 0
    if tree_words and dm.tree_mask is None:
        raise BackendError("cuda attention: draft-tree masks are on the host only (prepare_meta did not upload them)")
    kern((qtiles, n * hk, nsplit), (THREADS,),
         (q, i64(sq), k_cache, v_cache, dm.cu_seqlens, dm.context_lens, dm.block_tables,
          i32(dm.block_tables.shape[1]), i32(block_size), i32(hq), i32(hk), f32(scale), i32(1 if causal else 0),
          i32(max(0, int(window))), i32(nsplit), i32(split_tiles), i32(t), out, o_part, lse_part,
          dm.tree_seq if tree_words else dm.cu_seqlens, dm.tree_mask if tree_words else dm.cu_seqlens,
          i32(tree_words), *gating),
         shared_mem=smem)
    if nsplit > 1:
        rows = t * hq
        names = _layouts(d, gated)
        combine = kernel_loader.function("attention", names[-1], names, tuning=tuning)
        combine((cdiv(rows, THREADS // 32),), (THREADS,),
                (o_part, lse_part, out, i32(rows), i32(nsplit), *gating, i32(hq)))
    return out
