// fp8_dequant.cu: an FP8 weight as bf16, for the many-row GEMMs (prefill, large batches) that cuBLAS does.
//
// Layout: codes [N, K] uint8 E4M3 (contiguous), scale [S, cols] float32 (cols = ceil(K / 128)), rows [N] int32 (the
// scale row of each weight row); out [N, K] bf16 contiguous:
//     out[n, k] = bf16_rn(float(e4m3(codes[n, k])) * scale[rows[n], k / 128])
// The product is one IEEE float32 multiply and the rounding to bf16 is to nearest even: the bits of the numpy
// backend's float32 weight (quant.weight.dequantize) rounded once to bf16, which is also what the step read before
// the FP8 GEMMs existed. Decoding is integer arithmetic (no float subnormal is formed, so no flush-to-zero setting
// can change it); codes 0x7F / 0xFF decode to NaN as in quant.numerics.
// Grid: flat, grid-stride; VEC = 4: each thread decodes 4 consecutive codes (one 32-bit load, K % 4 == 0), else 1.
#include "common.cuh"

__device__ __forceinline__ float e4m3_value(unsigned code) {
    const unsigned e = (code >> 3) & 15u, m = code & 7u;
    float v;
    if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
    else if (e == 0u) v = (float)m * 0.001953125f;  // m / 8 * 2^-6: subnormal E4M3, a normal float32
    else v = __int_as_float(((e + 120u) << 23) | (m << 20));
    return (code & 0x80u) ? -v : v;
}

template <int VEC>
__global__ void fp8_dequant_bf16(const unsigned char* __restrict__ codes, const float* __restrict__ scale,
                                 const int* __restrict__ rows, int cols, bf16* __restrict__ out, int N, int K) {
    pdl_entry();
    const long long groups = (long long)N * K / VEC;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups;
         i += (long long)gridDim.x * blockDim.x) {
        const long long first = i * VEC;
        const int n = (int)(first / K), k = (int)(first % K);  // VEC divides K: the group lies in one row
        const float s = scale[(long long)rows[n] * cols + k / 128];  // VEC divides 128 too: one scale column
        if constexpr (VEC == 4) {
            const unsigned c4 = reinterpret_cast<const unsigned*>(codes)[i];
            bf162 lo = __floats2bfloat162_rn(e4m3_value(c4 & 255u) * s, e4m3_value((c4 >> 8) & 255u) * s);
            bf162 hi = __floats2bfloat162_rn(e4m3_value((c4 >> 16) & 255u) * s, e4m3_value(c4 >> 24) * s);
            reinterpret_cast<bf162*>(out)[2 * i] = lo;
            reinterpret_cast<bf162*>(out)[2 * i + 1] = hi;
        } else {
            out[first] = __float2bfloat16_rn(e4m3_value(codes[first]) * s);
        }
    }
}
