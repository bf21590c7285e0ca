// argmax.cu: index of the largest value of each row (first index on ties), float32 comparison.
//
// x [rows, V] (bf16 or float32) with row stride sx (elements). Two launches:
//   argmax_partial<T, VEC>: grid (ceil(V / CHUNK), rows), 256 threads; each block reduces one CHUNK of one
//     row to a 64-bit key and folds it into keys[row] (uint64 [rows], zeroed by the caller) with atomicMax.
//     key = (order-preserving bits of the float) << 32 | (0xffffffff - index): the largest key is the largest
//     value and, among equal values, the smallest index. A non-finite value (NaN, +-Inf) takes the high word
//     0xffffffff, above every finite value's, so one decides its row. VEC: 16-byte loads (rows 16-byte aligned).
//   argmax_finish: out[row] = 0xffffffff - (keys[row] & 0xffffffff), int32 [rows], or `nonfinite` for a row that
//     holds a non-finite value (the engine finishes such a sequence with an error instead of sampling garbage).
// Splitting rows into chunks keeps the whole GPU busy when there are only a few rows of a 150k vocabulary.
#include "common.cuh"

#define ARGMAX_THREADS 256
#define ARGMAX_CHUNK 8192

#define ARGMAX_NONFINITE 0xffffffffu  // the high word of a non-finite value's key (no finite value has it)

__device__ __forceinline__ unsigned long long argmax_key(float f, unsigned idx) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) u = ARGMAX_NONFINITE;  // exponent all ones: NaN or +-Inf
    else u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - idx);
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }

template <typename T, bool VEC>
__global__ void argmax_partial(const T* __restrict__ x, long long sx, int V, unsigned long long* __restrict__ keys) {
    pdl_entry();
    constexpr int E = 16 / sizeof(T);  // elements per 16-byte vector
    const long long row = blockIdx.y;
    const T* xr = x + row * sx;
    const int lo = blockIdx.x * ARGMAX_CHUNK;
    const int hi = min(lo + ARGMAX_CHUNK, V);
    unsigned long long best = 0ull;
    if (VEC) {
        for (int i = lo + threadIdx.x * E; i < hi; i += ARGMAX_THREADS * E) {
            const uint4 raw = *reinterpret_cast<const uint4*>(xr + i);
            const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const unsigned long long k = argmax_key(to_f(vals[e]), (unsigned)(i + e));
                best = k > best ? k : best;
            }
        }
    } else {
        for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) {
            const unsigned long long k = argmax_key(to_f(xr[i]), (unsigned)i);
            best = k > best ? k : best;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    __shared__ unsigned long long warp_best[ARGMAX_THREADS / 32];
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
        atomicMax(keys + row, best);
    }
}

extern "C" __global__ void argmax_finish(const unsigned long long* __restrict__ keys, int* __restrict__ out, int rows,
                                         int nonfinite) {
    pdl_entry();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        const unsigned long long k = keys[r];
        out[r] = (unsigned)(k >> 32) == ARGMAX_NONFINITE ? nonfinite : (int)(0xffffffffu - (unsigned)(k & 0xffffffffull));
    }
}
