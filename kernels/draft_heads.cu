// draft_heads.cu: the ops of the DFlash2 drafter heads (definitions: NumpyBackend.block_conv / topk / pair_scores).
//
// block_conv<X, CO, B>: grouped dynamic depthwise convolution along the rows of each block.
//   x [T, C] X (bf16 or float32, row stride sx), T a multiple of `block`; coeff [T, K * G] CO (bf16 or float32,
//   row stride sc: a column slice of the fused projection), tap-major; base [K, C] B (row stride sb);
//   out [T, C] X contiguous:
//     out[t, c] = sum over tau < K, tau <= t % block of
//                 (base[tau, c] + coeff[t, tau * G + c / (C / G)]) * x[t - tau, c]
//   C % 8 == 0, 16-byte aligned rows of x and base. Flat grid over T * C / 8: each thread owns 8 channels of
//   one row (16-byte loads of x and base, scalar coefficient loads, one per channel group). float32 math in
//   the reference's order (kernel = base + coeff, then kernel * x, summed over tau ascending) with __fadd_rn /
//   __fmul_rn, so a float32 x gives the numpy result bit for bit; a bf16 x is rounded once on store.
//
// topk_level<T, VEC> / topk_write<T>: the k largest entries of each row, value descending, equal values lower
//   index first (numpy's order; -0.0 and +0.0 are equal). Every entry becomes a unique 64-bit key
//   (order-preserving bits of the float32 value) << 32 | (0xffffffff - index), so the top k of a row are
//   exactly its k largest keys, sorted by key. Key 0 (never a real key) pads.
//   topk_level: grid (ceil(n / TOPK_CHUNK), rows), TOPK_THREADS threads; block b of row r reads inputs
//     b * TOPK_CHUNK .. of in + r * s_in (n per row: T = bf16 / float values of x, or T = unsigned long long
//     keys of the previous level) and writes its k largest keys, sorted, zero padded, to
//     out[(r * gridDim.x + b) * k ..]. The caller repeats on the keys until one block per row remains
//     (k <= TOPK_MAX_K, so each level shrinks its input by TOPK_CHUNK / k >= 32).
//     In a block: each thread keeps TOPK_PER keys in registers (VEC: 16-byte loads, rows 16-byte aligned and
//     n % (16 / sizeof(T)) == 0). L = the smallest of the k largest per-thread maxima: k distinct keys are
//     >= L, so every top-k key is >= L, and only the <= k threads whose maximum is >= L can hold one; their
//     keys >= L (at most k * TOPK_PER) go to shared memory, where each candidate's rank (the number of larger
//     candidates) is its output slot when it is < k.
//   topk_write: vals [rows, k] float32 = x[r, id], ids [rows, k] int32, from the last level's keys [rows, k];
//     the value is read back from x (it keeps the sign of a zero that the key folded to +0).
//   NaN is not ordered like numpy's reference (it ranks above +inf here).
//
// pair_scores<H>: the DFlash2 selector lattice, out [R, P, K] float32 contiguous:
//     out[t, p, c] = unary[t, c] + sum_j (A[pred[t, p], j] * h[t, j]) * B[cand[t, c], j]
//   unary float32 [R, K], cand int32 [R, K], pred int32 [R, P] (contiguous); h [R, r] H (bf16 or float32, row
//   stride sh); A, B [V, r] bf16 (row strides sa, sb); r % 8 == 0, 16-byte aligned rows; ids must be in [0, V).
//   Grid (R, ceil(P / PS_TILE), ceil(K / PS_TILE)), PS_THREADS threads: the block stages rank columns
//   j0 .. j0 + PS_RT of its (up to) PS_TILE predecessor rows A * h (float32, rounded as the reference's
//   product) and PS_TILE candidate rows of B in shared memory (rows padded by one float against bank
//   conflicts); output o = p * nk + c of the tile (p < np, c < nk) is thread o % PS_THREADS's accumulator
//   o / PS_THREADS, float32 in registers (one output per thread for P = K = 16), summed over j ascending.
#include "common.cuh"

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(bf16 v) { return __bfloat162float(v); }

