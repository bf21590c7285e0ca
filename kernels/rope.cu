// rope.cu: optional per-head RMSNorm (Qwen3 q_norm / k_norm) and rotate-half RoPE of a fused qkv row, with the
// K and V heads written straight into one layer's paged KV cache (one launch instead of rope q, rope k, store).
//
// rope_store<D, NORM, X>: x [T, (Hq + 2 Hk) * D] X (bf16, or the float32 output of the qkv GEMM) with row stride
// sx (elements; x may be a column slice of a fused GEMM output, read in place): Hq q heads, Hk k heads, Hk v heads;
// positions int32 [T]; cos, sin float32 [max_pos, D / 2]; q_w, k_w [D] bf16 (NORM only);
// slots int32 [T] (cache row of token t = block * block_size + offset; < 0: padding, nothing stored);
// q_out contiguous [T, Hq * D] bf16; k_cache, v_cache [num_blocks, block_size, Hk, D] bf16.
//   q, k head:  h = NORM ? w * (x_head * rsqrt(mean(x_head^2) + eps)) : x_head        (float32)
//               rope(h) = [h1 * cos - h2 * sin, h2 * cos + h1 * sin]   with h1 = h[:D/2], h2 = h[D/2:]
//   q head -> q_out[t] = rope(h); k head -> k_cache[slots[t]] = rope(h); v head -> v_cache[slots[t]] = x_head.
// The head_norm_rope op is the Hk = 0 case (every head a q head; slots and caches unused).
// Grid: flat, D/16 consecutive threads per (row, head); thread j owns elements 8j..8j+7 of both halves
// (two 16-byte loads), so the rotation partner is in the same thread. The head's sum of squares is reduced
// over its D/16 lanes with xor-shuffles (D/16 divides 32, so a head never straddles a warp).
// Loads: the norm weight before griddepcontrol.wait (no kernel writes a weight); after it x, the position's
// cos / sin and the slot are all requested before any of them is used, so the chain after the kernel in front is
// one round trip for x and two for position -> table side by side, not one after the other.
#include "common.cuh"

// Rotates one thread's elements in place: a = h[8j..8j+7] (first half), b = its partners in the second half,
// c / s = cos / sin of its position at those eight frequencies.
__device__ __forceinline__ void rope8(float* a, float* b, const float* c, const float* s) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float o1 = a[e] * c[e] - b[e] * s[e];
        const float o2 = b[e] * c[e] + a[e] * s[e];
        a[e] = o1;
        b[e] = o2;
    }
}

template <int D, bool NORM, typename X>
__global__ void rope_store(const X* __restrict__ x, long long sx, const int* __restrict__ positions,
                           const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                           const bf16* __restrict__ q_w, const bf16* __restrict__ k_w, const int* __restrict__ slots,
                           bf16* __restrict__ q_out, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                           int T, int q_heads, int kv_heads, float eps) {
    pdl_launch_dependents();
    constexpr int TPH = D / 16, HALF = D / 2;
    const int heads = q_heads + 2 * kv_heads;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const bool valid = g < (long long)T * heads * TPH;
    const int j = (int)(g % TPH);
    const long long th = valid ? g / TPH : 0;
    const int h = (int)(th % heads);
    const long long t = th / heads;
    const bool is_v = h >= q_heads + kv_heads;
    float wa[8], wb[8];
    if (NORM && !is_v) {
        const bf16* w = h < q_heads ? q_w : k_w;
        unpack8(*reinterpret_cast<const uint4*>(w + 8 * j), wa);
        unpack8(*reinterpret_cast<const uint4*>(w + HALF + 8 * j), wb);
    }
    pdl_wait();
    float a[8], b[8], c[8], s[8];
    const X* src = x + t * sx + h * D + 8 * j;
    load8(src, 0, a);
    load8(src + HALF, 0, b);
    if (valid && !is_v) {
        const long long p = positions[t];
        load8(cos_t + p * HALF, j, c);
        load8(sin_t + p * HALF, j, s);
    }
    const long long slot = valid && h >= q_heads ? slots[t] : -1;
    if (NORM) {
        // Every lane takes part in the full-mask shuffles, v heads and out-of-range lanes included (their sum is
        // discarded): a warp may hold k and v heads side by side.
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += a[e] * a[e] + b[e] * b[e];
#pragma unroll
        for (int o = TPH / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (!is_v) {
            const float r = rsqrtf(ss / (float)D + eps);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                a[e] = wa[e] * (a[e] * r);
                b[e] = wb[e] * (b[e] * r);
            }
        }
    }
    if (!valid) return;
    bf16* dst;
    if (h < q_heads) {
        dst = q_out + (t * q_heads + h) * D;
    } else {
        if (slot < 0) return;
        const int kvh = is_v ? h - q_heads - kv_heads : h - q_heads;
        dst = (is_v ? v_cache : k_cache) + (slot * kv_heads + kvh) * D;
    }
    if (!is_v) rope8(a, b, c, s);
    *reinterpret_cast<uint4*>(dst + 8 * j) = pack8(a);
    *reinterpret_cast<uint4*>(dst + HALF + 8 * j) = pack8(b);
    cf_trace_event(2);  // (thread 0, where it had a row to store) this CTA has written: the step timeline
}
