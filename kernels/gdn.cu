// gdn.cu: the Gated DeltaNet ops of Qwen3.5 hybrid targets (issue 22). cudflash/backends/gdn_numpy.py is the
// definition every kernel here follows; cudflash/backends/cuda_gdn.py launches them and checks the layouts.
//
// Sequences: sequence s owns rows cu[s] .. cu[s+1]-1 of every [T, ...] input and the state slot slots[s] of the
// pools (slot < 0: a padding sequence, no state read or written; the kernels write its output rows as zeros).
// All arithmetic is float32; the recurrent and conv states are float32 pools updated in place, and only when
// `commit` is set (a verify runs with commit = 0 and leaves them as they were: the rollback).
// Spans (causal_conv1d, gdn_recurrent; `spanned` = 1): span int32 [2, n] on the device; sequence s then runs only
// its rows cu[s] + span[0][s] .. cu[s] + span[0][s] + span[1][s] - 1 (within its own rows; none if span[1][s] = 0,
// which leaves its state as it was) and writes zeros in its other rows. That is the commit after a verify: the
// accepted rows of the tape, read in place with the verify's cu, and counts that a CUDA graph reads at replay.
// With spanned = 0 the span pointer is not read. n is the grid's sequence dimension.
//
// causal_conv1d<K, X, W>: y[t, c] = silu(sum_j w[c, j] xx[t + j, c]) with xx = [conv state (K-1 rows, oldest
//   first); the sequence's rows of x]. x [T, C] X (bf16 or float32) with row stride sx (elements), w [C, K] W
//   contiguous, states [S, C, K-1] float32, out [T, C] float32 contiguous.
//   Grid (cdiv(C, blockDim.x), cdiv(max rows, CONV_ROWS), n); thread = one channel over CONV_ROWS rows (of the span
//   with spans), keeping the K-row window in registers. Only row tile 0 reads the conv state, and only it writes the
//   new one (computed from x and the old state it holds in registers), so a commit never races a read; tile 0 also
//   writes the zeros of the rows outside a span.
// gdn_recurrent<DK>: per sequence and value head h (q / k head h / (HV / HK)), token by token:
//   S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q,  with q, k L2-normalised (eps L2_EPS) and q scaled by qscale
//   (dk^-1/2), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias). qkv [T, 2 HK DK + HV DV] float32 (q | k | v)
//   with row stride sq; a, b [T, HV] float32 with row strides sa, sb; A_log, dt_bias [HV] float32; states
//   [S, HV, DK, DV] float32; out [T, HV DV] float32 contiguous.
//   Grid (n, HV, cdiv(DV, GDN_TILE)), GDN_WARPS x 32 threads: warp w owns the GDN_COLS state columns
//   j0 + GDN_COLS w .. of the CTA's tile; lane l = 8 g + c holds column c's rows g DK/4 .. (g + 1) DK/4 - 1, in
//   registers for the whole sequence (read once, written once at commit). Rows are staged GDN_ROWS at a time in
//   shared memory (q, k normalised, k.q, the v tile, e^g, beta; every load of a stage issued before its reductions);
//   then each warp runs the tokens alone, without a barrier: per token each lane sums its rows of S^T k and S^T q,
//   two shuffle steps add the four groups' sums, o = e^g S^T q + delta (k.q) equals S'^T q, and
//   S' = e^g S + k delta^T. The order of every sum is fixed: a row's bits do not depend on how many rows the call
//   runs (a verify row equals its decode). The chunked (prefill) op runs this kernel below cuda_gdn_chunk.MIN_ROWS.
// gdn_mixer<K, DK, W>: the token-by-token mixer of a GDN layer in one kernel (decode, verify, and the commit after a
//   verify): causal_conv1d of the head's q, k, v channels, gdn_recurrent, then gated_rms_norm, each with the same
//   arithmetic in the same order as those kernels (so the same bits), without the float32 round trips and the two
//   kernel boundaries between them. proj [T, C + HV DV + 2 HV] float32 (row stride sp): the in_proj rows, qkv (C =
//   2 HK DK + HV DV) | z | b | a; conv_w [C, K] W; conv_states [S, C, K-1]; norm_w [DV] float32; out [T, HV DV]
//   bf16, written only if `normed` (a commit needs no output). DV <= 8 MIX_WARPS, 2 DK + DV <= 32 MIX_WARPS.
//   Grid (R, HK, n) in clusters of (R, 1, 1), R = HV / HK: CTA (r, hk, s) is value head h = hk R + r of sequence s,
//   all its DV columns; warp w owns columns 8 w .. 8 w + 7 as gdn_recurrent's warps do, and thread i < 2 DK + DV
//   convolves one channel (q of key head hk, its k, or v of head h) over the staged rows, its K-row window in
//   registers across stages. The R CTAs of a cluster read the same q / k conv states: at commit rank 0 writes them,
//   after a cluster barrier that each CTA arrives at once its windows are loaded (v channels and the recurrent
//   state belong to one CTA alone). Under PDL the windows and the state are read before griddepcontrol.wait: slots
//   [n] is a step input, and only this layer's mixer writes its states, in an earlier launch. independent != 0
//   (a commit's layers, whose inputs all predate the step) skips the wait: those launches run side by side.
// gated_rms_norm<X, Z>: out[t, h D + i] = w[i] x[t, h D + i] rsqrt(mean_i x^2 + eps) silu(z[t, h D + i]); x, z
//   [T, H D] X / Z with row strides sx, sz; w [D] float32; out [T, H D] bf16 contiguous. One warp per (row, head).
// sigmoid_gate<X, G>: out = x sigmoid(gate); x, gate [T, W] with row strides; out [T, W] bf16. A thread per element.
#include "common.cuh"

