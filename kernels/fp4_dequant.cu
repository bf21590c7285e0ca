// fp4_dequant.cu: an NVFP4 weight as bf16, for the many-row GEMMs (prefill, large batches) that cuBLAS does.
//
// Layout (w4_layout.py, decoded by nvfp4.cuh): code words [N, K / 8] uint32 (8 codes each), scale bytes [N, K / 16],
// gscale [N] float32 (global scale * 2^7); out [N, K] bf16 contiguous:
//     out[n, k] = bf16_rn(float(code * scale * 2^-7) * gscale[n])
// The first product is exact (the bf16 multiply the streaming GEMM does too) and the second one IEEE float32
// multiply: the numpy backend's float32 weight (quant.weight.dequantize: (code * scale) * global) rounded once to
// bf16, which is what the step read before the W4 GEMM existed.
// Grid: flat, grid-stride; each thread one code word, 8 outputs (one 16-byte store). K % 16 == 0.
#include "nvfp4.cuh"

__global__ void fp4_dequant_bf16(const unsigned* __restrict__ words, const unsigned char* __restrict__ scale,
                                 const float* __restrict__ gscale, bf16* __restrict__ out, int N, int K) {
    pdl_entry();
    const long long total = (long long)N * (K / 8);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int n = (int)(i / (K / 8));
        const unsigned sw = scale[i / 2];  // word i covers columns 8 (i % (K / 8)) ..: group (i % (K / 8)) / 2
        const unsigned sp = w4_scale_pair(sw, 0x4040u);
        const float g = gscale[n];
        unsigned p[4];
        e2m1x8_to_bf16(words[i], p);
        uint4 v;
        unsigned* o = reinterpret_cast<unsigned*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned q = bf16x2_mul(p[j], sp);
            const float2 f = __bfloat1622float2(*reinterpret_cast<const bf162*>(&q));
            const bf162 r = __floats2bfloat162_rn(f.x * g, f.y * g);
            o[j] = *reinterpret_cast<const unsigned*>(&r);
        }
        reinterpret_cast<uint4*>(out)[i] = v;
    }
}
