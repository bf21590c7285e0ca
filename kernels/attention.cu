// attention.cu: paged attention for prefill, decode / verify and the drafter, flash-attention style on bf16
// tensor cores (mma.sync m16n8k16, float32 accumulation, online softmax in float32 / base 2).
//
// Layout: q [T, Hq * D] bf16 with row stride sq (elements); out [T, Hq * D] bf16 contiguous;
//   k_cache, v_cache [num_blocks, block_size, Hk, D] bf16; cu_seqlens int32 [n + 1]; context_lens int32 [n];
//   block_tables int32 [n, max_blocks]. Query row i of sequence s sits at position ctx_s - qlen_s + i and sees
//   key j iff j < ctx_s, (causal: j <= pos) and (window > 0: j > pos - window); for a draft tree (tree_words > 0
//   and tree_seq[s]: its rows sit at consecutive cache positions pos0 = ctx_s - qlen_s ..), a key j >= pos0 only if
//   bit j - pos0 of the row's tree_mask [T, tree_words] int32 is set (its ancestors and itself, engine/tree.py).
// Packed GQA: the G = Hq / Hk query heads that share KV head h become rows of one problem: packed row r of
//   (s, h) is query token r / G, head h * G + r % G. One CTA's K/V tile serves all G heads (read once).
// Grid: x = tile of BM = 16 * WM packed rows (reversed, so the heaviest causal tiles start first),
//   y = s * Hk + h, z = split of the key range (split-K for short query runs over long contexts).
// Key tiles sit at absolute positions (tile i holds keys 64 i .. 64 i + 63). Split z takes either tiles
//   [z * split_tiles, (z + 1) * split_tiles) (split_tiles > 0: a partition fixed by key position alone, so a
//   query row computes the same bits whatever the batch, the other rows or the grid; decode and verify use it)
//   or the z-th share of the n tiles the row tile needs, n / nsplit or one more, the larger shares first (split_tiles
//   == 0: prefill, and decode or verify past the row-invariant shape). Splits left empty (n < nsplit) are then the
//   grid's last CTAs, the ones that become resident last while a GEMM's CTAs still hold the SMs, so no real tile
//   waits for a late slot.
// Block: 128 threads = 4 warps arranged WM (rows) x WN (keys). Warp (wm, wn) owns packed rows
//   16 wm .. 16 wm + 15 and keys wn * BN / WN .. of every BN-key tile, with its own running (max, sum, O);
//   when WN > 1 (query runs too short to give every warp its own rows) the warps' partial states are merged
//   through shared memory at the end. All 128 threads stream K/V tiles with cp.async, double-buffered.
// Shared memory: Q [BM][D], K [2][BN][D], V [2][BN][D], rows of D bf16 stored as 16-byte chunks XOR-swizzled
//   by (row & 7), so ldmatrix reads and cp.async writes are free of bank conflicts. (Two stages: more in flight
//   do not help, a CTA is bound by its per-SM load rate.)
// Output: nsplit == 1 writes bf16 out directly; otherwise each split writes its normalised float32 partial
//   o_part [nsplit, T, Hq, D] and log2-sum-exp lse_part [nsplit, T, Hq], and attn_combine merges them in
//   split order, skipping splits that saw no key. One visible split merges to the exact bits of the
//   nsplit == 1 path (weight 1, sum 1), so a row's result does not depend on how many splits the grid has.
//   (The merge stays a separate kernel: merging in the last CTA of each row tile serialises the merge of 64-row
//   tiles on a few CTAs.)
// Output gate (gated attention, Qwen3.5): in the GATED instantiations, with gate [T, Hq * D] float32 (row stride
//   sg), the kernel that writes out (attn_fwd at nsplit == 1, else attn_combine) writes bf16(bf16(o) *
//   sigmoid(gate)) instead of bf16(o): the bits of gdn.cu's sigmoid_gate over the ungated output (both
//   sigmoid_ieee), without its launch. The ungated instantiations compile to the kernels without the gate.
#include "mma.cuh"

#define ATTN_BN 64
#define ATTN_THREADS 128
#define LOG2E 1.4426950408889634f