#define CONV_ROWS 16  // rows per thread of causal_conv1d (a row tile)
#define GDN_WARPS 4
#define GDN_TILE 32  // state columns (dv) per CTA
#define GDN_COLS 8  // state columns per warp (GDN_TILE / GDN_WARPS)
#define GDN_ROWS 16  // rows staged in shared memory at a time (a multiple of GDN_WARPS)
#define L2_EPS 1e-6f  // gdn_numpy.L2_EPS
#define MIX_WARPS 16  // gdn_mixer: 128 state columns, 512 conv channels

__device__ __forceinline__ float gdn_f(float v) { return v; }
__device__ __forceinline__ float gdn_f(bf16 v) { return __bfloat162float(v); }

// The pieces gdn_mixer shares with the three kernels it fuses, so that both compute the same bits.
// One conv row: win[K-1] = x, silu(sum_j w[j] win[j]), then the window moves on by a row.
template <int K>
__device__ __forceinline__ float conv_row(const float (&wc)[K], float (&win)[K], float x) {
    win[K - 1] = x;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) acc += wc[j] * win[j];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
    return acc * sigmoid_ieee(acc);
}

// The staging of one row by its warp (lane l holds q, k elements l + 32 m): q, k L2-normalised (q times qscale)
// into the padded shared rows sq, sk (element i at i + 4 (i / RPL)); lane 0 writes e^g, beta and k . q.
template <int DK>
__device__ __forceinline__ void stage_row(const float (&qv)[(DK + 31) / 32], const float (&kv)[(DK + 31) / 32],
                                          float a, float b, float neg_a, float dtb, float qscale, float* sq,
                                          float* sk, float* decay, float* beta, float* kq, int lane) {
    constexpr int RPL = DK / 4, EPL = (DK + 31) / 32;
    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int m = 0; m < EPL; ++m) {
        qq += qv[m] * qv[m];
        kk += kv[m] * kv[m];
        qk += qv[m] * kv[m];
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    qk = warp_sum(qk);
    const float rq = 1.f / sqrtf(qq + L2_EPS), rk = 1.f / sqrtf(kk + L2_EPS);
#pragma unroll
    for (int m = 0; m < EPL; ++m) {
        const int i = lane + 32 * m;
        if (i < DK) {
            sq[i + (i / RPL) * 4] = qv[m] * rq * qscale;
            sk[i + (i / RPL) * 4] = kv[m] * rk;
        }
    }
    if (lane == 0) {
        const float x = a + dtb;
        const float softplus = x > 20.f ? x : log1pf(expf(x));
        *decay = expf(neg_a * softplus);
        *beta = sigmoid_ieee(b);
        *kq = qk * rq * rk * qscale;
    }
}

