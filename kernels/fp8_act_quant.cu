// fp8_act_quant.cu: activations as FP8 with one float32 scale per row and 128 columns, the A8 of the W8A8 GEMMs on
// the FP8 tensor cores (cudflash/backends/w8a8.py). quant.weight.quantize_fp8_block(x, (1, 128)) is the definition:
//     scale[m][b] = amax_j |x[m, 128 b + j]| / 448 (IEEE division; 1 for a block of zeros, NaN if the block has one),
//     codes[m, k] = e4m3(x[m, k] / scale[m][k / 128]), to nearest even, finite values saturating at +-448.
// Layout: x [M, K] bf16 with row stride ldx (elements; rows 8-byte aligned), K % 128 == 0; codes [MP, K] uint8
// contiguous; scales [K / 128, MP] float32 contiguous (a block column's MP row scales together: the layout cuBLASLt's
// VEC128_32F mode reads for the activations). Rows m in M .. MP - 1 (padding up to the GEMM's row multiple) get zero
// codes and scale 1.
// Grid: (MP, K / 128 / 4 rounded up), 128 threads (rows on x: a prefill's 65536 rows exceed grid y): warp w of CTA
// (m, by) takes block b = 4 by + w of row m, lane l its columns 4 l .. 4 l + 3 (one 8-byte load); the amax by
// xor-shuffles, the codes by cvt.rn.satfinite.e4m3x2.f32.
#include "common.cuh"

extern "C" __global__ void fp8_act_quant(const bf16* __restrict__ x, long long ldx, unsigned char* __restrict__ codes,
                              float* __restrict__ scales, int M, int MP, int K) {
    pdl_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m = blockIdx.x, b = blockIdx.y * 4 + warp;
    if (b >= K / 128) return;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (m < M) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + m * ldx + 128 * b + 4 * lane);
        v[0] = __uint_as_float(raw.x << 16), v[1] = __uint_as_float(raw.x & 0xffff0000u);
        v[2] = __uint_as_float(raw.y << 16), v[3] = __uint_as_float(raw.y & 0xffff0000u);
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    const bool nan = isnan(v[0]) || isnan(v[1]) || isnan(v[2]) || isnan(v[3]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale = __fdiv_rn(amax, 448.f);
    if (scale == 0.f) scale = 1.f;
    if (__any_sync(0xffffffffu, nan)) scale = __int_as_float(0x7fc00000);  // fmaxf drops NaN; numpy's max keeps it
    float q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = __fdiv_rn(v[j], scale);
    unsigned short lo, hi;  // cvt packs its first source into the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(q[1]), "f"(q[0]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(q[3]), "f"(q[2]));
    reinterpret_cast<unsigned*>(codes + (long long)m * K + 128 * b)[lane] = (unsigned)lo | ((unsigned)hi << 16);
    if (lane == 0) scales[(long long)b * MP + m] = scale;
}
