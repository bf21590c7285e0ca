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
//   Grid (n, HV, cdiv(DV, GDN_TILE)), GDN_WARPS x 32 threads: lane l owns column j0 + l of the state, warp w its
//   rows w DK/GDN_WARPS .. (w+1) DK/GDN_WARPS - 1, in registers for the whole sequence (read once, written once at
//   commit). Rows are staged GDN_ROWS at a time in shared memory (q, k normalised, the v tile, e^g, beta); the two
//   reductions over dk per token (S^T k, S^T q) go lane-wise within a thread, then across warps through shared
//   memory in a fixed order. The chunked (prefill) op runs this same kernel over all rows of a sequence.
// gated_rms_norm<X, Z>: out[t, h D + i] = w[i] x[t, h D + i] rsqrt(mean_i x^2 + eps) silu(z[t, h D + i]); x, z
//   [T, H D] X / Z with row strides sx, sz; w [D] float32; out [T, H D] bf16 contiguous. One warp per (row, head).
// sigmoid_gate<X, G>: out = x sigmoid(gate); x, gate [T, W] with row strides; out [T, W] bf16. A thread per element.
#include "common.cuh"

#define CONV_ROWS 64  // rows per thread of causal_conv1d
#define GDN_WARPS 4
#define GDN_TILE 32  // state columns (dv) per CTA: one per lane
#define GDN_ROWS 16  // rows staged in shared memory at a time (even: the reduction buffers alternate by row parity)
#define L2_EPS 1e-6f  // gdn_numpy.L2_EPS