// One token of the delta rule for a lane's RPL state rows st of one column (rows of its lane group at kr, qr in a
// staged row): S^T k and S^T q (four chains of RPL / 4 FMAs, then across the 4 lane groups: a + b == b + a, so the
// four lanes of a column agree exactly), delta = beta (v - e^g S^T k), S' = e^g S + k delta^T; returns
// o = e^g S^T q + delta (k . q) (= S'^T q).
template <int RPL>
__device__ __forceinline__ float delta_rule_token(float (&st)[RPL], const float4* kr, const float4* qr, float v,
                                                  float decay, float beta, float kq) {
    float pk[4] = {0.f, 0.f, 0.f, 0.f}, pq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int m = 0; m < RPL / 4; ++m) {
        const float4 k4 = kr[m], q4 = qr[m];
        pk[0] += st[4 * m] * k4.x, pk[1] += st[4 * m + 1] * k4.y;
        pk[2] += st[4 * m + 2] * k4.z, pk[3] += st[4 * m + 3] * k4.w;
        pq[0] += st[4 * m] * q4.x, pq[1] += st[4 * m + 1] * q4.y;
        pq[2] += st[4 * m + 2] * q4.z, pq[3] += st[4 * m + 3] * q4.w;
    }
    float sk = (pk[0] + pk[1]) + (pk[2] + pk[3]), sq = (pq[0] + pq[1]) + (pq[2] + pq[3]);
    sk += __shfl_xor_sync(0xffffffffu, sk, 8);
    sq += __shfl_xor_sync(0xffffffffu, sq, 8);
    sk += __shfl_xor_sync(0xffffffffu, sk, 16);
    sq += __shfl_xor_sync(0xffffffffu, sq, 16);
    const float delta = (v - decay * sk) * beta;
#pragma unroll
    for (int m = 0; m < RPL / 4; ++m) {
        const float4 k4 = kr[m];
        st[4 * m] = st[4 * m] * decay + k4.x * delta;
        st[4 * m + 1] = st[4 * m + 1] * decay + k4.y * delta;
        st[4 * m + 2] = st[4 * m + 2] * decay + k4.z * delta;
        st[4 * m + 3] = st[4 * m + 3] * decay + k4.w * delta;
    }
    return decay * sq + delta * kq;
}

// The gated RMSNorm of one head of one row, by a warp (lanes over its D columns): x (nullptr: zeros, the rows numpy
// leaves 0), z, the weight w. Lane l sums the squares of columns l, l + 32, .. in that order; gated_norm_scale and
// gated_norm_value are the rest of the arithmetic, shared with gdn_mixer's form on registers.
__device__ __forceinline__ float gated_norm_scale(float lane_ss, int D, float eps) {
    return 1.f / sqrtf(warp_sum(lane_ss) / (float)D + eps);
}
__device__ __forceinline__ bf16 gated_norm_value(float w, float x, float rs, float g) {
    return __float2bfloat16_rn(w * (x * rs) * (g * sigmoid_ieee(g)));
}
template <typename X, typename Z>
__device__ __forceinline__ void gated_norm_row(const X* xr, const Z* zr, const float* __restrict__ w, bf16* orow,
                                               int D, float eps, int lane) {
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) {
        const float v = xr ? gdn_f(xr[i]) : 0.f;
        ss += v * v;
    }
    const float rs = gated_norm_scale(ss, D, eps);
    for (int i = lane; i < D; i += 32) orow[i] = gated_norm_value(w[i], xr ? gdn_f(xr[i]) : 0.f, rs, gdn_f(zr[i]));
}