// ------------------------------------------------------------------------------------------------ block_conv
template <typename X, typename CO, typename B>
__global__ void block_conv(const X* __restrict__ x, long long sx, const CO* __restrict__ coeff, long long sc,
                           const B* __restrict__ base, long long sb, X* __restrict__ out, int T, int C, int K,
                           int G, int block) {
    pdl_entry();
    const int vpr = C >> 3;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (g >= (long long)T * vpr) return;
    const long long t = g / vpr;
    const int c = (int)(g % vpr);
    const int gs = C / G;  // channels per group
    int grp[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) grp[e] = (8 * c + e) / gs;
    const int taps = min(K, (int)(t % block) + 1);  // taps stop at the block boundary
    const CO* crow = coeff + t * sc;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int tau = 0; tau < taps; ++tau) {
        float xv[8], bv[8];
        load8(x + (t - tau) * sx, c, xv);
        load8(base + tau * sb, c, bv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float kern = __fadd_rn(bv[e], as_float(crow[tau * G + grp[e]]));
            acc[e] = __fadd_rn(acc[e], __fmul_rn(kern, xv[e]));
        }
    }
    store8(out + t * C, c, acc);
}

// ------------------------------------------------------------------------------------------------ topk
#define TOPK_THREADS 256
#define TOPK_PER 16                                // keys per thread
#define TOPK_CHUNK (TOPK_THREADS * TOPK_PER)       // inputs per block
#define TOPK_MAX_K 128

__device__ __forceinline__ unsigned long long topk_key(float f, unsigned idx) {
    unsigned u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0u;  // -0.0 == +0.0 (numpy): equal values, ordered by index
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - idx);
}

