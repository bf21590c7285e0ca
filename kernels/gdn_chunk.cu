// gdn_chunk.cu: the chunked (prefill) form of the gated delta rule on tensor cores (issue 22). It computes what
// gdn_recurrent<DK> in gdn.cu computes from the same inputs (gdn_numpy.py: `chunked` is the readable definition,
// the WY / UT form of FLA's chunk_gated_delta_rule); cudflash/backends/cuda_gdn_chunk.py launches the two kernels
// and checks the layouts.
//
// Per sequence s (rows cu[s] .. cu[s+1]-1, state slot slots[s]; slot < 0: a padding sequence, its rows written as
// zeros, no state read or written) and value head h (q / k head h / (HV / HK)), in chunks of GC_CHUNK = 64 rows
// (the last one padded with rows of q = k = v = 0, beta = g = 0, which change neither outputs nor state):
//   G = cumsum(g) within the chunk, D[i, j] = e^{G_i - G_j} (j <= i), A = strictly_lower(beta_i k_i . k_j D_ij),
//   T = (I + A)^-1, u = T (beta v), w = T (beta k e^G), intra = (q k^T) * D (j <= i);
//   then chunk by chunk: v' = u - w S;  o = (q e^G) S + intra v';  S = e^{G_last} S + (k e^{G_last - G})^T v'.
// q, k are L2-normalised (eps L2_EPS), q scaled by qscale (dk^-1/2), beta = sigmoid(b), g = -exp(A_log)
// softplus(a + dt_bias): the recurrent kernel's definitions, from the same inputs (qkv [T, 2 HK DK + HV DV] float32
// q | k | v with row stride sq; a, b [T, HV] float32 with row strides sa, sb; A_log, dt_bias [HV] float32; states
// [S, HV, DK, DV] float32, read at the start and written at the end only when `commit`; out [T, HV DV] float32).
//
// Chunk c of sequence s is scratch block (gc_chunk_base(s) + c) * HV + h; the base counts every earlier sequence's
// chunks (padding ones too: the wrapper sizes the scratch by the same count). Scratch, per block of 64 rows:
//   w, qg = q e^G, kd = k e^{G_last - G}: [64, DK] bf16;  u: [64, DV] float32;  intra: [64, 64] bf16;
//   decay = e^{G_last}: one float32.
//
// gdn_chunk_prepare<DK, DV>: grid (max chunks per sequence, HV, n), GC_THREADS threads, dynamic shared memory
//   (cuda_gdn_chunk.prepare_smem). Everything a chunk needs that does not depend on the state: the gates, the
//   normalised rows, k k^T and q k^T (bf16 mma), the unit lower-triangular inverse T in float32 (one thread per
//   column, forward substitution in registers), u and w (bf16 mma).
// gdn_chunk_scan<DK, BV>: grid (DV / BV, HV, n), GC_THREADS threads, dynamic shared memory
//   (cuda_gdn_chunk.scan_smem). The state's columns j0 .. j0 + BV - 1 live in registers as mma accumulators for the
//   whole sequence (warp w owns the 16-row tiles w, w + 4, ... of dk); each chunk's w, qg, kd, intra are brought in
//   with cp.async one chunk ahead (double buffered), the state goes to shared memory as bf16 for the two products
//   that read it.
//
// Precision: every tensor-core product takes bf16 operands with float32 accumulation (as FLA's kernels); the
// gates, decays, cumulative sums, normalisation, the triangular inverse, u (added in float32), the state and the
// outputs are float32. Relative error is ~2^-9 per product (tests/gpu/test_gdn_chunk.py derives its tolerance).
//
// Warp roles in every chunk-row product (M = 64 chunk rows): warp w computes rows 16w .. 16w + 15; products with
// a triangular factor (k k^T, q k^T, T (.), intra v') skip the 16x16 tiles above the diagonal.
#include "mma.cuh"