template <int K, typename X, typename W>
__global__ void __launch_bounds__(128) causal_conv1d(const X* __restrict__ x, long long sx, const W* __restrict__ w,
                                                     float* __restrict__ states, const int* __restrict__ slots,
                                                     const int* __restrict__ cu, const int* __restrict__ span,
                                                     int spanned, float* __restrict__ out, int C, int commit) {
    pdl_launch_dependents();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    float wc[K];  // the conv weight is no kernel's output: read before the wait
#pragma unroll
    for (int j = 0; j < K; ++j) wc[j] = c < C ? gdn_f(w[(long long)c * K + j]) : 0.f;
    pdl_wait();
    const int s = blockIdx.z;
    const int slot = slots[s];
    const int start = cu[s], seq_rows = cu[s + 1] - start;  // the sequence's rows
    const int first = spanned ? span[s] : 0, len = spanned ? span[gridDim.z + s] : seq_rows;  // the rows it runs
    const int lo = start + first;
    const int r0 = blockIdx.y * CONV_ROWS;
    if (c >= C) return;
    if (spanned && blockIdx.y == 0)  // the sequence's rows outside its span: zeros, as numpy's
        for (int r = 0; r < seq_rows; ++r)
            if (r < first || r >= first + len) out[(long long)(start + r) * C + c] = 0.f;
    if (r0 >= len) return;
    if (slot < 0) {  // a padding sequence: zero rows, as numpy's (so the caller need not clear the output)
        for (int r = r0; r < min(len, r0 + CONV_ROWS); ++r) out[(long long)(lo + r) * C + c] = 0.f;
        return;
    }
    float* st = states + ((long long)slot * C + c) * (K - 1);  // [K-1], oldest first
    const X* xc = x + (long long)lo * sx + c;
    // win[j] = xx[r + j]: the input row r + j - (K-1) of the sequence, or old state entry r + j where that is < 0.
    float win[K];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int r = r0 + j - (K - 1);
        win[j] = r >= 0 ? gdn_f(xc[(long long)r * sx]) : st[r + K - 1];
    }
    const int r1 = min(len, r0 + CONV_ROWS);
    float xr[CONV_ROWS];  // the tile's rows, loaded together: their loads are in flight at once, not one per row
#pragma unroll
    for (int i = 0; i < CONV_ROWS; ++i) xr[i] = r0 + i < r1 ? gdn_f(xc[(long long)(r0 + i) * sx]) : 0.f;
#pragma unroll
    for (int i = 0; i < CONV_ROWS; ++i) {
        if (r0 + i >= r1) break;
        out[(long long)(lo + r0 + i) * C + c] = conv_row(wc, win, xr[i]);
    }
    if (commit && blockIdx.y == 0) {
        // The new state m = xx[len + m]: input row len + m - (K-1), or old state entry len + m for a short sequence.
        // All of it is read before any of it is written (this thread is the state's only reader and writer).
        float next[K - 1];
#pragma unroll
        for (int m = 0; m < K - 1; ++m) {
            const int r = len + m - (K - 1);
            next[m] = r >= 0 ? gdn_f(xc[(long long)r * sx]) : st[len + m];
        }
#pragma unroll
        for (int m = 0; m < K - 1; ++m) st[m] = next[m];
    }
}