// 16-byte async copy global -> shared; pred == false writes zeros (src is then never read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Two adjacent output columns, gated by g[0], g[1] (GATED), as one bf16 pair.
template <bool GATED>
__device__ __forceinline__ unsigned pack_out(float lo, float hi, const float* g) {
    if constexpr (GATED) {
        const float a = __bfloat162float(__float2bfloat16_rn(lo)), b = __bfloat162float(__float2bfloat16_rn(hi));
        return pack_bf16x2(a * sigmoid_ieee(g[0]), b * sigmoid_ieee(g[1]));
    } else {
        return pack_bf16x2(lo, hi);
    }
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows][D] bf16 tile.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) << 3);
}

template <int D, int WM, int WN, bool GATED>
__global__ void __launch_bounds__(ATTN_THREADS)
attn_fwd(const bf16* __restrict__ q, long long sq, const bf16* __restrict__ k_cache,
         const bf16* __restrict__ v_cache, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
         const int* __restrict__ block_tables, int max_blocks, int block_size, int Hq, int Hk, float scale,
         int causal, int window, int nsplit, int split_tiles, int T, bf16* __restrict__ out,
         float* __restrict__ o_part, float* __restrict__ lse_part, const int* __restrict__ tree_seq,
         const int* __restrict__ tree_mask, int tree_words, const float* __restrict__ gate, long long sg) {
    // Programmatic dependent launch, split in two: the metadata (staged before the step's first kernel) and the
    // K/V of keys before the first query position (written by earlier steps, never by this forward) may be read
    // before griddepcontrol.wait; q and the new tokens' K/V (the kernel in front writes them) only after it.
    // Launched early, the CTA then has its first K/V tiles in flight while the GEMM in front still streams.
    pdl_launch_dependents();
    static_assert(WM * WN == 4, "4 warps");
    constexpr int BN = ATTN_BN;
    constexpr int BM = 16 * WM;
    constexpr int KW = BN / WN;   // keys per warp per tile
    constexpr int NS = KW / 8;    // S accumulator n-tiles per warp
    constexpr int NO = D / 8;     // O accumulator n-tiles
    constexpr int CPR = D / 8;    // 16-byte chunks per row
    static_assert(KW % 16 == 0 && D % 64 == 0, "tile shape");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [BM][D]
    bf16* sK = sQ + BM * D;                        // [2][BN][D]
    bf16* sV = sK + 2 * BN * D;                    // [2][BN][D]

    const int G = Hq / Hk;
    const int s = blockIdx.y / Hk, kvh = blockIdx.y % Hk;
    const int q0 = cu_seqlens[s];
    const int qlen = cu_seqlens[s + 1] - q0;
    const int R = qlen * G;  // packed rows of this (sequence, kv head)
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
    if (m0 >= R) {
        pdl_wait();  // a CTA leaves only once the kernel in front is done (its successor relies on that order)
        return;
    }
    const int ctx = context_lens[s];
    const int pos0 = ctx - qlen;
    const int p_lo = pos0 + m0 / G;                    // first and last query positions in this tile
    const int p_hi = pos0 + (min(m0 + BM, R) - 1) / G;
    const int kend = causal ? min(p_hi + 1, ctx) : ctx;
    const int tile_lo = window > 0 ? max(0, p_lo - window + 1) / BN : 0;  // absolute key tiles [tile_lo, tile_hi)
    const int tile_hi = max(tile_lo, (kend + BN - 1) / BN);
    int t_beg, t_end;
    if (split_tiles > 0) {
        t_beg = max(tile_lo, (int)blockIdx.z * split_tiles);
        t_end = min(tile_hi, ((int)blockIdx.z + 1) * split_tiles);
    } else {  // shares of share or share + 1 tiles, the larger first
        const int ntiles = tile_hi - tile_lo, z = blockIdx.z;
        const int share = ntiles / nsplit, extra = ntiles % nsplit;
        t_beg = tile_lo + z * share + min(z, extra);
        t_end = t_beg + share + (z < extra ? 1 : 0);
    }
    const int* table = block_tables + (long long)s * max_blocks;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;
    const int g8 = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
    const int ra = m0 + wm * 16 + g8;         // this thread's two packed rows: ra and ra + 8
    const int pa = pos0 + ra / G, pb = pos0 + (ra + 8) / G;
    const float sl2 = scale * LOG2E;
    // A draft tree's rows: the masks of this thread's two rows (rows past the sequence's read its last one's).
    const bool tree = tree_words > 0 && tree_seq[s] != 0;
    const int* mask_a = tree_mask + (long long)(q0 + min(ra / G, qlen - 1)) * tree_words;
    const int* mask_b = tree_mask + (long long)(q0 + min((ra + 8) / G, qlen - 1)) * tree_words;

    auto load_kv = [&](int tile, int buf) {
        const int kv0 = tile * BN;
#pragma unroll
        for (int i = 0; i < BN * CPR / ATTN_THREADS; ++i) {
            const int idx = tid + i * ATTN_THREADS;
            const int row = idx / CPR, ch = idx % CPR;
            const int j = kv0 + row;
            const bool ok = j < kend;
            long long off = 0;
            if (ok) {
                const long long slot = (long long)table[j / block_size] * block_size + j % block_size;
                off = (slot * Hk + kvh) * D + ch * 8;
            }
            cp_async16(sK + buf * BN * D + swz<D>(row, ch), k_cache + off, ok);
            cp_async16(sV + buf * BN * D + swz<D>(row, ch), v_cache + off, ok);
        }
    };

    float o[NO][4];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_r[2] = {-CF_INF, -CF_INF};  // running max of this thread's two rows (log2 domain)
    float l_r[2] = {0.f, 0.f};          // running sum, partial over this thread's columns

    // The leading tiles (at most the two buffers) that hold old keys only are requested before the wait; the tile
    // where the new keys start waits, because what goes out before the wait competes with the kernel in front.
    const int pre = min(2, max(0, min(t_end, pos0 / BN) - t_beg));
    for (int i = 0; i < pre; ++i) load_kv(t_beg + i, i);
    pdl_wait();
    if (t_beg < t_end) {
        for (int idx = tid; idx < BM * CPR; idx += ATTN_THREADS) {
            const int row = idx / CPR, ch = idx % CPR;
            const int r = m0 + row;
            const bool ok = r < R;
            const bf16* src = q;
            if (ok) src = q + (long long)(q0 + r / G) * sq + (kvh * G + r % G) * D + ch * 8;
            cp_async16(sQ + swz<D>(row, ch), src, ok);
        }
        if (pre == 0) load_kv(t_beg, 0);
    }
    cp_async_commit();

    for (int tile = t_beg; tile < t_end; ++tile) {
        const int buf = (tile - t_beg) & 1;
        if (tile + 1 < t_end && tile + 1 - t_beg >= pre) load_kv(tile + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const bf16* Kt = sK + buf * BN * D;
        const bf16* Vt = sV + buf * BN * D;
        const int kv0 = tile * BN;

        // S = Q K^T for this warp's 16 rows x KW keys.
        float sacc[NS][4];
#pragma unroll
        for (int i = 0; i < NS; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            unsigned a0, a1, a2, a3;
            ldmatrix_x4(smem_addr(sQ + swz<D>(wm * 16 + (lane & 15), ks * 2 + (lane >> 4))), a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < NS / 2; ++np) {
                unsigned b0, b1, b2, b3;
                const int key = wn * KW + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(smem_addr(Kt + swz<D>(key, ks * 2 + ((lane >> 3) & 1))), b0, b1, b2, b3);
                mma_bf16(sacc[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(sacc[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }

        // Scale into the log2 domain and mask (only tiles that touch a boundary pay for the compares).
        const bool need_mask = (kv0 + BN > ctx) || (causal && kv0 + BN - 1 > p_lo) ||
                               (window > 0 && kv0 <= p_hi - window) || (tree && kv0 + BN > pos0);
        float mx[2] = {-CF_INF, -CF_INF};
#pragma unroll
        for (int i = 0; i < NS; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = sacc[i][e] * sl2;
                if (need_mask) {
                    const int j = kv0 + wn * KW + i * 8 + 2 * t4 + (e & 1);
                    const int p = e < 2 ? pa : pb;
                    bool vis = j < ctx && (!causal || j <= p) && (window <= 0 || j > p - window);
                    if (tree && vis && j >= pos0) {
                        const int bit = j - pos0;
                        vis = ((e < 2 ? mask_a : mask_b)[bit >> 5] >> (bit & 31)) & 1;
                    }
                    v = vis ? v : -CF_INF;
                }
                sacc[i][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float corr[2], m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m_r[r], mx[r]);
            m_use[r] = m_new == -CF_INF ? 0.f : m_new;  // a row with nothing visible yet stays all-zero
            corr[r] = exp2f(m_r[r] - m_use[r]);
            m_r[r] = m_new;
            l_r[r] *= corr[r];
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[0];
            o[i][2] *= corr[1];
            o[i][3] *= corr[1];
        }
#pragma unroll
        for (int i = 0; i < NS; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float pv = exp2f(sacc[i][e] - m_use[e >> 1]);
                sacc[i][e] = pv;
                l_r[e >> 1] += pv;
            }
        }

        // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
            const unsigned a0 = pack_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]);
            const unsigned a1 = pack_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]);
            const unsigned a2 = pack_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
            const unsigned a3 = pack_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
            const int key = wn * KW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(smem_addr(Vt + swz<D>(key, dp * 2 + (lane >> 4))), b0, b1, b2, b3);
                mma_bf16(o[2 * dp], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        __syncthreads();  // everyone is done with this buffer before the next iteration refills it
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }

    if (WN > 1) {
        // Merge the WN warps that share rows: each publishes (m, l, O) in its fragment layout, warp wn == 0
        // of each row group combines. The K/V buffers are free now and are large enough (4 x 16 x D floats).
        __syncthreads();
        float* sO = reinterpret_cast<float*>(smem_raw);  // [4 warps][16 rows][D]
        float* sM = sO + 4 * 16 * D;                     // [4 warps][16 rows]
        float* sL = sM + 4 * 16;                         // [4 warps][16 rows]
        float* my = sO + warp * 16 * D;
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int col = i * 8 + 2 * t4;
            *reinterpret_cast<float2*>(my + g8 * D + col) = make_float2(o[i][0], o[i][1]);
            *reinterpret_cast<float2*>(my + (g8 + 8) * D + col) = make_float2(o[i][2], o[i][3]);
        }
        if (t4 == 0) {
            sM[warp * 16 + g8] = m_r[0];
            sM[warp * 16 + g8 + 8] = m_r[1];
            sL[warp * 16 + g8] = l_r[0];
            sL[warp * 16 + g8 + 8] = l_r[1];
        }
        __syncthreads();
        if (wn != 0) return;
        float w[WN][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mm = -CF_INF;
#pragma unroll
            for (int u = 0; u < WN; ++u) mm = fmaxf(mm, sM[(warp + u) * 16 + g8 + 8 * r]);
            const float mu = mm == -CF_INF ? 0.f : mm;
            float ll = 0.f;
#pragma unroll
            for (int u = 0; u < WN; ++u) {
                w[u][r] = exp2f(sM[(warp + u) * 16 + g8 + 8 * r] - mu);
                ll += w[u][r] * sL[(warp + u) * 16 + g8 + 8 * r];
            }
            m_r[r] = mm;
            l_r[r] = ll;
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int col = i * 8 + 2 * t4;
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int u = 0; u < WN; ++u) {
                const float* other = sO + (warp + u) * 16 * D;
                const float2 x = *reinterpret_cast<const float2*>(other + g8 * D + col);
                const float2 y = *reinterpret_cast<const float2*>(other + (g8 + 8) * D + col);
                acc[0] += w[u][0] * x.x;
                acc[1] += w[u][0] * x.y;
                acc[2] += w[u][1] * y.x;
                acc[3] += w[u][1] * y.y;
            }
            o[i][0] = acc[0];
            o[i][1] = acc[1];
            o[i][2] = acc[2];
            o[i][3] = acc[3];
        }
    }

    // Write this thread's two rows.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ra + 8 * r;
        if (row >= R) continue;
        const long long t = q0 + row / G;
        const int head = kvh * G + row % G;
        const float inv = l_r[r] > 0.f ? 1.f / l_r[r] : 0.f;
        if (nsplit == 1) {
            bf16* dst = out + (t * Hq + head) * D;
            const float* g = gate + t * sg + (long long)head * D;  // read only if GATED
#pragma unroll
            for (int i = 0; i < NO; ++i)
                *reinterpret_cast<unsigned*>(dst + i * 8 + 2 * t4) =
                    pack_out<GATED>(o[i][2 * r] * inv, o[i][2 * r + 1] * inv, g + i * 8 + 2 * t4);
        } else {
            const long long prow = ((long long)blockIdx.z * T + t) * Hq + head;
            float* dst = o_part + prow * D;
#pragma unroll
            for (int i = 0; i < NO; ++i)
                *reinterpret_cast<float2*>(dst + i * 8 + 2 * t4) = make_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
            if (t4 == 0) lse_part[prow] = l_r[r] > 0.f ? m_r[r] + log2f(l_r[r]) : -CF_INF;
        }
    }
    cf_trace_event(2);  // this CTA's outputs are written (the step timeline)
}

