// nvfp4.cuh: NVFP4 (E2M1 codes, E4M3 scales per 16 columns) to bf16, in the device layout of
// cudflash/backends/w4_layout.py (the reference of every constant here), for stream_gemm.cu (W4) and
// fp4_dequant.cu.
//
// Codes: a 32-bit word holds the 8 codes of columns 8 i .. 8 i + 7 of a row, placed so that pair j (columns
// 8 i + 2 j, + 1) is (rotl(w, MAG_ROT[j]) & 0x01C001C0) | (rotl(w, SIGN_ROT[j]) & 0x80008000): each half the bf16
// whose sign is the code's and whose bits 8..6 are its exponent and mantissa, i.e. code * 2^-126 exactly (a bf16
// subnormal for 0.5). Every rotation but one acts as a left shift under its mask (no bit it wraps around is kept),
// and a shift by a constant can issue on the FMA pipe (IMAD.SHL) while the masks take the ALU pipe: 7 ALU
// instructions per 8 codes, not 11 (the ALU pipe takes most of the W4 loop's instructions).
// Scales: byte b stands for the bf16 scale * 2^119, bits (b << 4) + 0x7400. Their bf16 product is exact (at most 6
// significant bits, in [2^-17, 21]): code * scale * 2^-7; the 2^7 rides with the global scale.
#pragma once
#include "common.cuh"

#define W4_MAG 0x01C001C0u
#define W4_SIGN 0x80008000u
#define W4_SCALE_BIAS 0x74007400u  // 232 << 7 in both halves

__device__ __forceinline__ unsigned rotl32(unsigned w, int r) { return __funnelshift_l(w, w, r); }

// The four bf16 pairs of one code word (columns (0, 1), (2, 3), (4, 5), (6, 7) of its eight), each code * 2^-126:
// MAG_ROT (0, 3, 6, 9), SIGN_ROT (4, 3, 6, 5) of w4_layout.py, the rotations that are shifts written as shifts.
__device__ __forceinline__ void e2m1x8_to_bf16(unsigned w, unsigned (&p)[4]) {
    p[0] = (w & W4_MAG) | ((w << 4) & W4_SIGN);
    p[1] = (w << 3) & (W4_MAG | W4_SIGN);
    p[2] = (w << 6) & (W4_MAG | W4_SIGN);
    p[3] = (rotl32(w, 9) & W4_MAG) | ((w << 5) & W4_SIGN);
}

// Scale byte `sel` picks of the word sw (sel = 0x4040 + 0x0101 * byte index: that byte in both halves, zeros above
// them) as the bf16 pair scale * 2^119 in both halves.
__device__ __forceinline__ unsigned w4_scale_pair(unsigned sw, unsigned sel) {
    unsigned v;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(v) : "r"(sw), "r"(sel));
    return v * 16u + W4_SCALE_BIAS;
}

// a * b per half, rounded to nearest (exact for a decoded code and its scale); subnormal inputs are kept.
__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned y;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(a), "r"(b), "r"(0x80008000u));
    return y;
}