template <int DK>
__global__ void __launch_bounds__(GDN_WARPS * 32) gdn_recurrent(
        const float* __restrict__ qkv, long long sq, const float* __restrict__ a, long long sa,
        const float* __restrict__ b, long long sb, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
        float* __restrict__ states, const int* __restrict__ slots, const int* __restrict__ cu,
        const int* __restrict__ span, int spanned, float* __restrict__ out, int HK, int HV, int DV, float qscale,
        int commit) {
    constexpr int RPL = DK / 4;  // state rows per lane: lane (g, c) holds rows g RPL .. (g + 1) RPL - 1 of column c
    constexpr int KROW = DK + 16;  // a staged q / k row: the four groups' RPL values, each group padded by 4 floats
    constexpr int SPW = GDN_ROWS / GDN_WARPS;  // rows each warp stages
    static_assert(RPL % 4 == 0, "DK must be a multiple of 16: a lane group's rows are read as float4");
    __shared__ __align__(16) float s_q[GDN_ROWS][KROW];  // normalised q times qscale: element i at i + 4 (i / RPL)
    __shared__ __align__(16) float s_k[GDN_ROWS][KROW];  // normalised k, likewise
    __shared__ float s_v[GDN_ROWS][GDN_TILE];  // this CTA's columns of v
    __shared__ float s_decay[GDN_ROWS];  // e^g
    __shared__ float s_beta[GDN_ROWS];
    __shared__ float s_kq[GDN_ROWS];  // k . q of the normalised, scaled rows
    pdl_launch_dependents();
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * GDN_TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane >> 3, c = lane & 7;  // the lane's row group and column of the warp's GDN_COLS
    const int j = j0 + warp * GDN_COLS + c;  // the lane's state column
    const float neg_a = -expf(A_log[h]), dtb = dt_bias[h];  // weights: read before the wait
    pdl_wait();
    const int slot = slots[s];
    const int start = cu[s], seq_rows = cu[s + 1] - start;  // the sequence's rows
    const int first = spanned ? span[s] : 0, len = spanned ? span[gridDim.x + s] : seq_rows;  // the rows it runs
    const int lo = start + first;
    const long long out_stride = (long long)HV * DV;
    const int jl = j0 + lane;  // the column this lane zeroes below (one per lane of the CTA's tile)
    if (spanned && jl < DV)  // the sequence's rows outside its span: zeros, as numpy's
        for (int r = warp; r < seq_rows; r += GDN_WARPS)
            if (r < first || r >= first + len) out[(start + r) * out_stride + (long long)h * DV + jl] = 0.f;
    if (len <= 0) return;  // uniform over the CTA (as the next branch): no barrier is skipped by part of it
    if (slot < 0) {  // a padding sequence: zero rows, as numpy's (so the caller need not clear the output)
        if (jl < DV)
            for (int r = warp; r < len; r += GDN_WARPS) out[(lo + r) * out_stride + (long long)h * DV + jl] = 0.f;
        return;
    }
    const int hk = h / (HV / HK);
    float* S = states + ((long long)slot * HV + h) * DK * DV;  // [DK, DV]
    // st[i] = S[grp RPL + i][j]: per load the warp reads 4 rows x 8 adjacent columns (four 32-byte sectors). A column
    // past DV is zeros that stay zero (its v is 0, so its delta is) and is never written back.
    const bool col = j < DV;
    float st[RPL];
#pragma unroll
    for (int i = 0; i < RPL; ++i) st[i] = col ? S[(long long)(grp * RPL + i) * DV + j] : 0.f;
    for (int base = 0; base < len; base += GDN_ROWS) {
        const int rows = min(GDN_ROWS, len - base);
        if (base > 0) __syncthreads();  // every warp is done with the previous stage's rows
        // Stage: warp w takes rows w SPW .. (w + 1) SPW - 1, all their loads issued before any reduction; lane l
        // holds elements l + 32 m of q and k (m < DK / 32, and lanes < 16 one more for DK = 48).
        constexpr int EPL = (DK + 31) / 32;
        float qv[SPW][EPL], kv[SPW][EPL], vv[SPW], av[SPW], bv[SPW];
#pragma unroll
        for (int u = 0; u < SPW; ++u) {
            const int r = warp * SPW + u;
            const bool live = r < rows;
            const long long t = lo + base + (live ? r : 0);
            const float* row = qkv + t * sq;
#pragma unroll
            for (int m = 0; m < EPL; ++m) {
                const int i = lane + 32 * m;
                qv[u][m] = live && i < DK ? row[hk * DK + i] : 0.f;
                kv[u][m] = live && i < DK ? row[(HK + hk) * DK + i] : 0.f;
            }
            vv[u] = live && jl < DV ? row[2LL * HK * DK + (long long)h * DV + jl] : 0.f;
            av[u] = live ? a[t * sa + h] : 0.f;
            bv[u] = live ? b[t * sb + h] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SPW; ++u) {
            const int r = warp * SPW + u;
            if (r >= rows) continue;  // uniform over the warp
            stage_row<DK>(qv[u], kv[u], av[u], bv[u], neg_a, dtb, qscale, s_q[r], s_k[r], &s_decay[r], &s_beta[r],
                          &s_kq[r], lane);
            s_v[r][lane] = vv[u];
        }
        __syncthreads();
        // Token by token, each warp alone (no barrier).
        const int kbase = grp * (RPL + 4);  // the lane group's rows in a staged q / k row
        for (int r = 0; r < rows; ++r) {
            const float o = delta_rule_token<RPL>(st, reinterpret_cast<const float4*>(&s_k[r][kbase]),
                                                  reinterpret_cast<const float4*>(&s_q[r][kbase]),
                                                  s_v[r][warp * GDN_COLS + c], s_decay[r], s_beta[r], s_kq[r]);
            if (grp == 0 && col) out[(lo + base + r) * out_stride + (long long)h * DV + j] = o;
        }
    }
    if (commit && col) {
#pragma unroll
        for (int i = 0; i < RPL; ++i) S[(long long)(grp * RPL + i) * DV + j] = st[i];
    }
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

template <int K, int DK, typename W>
__global__ void __launch_bounds__(MIX_WARPS * 32) gdn_mixer(
        const float* __restrict__ proj, long long sp, const W* __restrict__ conv_w, float* __restrict__ conv_states,
        const float* __restrict__ A_log, const float* __restrict__ dt_bias, float* __restrict__ states,
        const float* __restrict__ norm_w, float eps, const int* __restrict__ slots, const int* __restrict__ cu,
        const int* __restrict__ span, int spanned, bf16* __restrict__ out, int normed, int HK, int HV, int DV,
        float qscale, int commit, int independent) {
    constexpr int RPL = DK / 4;
    constexpr int KROW = DK + 16;  // gdn_recurrent's staged q / k row: a lane group's RPL values padded by 4 floats
    constexpr int EPL = (DK + 31) / 32;
    static_assert(RPL % 4 == 0 && GDN_ROWS == MIX_WARPS, "a warp stages one row");
    __shared__ __align__(16) float s_q[GDN_ROWS][KROW];  // conv output, then normalised q times qscale
    __shared__ __align__(16) float s_k[GDN_ROWS][KROW];  // likewise k
    __shared__ float s_v[GDN_ROWS][8 * MIX_WARPS];  // conv output of v
    __shared__ float s_o[GDN_ROWS][8 * MIX_WARPS];  // the delta rule's o, the gated norm's input
    __shared__ float s_decay[GDN_ROWS], s_beta[GDN_ROWS], s_kq[GDN_ROWS];
    pdl_launch_dependents();
    const int R = gridDim.x, rank = blockIdx.x, hk = blockIdx.y, s = blockIdx.z, h = hk * R + rank;
    const int C = 2 * HK * DK + HV * DV;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int grp = lane >> 3, c = lane & 7, j = warp * GDN_COLS + c;  // as gdn_recurrent's lanes
    // The thread's conv channel: q (ch < DK), k, or v (ch - 2 DK < DV) of this head; its column in proj and conv_w.
    const int ch = tid, nch = 2 * DK + DV;
    const bool conv_lane = ch < nch;
    const int pcol = ch < DK ? hk * DK + ch : ch < 2 * DK ? (HK + hk) * DK + ch - DK : 2 * HK * DK + h * DV + ch - 2 * DK;
    const bool qk_channel = ch < 2 * DK;
    float wc[K];  // weights: read before the wait
#pragma unroll
    for (int q = 0; q < K; ++q) wc[q] = conv_lane ? gdn_f(conv_w[(long long)pcol * K + q]) : 0.f;
    const float neg_a = -expf(A_log[h]), dtb = dt_bias[h];
    constexpr int NPL = 8 * MIX_WARPS / 32;  // gated-norm columns per lane: l, l + 32, .. (DV <= 8 MIX_WARPS)
    float nw[NPL];  // the norm weight of those columns
#pragma unroll
    for (int m = 0; m < NPL; ++m) nw[m] = lane + 32 * m < DV ? norm_w[lane + 32 * m] : 0.f;
    // The sequence's conv window and recurrent state, requested before the wait so that they arrive under the
    // kernel in front (the in_proj GEMM) instead of after it: the slots are step inputs, copied in before any kernel
    // of the step runs, and a layer's states are written only by this kernel of that layer, in an earlier launch
    // (the previous step or the commit's own replay), never by a kernel in front of it in the same chain.
    const int slot = slots[s];
    const bool live_slot = slot >= 0, col = j < DV;
    float* cst = conv_states + ((long long)max(slot, 0) * C + pcol) * (K - 1);
    float* S = states + ((long long)max(slot, 0) * HV + h) * DK * DV;
    float win[K];  // win[q] = xx[r + q]: the K-1 rows before the next one, then that row
#pragma unroll
    for (int q = 0; q < K - 1; ++q) win[q] = conv_lane && live_slot ? cst[q] : 0.f;
    float st[RPL];
#pragma unroll
    for (int i = 0; i < RPL; ++i) st[i] = col && live_slot ? S[(long long)(grp * RPL + i) * DV + j] : 0.f;
    if (!independent) pdl_wait();
    const int start = cu[s], seq_rows = cu[s + 1] - start;
    const int first = spanned ? span[s] : 0, len = spanned ? span[gridDim.z + s] : seq_rows;
    const int lo = start + first;
    const long long out_stride = (long long)HV * DV;
    const float* zcol = proj + C + (long long)h * DV;  // z of this head, row t at zcol + t sp
    if (normed) {  // rows this sequence does not run (outside its span, or all of a padding sequence's): norm of zeros
        for (int r = warp; r < seq_rows; r += MIX_WARPS)
            if (slot < 0 || r < first || r >= first + len)
                gated_norm_row<float, float>(nullptr, zcol + (start + r) * sp, norm_w,
                                             out + (start + r) * out_stride + h * DV, DV, eps, lane);
    }
    if (len <= 0 || slot < 0) return;  // uniform over the cluster (one sequence): no CTA waits at its barrier alone
    const bool shared_writes = commit && R > 1;
    if (shared_writes) cluster_arrive();  // this CTA has read the q / k conv states rank 0 may overwrite
    for (int base = 0; base < len; base += GDN_ROWS) {
        const int rows = min(GDN_ROWS, len - base);
        if (base > 0) __syncthreads();  // every warp is done with the previous stage
        // Loads of the stage, all in flight together: the channel's rows; the warp's row's a, b and z (z is used
        // only after the token loop: loaded here, its latency passes under the loop).
        float xr[GDN_ROWS];
#pragma unroll
        for (int i = 0; i < GDN_ROWS; ++i) xr[i] = conv_lane && i < rows ? proj[(lo + base + i) * sp + pcol] : 0.f;
        const bool live = warp < rows;
        const long long t = lo + base + (live ? warp : 0);
        const float av = live ? proj[t * sp + C + HV * DV + HV + h] : 0.f;
        const float bv = live ? proj[t * sp + C + HV * DV + h] : 0.f;
        float zv[NPL];
#pragma unroll
        for (int m = 0; m < NPL; ++m) zv[m] = normed && live && lane + 32 * m < DV ? zcol[t * sp + lane + 32 * m] : 0.f;
        // The conv (causal_conv1d's sum and SiLU) of the stage's rows.
#pragma unroll
        for (int i = 0; i < GDN_ROWS; ++i) {
            if (i >= rows) break;
            const float y = conv_row(wc, win, xr[i]);
            if (conv_lane) {
                if (ch < DK) s_q[i][ch + (ch / RPL) * 4] = y;
                else if (qk_channel) s_k[i][ch - DK + ((ch - DK) / RPL) * 4] = y;
                else s_v[i][ch - 2 * DK] = y;
            }
        }
        __syncthreads();
        // gdn_recurrent's staging of row `warp`: L2 norms, k . q, the decay and beta.
        if (live) {
            float qv[EPL], kv[EPL];
#pragma unroll
            for (int m = 0; m < EPL; ++m) {
                const int i = lane + 32 * m;
                qv[m] = i < DK ? s_q[warp][i + (i / RPL) * 4] : 0.f;
                kv[m] = i < DK ? s_k[warp][i + (i / RPL) * 4] : 0.f;
            }
            stage_row<DK>(qv, kv, av, bv, neg_a, dtb, qscale, s_q[warp], s_k[warp], &s_decay[warp], &s_beta[warp],
                          &s_kq[warp], lane);
        }
        __syncthreads();
        // gdn_recurrent's token loop, o into shared memory.
        const int kbase = grp * (RPL + 4);
        for (int r = 0; r < rows; ++r) {
            const float o = delta_rule_token<RPL>(st, reinterpret_cast<const float4*>(&s_k[r][kbase]),
                                                  reinterpret_cast<const float4*>(&s_q[r][kbase]),
                                                  col ? s_v[r][j] : 0.f, s_decay[r], s_beta[r], s_kq[r]);
            if (grp == 0 && col) s_o[r][j] = o;
        }
        if (normed) {
            __syncthreads();  // the stage's o is complete
            if (live) {  // gated_norm_row of row `warp` on the registers
                float ss = 0.f;
#pragma unroll
                for (int m = 0; m < NPL; ++m)
                    if (lane + 32 * m < DV) ss += s_o[warp][lane + 32 * m] * s_o[warp][lane + 32 * m];
                const float rs = gated_norm_scale(ss, DV, eps);
                bf16* orow = out + t * out_stride + h * DV;
#pragma unroll
                for (int m = 0; m < NPL; ++m)
                    if (lane + 32 * m < DV) orow[lane + 32 * m] = gated_norm_value(nw[m], s_o[warp][lane + 32 * m], rs, zv[m]);
            }
        }
    }
    if (commit) {
        if (col) {
#pragma unroll
            for (int i = 0; i < RPL; ++i) S[(long long)(grp * RPL + i) * DV + j] = st[i];
        }
        // The new conv state: the window's K-1 rows after the last one run (causal_conv1d's `next`).
        if (shared_writes) cluster_wait();  // every CTA of the cluster has read the old q / k states
        if (conv_lane && (!qk_channel || rank == 0)) {
#pragma unroll
            for (int q = 0; q < K - 1; ++q) cst[q] = win[q];
        }
    }
}

template <typename X, typename Z>
__global__ void gated_rms_norm(const X* __restrict__ x, long long sx, const Z* __restrict__ z, long long sz,
                               const float* __restrict__ w, bf16* __restrict__ out, int T, int H, int D, float eps) {
    pdl_entry();
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // (row, head)
    if (item >= (long long)T * H) return;  // whole warps leave together
    const int lane = threadIdx.x & 31;
    const long long t = item / H;
    const int h = (int)(item % H);
    gated_norm_row(x + t * sx + (long long)h * D, z + t * sz + (long long)h * D, w,
                   out + t * ((long long)H * D) + (long long)h * D, D, eps, lane);
}

template <typename X, typename G>
__global__ void sigmoid_gate(const X* __restrict__ x, long long sx, const G* __restrict__ gate, long long sg,
                             bf16* __restrict__ out, int T, int W) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * W) return;
    const long long t = i / W;
    const int c = (int)(i % W);
    out[i] = __float2bfloat16_rn(gdn_f(x[t * sx + c]) * sigmoid_ieee(gdn_f(gate[t * sg + c])));
}