#define GC_CHUNK 64  // rows per chunk (gdn_numpy.GDN_CHUNK)
#define GC_THREADS 128  // 4 warps: one 16-row tile of the chunk each
#define L2_EPS 1e-6f  // gdn_numpy.L2_EPS
#define GC_ROWS_AT_ONCE 4  // rows a warp of the prepare kernel loads together
#define GC_PAD 8  // bf16 padding per shared-memory row: strides of an odd multiple of 16 bytes, ldmatrix conflict-free

__device__ __forceinline__ bf16 gc_bf16(float v) { return __float2bfloat16_rn(v); }

// 16-byte async copy global -> shared (both 16-byte aligned).
__device__ __forceinline__ void gc_cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void gc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void gc_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The first scratch chunk of sequence s: the chunks of sequences 0 .. s-1 (the wrapper allocates their sum).
__device__ __forceinline__ int gc_chunk_base(const int* __restrict__ cu, int s) {
    int base = 0;
    for (int i = 0; i < s; ++i) base += (cu[i + 1] - cu[i] + GC_CHUNK - 1) / GC_CHUNK;
    return base;
}

// T = (I + A)^-1 for A strictly lower triangular [64][64] float32 (row stride GC_CHUNK + 4, zero on and above the
// diagonal), one column per thread: x_i = [i == col] - sum_{j < i} A_ij x_j, x in registers. Rows are read four
// at a time (a broadcast: every thread reads the same A_ij); entries j >= i of a row are 0 and their x_j is still
// 0, so reading past the diagonal adds nothing. Writes column col of T as bf16 (row stride GC_CHUNK + GC_PAD).
__device__ __forceinline__ void gc_unit_lower_inverse(const float* __restrict__ s_a, bf16* __restrict__ s_t, int col) {
    constexpr int AS = GC_CHUNK + 4, TS = GC_CHUNK + GC_PAD;
    float x[GC_CHUNK];
#pragma unroll
    for (int i = 0; i < GC_CHUNK; ++i) x[i] = 0.f;
#pragma unroll
    for (int i = 0; i < GC_CHUNK; ++i) {
        float acc[4] = {i == col ? 1.f : 0.f, 0.f, 0.f, 0.f};  // four chains: a quarter of the dependent FMAs
#pragma unroll
        for (int j4 = 0; j4 <= i / 4; ++j4) {
            const float4 av = *reinterpret_cast<const float4*>(s_a + i * AS + 4 * j4);
            acc[0] -= av.x * x[4 * j4];
            acc[1] -= av.y * x[4 * j4 + 1];
            acc[2] -= av.z * x[4 * j4 + 2];
            acc[3] -= av.w * x[4 * j4 + 3];
        }
        x[i] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
#pragma unroll
    for (int i = 0; i < GC_CHUNK; ++i) s_t[i * TS + col] = gc_bf16(x[i]);
}

template <int DK, int DV>
__global__ void __launch_bounds__(GC_THREADS) gdn_chunk_prepare(
        const float* __restrict__ qkv, long long sq, const float* __restrict__ a, long long sa,
        const float* __restrict__ b, long long sb, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
        const int* __restrict__ slots, const int* __restrict__ cu, bf16* __restrict__ w_out,
        float* __restrict__ u_out, bf16* __restrict__ qg_out, bf16* __restrict__ kd_out,
        bf16* __restrict__ intra_out, float* __restrict__ decay_out, int HK, int HV, float qscale) {
    static_assert(DK % 16 == 0 && DV % 16 == 0, "head dims must be multiples of the mma k-step");
    constexpr int KS = DK + GC_PAD, VS = DV + GC_PAD, TS = GC_CHUNK + GC_PAD, AS = GC_CHUNK + 4;
    constexpr int KPL = (DK + 31) / 32, VPL = (DV + 31) / 32;  // elements per lane of a q / k / v row
    // q and k are dead once k k^T and q k^T are in registers: A and T take their place (the larger of the two uses).
    constexpr int QK_BYTES = 2 * GC_CHUNK * KS * 2, AT_BYTES = GC_CHUNK * AS * 4 + GC_CHUNK * TS * 2;
    constexpr int REGION0 = QK_BYTES > AT_BYTES ? QK_BYTES : AT_BYTES;
    extern __shared__ __align__(16) unsigned char gc_smem[];
    bf16* s_q = reinterpret_cast<bf16*>(gc_smem);  // [64][KS] normalised, scaled q
    bf16* s_k = s_q + GC_CHUNK * KS;  // [64][KS] normalised k
    float* s_a = reinterpret_cast<float*>(gc_smem);  // [64][AS] A (over q and k)
    bf16* s_t = reinterpret_cast<bf16*>(s_a + GC_CHUNK * AS);  // [64][TS] T = (I + A)^-1 (over q and k)
    bf16* s_rk = reinterpret_cast<bf16*>(gc_smem + REGION0);  // [64][KS] beta k e^G: the right-hand side of w
    bf16* s_rv = s_rk + GC_CHUNK * KS;  // [64][VS] beta v: the right-hand side of u
    float* s_g = reinterpret_cast<float*>(s_rv + GC_CHUNK * VS);  // [64] g, then G (cumulative)
    float* s_beta = s_g + GC_CHUNK;  // [64]
    pdl_launch_dependents();
    const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, t4 = lane & 3;  // mma fragment coordinates: row g8 (+8), column pair 2 t4
    const float neg_a = -expf(A_log[h]), dtb = dt_bias[h];  // weights: read before the wait
    pdl_wait();
    const int lo = cu[s], len = cu[s + 1] - lo, r0 = c * GC_CHUNK;
    if (slots[s] < 0 || r0 >= len) return;  // uniform over the CTA
    const int rows = min(GC_CHUNK, len - r0);
    const long long blk = (long long)(gc_chunk_base(cu, s) + c) * HV + h;
    const int hk = h / (HV / HK);
    const float* base_row = qkv + (long long)(lo + r0) * sq;

    // Gates of the chunk's rows (zero for the padding rows), then G: a serial sum, numpy's cumsum order.
    if (tid < GC_CHUNK) {
        float g = 0.f, beta = 0.f;
        if (tid < rows) {
            const long long t = lo + r0 + tid;
            const float x = a[t * sa + h] + dtb;
            const float softplus = x > 20.f ? x : log1pf(expf(x));
            g = neg_a * softplus;
            beta = sigmoid_ieee(b[t * sb + h]);
        }
        s_g[tid] = g;
        s_beta[tid] = beta;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
#pragma unroll
        for (int r = 0; r < GC_CHUNK; ++r) {
            acc += s_g[r];
            s_g[r] = acc;
        }
        decay_out[blk] = expf(acc);
    }
    __syncthreads();

    // Rows: warp w takes rows 16 w .. 16 w + 15, GC_ROWS_AT_ONCE at a time (their loads in flight together); lane l
    // elements l, l + 32, ... Writes the bf16 operands to shared memory and the state-side ones (qg, kd) to the
    // scratch; padding rows become zeros everywhere.
    {
        constexpr int RA = GC_ROWS_AT_ONCE;
        const float g_last = s_g[GC_CHUNK - 1];
        for (int rb = warp * 16; rb < warp * 16 + 16; rb += RA) {
            float qv[RA][KPL], kv[RA][KPL], vv[RA][VPL];
#pragma unroll
            for (int rr = 0; rr < RA; ++rr) {
                const bool real = rb + rr < rows;
                const float* row = base_row + (long long)(rb + rr) * sq;  // read only when real
#pragma unroll
                for (int e = 0; e < KPL; ++e) {
                    const int i = lane + 32 * e;
                    qv[rr][e] = real && i < DK ? row[hk * DK + i] : 0.f;
                    kv[rr][e] = real && i < DK ? row[(HK + hk) * DK + i] : 0.f;
                }
#pragma unroll
                for (int e = 0; e < VPL; ++e) {
                    const int i = lane + 32 * e;
                    vv[rr][e] = real && i < DV ? row[2LL * HK * DK + (long long)h * DV + i] : 0.f;
                }
            }
#pragma unroll
            for (int rr = 0; rr < RA; ++rr) {
                const int r = rb + rr;
                float qq = 0.f, kk = 0.f;
#pragma unroll
                for (int e = 0; e < KPL; ++e) {
                    qq += qv[rr][e] * qv[rr][e];
                    kk += kv[rr][e] * kv[rr][e];
                }
                qq = warp_sum(qq);
                kk = warp_sum(kk);
                const float rq = 1.f / sqrtf(qq + L2_EPS), rk = 1.f / sqrtf(kk + L2_EPS);
                const float G = s_g[r], beta = s_beta[r];
                const float eg = expf(G), to_end = expf(g_last - G);
                bf16* qg_row = qg_out + (blk * GC_CHUNK + r) * DK;
                bf16* kd_row = kd_out + (blk * GC_CHUNK + r) * DK;
#pragma unroll
                for (int e = 0; e < KPL; ++e) {
                    const int i = lane + 32 * e;
                    if (i < DK) {
                        const float qn = qv[rr][e] * rq * qscale, kn = kv[rr][e] * rk;
                        s_q[r * KS + i] = gc_bf16(qn);
                        s_k[r * KS + i] = gc_bf16(kn);
                        s_rk[r * KS + i] = gc_bf16(kn * beta * eg);
                        qg_row[i] = gc_bf16(qn * eg);
                        kd_row[i] = gc_bf16(kn * to_end);
                    }
                }
#pragma unroll
                for (int e = 0; e < VPL; ++e) {
                    const int i = lane + 32 * e;
                    if (i < DV) s_rv[r * VS + i] = gc_bf16(vv[rr][e] * beta);
                }
            }
        }
    }
    __syncthreads();

    // k k^T and q k^T for rows 16 warp ..: column tiles (16 wide) p <= warp only, the rest stays zero.
    {
        float kk_acc[8][4], qk_acc[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) kk_acc[n][e] = qk_acc[n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            unsigned ka0, ka1, ka2, ka3, qa0, qa1, qa2, qa3;
            const int arow = warp * 16 + (lane & 15), acol = ks * 16 + (lane >> 4) * 8;
            ldmatrix_x4(smem_addr(s_k + arow * KS + acol), ka0, ka1, ka2, ka3);
            ldmatrix_x4(smem_addr(s_q + arow * KS + acol), qa0, qa1, qa2, qa3);
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                if (p > warp) continue;  // warp-uniform
                unsigned b0, b1, b2, b3;
                const int brow = p * 16 + (lane & 7) + ((lane >> 4) << 3), bcol = ks * 16 + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(smem_addr(s_k + brow * KS + bcol), b0, b1, b2, b3);
                mma_bf16(kk_acc[2 * p], ka0, ka1, ka2, ka3, b0, b1);
                mma_bf16(kk_acc[2 * p + 1], ka0, ka1, ka2, ka3, b2, b3);
                mma_bf16(qk_acc[2 * p], qa0, qa1, qa2, qa3, b0, b1);
                mma_bf16(qk_acc[2 * p + 1], qa0, qa1, qa2, qa3, b2, b3);
            }
        }
        __syncthreads();  // every warp is done with q and k: A and T overwrite them
        // A (strictly lower) to shared memory, intra (lower, diagonal included) to the scratch; above the
        // diagonal both are written as zeros (the accumulators of skipped tiles are zero, the mask makes sure).
        bf16* intra_blk = intra_out + blk * GC_CHUNK * GC_CHUNK;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = warp * 16 + g8 + hf * 8, j = n * 8 + 2 * t4;
                const float gi = s_g[i], bi = s_beta[i];
                const float d0 = j <= i ? expf(gi - s_g[j]) : 0.f;
                const float d1 = j + 1 <= i ? expf(gi - s_g[j + 1]) : 0.f;
                s_a[i * AS + j] = j < i ? bi * kk_acc[n][2 * hf] * d0 : 0.f;
                s_a[i * AS + j + 1] = j + 1 < i ? bi * kk_acc[n][2 * hf + 1] * d1 : 0.f;
                *reinterpret_cast<unsigned*>(intra_blk + i * GC_CHUNK + j) =
                        pack_bf16x2(qk_acc[n][2 * hf] * d0, qk_acc[n][2 * hf + 1] * d1);
            }
        }
    }
    __syncthreads();
    if (tid < GC_CHUNK) gc_unit_lower_inverse(s_a, s_t, tid);
    __syncthreads();

    // u = T (beta v) (float32 out) and w = T (beta k e^G) (bf16 out): T is lower triangular, so rows 16 warp ..
    // need the k-steps ks <= warp only.
    unsigned ta[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        if (ks <= warp)
            ldmatrix_x4(smem_addr(s_t + (warp * 16 + (lane & 15)) * TS + ks * 16 + (lane >> 4) * 8), ta[ks][0],
                        ta[ks][1], ta[ks][2], ta[ks][3]);
    float* u_blk = u_out + blk * GC_CHUNK * DV;
#pragma unroll 2
    for (int np = 0; np < DV / 16; ++np) {
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if (ks > warp) continue;
            unsigned b0, b1, b2, b3;
            ldmatrix_x4_trans(smem_addr(s_rv + (ks * 16 + (lane & 15)) * VS + np * 16 + (lane >> 4) * 8), b0, b1, b2,
                              b3);
            mma_bf16(acc[0], ta[ks][0], ta[ks][1], ta[ks][2], ta[ks][3], b0, b1);
            mma_bf16(acc[1], ta[ks][0], ta[ks][1], ta[ks][2], ta[ks][3], b2, b3);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = warp * 16 + g8 + hf * 8, j = np * 16 + n * 8 + 2 * t4;
                *reinterpret_cast<float2*>(u_blk + i * DV + j) = make_float2(acc[n][2 * hf], acc[n][2 * hf + 1]);
            }
    }
    bf16* w_blk = w_out + blk * GC_CHUNK * DK;
