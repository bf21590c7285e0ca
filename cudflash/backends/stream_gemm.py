"""The weight-streaming GEMM of decode, verify and propose: y[M, N] = x[M, K] @ w[N, K].T for M <= 16
(kernels/stream_gemm.cu).

At a few rows a bf16 GEMM reads its weight once and does little else. cuBLAS's kernels for it cannot be launched
with programmatic dependent launch (they never wait on the grid dependency, so behind a programmatic edge they
would read stale inputs), so inside a captured step each one starts only after the kernel in front has drained,
and the latency-bound kernels between GEMMs (norms, RoPE, attention) leave HBM idle. This kernel is launched
with PDL: its CTAs sit resident behind those kernels and request their first weight tiles into a shared-memory
ring before waiting for x. The tiles come in by TMA (tensor maps encoded here through the driver), a few large
copies per stage, because a copy per weight row is bound by the number of copies, not by bytes.

The launch plan (`plan_for`) depends on (N, K) and the device alone, never on M, so every output row's float32
summation order is the same at any M: a verify pass computes the bits of the decode passes of its rows.

A weight with too few 16-row tiles for the SMs over a long K (Qwen3-4B's down_proj: a whole-block plan leaves 52 of
132 SMs idle; plan_for says where) is streamed split (`Plan.split`, stream-K): its CTAs share the (block, k tile)
units evenly, a block that spans two CTAs is summed by the one holding its first k tile, which adds the other's
float32 partial (SplitK in the kernel, through a workspace of the device: `split_workspace`). Where a block's K
range is cut depends on (t, grid), so a split weight takes the same t and grid in every launch, a wide one's
included.

A few rows of x (a decode step at batch 1: one row of 8-24 KiB) are copied into shared memory once, after the wait,
instead of in boxes beside every weight stage (`resident_x_bytes`): the ring then holds weight alone, in as many
stages as with boxes. Only where x's bytes come from changes, not the MMAs or their order, so the bits are the same
either way. A quantized weight's ring, with x resident or in boxes, keeps at least
`tuning.stream_gemm_quantized_stages` (`floored_plan`: its stages are small, and two or three of them hold too
little in flight); deeper rings keep the bits too.

Two epilogues remove the RMSNorm launches between a layer's GEMMs (`Epilogue`): the GEMM in front of a norm
(o_proj, down) adds the residual and writes `norm_w * r` with its partial sums of r^2, and the GEMM after it
(gate_up, the next qkv) scales its output rows by the rsqrt those sums give. A base.DeferredNorm carries the
product (its `partial`: PartialNorm).
A third removes the SwiGLU kernel between gate_up and down: with gate and up rows interleaved in groups of 8
(CudaBackend.gate_up_weight), gate_up's epilogue holds both halves of a feature in one lane and writes
silu(gate) * up as bf16 (`swiglu`).

FP8 weights (fp8_weight.Fp8Weight: E4M3 codes [N, K] with float32 scales per 128 columns and a scale row per weight
row) stream through the same kernel (its W8 instantiations, compiled as a module of their own so that the bf16
build is unchanged): half the weight bytes per stage, the codes decoded to bf16 on chip (exactly), each 64-column
partial sum scaled in float32. Every epilogue works the same; the plan is a function of (N, K, the weight's format)
and the device, still never of M. The scales come into shared memory with the codes (the copy warp stages them),
so no compute warp waits on a global load in its loop.

NVFP4 weights (fp4_weight.Fp4Weight: E2M1 codes in w4_layout's device layout, a byte per 16-column scale, a global
scale per row) take its W4 instantiations: stages of 512 columns (the code bytes of an FP8 stage), the scale bytes
brought by a second tensor map beside the codes, each decoded pair multiplied by its scale in bf16 (exactly), the
global scale applied to each row's float32 sum.

A quantized product of more than 16 rows (a verify of several sequences, whose rows must keep their decodes' bits)
streams in wide launches of 32 or 64 rows (`wide_plan`, tuning.quantized_launch_rows): x in boxes of that many rows,
each weight fragment decoded once for all of them. A row's float32 summation order depends on (K, the stage's
columns, the compute warps) alone, not on the row tiles t or the token tiles of a launch, so a row of a wide launch
has the bits of that row streamed alone.
"""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, replace

import cupy

from cudflash.backends import kernel_loader, pdl
from cudflash.backends.base import DeferredNorm
from cudflash.backends.cuda_util import i32
from cudflash.backends.fp4_weight import Fp4Weight
from cudflash.backends.fp8_weight import SCALE_COLS, Fp8Weight
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError

MAX_ROWS = 16  # two token tiles of 8
# Row tiles per block of a wide launch, by (bits, token tiles): the most whose accumulators stay in registers
# (ptxas -v; W4's x boxes of 512 columns make a 64-row stage 69 KB, so its launches stop at 32 rows).
WIDE_MAX_T = {(8, 4): 4, (8, 8): 2, (4, 4): 2}
# Shared memory of a wide launch's CTA: the deep x boxes need more than SMEM_BUDGET; Hopper's opt-in limit of
# 227 KiB per CTA less the kernel's static row_scale.
WIDE_SMEM_BUDGET = (227 << 10) - 4 * MAX_ROWS
MAX_PARTS = 256  # SG_MAX_PARTS: producer CTAs whose partial sums of squares a row-scaling GEMM folds
SPLIT_ACC = 64  # SG_SPLIT_ACC: float32 per lane of a split block's partial
# A weight streams split where that takes at least this many tile stages (16 rows x one ring stage's columns), and
# SPLIT_MIN_SHARE of its stream, off the busiest CTA of its whole-block plan: a split costs ~1 us more at the end (the
# owner's wait for its partner's partial), which a smaller saving does not repay (BENCHMARKS.md, "Split plans":
# Qwen3-4B's down_proj saves 30 of 76 tile stages and 1.3-3.8 us, its o_proj 13 of 32 and loses up to 0.3 us,
# Qwen3.5-27B's gate_up 30 of 360 and gains nothing).
SPLIT_MIN_TILE_STAGES, SPLIT_MIN_SHARE = 24, 0.1
# ... and only where the whole-block plan's CTAs fill at most this share of the SMs: inside a step, under PDL, the
# SMs a whole-block plan leaves free run the neighbouring kernels' CTAs, and a split over every SM made Qwen3.5-27B's
# step slower (its down_proj and qkvg at 81-85%: AR +0.34, verify +0.60 ms) where the GEMM alone was faster.
SPLIT_MAX_OCCUPANCY = 0.75
SPLIT_T = 2  # a split plan's row blocks: a ring of 4 stages (t = 4 has 2); WIDE_MAX_T's smallest, for wide launches
KT = 256  # K columns per ring stage (bf16, FP8): 64 per compute warp, four k16 MMA steps
KT_W4 = 512  # per ring stage of an NVFP4 weight: the code bytes of an FP8 stage
W4_WARPS = 8  # compute warps over an NVFP4 weight: 64 columns of a stage each (one ldmatrix.x4 per tile)
BOX_K = 64  # K columns per TMA box: 128 bytes, the span of the 128-byte swizzle
X_RESIDENT_BYTES = 32 << 10  # x's rows are resident (see above) while they take at most this much shared memory
# Shared memory per CTA, all of it requested: more than half an SM's 228 KiB, so two of these CTAs never share an
# SM (a kernel launched early under PDL would otherwise pile its CTAs onto the SMs free at that moment and stream
# at half speed there), while one attention CTA (70 KiB) still fits beside one.
SMEM_BUDGET = 116 << 10
MAX_STAGES = 16  # ring stages a CTA's full / empty barriers are laid out for (fixed_bytes)
BF16_WARPS = 4  # compute warps (the kernel's CW) of a bf16 weight; an FP8 one's: tuning.stream_gemm_w8_warps
Weight = cupy.ndarray | Fp8Weight | Fp4Weight
_Y = {"float32": "float", "bfloat16": "bf16", "uint16": "bf16"}
PLAIN, ADD_NORM, ROW_SCALE, SWIGLU = 0, 1, 2, 4  # SG_PLAIN, SG_ADD_NORM, SG_ROW_SCALE, SG_SWIGLU (a flag)


