// stream_gemm.cu: y[M, N] = x[M, K] @ w[N, K]^T for a few rows (M <= 16: decode, verify, propose; up to 64 for an
// FP8 / NVFP4 weight, whose many rows of a large verify must keep a decode's bits), the weight
// streamed through a shared-memory ring by bulk asynchronous copies (TMA) that start before the kernel waits for
// its predecessor.
//
// Why: at a few rows a GEMM is a weight stream, and in a captured step the kernels between two GEMMs (norms,
// RoPE, attention) leave HBM idle. Launched with programmatic dependent launch (pdl.py), this kernel's CTAs are
// resident while those kernels run and request their first weight tiles before griddepcontrol.wait: the
// weight does not depend on the predecessor, only x does.
//
// Layout: x [M, K] bf16, row stride ldx (elements; 16-byte aligned rows); w [N, K] bf16 contiguous; y [M, N] Y
// (bf16 or float32) contiguous. K % KT == 0 (the wrapper checks); any N. Both operands come through 2-D tensor
// maps (stream_gemm.py): w in boxes of [16 T rows][64 columns], x in boxes of [16 rows][64 columns] (a wide
// launch of a quantized weight: [8 NT rows], M <= 8 NT <= 64); rows past N or past M are filled with zeros by the
// copy engine, and only reach their own (masked) outputs anyway.
// Work: w's rows form blocks of 16 T, each streamed in K tiles of KT columns (one ring stage holds a tile's KT / 64
// weight boxes and KT / 64 x boxes, layout below): units = blocks x K tiles in (block, k tile) order. CTA i takes
// whole blocks i, i + G, i + 2 G, .. (G CTAs), or (SPLIT: stream-K) the contiguous units i U / G ..
// (i + 1) U / G, so every CTA streams the same bytes even where there are fewer blocks than SMs (Qwen3-4B's
// down_proj: 80 blocks of 2 tiles for 132 SMs). A block then spans CTAs: the one
// holding its k tile 0 owns it; a CTA whose range starts inside a block (only its first) writes that block's float32
// partial sums to SplitK.part and raises its lanes' flags; the owner, at the block's end, adds its own sums and
// then those of the CTAs i + 1, i + 2, .. that hold the rest, in that order, and runs the epilogue. The partial is
// a CTA's first work and the owner's wait its last, so the wait is short; it needs every CTA resident at once
// (the plan: grid <= SMs, one CTA per SM by its shared memory). The order of every sum still depends on the plan
// alone, never on M.
// Warps: 0..CW-1 compute (CW = 4, or 8 for W8 and W4: two per scheduler, below), warp CW copies (its lane 0 arms
// a stage's barrier with the byte count and issues the stage's box copies; W8: all its lanes also stage the
// scales, below). Barriers: full[s] (1 arrival + the bytes; W8: 1 + 32 arrivals), empty[s] (one per compute warp).
// Before griddepcontrol.wait the copy warp requests the weight boxes of the first `prefill` stages; the rest of the
// ring and x's boxes follow the wait. (A stage or two is the head start; a full ring's prefill only competes with
// the latency-bound kernels in front for HBM: the tuning's stream_gemm_prefill_stages.)
// Resident x (XRES, few rows): x's rows are copied once into shared memory after the wait (one bulk copy per row,
// rows padded by 16 bytes so ldmatrix's eight rows hit eight bank groups) and the ring holds weight boxes only,
// as many stages as with boxes (or more: the stage count is the wrapper's). Per stage that saves the x boxes'
// copies, which each stage would otherwise wait for. The MMAs and their order are the same, so are the bits.
// Compute: swapped mma.m16n8k16: A = 16 weight rows, B = 8 tokens (NT token tiles), so y^T tile = W . x^T.
// Compute warp c takes columns [c KT/CW, (c + 1) KT/CW) of every stage for all T row tiles; at the end of a block
// the CW partials are added in the order c = 0, 1, .. through shared memory. The float32 summation order
// therefore depends on (K, KT, CW) alone, never on M: row i of y has the same bits whatever the other rows are
// (a verify row equals the decode of that token alone).
// Shared memory per CTA is sized by the wrapper to more than half an SM, so two of these CTAs never share one.
//
// Epilogues (EPI), which take the RMSNorm between two GEMMs of a layer out of the step (no kernel, no wait):
//   SG_PLAIN     y = x @ w^T.
//   SG_ADD_NORM  the producer: r = residual + x @ w^T is the new residual stream (y = r, float32), written with
//                normed = bf16(norm_w * r) and this CTA's sums of r^2 over its columns, ssq[blockIdx.x][16].
//   SG_ROW_SCALE the consumer of such a normed: y[m] = s[m] * (x @ w^T)[m], s[m] = rsqrt(sum_p ssq[p][m] / width
//                + eps), summed over the producer's parts in a fixed order.
// Together they compute linear(rms_norm(r) * norm_w) with the row scale moved past the GEMM, where it is exact
// (one rounding of x to bf16 either way). Every sum's order depends on the plans alone: rows stay invariant.
//   SG_SWIGLU    a flag, alone or with SG_ROW_SCALE, for a gate_up weight whose rows interleave gate and up in
//                groups of 8 (CudaBackend.gate_up_weight): a 16-row tile's rows g and g + 8 are the gate and up of
//                one feature, so one lane's sums hold both, and y [M, N / 2] bf16 = silu(gate) * up is written
//                directly (swiglu_value, as the swiglu kernel computes it: the same bits; the four compute warps
//                share a block's divisions). No float32 gate_up round trip and no SwiGLU kernel between the two
//                MLP GEMMs. N % 16 == 0.
//
// FP8 weights (W8, W8A16): w [N, K] is uint8 E4M3 codes with float32 block scales, w[n, k] = e4m3(w[n, k]) *
// scale[rows[n]][k / 128] (WeightScales; rows maps each weight row to its scale row: n / 128 for the 128x128 blocks
// of the Qwen -FP8 layout, anything for fused or interleaved weights). The weight's tensor map is uint8 with boxes
// of [16 T rows][128 columns] (rows of 128 bytes again, the same swizzle), so a stage holds KT / 128 weight boxes:
// half of bf16's bytes. x stays bf16 (resident rows XROW = 2 K + 32 bytes apart, see below). Each compute warp's KT / CW
// columns (64, or 32 with eight warps) lie inside one 128-column scale block, so per stage a warp sums them in
// float32 (MMA steps in independent chains of two from zero, columns 0..31 and 32..63, added before the scale: half
// the dependent MMA latency a stage waits for) and adds that partial times the row's scale to its accumulators: the
// codes enter the MMA as exact bf16 values, the scale is applied once per KT / CW columns in float32 (no bf16
// rounding of code * scale), and the summation order still depends on (K, KT, CW) alone. The epilogues are the same.
// Eight compute warps (two per scheduler) for W8: one warp's chain ldmatrix -> decode -> MMA -> scale is serial and
// issue bound, so a second warp per scheduler fills its stalls (BENCHMARKS.md, "The W8 kernel's bottleneck").
// Scales: the copy warp stages them with the codes. With each stage's weight boxes its 32 lanes copy the stage's
// 2 x 16 T scales (the block's 16 T rows, the stage's two scale columns) into scs[stage] by cp.async, counted on
// full[s] by one cp.async.mbarrier.arrive.noinc per lane (full[s] expects 1 + 32 arrivals); the compute warps read
// them from shared memory after the full wait. (Loaded by the compute warps at the top of each stage, the scales
// cost every stage one dependent L2 / HBM round trip: the GEMM ran at half the copy bandwidth, BENCHMARKS.md.) The
// copy warp fetches the row map of block b + 1 while it issues block b, the first ones before griddepcontrol.wait
// (they are weights). Both warps count a stage's slot, phase, k tile and block rather than divide by run-time values.
// Codes to bf16: ldmatrix of a [16 rows][32 bytes] region gives each lane 4 consecutive codes of a row (bytes 4c ..
// 4c + 3, c = lane % 4) per register; e4m3x4_to_bf16 turns them into bf16 pairs (4c, 4c + 2) and (4c + 1, 4c + 3)
// by bit placement alone: each bf16 is the code's value times 2^-120 exactly (a bf16 subnormal for a subnormal
// code; the MMA takes subnormal inputs as they are). The 2^120 is restored outside the MMA in exact powers of two:
// x's bf16 pairs are multiplied by 2^64 (exact for |x| < 2^64; resident rows once, in place, when they have landed,
// x in boxes as each stage reads them) and the scale by 2^56 (exact below 2^72). Scaling every input of a float sum
// by a power of two scales each rounding with it, so a partial sum is 2^-56 times the one of the codes' values and
// scale * partial is the same float (unless a product falls below 2^-126, i.e. |x| < 2^-61, where a contribution
// of relative size 2^-60 is lost).
// The MMA's k index is a permutation of the 16 columns of a step (logical 2c, 2c + 1 <- columns 4c, 4c + 2;
// 8 + 2c, 9 + 2c <- 4c + 1, 4c + 3), and each lane reads x's 4 columns 4c .. 4c + 3 (8 bytes) and permutes them the
// same way: a dot product is a sum over k in any order of the same products. NaN codes (0x7F, 0xFF) are not decoded
// as NaN (the loader refuses non-finite weights before they get here).
//
// NVFP4 weights (W4, W4A16): w [N, K] is E2M1 codes, 8 per 32-bit word, with one E4M3 scale per 16 columns and a
// float32 global scale per row, in the device layout of w4_layout.py (nvfp4.cuh decodes it). The weight's tensor
// map is uint8 over [N, K / 2] with boxes of [16 T rows][128 bytes] (256 columns), a second map (smap) brings the
// scale bytes [N, K / 16] in boxes of [16 T][KT / 16]; a stage is KT = 512 columns, two code boxes and one scale
// box (the same code bytes per stage as W8's), eight compute warps of 64 columns each. Per tile a warp's ldmatrix.x4
// gives each lane one word per row g / g + 8 and 32-column chunk: columns 8 c .. 8 c + 7, the same columns of x as
// one 16-byte read (no permutation: the MMA's k index 2 c, 2 c + 1 <- column 8 c, 8 c + 1, 2 c + 8, 9 + 2 c <-
// 8 c + 2, 8 c + 3, and 8 c + 4 .. for the chunk's second step). Each decoded pair is multiplied (bf16, exactly) by
// its scale, so the MMA takes code * scale * 2^-7 as it is; the two chunks are two accumulator chains, added at the
// block's end, where warp 0 multiplies each row's float32 sum by its global scale * 2^7.
#include "mma.cuh"
#include "nvfp4.cuh"