#pragma unroll 2
    for (int np = 0; np < DK / 16; ++np) {
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if (ks > warp) continue;
            unsigned b0, b1, b2, b3;
            ldmatrix_x4_trans(smem_addr(s_rk + (ks * 16 + (lane & 15)) * KS + np * 16 + (lane >> 4) * 8), b0, b1, b2,
                              b3);
            mma_bf16(acc[0], ta[ks][0], ta[ks][1], ta[ks][2], ta[ks][3], b0, b1);
            mma_bf16(acc[1], ta[ks][0], ta[ks][1], ta[ks][2], ta[ks][3], b2, b3);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = warp * 16 + g8 + hf * 8, j = np * 16 + n * 8 + 2 * t4;
                *reinterpret_cast<unsigned*>(w_blk + i * DK + j) = pack_bf16x2(acc[n][2 * hf], acc[n][2 * hf + 1]);
            }
    }
}

// One chunk's w, qg, kd, intra (bf16 blocks of the scratch, contiguous) into one shared-memory buffer; every thread
// issues its share of 16-byte cp.async copies.
template <int DK>
__device__ __forceinline__ void gc_load_chunk(bf16* s_w, bf16* s_qg, bf16* s_kd, bf16* s_intra,
                                              const bf16* __restrict__ w, const bf16* __restrict__ qg,
                                              const bf16* __restrict__ kd, const bf16* __restrict__ intra) {
    constexpr int KS = DK + GC_PAD, IS = GC_CHUNK + GC_PAD, KC = DK / 8;  // KC: 16-byte pieces per row
    for (int q = threadIdx.x; q < GC_CHUNK * KC; q += GC_THREADS) {
        const int off = (q / KC) * KS + (q % KC) * 8;
        gc_cp_async16(s_w + off, w + q * 8);
        gc_cp_async16(s_qg + off, qg + q * 8);
        gc_cp_async16(s_kd + off, kd + q * 8);
    }
    for (int q = threadIdx.x; q < GC_CHUNK * GC_CHUNK / 8; q += GC_THREADS)
        gc_cp_async16(s_intra + (q / 8) * IS + (q % 8) * 8, intra + q * 8);
}

