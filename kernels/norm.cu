// norm.cu: RMSNorm over the last axis, optionally fused with the residual add.
//
// rms_norm<VPT, ADD, X, RES>: for row t,
//   r        = x[t] + res[t]  (ADD; written to res_out[t] in float32: the residual stream)
//   out[t]   = w * (r * rsqrt(mean(r^2) + eps))
// Layout: x [T, H] X (bf16, or float32 from the GEMMs that feed the residual stream), res [T, H] RES (bf16
// for the embedding that starts the stream, else float32), row
// strides sx, sr (elements); out [T, H] bf16 and res_out [T, H] float32 contiguous; w [H] bf16.
// The residual stream stays in float32 across layers: rounding it to bf16 after every add costs the last
// few bits of every logit, enough to flip greedy choices that float32 makes consistently.
// H % 8 == 0. Grid: one block per row; blockDim.x = 32 * k; thread i keeps vectors i, i + blockDim.x, ...
// (VPT of them, 8 bf16 each) in registers, so the row is read once. Sum of squares in float32.
#include "common.cuh"

template <int VPT, bool ADD, typename X, typename RES>
__global__ void rms_norm(const X* __restrict__ x, long long sx, const RES* __restrict__ res, long long sr,
                         const bf16* __restrict__ w, bf16* __restrict__ out, float* __restrict__ res_out,
                         int H, float eps) {
    pdl_launch_dependents();
    const long long t = blockIdx.x;
    const int nvec = H >> 3;
    uint4 wv[VPT];  // the norm weight is no kernel's output: its loads go out before the wait
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) wv[i] = reinterpret_cast<const uint4*>(w)[c];
    }
    pdl_wait();
    float v[VPT][8];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) {
            load8(x + t * sx, c, v[i]);
            if (ADD) {
                float r[8];
                load8(res + t * sr, c, r);
#pragma unroll
                for (int e = 0; e < 8; ++e) v[i][e] += r[e];
                store8(res_out + t * H, c, v[i]);
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += v[i][e] * v[i][e];
        }
    }
    const float scale = rsqrtf(block_sum(ss) / (float)H + eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) {
            float wf[8], o[8];
            unpack8(wv[i], wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = wf[e] * (v[i][e] * scale);
            reinterpret_cast<uint4*>(out + t * H)[c] = pack8(o);
        }
    }
}