__device__ __forceinline__ float gdn_f(float v) { return v; }
__device__ __forceinline__ float gdn_f(bf16 v) { return __bfloat162float(v); }
// The numpy definitions' sigmoid, 1 / (1 + e^-x), with an IEEE division.
__device__ __forceinline__ float gdn_sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

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
    for (int r = r0; r < r1; ++r) {
        win[K - 1] = gdn_f(xc[(long long)r * sx]);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < K; ++j) acc += wc[j] * win[j];
        out[(long long)(lo + r) * C + c] = acc * gdn_sigmoid(acc);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
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
    constexpr int RPW = DK / GDN_WARPS;  // state rows per thread
    static_assert(DK % GDN_WARPS == 0, "DK must split evenly over the warps");
    __shared__ float s_q[GDN_ROWS][DK];  // normalised, scaled q of the staged rows
    __shared__ float s_k[GDN_ROWS][DK];  // normalised k
    __shared__ float s_v[GDN_ROWS][GDN_TILE];  // this CTA's columns of v
    __shared__ float s_decay[GDN_ROWS];  // e^g
    __shared__ float s_beta[GDN_ROWS];
    __shared__ float s_kv[2][GDN_WARPS][GDN_TILE];  // per-warp partial sums of S^T k, by row parity
    __shared__ float s_o[2][GDN_WARPS][GDN_TILE];  // per-warp partial sums of S^T q, by row parity
    pdl_launch_dependents();
    const int s = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * GDN_TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = j0 + lane;
    const bool col = j < DV;
    const float neg_a = -expf(A_log[h]), dtb = dt_bias[h];  // weights: read before the wait
    pdl_wait();
    const int slot = slots[s];
    const int start = cu[s], seq_rows = cu[s + 1] - start;  // the sequence's rows
    const int first = spanned ? span[s] : 0, len = spanned ? span[gridDim.x + s] : seq_rows;  // the rows it runs
    const int lo = start + first;
    const long long out_stride = (long long)HV * DV;
    if (spanned && col)  // the sequence's rows outside its span: zeros, as numpy's
        for (int r = warp; r < seq_rows; r += GDN_WARPS)
            if (r < first || r >= first + len) out[(start + r) * out_stride + (long long)h * DV + j] = 0.f;
    if (len <= 0) return;  // uniform over the CTA (as the next branch): no barrier is skipped by part of it
    if (slot < 0) {  // a padding sequence: zero rows, as numpy's (so the caller need not clear the output)
        if (col)
            for (int r = warp; r < len; r += GDN_WARPS) out[(lo + r) * out_stride + (long long)h * DV + j] = 0.f;
        return;
    }
    const int hk = h / (HV / HK);
    float* S = states + ((long long)slot * HV + h) * DK * DV;  // [DK, DV]
    float st[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) st[r] = col ? S[(long long)(warp * RPW + r) * DV + j] : 0.f;
    for (int base = 0; base < len; base += GDN_ROWS) {
        const int rows = min(GDN_ROWS, len - base);
        // Stage: warp w takes rows w, w + GDN_WARPS, ...; lane l owns elements l, l + 32, ... of q and k.
        for (int r = warp; r < rows; r += GDN_WARPS) {
            const long long t = lo + base + r;
            const float* row = qkv + t * sq;
            const float* qr = row + hk * DK;
            const float* kr = row + (HK + hk) * DK;
            float qq = 0.f, kk = 0.f;
            for (int i = lane; i < DK; i += 32) {
                const float u = qr[i], v = kr[i];
                s_q[r][i] = u;
                s_k[r][i] = v;
                qq += u * u;
                kk += v * v;
            }
            qq = warp_sum(qq);
            kk = warp_sum(kk);
            const float rq = 1.f / sqrtf(qq + L2_EPS), rk = 1.f / sqrtf(kk + L2_EPS);
            for (int i = lane; i < DK; i += 32) {  // the lane's own elements: no barrier needed
                s_q[r][i] = s_q[r][i] * rq * qscale;
                s_k[r][i] = s_k[r][i] * rk;
            }
            s_v[r][lane] = col ? row[2LL * HK * DK + (long long)h * DV + j] : 0.f;
            if (lane == 0) {
                const float x = a[t * sa + h] + dtb;
                const float softplus = x > 20.f ? x : log1pf(expf(x));
                s_decay[r] = expf(neg_a * softplus);
                s_beta[r] = gdn_sigmoid(b[t * sb + h]);
            }
        }
        __syncthreads();
        for (int r = 0; r < rows; ++r) {
            const int p = r & 1;
            const float decay = s_decay[r];
            // Four partial sums per thread: a chain of RPW / 4 dependent FMAs instead of RPW (the per-token latency).
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                st[i] *= decay;
                part[i & 3] += st[i] * s_k[r][warp * RPW + i];
            }
            s_kv[p][warp][lane] = (part[0] + part[1]) + (part[2] + part[3]);
            __syncthreads();
            float kv = 0.f;
#pragma unroll
            for (int w = 0; w < GDN_WARPS; ++w) kv += s_kv[p][w][lane];
            const float delta = (s_v[r][lane] - kv) * s_beta[r];
            part[0] = part[1] = part[2] = part[3] = 0.f;
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                st[i] += s_k[r][warp * RPW + i] * delta;
                part[i & 3] += st[i] * s_q[r][warp * RPW + i];
            }
            s_o[p][warp][lane] = (part[0] + part[1]) + (part[2] + part[3]);
            __syncthreads();  // also: every read of this row's staged q / k / v is done (the next stage may write)
            if (warp == 0 && col) {
                float o = 0.f;
#pragma unroll
                for (int w = 0; w < GDN_WARPS; ++w) o += s_o[p][w][lane];
                out[(lo + base + r) * out_stride + (long long)h * DV + j] = o;
            }
        }
    }
    if (commit && col) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) S[(long long)(warp * RPW + r) * DV + j] = st[r];
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
    const X* xr = x + t * sx + (long long)h * D;
    const Z* zr = z + t * sz + (long long)h * D;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) {
        const float v = gdn_f(xr[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float rs = 1.f / sqrtf(ss / (float)D + eps);
    bf16* orow = out + t * ((long long)H * D) + (long long)h * D;
    for (int i = lane; i < D; i += 32) {
        const float g = gdn_f(zr[i]);
        orow[i] = __float2bfloat16_rn(w[i] * (gdn_f(xr[i]) * rs) * (g * gdn_sigmoid(g)));
    }
}

template <typename X, typename G>
__global__ void sigmoid_gate(const X* __restrict__ x, long long sx, const G* __restrict__ gate, long long sg,
                             bf16* __restrict__ out, int T, int W) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * W) return;
    const long long t = i / W;
    const int c = (int)(i % W);
    out[i] = __float2bfloat16_rn(gdn_f(x[t * sx + c]) * gdn_sigmoid(gdn_f(gate[t * sg + c])));
}