template <int DK, int BV>
__global__ void __launch_bounds__(GC_THREADS) gdn_chunk_scan(
        const bf16* __restrict__ w_in, const float* __restrict__ u_in, const bf16* __restrict__ qg_in,
        const bf16* __restrict__ kd_in, const bf16* __restrict__ intra_in, const float* __restrict__ decay_in,
        float* __restrict__ states, const int* __restrict__ slots, const int* __restrict__ cu,
        float* __restrict__ out, int HV, int DV, int commit) {
    static_assert(DK % 16 == 0 && BV % 16 == 0, "dk and the column block must be multiples of 16");
    constexpr int KS = DK + GC_PAD, IS = GC_CHUNK + GC_PAD, HS = BV + GC_PAD;
    constexpr int MT = DK / 16, MPW = (MT + 3) / 4, NT = BV / 8;  // state row tiles, per warp; column tiles
    constexpr int BUF = 3 * GC_CHUNK * KS + GC_CHUNK * IS;  // bf16 elements of one chunk buffer
    extern __shared__ __align__(16) unsigned char gc_smem[];
    bf16* s_buf = reinterpret_cast<bf16*>(gc_smem);  // 2 x [w | qg | kd: [64][KS] each; intra [64][IS]]
    bf16* s_h = s_buf + 2 * BUF;  // [DK][HS] the state's columns, bf16
    bf16* s_vn = s_h + DK * HS;  // [64][HS] v' = u - w S, bf16
    pdl_launch_dependents();
    const int j0 = blockIdx.x * BV, h = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, t4 = lane & 3;
    pdl_wait();
    const int slot = slots[s];
    const int lo = cu[s], len = cu[s + 1] - lo;
    if (len <= 0) return;  // uniform over the CTA (as the next branch)
    const long long ostride = (long long)HV * DV;
    float* o_base = out + (long long)lo * ostride + (long long)h * DV + j0;
    if (slot < 0) {  // a padding sequence: zero rows, as numpy's
        for (int q = tid; q < len * BV; q += GC_THREADS) o_base[(long long)(q / BV) * ostride + q % BV] = 0.f;
        return;
    }
    const int chunks = (len + GC_CHUNK - 1) / GC_CHUNK;
    const long long blk0 = (long long)gc_chunk_base(cu, s) * HV + h;  // chunk c: block blk0 + c HV
    float* S = states + ((long long)slot * HV + h) * DK * DV + j0;  // [DK] rows of stride DV, this CTA's columns

    // The state: tile (mt = warp + 4 mi, nt) holds rows mt 16 + g8 (+8), columns nt 8 + 2 t4 (+1).
    float hacc[MPW][NT][4];
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi) {
        const int mt = warp + 4 * mi;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float2 top = make_float2(0.f, 0.f), bottom = top;
            if (mt < MT) {
                const int r = mt * 16 + g8, col = n * 8 + 2 * t4;
                top = *reinterpret_cast<const float2*>(S + (long long)r * DV + col);
                bottom = *reinterpret_cast<const float2*>(S + (long long)(r + 8) * DV + col);
            }
            hacc[mi][n][0] = top.x;
            hacc[mi][n][1] = top.y;
            hacc[mi][n][2] = bottom.x;
            hacc[mi][n][3] = bottom.y;
        }
    }

    {
        const long long blk = blk0;
        gc_load_chunk<DK>(s_buf, s_buf + GC_CHUNK * KS, s_buf + 2 * GC_CHUNK * KS, s_buf + 3 * GC_CHUNK * KS,
                          w_in + blk * GC_CHUNK * DK, qg_in + blk * GC_CHUNK * DK, kd_in + blk * GC_CHUNK * DK,
                          intra_in + blk * GC_CHUNK * GC_CHUNK);
        gc_cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        const long long blk = blk0 + (long long)c * HV;
        bf16* s_w = s_buf + (c & 1) * BUF;
        bf16* s_qg = s_w + GC_CHUNK * KS;
        bf16* s_kd = s_qg + GC_CHUNK * KS;
        bf16* s_intra = s_kd + GC_CHUNK * KS;
        if (c + 1 < chunks) {  // the next chunk into the other buffer (free since the last iteration's barrier)
            const long long nb = blk + HV;
            bf16* n_w = s_buf + ((c + 1) & 1) * BUF;
            gc_load_chunk<DK>(n_w, n_w + GC_CHUNK * KS, n_w + 2 * GC_CHUNK * KS, n_w + 3 * GC_CHUNK * KS,
                              w_in + nb * GC_CHUNK * DK, qg_in + nb * GC_CHUNK * DK, kd_in + nb * GC_CHUNK * DK,
                              intra_in + nb * GC_CHUNK * GC_CHUNK);
        }
        gc_cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning this chunk's
        // The state as bf16, the B operand of w S and qg S.
#pragma unroll
        for (int mi = 0; mi < MPW; ++mi) {
            const int mt = warp + 4 * mi;
            if (mt >= MT) continue;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int r = mt * 16 + g8, col = n * 8 + 2 * t4;
                *reinterpret_cast<unsigned*>(s_h + r * HS + col) = pack_bf16x2(hacc[mi][n][0], hacc[mi][n][1]);
                *reinterpret_cast<unsigned*>(s_h + (r + 8) * HS + col) = pack_bf16x2(hacc[mi][n][2], hacc[mi][n][3]);
            }
        }
        // u's tile and the chunk's decay: global loads in flight during the products below.
        const float* u_blk = u_in + blk * GC_CHUNK * DV + j0;
        float uu[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int r = warp * 16 + g8, col = n * 8 + 2 * t4;
            const float2 top = *reinterpret_cast<const float2*>(u_blk + r * DV + col);
            const float2 bottom = *reinterpret_cast<const float2*>(u_blk + (r + 8) * DV + col);
            uu[n][0] = top.x;
            uu[n][1] = top.y;
            uu[n][2] = bottom.x;
            uu[n][3] = bottom.y;
        }
        const float decay = decay_in[blk];
        gc_cp_async_wait<1>();
        __syncthreads();  // this chunk's buffer and s_h are complete

        // w S and qg S for rows 16 warp ..
        float wh[NT][4], oacc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) wh[n][e] = oacc[n][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            unsigned wa0, wa1, wa2, wa3, qa0, qa1, qa2, qa3;
            const int arow = warp * 16 + (lane & 15), acol = ks * 16 + (lane >> 4) * 8;
            ldmatrix_x4(smem_addr(s_w + arow * KS + acol), wa0, wa1, wa2, wa3);
            ldmatrix_x4(smem_addr(s_qg + arow * KS + acol), qa0, qa1, qa2, qa3);
#pragma unroll
            for (int np = 0; np < BV / 16; ++np) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(smem_addr(s_h + (ks * 16 + (lane & 15)) * HS + np * 16 + (lane >> 4) * 8), b0, b1,
                                  b2, b3);
                mma_bf16(wh[2 * np], wa0, wa1, wa2, wa3, b0, b1);
                mma_bf16(wh[2 * np + 1], wa0, wa1, wa2, wa3, b2, b3);
                mma_bf16(oacc[2 * np], qa0, qa1, qa2, qa3, b0, b1);
                mma_bf16(oacc[2 * np + 1], qa0, qa1, qa2, qa3, b2, b3);
            }
        }
        // v' = u - w S (padding rows: 0 - 0), as bf16 for the two products that read it.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int r = warp * 16 + g8, col = n * 8 + 2 * t4;
            *reinterpret_cast<unsigned*>(s_vn + r * HS + col) = pack_bf16x2(uu[n][0] - wh[n][0], uu[n][1] - wh[n][1]);
            *reinterpret_cast<unsigned*>(s_vn + (r + 8) * HS + col) =
                    pack_bf16x2(uu[n][2] - wh[n][2], uu[n][3] - wh[n][3]);
        }
        __syncthreads();  // all of v' is in s_vn

        // o += intra v' (intra is lower triangular: k-steps ks <= warp), then the real rows go out.
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if (ks > warp) continue;
            unsigned ia0, ia1, ia2, ia3;
            ldmatrix_x4(smem_addr(s_intra + (warp * 16 + (lane & 15)) * IS + ks * 16 + (lane >> 4) * 8), ia0, ia1,
                        ia2, ia3);
