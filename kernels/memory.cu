// memory.cu: row gathers (embedding lookup, take_rows) and checkpoint dtype conversion to bf16.
//
// gather_rows: dst[t, :] = src[rows[t], :]; rows int32 [T]; src row stride `src_stride` and row width `width`
//   counted in 16-byte vectors (any dtype whose rows are 16-byte multiples); dst contiguous [T, width].
//   Grid: (T, ceil(width / blockDim.x)); each thread copies one uint4 per row. A row id < 0 writes zeros.
// f32_to_bf16 / f16_to_bf16: flat conversion of n elements, grid-stride, round to nearest even. Run once per
//   weight at load time, so plain scalar code is enough.
// bf16_flags: what a loaded weight holds, x bf16 bits [n]: flags[0] = 1 if some element is NaN or +-Inf (exponent
//   all ones), flags[1] = 1 if some element is not zero (of either sign); flags int32 [2], zeroed by the caller.
//   Grid-stride, one pass, load time only.
#include "common.cuh"
#include <cuda_fp16.h>

extern "C" __global__ void gather_rows(const uint4* __restrict__ src, long long src_stride,
                                       const int* __restrict__ rows, uint4* __restrict__ dst, int width) {
    pdl_entry();
    const int t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const int r = rows[t];
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r >= 0) v = src[(long long)r * src_stride + c];
    dst[(long long)t * width + c] = v;
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long long n) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

extern "C" __global__ void bf16_flags(const unsigned short* __restrict__ x, long long n, int* __restrict__ flags) {
    pdl_entry();
    int nonfinite = 0, nonzero = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned b = x[i];
        nonfinite |= (b & 0x7F80u) == 0x7F80u;
        nonzero |= (b & 0x7FFFu) != 0u;
    }
    nonfinite = __syncthreads_or(nonfinite);
    nonzero = __syncthreads_or(nonzero);
    if (threadIdx.x == 0) {
        if (nonfinite) atomicOr(flags, 1);
        if (nonzero) atomicOr(flags + 1, 1);
    }
}

extern "C" __global__ void f16_to_bf16(const __half* __restrict__ src, bf16* __restrict__ dst, long long n) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(__half2float(src[i]));
}