// This thread's TOPK_PER keys of inputs [lo, hi) of one row (0 beyond hi).
template <bool VEC, typename T>
__device__ __forceinline__ void topk_fetch(const T* __restrict__ row, int lo, int hi, unsigned long long* key) {
    if (VEC) {
        constexpr int E = 16 / sizeof(T);
#pragma unroll
        for (int j = 0; j < TOPK_PER / E; ++j) {
            const int i = lo + (j * TOPK_THREADS + (int)threadIdx.x) * E;
            if (i < hi) {  // hi % E == 0: a vector is wholly inside or outside
                const uint4 raw = *reinterpret_cast<const uint4*>(row + i);
                const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int e = 0; e < E; ++e) key[j * E + e] = topk_key(as_float(v[e]), (unsigned)(i + e));
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) key[j * E + e] = 0ull;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < TOPK_PER; ++j) {
            const int i = lo + j * TOPK_THREADS + (int)threadIdx.x;
            key[j] = i < hi ? topk_key(as_float(row[i]), (unsigned)i) : 0ull;
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void topk_fetch(const unsigned long long* __restrict__ row, int lo, int hi,
                                           unsigned long long* key) {
#pragma unroll
    for (int j = 0; j < TOPK_PER; ++j) {
        const int i = lo + j * TOPK_THREADS + (int)threadIdx.x;
        key[j] = i < hi ? row[i] : 0ull;
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(TOPK_THREADS) topk_level(const T* __restrict__ in, long long s_in, int n, int k,
                                                           unsigned long long* __restrict__ out) {
    pdl_entry();
    __shared__ unsigned long long tmax[TOPK_THREADS];
    __shared__ unsigned long long cand[TOPK_MAX_K * TOPK_PER];
    __shared__ unsigned long long lower;
    __shared__ int ncand;
    const int tid = threadIdx.x;
    const long long row = blockIdx.y;
    const int lo = blockIdx.x * TOPK_CHUNK;
    const int hi = min(lo + TOPK_CHUNK, n);
    unsigned long long key[TOPK_PER];
    topk_fetch<VEC>(in + row * s_in, lo, hi, key);
    unsigned long long m = key[0];
#pragma unroll
    for (int j = 1; j < TOPK_PER; ++j) m = key[j] > m ? key[j] : m;
    tmax[tid] = m;
    if (tid == 0) {
        lower = ~0ull;
        ncand = 0;
    }
    __syncthreads();
    // L = min of the k largest thread maxima (real keys are unique; only padding zeros repeat).
    int rank = 0;
    for (int j = 0; j < TOPK_THREADS; ++j) rank += tmax[j] > m;
    if (rank < k) atomicMin(&lower, m);
    __syncthreads();
    const unsigned long long L = lower > 1ull ? lower : 1ull;  // never a padding key
    if (m >= L) {
#pragma unroll
        for (int j = 0; j < TOPK_PER; ++j)
            if (key[j] >= L) cand[atomicAdd(&ncand, 1)] = key[j];
    }
    __syncthreads();
    const int nc = ncand;
    unsigned long long* dst = out + (row * gridDim.x + blockIdx.x) * k;
    for (int i = tid; i < nc; i += TOPK_THREADS) {
        const unsigned long long ki = cand[i];
        int r = 0;
        for (int j = 0; j < nc; ++j) r += cand[j] > ki;
        if (r < k) dst[r] = ki;
    }
    for (int i = nc + tid; i < k; i += TOPK_THREADS) dst[i] = 0ull;  // fewer than k inputs in this block
}

template <typename T>
__global__ void topk_write(const unsigned long long* __restrict__ keys, const T* __restrict__ x, long long sx,
                           float* __restrict__ vals, int* __restrict__ ids, int total, int k) {
    pdl_entry();
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total) return;
    const long long row = g / k;
    const unsigned id = 0xffffffffu - (unsigned)(keys[g] & 0xffffffffull);
    ids[g] = (int)id;
    vals[g] = as_float(x[row * sx + id]);
}

// ------------------------------------------------------------------------------------------------ pair_scores
#define PS_THREADS 256
#define PS_TILE 64   // predecessors / candidates per block
#define PS_RT 64     // rank columns staged per step
#define PS_OUT (PS_TILE * PS_TILE / PS_THREADS)

template <typename H>
__global__ void __launch_bounds__(PS_THREADS) pair_scores(
        const float* __restrict__ unary, const int* __restrict__ cand, const int* __restrict__ pred,
        const H* __restrict__ hidden, long long sh, const bf16* __restrict__ A, long long sa,
        const bf16* __restrict__ B, long long sb, float* __restrict__ out, int P, int K, int r) {
    pdl_entry();
    __shared__ float sa_[PS_TILE][PS_RT + 1];
    __shared__ float sb_[PS_TILE][PS_RT + 1];
    __shared__ int sid[2 * PS_TILE];
    const int tid = threadIdx.x;
    const long long t = blockIdx.x;
    const int p0 = blockIdx.y * PS_TILE, c0 = blockIdx.z * PS_TILE;
    const int np = min(PS_TILE, P - p0), nk = min(PS_TILE, K - c0);
    if (tid < np) sid[tid] = pred[t * P + p0 + tid];
    if (tid < nk) sid[PS_TILE + tid] = cand[t * K + c0 + tid];
    float acc[PS_OUT];
#pragma unroll
    for (int i = 0; i < PS_OUT; ++i) acc[i] = 0.f;
    const H* hrow = hidden + t * sh;
    for (int j0 = 0; j0 < r; j0 += PS_RT) {
        __syncthreads();  // sid written / the previous step's tiles consumed
        constexpr int VPR = PS_RT / 8;  // 16-byte vectors per staged row
        for (int v = tid; v < 2 * PS_TILE * VPR; v += PS_THREADS) {
            const int row = v / VPR, q = v % VPR;
            const int col = j0 + 8 * q;
            const bool is_a = row < PS_TILE;
            const int rr = is_a ? row : row - PS_TILE;
            if (col >= r || rr >= (is_a ? np : nk)) continue;
            float f[8];
            if (is_a) {
                float hv[8];
                load8(A + (long long)sid[row] * sa, col >> 3, f);
                load8(hrow, col >> 3, hv);
#pragma unroll
                for (int e = 0; e < 8; ++e) sa_[rr][8 * q + e] = __fmul_rn(f[e], hv[e]);
            } else {
                load8(B + (long long)sid[row] * sb, col >> 3, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) sb_[rr][8 * q + e] = f[e];
            }
        }
        __syncthreads();
        const int jn = min(PS_RT, r - j0);
#pragma unroll
        for (int i = 0; i < PS_OUT; ++i) {
            const int o = tid + i * PS_THREADS;
            const int p = o / nk, c = o % nk;
            if (o < np * nk) {
                float s = acc[i];
                for (int j = 0; j < jn; ++j) s = fmaf(sa_[p][j], sb_[c][j], s);
                acc[i] = s;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < PS_OUT; ++i) {
        const int o = tid + i * PS_THREADS;
        const int p = o / nk, c = o % nk;
        if (o < np * nk) out[(t * P + p0 + p) * K + c0 + c] = unary[t * K + c0 + c] + acc[i];
    }
}