#pragma unroll
            for (int np = 0; np < BV / 16; ++np) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(smem_addr(s_vn + (ks * 16 + (lane & 15)) * HS + np * 16 + (lane >> 4) * 8), b0, b1,
                                  b2, b3);
                mma_bf16(oacc[2 * np], ia0, ia1, ia2, ia3, b0, b1);
                mma_bf16(oacc[2 * np + 1], ia0, ia1, ia2, ia3, b2, b3);
            }
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = c * GC_CHUNK + warp * 16 + g8 + hf * 8;
            if (r < len) {
#pragma unroll
                for (int n = 0; n < NT; ++n)
                    *reinterpret_cast<float2*>(o_base + (long long)r * ostride + n * 8 + 2 * t4) =
                            make_float2(oacc[n][2 * hf], oacc[n][2 * hf + 1]);
            }
        }

        // S = e^{G_last} S + kd^T v': A = kd^T (ldmatrix .trans of kd's [row][d] tile), B = v'.
#pragma unroll
        for (int mi = 0; mi < MPW; ++mi) {
            const int mt = warp + 4 * mi;
            if (mt >= MT) continue;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) hacc[mi][n][e] *= decay;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                unsigned ka0, ka1, ka2, ka3;
                const int krow = ks * 16 + (lane & 7) + ((lane >> 4) << 3), kcol = mt * 16 + ((lane >> 3) & 1) * 8;
                ldmatrix_x4_trans(smem_addr(s_kd + krow * KS + kcol), ka0, ka1, ka2, ka3);