@dataclass(frozen=True)
class Plan:
    """One launch: row blocks of 16 t weight rows, `grid` CTAs taking blocks round robin, a ring of `stages`."""

    t: int  # 16-row tiles per block (1..4)
    grid: int
    stages: int

    bits: int = 16  # bits per weight element: 16 bf16, 8 FP8 (boxes of 128 one-byte codes), 4 NVFP4 (256 codes)
    warps: int = BF16_WARPS  # compute warps (CW): each takes stage_cols / warps columns of a stage; one more copies
    nt: int = 2  # token tiles of 8 rows the launch is sized for: 1 or 2 (up to 16 rows), a wide launch's 4 or 8
    split: bool = False  # stream-K: the grid shares (block, k tile) units evenly, blocks may span two CTAs

    @property
    def threads(self) -> int:
        return 32 * (self.warps + 1)

    @property
    def kt(self) -> int:
        return stage_cols(self.bits)

    @staticmethod
    def stage_bytes(t: int, x_resident: bool = False, bits: int = 16, nt: int = 2) -> int:
        """One ring stage: the weight's stage_cols(bits) columns of 16 t rows, and x boxes [x_box_rows(nt)][BOX_K]
        bf16 over them unless x is resident; FP8: and the stage's scales, KT / 128 x 16 t float32 (the copy warp
        stages them beside the codes); NVFP4: and its scale bytes, 16 t x KT_W4 / 16, the stage rounded up to 1024
        bytes."""
        kt = stage_cols(bits)
        x = 0 if x_resident else kt // BOX_K * x_box_rows(nt) * BOX_K * 2
        if bits == 4:
            return -(-(16 * t * kt // 2 + x + 16 * t * kt // 16) // 1024) * 1024
        return 16 * t * kt * bits // 8 + x + (KT // SCALE_COLS * 16 * t * 4 if bits == 8 else 0)

    def smem(self, x_bytes: int | None = None) -> int:
        """Dynamic shared memory to request, with x's rows resident (`x_bytes`) or in boxes (None): at least
        SMEM_BUDGET, which keeps two CTAs off one SM."""
        ring = self.stages * self.stage_bytes(self.t, x_bytes is not None, self.bits, self.nt)
        return max(SMEM_BUDGET, self.fixed_bytes(self.t, self.warps, self.nt) + ring + (x_bytes or 0))

    @staticmethod
    def fixed_bytes(t: int, warps: int = BF16_WARPS, nt: int = 2) -> int:
        """Everything but the ring and resident x: alignment slack, the partials red[warps - 1][t][nt][4][32]
        float32, the barriers (full and empty for up to MAX_STAGES stages, the x barrier)."""
        return 1024 + (warps - 1) * t * nt * 4 * 32 * 4 + MAX_STAGES * 16 + 16


def ring_stages(room: int, stage: int) -> int:
    """Ring stages of `stage` bytes that `room` bytes of shared memory hold, at most MAX_STAGES."""
    return min(MAX_STAGES, room // stage)


def x_box_rows(nt: int) -> int:
    """Rows of an x box: 16 for launches of up to 16 rows, 8 nt for a wide one."""
    return 8 * nt if nt > 2 else 16


def stage_cols(bits: int) -> int:
    """K columns per ring stage for a weight of `bits` per element (K must be a multiple)."""
    return KT_W4 if bits == 4 else KT


def weight_bits(w: Weight) -> int:
    return 4 if isinstance(w, Fp4Weight) else 8 if isinstance(w, Fp8Weight) else 16


def resident_x_bytes(m: int, k: int, bits: int = 16) -> int | None:
    """Shared memory for x [m, k]'s rows, each padded by 16 bytes (FP8: 32, NVFP4: 64; the kernel's XRES layout), if
    they are to be resident: one token tile (m <= 8) within X_RESIDENT_BYTES; else None (x comes in boxes)."""
    size = m * (2 * k + {16: 16, 8: 32, 4: 64}[bits])
    return size if m <= 8 and size <= X_RESIDENT_BYTES else None


# What a row block costs beyond streaming its t tiles, in tiles: its start and the four warps' final sums. Fitted to
# the plan sweep (BENCHMARKS.md, "The streaming GEMM's plans"): Qwen3.5-9B's qkvg [10240, 4096] in 5 rounds of 1 tile
# took 28.0 us against 23.4 us in 2 rounds of 3 tiles, (5 + 5 c) / (6 + 2 c) = 1.2.
BLOCK_OVERHEAD_TILES = 0.85


@functools.cache
def plan_for(n: int, k: int, num_sms: int, bits: int = 16, warps: int = BF16_WARPS, split: bool = True) -> Plan:
    """Row blocks of t = 4..1 tiles, the t whose CTAs finish first: each CTA streams `rounds` blocks of t tiles and
    pays BLOCK_OVERHEAD_TILES per block (ties go to larger blocks, which share each x tile across more weight
    rows). Counting only the SM slots the last round leaves idle picked one-tile blocks whenever they divided
    evenly (1.2x slower at 9B's qkvg, and for 27B's qkvg and gate_up). bits: the weight's format (FP8's smaller
    stages make the ring deeper); warps: its compute warps (their partials take shared memory from the ring).
    Where those CTAs leave SMs idle (N = 2560, 5120: too few blocks) and sharing the units over every SM would take
    SPLIT_MIN_TILE_STAGES and SPLIT_MIN_SHARE off the busiest CTA's stream, and those CTAs fill at most
    SPLIT_MAX_OCCUPANCY of the SMs, the plan is split (stream-K, `split` allowing), in blocks of SPLIT_T tiles."""
    tiles = math.ceil(n / 16)

    def cost(t: int) -> float:
        return math.ceil(math.ceil(tiles / t) / num_sms) * (t + BLOCK_OVERHEAD_TILES)

    t = min((4, 3, 2, 1), key=cost)
    blocks = math.ceil(tiles / t)
    rounds = math.ceil(blocks / num_sms)
    grid = math.ceil(blocks / rounds)
    ktiles = k // stage_cols(bits)
    units = math.ceil(tiles / SPLIT_T) * ktiles  # of a split plan: every CTA must have at least one
    busiest = rounds * t * ktiles
    saved = busiest - units * SPLIT_T / num_sms
    if (split and units >= num_sms and saved >= max(SPLIT_MIN_TILE_STAGES, SPLIT_MIN_SHARE * busiest)
            and blocks <= SPLIT_MAX_OCCUPANCY * rounds * num_sms):
        return split_plan(num_sms, bits, warps)
    stages = ring_stages(SMEM_BUDGET - Plan.fixed_bytes(t, warps), Plan.stage_bytes(t, bits=bits))
    return Plan(t=t, grid=grid, stages=max(2, stages), bits=bits, warps=warps)


def split_plan(grid: int, bits: int = 16, warps: int = BF16_WARPS) -> Plan:
    """A stream-K plan of blocks of SPLIT_T tiles (the kernel's SPLIT instantiations) over `grid` CTAs (at most the
    SMs: every CTA must be resident at once)."""
    t = SPLIT_T
    stages = ring_stages(SMEM_BUDGET - Plan.fixed_bytes(t, warps), Plan.stage_bytes(t, bits=bits))
    return Plan(t=t, grid=grid, stages=max(2, stages), bits=bits, warps=warps, split=True)


def weight_plan(n: int, k: int, num_sms: int, bits: int, tuning: CudaTuning) -> Plan:
    """plan_for with the weight format's compute warps and the tuning's choice of split plans."""
    return plan_for(n, k, num_sms, bits, _warps(bits, tuning), tuning.stream_gemm_split)


def _warps(bits: int, tuning: CudaTuning) -> int:
    return {16: BF16_WARPS, 8: tuning.stream_gemm_w8_warps, 4: W4_WARPS}[bits]


@functools.cache
def wide_plan(n: int, k: int, num_sms: int, bits: int, warps: int, nt: int, split: bool = True) -> Plan:
    """The plan of a wide launch (nt = 4 or 8 token tiles) over a quantized weight: row blocks of at most
    WIDE_MAX_T[bits, nt] tiles, chosen as plan_for chooses, and a ring filling WIDE_SMEM_BUDGET. Its rows' bits are
    those of plan_for's launches (the order of a row's sums does not depend on t or nt; a split plan's does, and
    its t and grid are kept)."""
    tiles = math.ceil(n / 16)
    most = WIDE_MAX_T[bits, nt]
    base = plan_for(n, k, num_sms, bits, warps, split)
    if base.split:
        if base.t > most:
            raise BackendError(f"stream_gemm: a split plan of {base.t} tiles has no wide launch of {8 * nt} rows")
        t, grid = base.t, base.grid
    else:
        def cost(t: int) -> float:
            return math.ceil(math.ceil(tiles / t) / num_sms) * (t + BLOCK_OVERHEAD_TILES)

        t = min(range(most, 0, -1), key=cost)
        blocks = math.ceil(tiles / t)
        grid = math.ceil(blocks / math.ceil(blocks / num_sms))
    stages = ring_stages(WIDE_SMEM_BUDGET - Plan.fixed_bytes(t, warps, nt), Plan.stage_bytes(t, bits=bits, nt=nt))
    return Plan(t=t, grid=grid, stages=stages, bits=bits, warps=warps, nt=nt, split=base.split)


def launch_plan(m: int, n: int, k: int, num_sms: int, bits: int, tuning: CudaTuning) -> Plan:
    """The plan of one launch of m rows: plan_for's up to MAX_ROWS, a wide plan for up to 64 quantized rows (the
    fewest token tiles that hold them)."""
    if m <= MAX_ROWS:
        return weight_plan(n, k, num_sms, bits, tuning)
    nt = 4 if m <= 32 else 8
    if bits == 16 or (bits, nt) not in WIDE_MAX_T:
        raise BackendError(f"stream_gemm: no launch of {m} rows over a {bits}-bit weight")
    return wide_plan(n, k, num_sms, bits, _warps(bits, tuning), nt, tuning.stream_gemm_split)


def deep_plan(plan: Plan, x_bytes: int | None, smem: int, most: int = MAX_STAGES) -> Plan:
    """The plan with the same blocks and grid (so the same sums and bits) and the ring as deep as `smem` allows, up
    to `most` stages (never shallower than the plan's): for a launch behind kernels that leave HBM idle (attention,
    the GDN mixer), which requests all of it before the wait (tuning.stream_gemm_prefetch_all_kib), and for the
    ring floors (floored_plan). Wide and split plans are kept as they are."""
    if plan.nt > 2 or plan.split:
        return plan
    room = smem - Plan.fixed_bytes(plan.t, plan.warps, plan.nt) - (x_bytes or 0)
    stages = min(most, ring_stages(room, Plan.stage_bytes(plan.t, x_bytes is not None, plan.bits, plan.nt)))
    return replace(plan, stages=max(plan.stages, stages))


def floored_plan(plan: Plan, x_bytes: int | None, tuning: CudaTuning) -> Plan:
    """The plan of a quantized weight with its ring at least tuning.stream_gemm_quantized_stages deep where the shared
    memory allows (deep_plan: the same blocks and grid, so the same bits): within SMEM_BUDGET with x resident, within
    WIDE_SMEM_BUDGET with x in boxes. A bf16 weight keeps its plan."""
    floor = tuning.stream_gemm_quantized_stages if plan.bits < 16 else 0
    if plan.stages >= floor:
        return plan
    return deep_plan(plan, x_bytes, SMEM_BUDGET if x_bytes is not None else WIDE_SMEM_BUDGET, floor)


_SMEM_PER_SM, _SMEM_PER_BLOCK_OPTIN = 81, 97  # cudaDeviceAttr values


@functools.cache
def available() -> bool:
    """TMA and mbarrier transaction counts need Hopper (sm_90) or later, and the driver's tensor-map encoder. The
    shared-memory request must fit one CTA and exceed half an SM (Hopper and datacenter Blackwell: 228 KiB per SM);
    a GPU with less (a consumer Blackwell part has about 100 KiB) keeps cuBLAS rather than a layout not measured."""
    dev = cupy.cuda.Device()
    if int(dev.compute_capability) < 90 or pdl._driver() is None or _encoder() is None:
        return False
    per_sm = cupy.cuda.runtime.deviceGetAttribute(_SMEM_PER_SM, dev.id)
    per_block = cupy.cuda.runtime.deviceGetAttribute(_SMEM_PER_BLOCK_OPTIN, dev.id)
    return per_block >= SMEM_BUDGET and 2 * (SMEM_BUDGET + 1024) > per_sm


def usable(m: int, n: int, k: int, nbytes: int, tuning: CudaTuning) -> bool:
    """Whether CudaBackend.linear takes this kernel for x [m, k] @ w [n, k].T. Never a function of m within
    1..MAX_ROWS: a weight must take one path for decode and verify alike, or their rows would differ. (Below the
    tuning's stream_gemm_min_bytes a GEMM is launch bound either way, and the tiny pair's goldens keep cuBLAS.)"""
    return 1 <= m <= MAX_ROWS and k % KT == 0 and nbytes >= tuning.stream_gemm_min_bytes and available()


def fusable(m: int, n: int, k: int, nbytes: int, num_sms: int, tuning: CudaTuning) -> bool:
    """Whether x [m, k] @ w [n, k].T can be an SG_ADD_NORM producer: usable, with few enough CTAs to fold."""
    return usable(m, n, k, nbytes, tuning) and weight_plan(n, k, num_sms, 16, tuning).grid <= MAX_PARTS


def usable_quantized(m: int, n: int, k: int, bits: int) -> bool:
    """Whether one launch of this kernel takes an FP8 (bits 8) or NVFP4 (4) weight [n, k] for x [m, k]: any size (the
    alternative is a dequantization to bf16 and cuBLAS, two launches and more bytes, so no minimum as for bf16),
    K a multiple of the stage's columns, and again never a function of m within 1..MAX_ROWS."""
    return 1 <= m <= MAX_ROWS and k % stage_cols(bits) == 0 and available()


def streams_quantized(m: int, n: int, k: int, bits: int, tuning: CudaTuning) -> bool:
    """Whether CudaBackend.linear streams the codes for x [m, k]: in launches of MAX_ROWS rows (stream_chunks) up to
    tuning.quantized_stream_max_rows rows. Each launch reads the whole weight, so beyond a few launches the
    dequantized bf16 weight and cuBLAS are faster; a row's bits are those it has alone either way it streams."""
    return 1 <= m <= max(MAX_ROWS, tuning.quantized_stream_max_rows) and usable_quantized(1, n, k, bits)


def launch_rows(bits: int, tuning: CudaTuning) -> int:
    """The most rows one launch of a streamed quantized product takes: tuning.quantized_launch_rows, NVFP4's at
    most 32 (WIDE_MAX_T); 16 on a GPU whose CTAs cannot have WIDE_SMEM_BUDGET."""
    if not _wide_available():
        return MAX_ROWS
    rows = tuning.quantized_launch_rows
    return min(rows, 32) if bits == 4 else rows


@functools.cache
def _wide_available() -> bool:
    dev = cupy.cuda.Device()
    return cupy.cuda.runtime.deviceGetAttribute(_SMEM_PER_BLOCK_OPTIN, dev.id) >= WIDE_SMEM_BUDGET + 4 * MAX_ROWS


def stream_chunks(m: int, per: int = MAX_ROWS) -> list[slice]:
    """The rows of each launch of a streamed product of m rows: `per` at a time (up to MAX_ROWS, a few rows, in
    one launch)."""
    per = max(per, MAX_ROWS) if m > MAX_ROWS else MAX_ROWS
    return [slice(i, min(i + per, m)) for i in range(0, m, per)]


def fusable_quantized(m: int, n: int, k: int, bits: int, num_sms: int, tuning: CudaTuning) -> bool:
    """usable_quantized, as an SG_ADD_NORM producer (few enough CTAs to fold)."""
    return usable_quantized(m, n, k, bits) and weight_plan(n, k, num_sms, bits, tuning).grid <= MAX_PARTS


class TensorMap(ctypes.Structure):  # CUtensorMap: 128 opaque bytes, passed to the kernel by value
    _fields_ = [("words", ctypes.c_uint64 * 16)]


class Epilogue(ctypes.Structure):  # struct Epilogue in stream_gemm.cu, passed by value
    _fields_ = [("residual", ctypes.c_void_p), ("norm_w", ctypes.c_void_p), ("normed", ctypes.c_void_p),
                ("ssq", ctypes.c_void_p), ("parts", ctypes.c_int), ("width", ctypes.c_int), ("eps", ctypes.c_float)]


class SplitK(ctypes.Structure):  # struct SplitK in stream_gemm.cu, passed by value (null for whole-block plans)
    _fields_ = [("part", ctypes.c_void_p), ("flag", ctypes.c_void_p)]


@functools.cache
def _split_workspace(device: int, num_sms: int) -> tuple[cupy.ndarray, cupy.ndarray]:
    # part [num_sms, SPLIT_ACC, 32] float32, flag [num_sms, 32] uint32 (zero between launches: each reader resets
    # the flags it read). One per device: every launch is on the engine's one stream, and a GEMM writes to it only
    # after the GEMM in front has completed.
    return (cupy.zeros((num_sms, SPLIT_ACC, 32), dtype=cupy.float32),
            cupy.zeros((num_sms, 32), dtype=cupy.uint32))


def split_workspace(num_sms: int) -> tuple[cupy.ndarray, cupy.ndarray]:
    """The split plans' workspace of the current device (CudaBackend allocates it up front, before any capture)."""
    return _split_workspace(cupy.cuda.Device().id, num_sms)


class WeightScales(ctypes.Structure):  # struct WeightScales in stream_gemm.cu, passed by value (null for bf16)
    _fields_ = [("scale", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("cols", ctypes.c_int),
                ("gscale", ctypes.c_void_p)]


@dataclass(frozen=True, eq=False)
class PartialNorm:
    """rms_norm(residual) * weight, not yet scaled by its rows' rsqrt (a DeferredNorm's `partial`): what an
    SG_ADD_NORM GEMM leaves for the next GEMM, which applies the scale to its output rows (SG_ROW_SCALE). For a
    consumer that cannot (a small weight on cuBLAS), CudaBackend.linear fills the DeferredNorm's `plain` once with
    the RMSNorm kernel's rows."""

    normed: cupy.ndarray  # [M, H] bf16: weight * residual
    ssq: cupy.ndarray  # [parts, MAX_ROWS] float32: each producer CTA's sums of residual^2 over its columns


@functools.cache
def _encoder():
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_UINT8, _BF16, _SWIZZLE_NONE, _SWIZZLE_128B, _L2_256B = 0, 9, 0, 3, 3  # CUtensorMap{DataType,Swizzle,L2promotion}


@functools.lru_cache(maxsize=4096)
def tensor_map(ptr: int, rows: int, cols: int, row_stride: int, box_rows: int, itemsize: int = 2,
               box_bytes: int | None = None) -> TensorMap:
    """A bf16 (itemsize 2) or uint8 (itemsize 1: FP8 / NVFP4 codes) [rows, cols] matrix (row stride in elements)
    read in boxes of [box_rows, 128 bytes of columns], 128-byte swizzled; or of [box_rows, box_bytes] unswizzled
    (the NVFP4 scale bytes). Boxes past the last row are filled with zeros. Keyed by address and shape, so a
    weight's map is built once."""
    out = TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride * itemsize)
    box = (ctypes.c_uint32 * 2)((box_bytes or BOX_K * 2) // itemsize, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    dtype = _BF16 if itemsize == 2 else _UINT8
    swizzle = _SWIZZLE_128B if box_bytes is None else _SWIZZLE_NONE
    status = _encoder()(ctypes.byref(out), dtype, 2, ptr, dims, strides, box, unit, 0, swizzle, _L2_256B, 0)
    if status != 0:
        raise BackendError(f"cuTensorMapEncodeTiled failed ({status}) for [{rows}, {cols}] stride {row_stride}")
    return out


def _name(t: int, nt: int, y: str, epilogue: int, x_resident: bool, bits: int, warps: int,
          split: bool = False) -> str:
    b = {True: "true", False: "false"}
    return f"stream_gemm<{t}, {nt}, {stage_cols(bits)}, {y}, {epilogue}, {b[x_resident]}, {bits}, {warps}, {b[split]}>"


@functools.cache
def _names(bits: int, warps: int) -> tuple[str, ...]:
    """Every instantiation of a module: one per weight format (bf16, FP8 with the tuning's compute warps, NVFP4: the
    same source compiled apart, so that one format's instantiations never change another's build)."""
    few = tuple(_name(t, nt, y, e, res, bits, warps, split) for t in (1, 2, 3, 4) for split in (False, True)
                if t == SPLIT_T or not split
                for nt, res in ((1, False), (2, False), (1, True))
                for y, e in (("float", PLAIN), ("bf16", PLAIN), ("float", ADD_NORM), ("float", ROW_SCALE),
                             ("bf16", ROW_SCALE), ("bf16", SWIGLU), ("bf16", ROW_SCALE | SWIGLU)))
    wide = tuple(_name(t, nt, y, e, False, bits, warps, split) for (b, nt), most in WIDE_MAX_T.items() if b == bits
                 for t in range(1, most + 1) for split in (False, True) if t == SPLIT_T or not split
                 for y, e in (("float", PLAIN), ("bf16", PLAIN), ("bf16", SWIGLU)))
    return few + wide


def stream_gemm(x: cupy.ndarray, w: Weight, y: cupy.ndarray, num_sms: int, tuning: CudaTuning,
                swiglu: bool = False) -> None:
    """y[M, N] = x[M, K] @ w[N, K].T; x bf16 with 16-byte aligned rows, w bf16 contiguous, an Fp8Weight or an
    Fp4Weight, y bf16 or float32 contiguous (the caller, CudaBackend.linear, checks `usable` / `usable_quantized` and
    the layouts). swiglu: w is
    an interleaved gate_up weight (N % 16 == 0) and y [M, N / 2] bf16 gets silu(gate) * up."""
    _launch(x, w, y, num_sms, tuning, SWIGLU if swiglu else PLAIN, Epilogue())


def add_norm(x: cupy.ndarray, w: Weight, residual: cupy.ndarray, norm_w: cupy.ndarray,
             eps: float, num_sms: int, tuning: CudaTuning,
             prefetch_all: bool = False) -> tuple[DeferredNorm, cupy.ndarray]:
    """(rms_norm(r) * norm_w deferred, r) with r = residual + x @ w.T, float32 [M, N]; residual contiguous float32
    [M, N], norm_w bf16 [N]. prefetch_all: the kernels in front leave HBM idle (deep_plan)."""
    m, n = x.shape[0], w.shape[0]
    parts = weight_plan(n, w.shape[1], num_sms, weight_bits(w), tuning).grid  # <= MAX_PARTS: checked
    r = cupy.empty((m, n), dtype=cupy.float32)
    normed = cupy.empty((m, n), dtype=x.dtype)
    ssq = cupy.empty((parts, MAX_ROWS), dtype=cupy.float32)
    _launch(x, w, r, num_sms, tuning, ADD_NORM,
            Epilogue(residual.data.ptr, norm_w.data.ptr, normed.data.ptr, ssq.data.ptr), prefetch_all=prefetch_all)
    return DeferredNorm(r, norm_w, eps, partial=PartialNorm(normed, ssq)), r


def row_scaled(x: DeferredNorm, w: Weight, y: cupy.ndarray, num_sms: int, tuning: CudaTuning,
               swiglu: bool = False) -> None:
    """y = rms_norm(x.residual) * x.weight @ w.T, from the partial form add_norm left: normed @ w.T, rows scaled
    (swiglu: as in stream_gemm)."""
    part: PartialNorm = x.partial
    _launch(part.normed, w, y, num_sms, tuning, ROW_SCALE | (SWIGLU if swiglu else 0),
            Epilogue(ssq=part.ssq.data.ptr, parts=part.ssq.shape[0], width=part.normed.shape[1], eps=x.eps))


def kernel_name(m: int, w: Weight, y: cupy.ndarray, num_sms: int, tuning: CudaTuning,
                epilogue: int = PLAIN) -> str:
    """The instantiation a launch for x [m, K] @ w.T into y takes (a microbench compiles just the ones it needs:
    `_launch`'s `names`)."""
    n, k = w.shape
    bits = weight_bits(w)
    plan = launch_plan(m, n, k, num_sms, bits, tuning)
    nt = plan.nt if m > MAX_ROWS else 1 if m <= 8 else 2
    return _name(plan.t, nt, _Y[y.dtype.name], epilogue, resident_x_bytes(m, k, bits) is not None, bits, plan.warps,
                 plan.split)


def _launch(x: cupy.ndarray, w: Weight, y: cupy.ndarray, num_sms: int, tuning: CudaTuning,
            epilogue: int, epi: Epilogue, names: tuple[str, ...] | None = None, prefetch_all: bool = False) -> None:
    """names: the instantiations to compile into the module (default: all of the weight format's); prefetch_all:
    see deep_plan."""
    m, k = x.shape
    n = w.shape[0]
    bits = weight_bits(w)
    if epilogue & SWIGLU and (n % 16 or y.shape != (m, n // 2) or y.dtype.name == "float32"):
        raise BackendError(f"stream_gemm swiglu: weight rows {n} (need a multiple of 16), y {y.shape} {y.dtype}")
    if m > MAX_ROWS and epilogue & ~SWIGLU:
        raise BackendError(f"stream_gemm: the norm epilogues take at most {MAX_ROWS} rows, not {m}")
    plan = launch_plan(m, n, k, num_sms, bits, tuning)
    x_bytes = resident_x_bytes(m, k, bits)
    plan = floored_plan(plan, x_bytes, tuning)
    prefill = tuning.stream_gemm_prefill_stages
    if prefetch_all and tuning.stream_gemm_prefetch_all_kib:
        plan = deep_plan(plan, x_bytes, tuning.stream_gemm_prefetch_all_kib << 10)
        prefill = plan.stages
    name = kernel_name(m, w, y, num_sms, tuning, epilogue)
    kern = kernel_loader.function("stream_gemm", name, names or _names(bits, plan.warps), tuning=tuning)
    smem = plan.smem(x_bytes)
    kern.reserve_shared(smem)
    ldx = x.strides[0] // x.itemsize if m > 1 else k
    smap = TensorMap()
    if bits == 4:
        wmap = tensor_map(w.data.data.ptr, n, k // 2, k // 2, 16 * plan.t, itemsize=1)
        smap = tensor_map(w.scale.data.ptr, n, k // 16, k // 16, 16 * plan.t, itemsize=1, box_bytes=KT_W4 // 16)
        scales = WeightScales(gscale=w.gscale.data.ptr)
    elif bits == 8:
        wmap = tensor_map(w.data.data.ptr, n, k, k, 16 * plan.t, itemsize=1)
        scales = WeightScales(w.scale.data.ptr, w.rows.data.ptr, w.scale.shape[1])
    else:
        wmap, scales = tensor_map(w.data.ptr, n, k, k, 16 * plan.t), WeightScales()
    xmap = tensor_map(x.data.ptr, m, k, ldx, x_box_rows(plan.nt)) if x_bytes is None else _x_rows(x.data.ptr, 2 * ldx)
    split = SplitK()
    if plan.split:
        if plan.grid > num_sms or math.ceil(n / (16 * plan.t)) * (k // plan.kt) < plan.grid:
            raise BackendError(f"stream_gemm: a split plan of {plan.grid} CTAs for [{n}, {k}] ({num_sms} SMs)")
        part, flag = split_workspace(num_sms)
        split = SplitK(part.data.ptr, flag.data.ptr)
    stream = cupy.cuda.get_current_stream()
    args = (wmap, xmap, y, i32(m), i32(n), i32(k), i32(plan.stages), i32(prefill), epi,
            scales, smap, split)
    pdl.launch(kern.raw, (plan.grid,), (plan.threads,), args, smem, stream, programmatic=kern.programmatic(stream))


def _x_rows(ptr: int, stride: int) -> TensorMap:
    """What a resident-x launch passes in the tensor map's place: {x's address, its row stride in bytes}."""
    out = TensorMap()
    out.words[0], out.words[1] = ptr, stride
    return out
