// common.cuh: helpers shared by every cudflash kernel.
//
// Storage is bf16 (__nv_bfloat16); all arithmetic is float32. Row-oriented kernels move 16 bytes (8 bf16)
// per thread per access, so callers guarantee 16-byte aligned row starts (row stride % 8 == 0, base % 16
// == 0) and widths that are multiples of 8; the Python wrappers check this and copy when it does not hold.
// kernel_loader.py inlines this file into each kernel source, so the on-disk NVRTC cache key covers it.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

#define CF_INF __int_as_float(0x7f800000)

// 16 bytes = 8 bf16 <-> 8 floats.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    const bf162* h = reinterpret_cast<const bf162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    bf162* h = reinterpret_cast<bf162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}

// Element c*8 .. c*8+7 of a row, as floats, from bf16 (one 16-byte load) or float32 (two) storage.
__device__ __forceinline__ void load8(const bf16* row, int c, float* f) {
    unpack8(reinterpret_cast<const uint4*>(row)[c], f);
}
__device__ __forceinline__ void load8(const float* row, int c, float* f) {
    const float4 a = reinterpret_cast<const float4*>(row)[2 * c], b = reinterpret_cast<const float4*>(row)[2 * c + 1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void store8(bf16* row, int c, const float* f) {
    reinterpret_cast<uint4*>(row)[c] = pack8(f);
}
__device__ __forceinline__ void store8(float* row, int c, const float* f) {
    reinterpret_cast<float4*>(row)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(row)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
}

// The step timeline (scripts/step_timeline.py), compiled in only with -DCF_TRACE (a tuning's nvrtc_options:
// scripts/step_trace.py's OPTIONS): thread 0 of every CTA appends an event when the CTA starts
// (pdl_launch_dependents) and when its wait for the kernel in front returns (pdl_wait), and a kernel may mark when
// the CTA's outputs are written (cf_trace_event(2): stream_gemm, attention, rope): cf_trace[2 i] = %globaltimer (ns),
// cf_trace[2 i + 1] = kind (bits 62-63: 0 start, 1 released, 2 end) | module (56-61) | SM (48-55) | warps per CTA
// (42-47) | CTAs in the grid (21-41) | CTA index (0-20). One buffer per compiled module; the script reads and resets
// them.
#ifdef CF_TRACE
#define CF_TRACE_CAP (1 << 18)
__device__ unsigned long long cf_trace[2 * CF_TRACE_CAP];
__device__ unsigned int cf_trace_count;
__device__ __forceinline__ void cf_trace_event(unsigned long long kind) {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    unsigned long long t;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned i = atomicAdd(&cf_trace_count, 1u);
    if (i >= CF_TRACE_CAP) return;
    const unsigned long long grid = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    const unsigned long long cta = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned long long warps = (blockDim.x * blockDim.y * blockDim.z + 31) / 32;
    cf_trace[2 * i] = t;
    cf_trace[2 * i + 1] = kind << 62 | (unsigned long long)CF_TRACE_MODULE << 56 | (unsigned long long)(sm & 255) << 48 |
                          (warps & 63) << 42 | (grid & 0x1fffff) << 21 | (cta & 0x1fffff);
}
#else
#define cf_trace_event(kind)
#endif

// Programmatic dependent launch (cudflash/backends/pdl.py), the first statement of every cudflash kernel:
// let the next kernel in the stream launch (its CTAs take SMs as ours leave), then wait until the previous
// kernel has finished and its writes are visible. Nothing may read a predecessor's output before this.
// Both are no-ops for a kernel launched without the attribute, and compiled out before sm_90.
// A kernel that has work independent of its predecessor (weights, old K/V) calls the two halves itself and does
// that work in between; every CTA must still reach pdl_wait() before it exits: a successor's wait covers only its
// predecessor, so a kernel that left early would let the successor overtake the kernels in front. The one
// exception is gdn.cu's gdn_mixer with independent != 0, for a step's last launches that read only the step's inputs
// (base.Backend.gdn_recurrent_mixer's `independent`).
__device__ __forceinline__ void pdl_launch_dependents() {
    cf_trace_event(0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    cf_trace_event(1);
}
__device__ __forceinline__ void pdl_entry() {
    pdl_launch_dependents();
    pdl_wait();
}

// Two floats -> one 32-bit register of two bf16 (the lower index in the low half), the mma operand format.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    bf162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// SwiGLU of one feature, silu(gate) * up, in float32. The swiglu kernel and the gate_up GEMM's epilogue both call
// this, so the two paths of a row give the same bits. (An IEEE division, not __fdividef: the approximate one
// changes enough bits to break a verify row's equality with its decode.)
__device__ __forceinline__ float swiglu_value(float gate, float up) {
    return gate / (1.f + __expf(-gate)) * up;
}

// The numpy definitions' sigmoid, 1 / (1 + e^-v), with expf and an IEEE division: the GDN kernels' beta, conv SiLU
// and gated norm (gdn.cu, gdn_chunk.cu), whose bits the CPU reference and the fused / unfused paths share.
__device__ __forceinline__ float sigmoid_ieee(float v) { return 1.f / (1.f + expf(-v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? partial[lane] : 0.f;
    return warp_sum(t);
}