// attn_combine<D, GATED>: out[t, h] = sum_s w_s o_part[s, t, h] / sum_s w_s, w_s = 2^(lse_s - max lse) (gated as
// above: row = t Hq + h).
// One warp per (t, h) row, D / 32 columns per lane; splits with lse = -inf (no visible key) are skipped,
// so their unwritten-in-spirit zeros never matter. Lanes hold the lse of splits lane and lane + 32 (nsplit <=
// 64); the partials of a batch of splits (64 floats per lane: 16 splits at D = 128, all of a decode step's) are
// loaded at once before they are added in split order, the first batch's together with the lse: a loop that
// waited on each load in turn paid an L2 round trip per split, the lse's included.
template <int D, bool GATED>
__global__ void attn_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                             bf16* __restrict__ out, int rows, int nsplit, const float* __restrict__ gate,
                             long long sg, int Hq) {
    pdl_entry();
    constexpr int PER = D / 32;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    constexpr int COMBINE_BATCH = 2048 / D;
    const float lse_lo = lane < nsplit ? lse_part[(long long)lane * rows + row] : -CF_INF;
    const float lse_hi = lane + 32 < nsplit ? lse_part[(long long)(lane + 32) * rows + row] : -CF_INF;
    float mx = -CF_INF;  // the largest lse, taken once the first batch's loads are in flight
    float acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = 0.f;
    float wsum = 0.f;
    for (int base = 0; base < nsplit; base += COMBINE_BATCH) {
        float v[COMBINE_BATCH][PER];
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; ++u) {
            if (base + u >= nsplit) break;
            const float* src = o_part + ((long long)(base + u) * rows + row) * D + lane * PER;
#pragma unroll
            for (int e = 0; e < PER; e += 2) {
                const float2 x = *reinterpret_cast<const float2*>(src + e);
                v[u][e] = x.x;
                v[u][e + 1] = x.y;
            }
        }
        if (base == 0) mx = warp_max(fmaxf(lse_lo, lse_hi));
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; ++u) {
            const int sp = base + u;  // the same for every lane: the shuffle is warp-uniform
            const float lse = __shfl_sync(0xffffffffu, sp < 32 ? lse_lo : lse_hi, sp & 31);
            if (sp >= nsplit || lse == -CF_INF) continue;
            const float w = exp2f(lse - mx);
            wsum += w;
#pragma unroll
            for (int e = 0; e < PER; ++e) acc[e] += w * v[u][e];
        }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    bf16* dst = out + (long long)row * D + lane * PER;
    const float* g = gate + (long long)(row / Hq) * sg + (long long)(row % Hq) * D + lane * PER;  // read only if GATED
#pragma unroll
    for (int e = 0; e < PER; e += 2)
        *reinterpret_cast<unsigned*>(dst + e) = pack_out<GATED>(acc[e] * inv, acc[e + 1] * inv, g + e);
    cf_trace_event(2);
}
