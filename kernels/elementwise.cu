// elementwise.cu: SwiGLU, residual-style add and bias add on bf16 rows, 8 elements (16 bytes) per thread.
//
// swiglu<G>: y [T, 2I] G (bf16, or the float32 GEMM output; row stride sy), a product with a gate_up weight whose
//           rows interleave gate and up in groups of 8 (CudaBackend.gate_up_weight: columns 16 j .. 16 j + 7 of y
//           are gate features 8 j .. 8 j + 7, the next eight their up features) -> out [T, I] bf16 = silu(gate) * up.
//           Flat grid over T * I / 8 vectors; vector j reads group j's 16 contiguous values. (Where the weight
//           streams, the GEMM's epilogue computes the same values itself: stream_gemm.cu, SG_SWIGLU.)
// add<A, B>: a [T, W] A (stride sa) + b [T, W] B (stride sb) -> out [T, W] bf16 contiguous; A and B are bf16
//           or float32 (a GEMM output / the residual stream). Flat grid over T * W / 8.
// bias_add<Y>: y [T, N] Y (bf16 or float32) contiguous, in place: y[t, :] += bias[:] (bias bf16; the GEMM
//           epilogue for Qwen2-style biases).
// All math in float32; one rounding to bf16 on store.
#include "common.cuh"

template <typename G>
__global__ void swiglu(const G* __restrict__ y, long long sy, bf16* __restrict__ out, int T, int I) {
    pdl_entry();
    const int vpr = I >> 3;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (g >= (long long)T * vpr) return;
    const long long t = g / vpr;
    const int c = (int)(g % vpr);
    const G* row = y + t * sy;
    float gt[8], up[8], o[8];
    load8(row, 2 * c, gt);
    load8(row, 2 * c + 1, up);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = swiglu_value(gt[e], up[e]);
    reinterpret_cast<uint4*>(out + t * I)[c] = pack8(o);
}

template <typename A, typename B>
__global__ void add(const A* __restrict__ a, long long sa, const B* __restrict__ b, long long sb,
                    bf16* __restrict__ out, int T, int W) {
    pdl_entry();
    const int vpr = W >> 3;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (g >= (long long)T * vpr) return;
    const long long t = g / vpr;
    const int c = (int)(g % vpr);
    float x[8], y[8];
    load8(a + t * sa, c, x);
    load8(b + t * sb, c, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += y[e];
    reinterpret_cast<uint4*>(out + t * W)[c] = pack8(x);
}

template <typename Y>
__global__ void bias_add(Y* __restrict__ y, const bf16* __restrict__ bias, int T, int N) {
    pdl_entry();
    const int vpr = N >> 3;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (g >= (long long)T * vpr) return;
    const int c = (int)(g % vpr);
    float x[8], b[8];
    load8(y, (int)g, x);  // g indexes 8-element vectors of the contiguous [T, N] array
    unpack8(reinterpret_cast<const uint4*>(bias)[c], b);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += b[e];
    store8(y, (int)g, x);
}
