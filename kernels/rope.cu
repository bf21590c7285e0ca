// rope.cu: optional per-head RMSNorm (Qwen3 q_norm / k_norm) followed by rotate-half RoPE.
//
// head_norm_rope<D, NORM, X>: x [T, heads * D] X (bf16, or the float32 output of the qkv GEMM) with row stride sx (elements; x may be a column slice of a
// fused qkv GEMM output, read in place); out contiguous [T, heads * D] bf16; positions int32 [T];
// cos, sin float32 [max_pos, D / 2]; w [D] bf16 (NORM only).
//   h   = NORM ? w * (x_head * rsqrt(mean(x_head^2) + eps)) : x_head        (float32)
//   out = [h1 * cos - h2 * sin, h2 * cos + h1 * sin]   with h1 = h[:D/2], h2 = h[D/2:]
// Grid: flat, D/16 consecutive threads per (row, head); thread j owns elements 8j..8j+7 of both halves
// (two 16-byte loads), so the rotation partner is in the same thread. The head's sum of squares is reduced
// over its D/16 lanes with xor-shuffles (D/16 divides 32, so a head never straddles a warp).
#include "common.cuh"

template <int D, bool NORM, typename X>
__global__ void head_norm_rope(const X* __restrict__ x, long long sx, const int* __restrict__ positions,
                               const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                               const bf16* __restrict__ w, bf16* __restrict__ out, int T, int heads, float eps) {
    constexpr int TPH = D / 16, HALF = D / 2;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const bool valid = g < (long long)T * heads * TPH;
    const int j = (int)(g % TPH);
    const long long th = valid ? g / TPH : 0;
    const int h = (int)(th % heads);
    const long long t = th / heads;
    float a[8], b[8];
    const X* src = x + t * sx + h * D + 8 * j;
    load8(src, 0, a);
    load8(src + HALF, 0, b);
    if (NORM) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += a[e] * a[e] + b[e] * b[e];
#pragma unroll
        for (int o = TPH / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float r = rsqrtf(ss / (float)D + eps);
        float wa[8], wb[8];
        unpack8(*reinterpret_cast<const uint4*>(w + 8 * j), wa);
        unpack8(*reinterpret_cast<const uint4*>(w + HALF + 8 * j), wb);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            a[e] = wa[e] * (a[e] * r);
            b[e] = wb[e] * (b[e] * r);
        }
    }
    if (!valid) return;
    const long long p = positions[t];
    const float4* cp = reinterpret_cast<const float4*>(cos_t + p * HALF + 8 * j);
    const float4* sp = reinterpret_cast<const float4*>(sin_t + p * HALF + 8 * j);
    const float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
    const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    float o1[8], o2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        o1[e] = a[e] * c[e] - b[e] * s[e];
        o2[e] = b[e] * c[e] + a[e] * s[e];
    }
    bf16* dst = out + (t * heads + h) * D + 8 * j;
    *reinterpret_cast<uint4*>(dst) = pack8(o1);
    *reinterpret_cast<uint4*>(dst + HALF) = pack8(o2);
}
