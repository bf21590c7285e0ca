// store_kv.cu: write one layer's new K and V rows into its paged cache.
//
// k [T, Hk * D] bf16 (the RoPE output), v [T, Hk * D] V (bf16, or float32 straight from the GEMM; rounded
// here), row strides sk, sv (elements; v may be a column slice of a fused GEMM output);
// k_cache, v_cache [num_blocks, block_size, Hk, D] bf16, i.e. slot-major rows of W = Hk * D elements;
// slots int32 [T]: row t goes to cache row slots[t] (= block * block_size + offset); a slot < 0 (padding)
// is skipped. Grid: flat over T * W / 8; each thread moves one 16-byte vector of K and one of V.
#include "common.cuh"

template <typename V>
__global__ void store_kv(const bf16* __restrict__ k, long long sk, const V* __restrict__ v, long long sv, const int* __restrict__ slots, bf16* __restrict__ k_cache,
                                    bf16* __restrict__ v_cache, int T, int W) {
    const int vpr = W >> 3;
    const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (g >= (long long)T * vpr) return;
    const long long t = g / vpr;
    const int c = (int)(g % vpr);
    const long long slot = slots[t];
    if (slot < 0) return;
    reinterpret_cast<uint4*>(k_cache + slot * W)[c] = reinterpret_cast<const uint4*>(k + t * sk)[c];
    float vf[8];
    load8(v + t * sv, c, vf);
    reinterpret_cast<uint4*>(v_cache + slot * W)[c] = pack8(vf);
}