#define SG_PLAIN 0
#define SG_ADD_NORM 1
#define SG_ROW_SCALE 2
#define SG_SWIGLU 4
#define SG_MAX_ROWS 16
#define SG_MAX_PARTS 256  // producer CTAs an SG_ROW_SCALE consumer can fold (stream_gemm.py checks)

#define SG_W8_BLOCK 128  // columns per FP8 scale
#define SG_SPLIT_ACC 64  // accumulators per lane of a split block's partial: T NT 4 of any instantiation

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// A box of a 2-D tensor map (a CUtensorMap, 128 bytes) at coordinates (c0 innermost, c1) into shared dst
// (1024-byte aligned for the 128-byte swizzle), counted on barrier bar.
struct __align__(64) TensorMap { unsigned long long words[16]; };
// The epilogue's operands (stream_gemm.py's Epilogue mirrors this layout); unused fields are null / zero.
struct Epilogue {
    const float* residual;  // [M, N] float32, row stride N (SG_ADD_NORM)
    const bf16* norm_w;     // [N] (SG_ADD_NORM)
    bf16* normed;           // [M, N] bf16 = norm_w * r (SG_ADD_NORM)
    float* ssq;             // [parts][SG_MAX_ROWS]: written (SG_ADD_NORM, parts = gridDim.x) or read (SG_ROW_SCALE)
    int parts;              // SG_ROW_SCALE: the producer's CTA count
    int width;              // SG_ROW_SCALE: the normed row's length (the producer's N)
    float eps;              // SG_ROW_SCALE
};
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, int c0, int c1, unsigned bar,
                                         unsigned long long policy) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
                 : "memory");
}
// The FP8 weight's scales (W8; unused, null, for bf16 weights).
// W4: only gscale (the scale bytes come by the tensor map smap).
// Stream-K's workspace (see Work above: the SPLIT instantiations); unused (null) by the others, which compile to
// the whole-block loop alone.
struct SplitK {
    float* part;     // [gridDim.x][SG_SPLIT_ACC][32] float32: CTA i's partial of the block its range starts inside
    unsigned* flag;  // [gridDim.x][32]: 1 once lane l of CTA i has written its part; the owner resets it to 0
};
struct WeightScales {
    const float* scale;   // W8: [S][cols] float32
    const int* rows;      // W8: [N] int32: scale row of each weight row
    int cols;             // W8: scale columns: ceil(K / SG_W8_BLOCK)
    const float* gscale;  // W4: [N] float32, each row's global scale * 2^7
};
// Four E4M3 codes (bytes b0..b3 of r) -> bf16 pairs lo = (b0, b2), hi = (b1, b3), each the code's value times 2^-120
// exactly: with a code in the high byte of a 16-bit half, (h & 0x8000) | ((h & 0x7F00) >> 4) is the bf16 whose
// exponent field is the code's and whose mantissa is the code's 3 bits (a bf16 subnormal for a code subnormal). The
// low bytes take one prmt in sign mode, which makes each half [8 copies of the code's sign][code]: << 4 then
// & 0x87F0 keeps one sign bit at bit 15 and the code's 7 low bits at bits 10..4 (three instructions, not four).
__device__ __forceinline__ void e4m3x4_to_bf16(unsigned r, unsigned& lo, unsigned& hi) {
    const unsigned h = (r & 0x80008000u) | ((r & 0x7F007F00u) >> 4);
    unsigned l;
    asm("prmt.b32 %0, %1, 0, 0xA280;" : "=r"(l) : "r"(r));  // bytes b0, sign(b0), b2, sign(b2)
    l = (l << 4) & 0x87F087F0u;
    hi = h;
    lo = l;
}
// A bf16 pair times 2^64, exactly for |x| < 2^64 (fma with -0: a zero keeps its sign, subnormals are kept).
__device__ __forceinline__ unsigned bf16x2_times_2_64(unsigned x) {
    unsigned y;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(0x5F805F80u), "r"(0x80008000u));
    return y;
}
__device__ __forceinline__ float lds32(unsigned addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}
// One float of global memory into shared memory, asynchronously (zeros where `ok` is false: nothing is read).
__device__ __forceinline__ void cp_async4(unsigned dst, const float* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(src)), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void lds64(unsigned addr, unsigned& a, unsigned& b) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
}
__device__ __forceinline__ void store_y(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_y(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// Dynamic shared memory (from the first 1024-byte boundary): stages of [KT / 64 weight boxes of 16 T x 64 bf16]
// (W8: KT / 128 boxes of 16 T x 128 uint8) [KT / 64 x boxes of 16 x 64] bf16 (XRES: the weight boxes alone), each
// box rows of 128 bytes in the 128-byte swizzle (16-byte chunk j of row r sits at chunk j ^ (r % 8): ldmatrix's
// eight rows hit eight different banks); XRES: then x's M rows of K bf16, XROW = 2 K + 16 bytes apart (W8: + 32, so
// the eight-byte reads of eight rows g at 8 c hit distinct banks); then the partials red[CW - 1][T][NT][4][32] float32;
// then full[stages], empty[stages] and (XRES) the x barrier; W8: then, 16 bytes past the x barrier's slot, the
// staged scales scs[stages][2][16 T] float32 ([stage][scale column of the stage][row of the block]). W4: a stage is
// [2 code boxes of 16 T x 128 bytes][x boxes unless XRES][scale box 16 T x KT / 16 bytes], rounded up to 1024
// bytes, and resident rows are XROW = 2 K + 64 apart (16-byte reads of rows g and g + 1 in distinct banks).
// stream_gemm.py computes the same size.
// XRES: xmap is no tensor map but {x's address, its row stride in bytes} in its first two words.
template <int T, int NT, int KT, typename Y, int EPI, bool XRES, int WB, int CW, bool SPLIT>
__global__ void __launch_bounds__(32 * (CW + 1))
stream_gemm(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, Y* __restrict__ y,
            int M, int N, int K, int stages, int prefill, const __grid_constant__ Epilogue epi,
            const __grid_constant__ WeightScales wsc, const __grid_constant__ TensorMap smap,
            const __grid_constant__ SplitK sk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    pdl_launch_dependents();
    static_assert(!XRES || NT == 1, "resident x rows are addressed for one token tile");
    static_assert(T * NT * 4 <= SG_SPLIT_ACC, "a split block's partial fits SplitK.part");
    static_assert(CW == 4 || CW == 8, "four or eight compute warps");
    constexpr bool W8 = WB == 8, W4 = WB == 4;  // the weight's bits per element (16: bf16)
    static_assert(WB == 16 || W8 || W4, "bf16, FP8 or NVFP4 weights");
    static_assert(!W8 || (KT == 256 && SG_W8_BLOCK % (KT / CW) == 0), "a warp's columns of a stage lie in one scale block");
    static_assert(!W4 || (KT == 512 && CW == 8), "W4: a warp's 64 columns of a stage are one ldmatrix.x4 per tile");
    constexpr bool COUNTED = W8 || W4;  // ring positions counted, not divided (below)
    constexpr int WCOLS = KT / CW;  // stage columns of one compute warp: [warp WCOLS, + WCOLS)
    constexpr int BOXES = KT / 64;                     // x boxes per stage (and bf16 weight boxes)
    constexpr int WBOXES = W4 ? KT / 256 : W8 ? KT / 128 : BOXES;  // weight boxes per stage (128 bytes of a row each)
    // Wide launches (NT = 4 or 8: 32 or 64 rows, for FP8 / NVFP4 products of more than 16 rows, which read the
    // weight once for all of them): x in boxes of 8 NT rows, the plain and SwiGLU epilogues only (the norm
    // epilogues' row sums are laid out for SG_MAX_ROWS rows).
    static_assert(NT == 1 || NT == 2 || ((NT == 4 || NT == 8) && WB != 16 && !XRES && (EPI & ~SG_SWIGLU) == 0),
                  "one or two token tiles, or a wide launch of a quantized weight");
    constexpr int XROWS = NT > 2 ? 8 * NT : 16;  // rows of an x box
    constexpr int WBOX = 16 * T * 128, XBOX = XROWS * 128;  // bytes
    constexpr int SBOX = W4 ? 16 * T * (KT / 16) : 0;    // W4: the stage's scale bytes, [16 T rows][KT / 16]
    constexpr int STAGE_TX = WBOXES * WBOX + (XRES ? 0 : BOXES * XBOX) + SBOX;  // bytes the copies bring
    constexpr int STAGE = (STAGE_TX + 1023) & ~1023;  // stages 1024-byte aligned (the swizzle's boxes)
    constexpr int NACC = T * NT * 4;  // accumulators per lane
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned ring = (raw + 1023) & ~1023u;
    unsigned char* smem = smem_raw + (ring - raw);
    const unsigned xs = ring + stages * STAGE, xrow = 2 * K + (W4 ? 64 : W8 ? 32 : 16);  // XRES: x's rows
    float* red = reinterpret_cast<float*>(smem + (size_t)stages * STAGE + (XRES ? M * xrow : 0));  // [CW-1][NACC][32]
    const unsigned full0 = smem_addr(red + (CW - 1) * NACC * 32), empty0 = full0 + 8 * stages, xbar = empty0 + 8 * stages;
    const unsigned scs = xbar + 16;  // W8: the staged scales scs[stages][2][16 T]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nblocks = (N + 16 * T - 1) / (16 * T);
    const int ktiles = K / KT;
    // The ring tiles this CTA streams (Work above), `total` of them in (block, k tile) order: from block blk0's k
    // tile kt0 (0 unless stream-K starts it inside a block), the next block bstride further, to block blk_last.
    // Tile i is k tile (kt0 + i) % ktiles of block blk0 + (kt0 + i) / ktiles * bstride.
    auto first_unit = [&](int cta) { return (int)((long long)cta * nblocks * ktiles / gridDim.x); };  // stream-K
    const int my_blocks = blockIdx.x < nblocks ? (nblocks - 1 - blockIdx.x) / gridDim.x + 1 : 0;  // whole blocks
    const int u0 = SPLIT ? first_unit(blockIdx.x) : 0;
    const int total = SPLIT ? first_unit(blockIdx.x + 1) - u0 : my_blocks * ktiles;
    const int bstride = SPLIT ? 1 : gridDim.x, kt0 = SPLIT ? u0 % ktiles : 0;
    const int blk0 = SPLIT ? u0 / ktiles : blockIdx.x;
    const int blk_last = blk0 + ((kt0 + total - 1) / ktiles) * bstride;
    auto tile_kt = [&](int i) { return (kt0 + i) % ktiles; };
    auto tile_blk = [&](int i) { return blk0 + (kt0 + i) / ktiles * bstride; };

    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(full0 + 8 * s, W8 ? 1 + 32 : 1);  // W8: the copy lanes' cp.async arrivals
            mbar_init(empty0 + 8 * s, CW);
        }
        if (XRES) mbar_init(xbar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == CW) {  // ------------------------------------------------------------ copy warp
        // Lane 0 arms the barriers and issues the bulk copies; W8: all 32 lanes stage the scales besides.
        if (!W8 && lane != 0) return;
        unsigned long long evict_first, evict_last;  // the weight is read once per step; x by every CTA
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(evict_last));
        // Stage i = s + stages * (its round) = kt + ktiles * blk: ring slot s, k tile kt of the CTA's block blk.
        auto copy_w = [&](int s, int kt, int blk) {
            if (W8 && lane != 0) return;
            const int row0 = blk * 16 * T, k0 = kt * KT;
            mbar_expect_tx(full0 + 8 * s, STAGE_TX);
#pragma unroll
            for (int b = 0; b < WBOXES; ++b)
                tma_load(ring + s * STAGE + b * WBOX, wmap, (W4 ? k0 / 2 : k0) + (W4 || W8 ? 128 : 64) * b, row0,
                         full0 + 8 * s, evict_first);
            if constexpr (W4)
                tma_load(ring + s * STAGE + STAGE_TX - SBOX, smap, k0 / 16, row0, full0 + 8 * s, evict_first);
        };
        auto copy_x = [&](int s, int kt) {
            if (W8 && lane != 0) return;
            const int k0 = kt * KT;
#pragma unroll
            for (int b = 0; b < BOXES; ++b)
                tma_load(ring + s * STAGE + WBOXES * WBOX + b * XBOX, xmap, k0 + 64 * b, 0, full0 + 8 * s, evict_last);
        };
        // W8: lane l stages entries j = l + 32 q (q < T) of scs[s]: row j % (16 T) of the block, scale column
        // j / (16 T) of the stage. srow[q] / srow_next[q]: rows[f] * cols of that row f in the block being issued /
        // the next block (-1 past N or past this CTA's blocks), fetched a block ahead so that only the first block's
        // row map is waited for (before griddepcontrol.wait, under the kernel in front: it is a weight). Blocks are
        // numbered absolutely (blk0 .. blk_last).
        constexpr int SQ = W8 ? T : 1;
        int srow[SQ], srow_next[SQ];
        auto block_rows = [&](int blk, int (&out)[SQ]) {
            const int row0 = blk * 16 * T;
#pragma unroll
            for (int q = 0; q < SQ; ++q) {
                const int f = row0 + (lane + 32 * q) % (16 * T);
                out[q] = blk <= blk_last && f < N ? wsc.rows[f] * wsc.cols : -1;
            }
        };
        auto copy_s = [&](int s, int kt, int blk) {  // called for stages i = 0, 1, 2, ... in order
            const int kb0 = kt * (KT / SG_W8_BLOCK);
            if (blk > blk0 && kt == 0) {  // a new block: its rows came with the previous one
#pragma unroll
                for (int q = 0; q < SQ; ++q) srow[q] = srow_next[q];
                block_rows(blk + bstride, srow_next);
            }
#pragma unroll
            for (int q = 0; q < SQ; ++q) {
                const int j = lane + 32 * q;
                const bool ok = srow[q] >= 0;
                cp_async4(scs + 4 * (s * 32 * T + j), wsc.scale + (ok ? srow[q] + kb0 + j / (16 * T) : 0), ok);
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(full0 + 8 * s) : "memory");
        };
        const int ahead = min(min(stages, prefill), total);
        if constexpr (W8) {
            block_rows(blk0, srow);
            block_rows(blk0 + bstride, srow_next);
        }
        // before the wait: overlaps the kernels in front
        for (int i = 0; i < ahead; ++i) copy_w(i % stages, tile_kt(i), tile_blk(i));
        if constexpr (W8)  // after the boxes, which do not wait for srow
            for (int i = 0; i < ahead; ++i) copy_s(i % stages, tile_kt(i), tile_blk(i));
        pdl_wait();
        if constexpr (XRES) {
            if (!W8 || lane == 0) {
                const unsigned long long x = xmap.words[0], stride = xmap.words[1];
                mbar_expect_tx(xbar, M * 2 * K);
                for (int m = 0; m < M; ++m)
                    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                                 ::"r"(xs + m * xrow), "l"(x + m * stride), "r"(2 * K), "r"(xbar) : "memory");
            }
        } else {
            for (int i = 0; i < ahead; ++i) copy_x(i % stages, tile_kt(i));
        }
        if constexpr (COUNTED) {
            // Counted, not divided, as in the compute warps' loop (this warp shares a scheduler with compute warp 0).
            int s = ahead % stages, phase = (ahead / stages + 1) & 1, kt = tile_kt(ahead), blk = tile_blk(ahead);
            for (int i = ahead; i < total; ++i) {
                mbar_wait(empty0 + 8 * s, phase);  // the slot's previous round was read
                copy_w(s, kt, blk);
                if constexpr (!XRES) copy_x(s, kt);
                if constexpr (W8) copy_s(s, kt, blk);
                if (++s == stages) s = 0, phase ^= 1;
                if (++kt == ktiles) kt = 0, blk += bstride;
            }
        } else {
            for (int i = ahead; i < total; ++i) {
                mbar_wait(empty0 + 8 * (i % stages), ((i / stages) - 1) & 1);
                copy_w(i % stages, tile_kt(i), tile_blk(i));
                if constexpr (!XRES) copy_x(i % stages, tile_kt(i));
            }
        }
        if constexpr (W8) asm volatile("cp.async.wait_all;" ::: "memory");  // none left in flight at exit
        return;
    }

    // ---------------------------------------------------------------------------------------- compute warps
    pdl_wait();  // y may be memory the predecessor still reads
    __shared__ float row_scale[SG_MAX_ROWS];
    if constexpr ((EPI & SG_ROW_SCALE) != 0) {
        // Thread 8 m + j adds parts j, j + 8, ... of row m (all loads in flight at once: a loop of dependent L2
        // round trips here would hold back the ring), then the eight lanes of the row fold by xor-shuffles.
        const int m = threadIdx.x >> 3, j = threadIdx.x & 7;
        float part[SG_MAX_PARTS / 8];
#pragma unroll
        for (int q = 0; q < SG_MAX_PARTS / 8; ++q) {
            const int p = j + 8 * q;
            part[q] = m < M && p < epi.parts ? epi.ssq[p * SG_MAX_ROWS + m] : 0.f;
        }
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < SG_MAX_PARTS / 8; ++q) sum += part[q];
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (j == 0 && (CW == 4 || m < SG_MAX_ROWS)) row_scale[m] = rsqrtf(sum / (float)epi.width + epi.eps);  // read after the block's bar.sync
    }
    float acc[T][NT][4], acc4[W4 ? T : 1][NT][4];  // W4: acc4 the second chain (columns 32..63 of a warp's)
    auto zero = [&]() {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                acc[t][n][0] = acc[t][n][1] = acc[t][n][2] = acc[t][n][3] = 0.f;
                if constexpr (W4) acc4[t][n][0] = acc4[t][n][1] = acc4[t][n][2] = acc4[t][n][3] = 0.f;
            }
    };
    zero();
    // ldmatrix rows: A lane -> weight row (lane & 15) of a 16-row tile, 8 columns further for lanes >= 16; B lane
    // -> token (lane & 7) + 8 (lane >= 16), 8 columns further for lanes 8..15 and 24..31. Rows are 128 bytes and
    // every tile starts at a multiple of 8 rows, so the swizzle key of a lane is lane & 7.
    const unsigned a_row = (lane & 15) * 128, a_half = lane >> 4;
    const unsigned b_row = ((lane & 7) + ((lane >> 4) << 3)) * 128, b_half = (lane >> 3) & 1;
    const unsigned key = lane & 7;
    const int g = lane >> 2, c = lane & 3;
    // XRES: B lane -> x row (lane & 7) (NT == 1), row 0 again for rows past M (their outputs are never written).
    const unsigned b_res = xs + ((lane & 7) < M ? (lane & 7) : 0) * xrow + b_half * 16;
    // W8, XRES: lane -> x row g (row 0 again past M), its eight-byte reads at columns 4c.
    const unsigned b_res8 = xs + (g < M ? g : 0) * xrow;
    if constexpr (XRES) mbar_wait(xbar, 0);
    if constexpr (XRES && W8) {  // x's resident rows times 2^64, in place, once
        // 16 bytes per lane and step (rows start 16-byte aligned: xrow = 2 K + 32): this is on the path from the
        // release to the first MMA, and each step waits for its load.
        for (int m = 0; m < M; ++m)
            for (int w = threadIdx.x; w < K / 8; w += 32 * CW) {
                const unsigned at = xs + m * xrow + 16 * w;
                unsigned v0, v1, v2, v3;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3) : "r"(at));
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                             ::"r"(at), "r"(bf16x2_times_2_64(v0)), "r"(bf16x2_times_2_64(v1)),
                               "r"(bf16x2_times_2_64(v2)), "r"(bf16x2_times_2_64(v3)) : "memory");
            }
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
    }
    // SG_ADD_NORM, warp 0: the block's residual and norm weight, requested when the block starts and used at its
    // end (XRES: read where they are used, since with x resident the MMA steps would wait for the early loads;
    // with x in boxes the early loads are cheaper than exposed ones at the end); the running sums of r^2 of this
    // lane's rows m = 8 n + 2 c + e over all of the CTA's blocks.
    float res[EPI == SG_ADD_NORM ? T : 1][NT][4], nw[EPI == SG_ADD_NORM ? T : 1][2], ss[NT][2] = {};
    // W8: stage i's slot i % stages, its phase (i / stages) & 1, its k tile i % ktiles and its block i / ktiles
    // are counted, not divided (integer divisions by run-time values cost ~50 instructions a stage); otherwise they
    // are divided where they are used (kt(), blk()).
    int ring_s = 0, ring_phase = 0, ring_kt = kt0, ring_blk = blk0;
    for (int i = 0; i < total; ++i) {
        if constexpr (COUNTED) if (i > 0) {
            if (++ring_s == stages) ring_s = 0, ring_phase ^= 1;
            if (++ring_kt == ktiles) ring_kt = 0, ring_blk += bstride;
        }
        auto kt = [&]() { return COUNTED ? ring_kt : tile_kt(i); };  // absolute k tile and block
        auto blk = [&]() { return COUNTED ? ring_blk : tile_blk(i); };
        const int s = COUNTED ? ring_s : i % stages;
        float sc0[W8 ? T : 1][2];  // W8: this stage's scale of each of the lane's rows (its warp's scale column)
        if constexpr (EPI == SG_ADD_NORM && !XRES) if (warp == 0 && kt() == 0) {
            const int row0 = blk() * 16 * T;
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int f = row0 + 16 * t + g + 8 * h;
                    nw[t][h] = f < N ? __bfloat162float(epi.norm_w[f]) : 0.f;
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int m = 8 * n + 2 * c + e;
                            res[t][n][2 * h + e] = m < M && f < N ? epi.residual[(long long)m * N + f] : 0.f;
                        }
                }
        }
        mbar_wait(full0 + 8 * s, COUNTED ? ring_phase : (i / stages) & 1);
        const unsigned base = ring + s * STAGE;
        if constexpr (W8) {
            // scs[s][the warp's scale column][16 t + g + 8 h] times 2^56 (exact below 2^72), read now, used after
            // the MMAs.
            const unsigned at = scs + 4 * (s * 32 * T + (warp * WCOLS / SG_W8_BLOCK) * 16 * T + g);
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    sc0[t][h] = lds32(at + 4 * (16 * t + 8 * h));
                    sc0[t][h] *= __int_as_float(0x5B800000);  // 2^56
                }
        }
        if constexpr (W8) {
            // This warp's WCOLS columns of the stage (bytes of the weight boxes, 128 columns each; columns of the x
            // boxes, 64 each, or x's resident columns), in rounds of 32 columns = two MMA steps, each round its own
            // partial sums (four warps: two rounds, eight: one).
            constexpr int ROUNDS = WCOLS / 32;
            float part[ROUNDS][T][NT][4];
#pragma unroll
            for (int h = 0; h < ROUNDS; ++h)
#pragma unroll
                for (int t = 0; t < T; ++t)
#pragma unroll
                    for (int n = 0; n < NT; ++n)
                        part[h][t][n][0] = part[h][t][n][1] = part[h][t][n][2] = part[h][t][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < WCOLS; kk += 32) {
                unsigned b[2][NT][2];  // [MMA step][token tile][register]
#pragma unroll
                for (int step = 0; step < 2; ++step)
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const int e = warp * WCOLS + kk + 16 * step + 4 * c;  // stage column: x[token][e .. e + 3]
                        const int xe = e % 64;  // its column in x box e / 64
                        const unsigned xa = XRES
                            ? b_res8 + 2 * (kt() * KT + e)
                            : base + WBOXES * WBOX + (e / 64) * XBOX + (8 * n + g) * 128 + (((xe / 8) ^ g) << 4) + 2 * (xe % 8);
                        unsigned x0, x1;
                        lds64(xa, x0, x1);
                        b[step][n][0] = __byte_perm(x0, x1, 0x5410);  // x[e], x[e + 2]
                        b[step][n][1] = __byte_perm(x0, x1, 0x7632);  // x[e + 1], x[e + 3]
                        if constexpr (!XRES) {  // restores 2^64 of the codes' 2^-120 (resident x: done)
                            b[step][n][0] = bf16x2_times_2_64(b[step][n][0]);
                            b[step][n][1] = bf16x2_times_2_64(b[step][n][1]);
                        }
                    }
                const int we = warp * WCOLS + kk;  // stage column = byte of weight box we / 128
                const unsigned wa = base + (we / 128) * WBOX + a_row + ((((we % 128) / 16 + a_half) ^ key) << 4);
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    unsigned r0, r1, r2, r3, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3;
                    ldmatrix_x4(wa + t * 16 * 128, r0, r1, r2, r3);  // rows g, g + 8 of columns 4c.., 16 + 4c..
                    e4m3x4_to_bf16(r0, lo0, hi0);
                    e4m3x4_to_bf16(r1, lo1, hi1);
                    e4m3x4_to_bf16(r2, lo2, hi2);
                    e4m3x4_to_bf16(r3, lo3, hi3);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        mma_bf16(part[kk / 32][t][n], lo0, lo1, hi0, hi1, b[0][n][0], b[0][n][1]);
                        mma_bf16(part[kk / 32][t][n], lo2, lo3, hi2, hi3, b[1][n][0], b[1][n][1]);
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        float sum = part[0][t][n][r];
#pragma unroll
                        for (int h = 1; h < ROUNDS; ++h) sum += part[h][t][n][r];
                        acc[t][n][r] += sc0[t][r >> 1] * sum;
                    }
        } else if constexpr (W4) {
            // This warp's 64 columns of the stage: byte 32 (warp % 4) of weight box warp / 4, one ldmatrix.x4 per
            // tile (r0, r1: rows g, g + 8 of columns 8 c .. 8 c + 7; r2, r3: of 32 + 8 c ..), four MMA steps, chunk h
            // of 32 columns into its own chain (acc, acc4). The scales of rows 16 t + g (+ 8) are bytes 4 warp .. + 3
            // of the stage's scale rows (one per 16 columns): byte 2 h + c / 2 is the lane's in chunk h.
            const unsigned sbase = base + STAGE_TX - SBOX + 4 * warp;
            const unsigned wa = base + (warp / 4) * WBOX + a_row + (((2 * (warp % 4) + a_half) ^ key) << 4);
            unsigned b[2][NT][4];  // [chunk][token tile]: x[token][8 c .. 8 c + 7] of the chunk, bf16 pairs
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int e = warp * WCOLS + 32 * h + 8 * c;  // stage column
                    const int xe = e % 64;
                    const unsigned xa = XRES
                        ? b_res8 + 2 * (kt() * KT + e)
                        : base + WBOXES * WBOX + (e / 64) * XBOX + (8 * n + g) * 128 + (((xe / 8) ^ g) << 4);
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(b[h][n][0]), "=r"(b[h][n][1]), "=r"(b[h][n][2]), "=r"(b[h][n][3]) : "r"(xa));
                }