#pragma unroll
                for (int np = 0; np < BV / 16; ++np) {
                    unsigned b0, b1, b2, b3;
                    ldmatrix_x4_trans(smem_addr(s_vn + (ks * 16 + (lane & 15)) * HS + np * 16 + (lane >> 4) * 8), b0,
                                      b1, b2, b3);
                    mma_bf16(hacc[mi][2 * np], ka0, ka1, ka2, ka3, b0, b1);
                    mma_bf16(hacc[mi][2 * np + 1], ka0, ka1, ka2, ka3, b2, b3);
                }
            }
        }
        __syncthreads();  // s_h, s_vn and this chunk's buffer are free for the next iteration
    }
    gc_cp_async_wait<0>();
    if (commit) {
#pragma unroll
        for (int mi = 0; mi < MPW; ++mi) {
            const int mt = warp + 4 * mi;
            if (mt >= MT) continue;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int r = mt * 16 + g8, col = n * 8 + 2 * t4;
                *reinterpret_cast<float2*>(S + (long long)r * DV + col) = make_float2(hacc[mi][n][0], hacc[mi][n][1]);
                *reinterpret_cast<float2*>(S + (long long)(r + 8) * DV + col) =
                        make_float2(hacc[mi][n][2], hacc[mi][n][3]);
            }
        }
    }
}