#pragma unroll
            for (int t = 0; t < T; ++t) {
                unsigned r[4];
                ldmatrix_x4(wa + t * 16 * 128, r[0], r[1], r[2], r[3]);
                const unsigned s_lo = __float_as_uint(lds32(sbase + (16 * t + g) * (KT / 16)));
                const unsigned s_hi = __float_as_uint(lds32(sbase + (16 * t + g + 8) * (KT / 16)));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned sel = 0x4040u + 0x0101u * (2 * h + (c >> 1));
                    const unsigned sg = w4_scale_pair(s_lo, sel), sg8 = w4_scale_pair(s_hi, sel);
                    unsigned pg[4], pg8[4];
                    e2m1x8_to_bf16(r[2 * h], pg);
                    e2m1x8_to_bf16(r[2 * h + 1], pg8);
#pragma unroll
                    for (int j = 0; j < 4; ++j) pg[j] = bf16x2_mul(pg[j], sg), pg8[j] = bf16x2_mul(pg8[j], sg8);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        float (&chain)[4] = h == 0 ? acc[t][n] : acc4[t][n];
                        mma_bf16(chain, pg[0], pg8[0], pg[1], pg8[1], b[h][n][0], b[h][n][1]);
                        mma_bf16(chain, pg[2], pg8[2], pg[3], pg8[3], b[h][n][2], b[h][n][3]);
                    }
                }
            }
        } else {
#pragma unroll
        for (int kk = 0; kk < KT / CW; kk += 16) {
            const int k0 = warp * (KT / CW) + kk;  // stage column of this MMA step
            const unsigned box = k0 / 64, chunk = (k0 % 64) / 8;
            unsigned b[NT][2];
            const unsigned xa = XRES ? b_res + 2 * (kt() * KT + k0)
                                     : base + BOXES * WBOX + box * XBOX + b_row + (((chunk + b_half) ^ key) << 4);
            if (NT == 2) ldmatrix_x4(xa, b[0][0], b[0][1], b[NT - 1][0], b[NT - 1][1]);
            else ldmatrix_x2(xa, b[0][0], b[0][1]);
            const unsigned wa = base + box * WBOX + a_row + (((chunk + a_half) ^ key) << 4);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                unsigned a0, a1, a2, a3;
                ldmatrix_x4(wa + t * 16 * 128, a0, a1, a2, a3);
#pragma unroll
                for (int n = 0; n < NT; ++n) mma_bf16(acc[t][n], a0, a1, a2, a3, b[n][0], b[n][1]);
            }
        }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);

        if (kt() + 1 != ktiles && i + 1 != total) continue;
        // End of a row block, or of this CTA's part of it: add the CW warps' partials in a fixed order, then (a
        // block it owns) the other CTAs' parts and write the outputs (W4: each warp's two chains first; warp 0
        // then scales each row's sum by its global scale * 2^7, requested here so the load's latency passes
        // under the barrier), or (a block it starts inside) hand its sums to the owner.
        const bool part_only = SPLIT && blk() == blk0 && kt0 > 0;  // CTA-uniform, as every branch here
        float gs[W4 ? T : 1][2];
        float* mine = &acc[0][0][0];  // acc[t][n][q] at (t NT + n) 4 + q
        if constexpr (W4) {
#pragma unroll
            for (int r = 0; r < NACC; ++r) mine[r] += (&acc4[0][0][0])[r];
            if (warp == 0 && !part_only) {
#pragma unroll
                for (int t = 0; t < T; ++t)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int f = blk() * 16 * T + 16 * t + g + 8 * h;
                        gs[t][h] = f < N ? wsc.gscale[f] : 0.f;
                    }
            }
        }
        if (warp > 0) {
#pragma unroll
            for (int r = 0; r < NACC; ++r) red[((warp - 1) * NACC + r) * 32 + lane] = mine[r];
        }
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
        const int row0 = blk() * 16 * T;
        if (warp == 0) {
            for (int p = 0; p < CW - 1; ++p) {
#pragma unroll
                for (int r = 0; r < NACC; ++r) mine[r] += red[(p * NACC + r) * 32 + lane];
            }
            if (part_only) {  // lane l's sums, then its flag (release: the sums are visible before it)
                float* out = sk.part + (size_t)blockIdx.x * SG_SPLIT_ACC * 32 + lane;
#pragma unroll
                for (int r = 0; r < NACC; ++r) out[r * 32] = mine[r];
                asm volatile("st.release.gpu.global.u32 [%0], 1;"
                             ::"l"(sk.flag + blockIdx.x * 32 + lane) : "memory");
            } else if (SPLIT && kt() + 1 != ktiles) {  // owned, continued by the next CTAs: add their parts in order
                const int end = (blk() + 1) * ktiles;
                for (int j = blockIdx.x + 1; j < gridDim.x && first_unit(j) < end; ++j) {
                    unsigned* flag = sk.flag + j * 32 + lane;
                    unsigned ready;
                    do {
                        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
                    } while (!ready);
                    const float* in = sk.part + (size_t)j * SG_SPLIT_ACC * 32 + lane;
#pragma unroll
                    for (int r = 0; r < NACC; ++r) mine[r] += in[r * 32];
                    *flag = 0;  // for the next launch, which writes only after this grid has completed
                }
            }
        }
        if (part_only) {
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");  // red is free again
            zero();
            continue;
        }
        if (warp == 0) {
            if constexpr (W4) {
#pragma unroll
                for (int r = 0; r < NACC; ++r) mine[r] *= gs[r / (4 * NT)][(r & 3) >> 1];
            }
            if constexpr ((EPI & SG_SWIGLU) != 0) {
#pragma unroll
                for (int r = 0; r < NACC; ++r) red[r * 32 + lane] = mine[r];  // for all the warps (below)
            } else {
#pragma unroll
                for (int t = 0; t < T; ++t)
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const int m = 8 * n + 2 * c + (r & 1);
                            const int f = row0 + 16 * t + g + 8 * (r >> 1);
                            if (m >= M || f >= N) continue;
                            float v = acc[t][n][r];
                            const long long at = (long long)m * N + f;
                            if constexpr (EPI == SG_ADD_NORM) {
                                v += XRES ? epi.residual[at] : res[t][n][r];
                                const float w = XRES ? __bfloat162float(epi.norm_w[f]) : nw[t][r >> 1];
                                epi.normed[at] = __float2bfloat16_rn(w * v);
                                ss[n][r & 1] += v * v;
                            } else if constexpr (EPI == SG_ROW_SCALE) {
                                v *= row_scale[m];
                            }
                            store_y(y + at, v);
                        }
            }
        }
        if constexpr ((EPI & SG_SWIGLU) != 0) {
            // The SwiGLU of the block's sums, spread over the compute warps (an IEEE division each: in warp 0 alone
            // they held the other warps at the barrier). Unit u = (t, n, e) holds accumulator 4 (t NT + n) + e,
            // the gate feature row0 / 2 + 8 t + g of token m, and + 2 its up (N % 16 == 0).
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
            for (int u = warp; u < T * NT * 2; u += CW) {
                const int t = u / (2 * NT), n = (u / 2) % NT, e = u % 2;
                const int m = 8 * n + 2 * c + e;
                if (m >= M || row0 + 16 * t >= N) continue;
                float gate = red[(4 * (t * NT + n) + e) * 32 + lane], up = red[(4 * (t * NT + n) + 2 + e) * 32 + lane];
                if constexpr ((EPI & SG_ROW_SCALE) != 0) {
                    gate *= row_scale[m];
                    up *= row_scale[m];
                }
                store_y(y + (long long)m * (N / 2) + row0 / 2 + 8 * t + g, swiglu_value(gate, up));
            }
        }
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");  // red is free again
        zero();
    }
    if constexpr (EPI == SG_ADD_NORM) if (warp == 0) {
        // Fold the eight lanes g = 0..7 that hold the same rows (xor 4, 8, 16), in a fixed order; lanes 0..3 write
        // rows 8 n + 2 c + e of this CTA's part (zeros for rows past M and for n >= NT: the consumer reads 16).
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) ss[n][e] += __shfl_xor_sync(0xffffffffu, ss[n][e], o);
        if (g == 0) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                epi.ssq[blockIdx.x * SG_MAX_ROWS + 2 * c + e] = ss[0][e];
                epi.ssq[blockIdx.x * SG_MAX_ROWS + 8 + 2 * c + e] = NT == 2 ? ss[NT - 1][e] : 0.f;
            }
        }
    }
    cf_trace_event(2);  // this CTA's outputs are written
#endif
}
