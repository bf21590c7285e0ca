"""Which part of a decode attention tile costs the time: the K/V copies, the compute, or neither.

Times variants of kernels/attention.cu (the source edited in memory: tile compute removed, K/V copies
removed, exp2 removed) at 1 and 8 key tiles, one split, one query row, head_dim 128, 8 KV heads, in CUDA
graphs of 20 copies. Usage on a GPU machine: python3 scripts/attention_anatomy.py
(numbers in BENCHMARKS.md, session 3). Breaks loudly (assert) if the kernel text it edits has changed.
"""
import statistics
import cupy
from cudflash.backends import kernel_loader, kernel_source
import cudflash.backends.cuda_attention as A
from cudflash.backends.base import build_meta
from cudflash.backends.cuda_backend import CudaBackend
b = CudaBackend(); stream = cupy.cuda.get_current_stream()
real_source = kernel_source.source
orig = real_source("attention")
def time_graph(fn, copies=20):
    fn(); stream.begin_capture()
    for _ in range(copies): fn()
    g = stream.end_capture(); g.upload(stream); t = []
    for _ in range(30):
        e0 = b.event(); g.launch(stream); e1 = b.event(); t.append(b.elapsed_ms(e0, e1) / copies)
    return statistics.median(t) * 1e3
LOAD = "            cp_async16(sK + buf * BN * D + swz<D>(row, ch), k_cache + off, ok);\n            cp_async16(sV + buf * BN * D + swz<D>(row, ch), v_cache + off, ok);"
S_BEGIN = "        // S = Q K^T for this warp's 16 rows x KW keys."
S_END = "        __syncthreads();  // everyone is done with this buffer before the next iteration refills it"
assert LOAD in orig and S_BEGIN in orig and S_END in orig
i0, i1 = orig.index(S_BEGIN), orig.index(S_END)
variants = {
    "base": orig,
    "no-compute": orig[:i0] + "        if (tid == 999999) o[0][0] += __bfloat162float(Kt[lane]) + __bfloat162float(Vt[lane]) + kv0;\n" + orig[i1:],
    "no-kv-load": orig.replace(LOAD, "            if (off == -1) cp_async16(sK, k_cache, ok);"),
    "no-mask-no-softmax-exp": orig.replace("const float pv = exp2f(sacc[i][e] - m_use[e >> 1]);", "const float pv = sacc[i][e] - m_use[e >> 1];"),
}
D = 128
A.SPLIT_KEYS = 1 << 20
for name, src in variants.items():
    kernel_loader.module.cache_clear(); kernel_loader.function.cache_clear()
    A._smem_raised.clear()
    kernel_source.source = (lambda s: (lambda n: s if n == "attention" else real_source(n)))(src)
    out = []
    for ctx in (64, 512):
        kc = b.random((ctx // 16 + 2, 16, 8, D), 1.0, 3); vc = b.random((ctx // 16 + 2, 16, 8, D), 1.0, 4)
        q = b.random((1, 32 * D), 1.0, 5)
        meta = b.prepare_meta(build_meta([1], [ctx], [list(range(ctx // 16 + 1))]))
        out.append(f"ctx {ctx}: {time_graph(lambda: A.attention(q, kc, vc, meta, D ** -0.5, True, 0, 132)):.1f} us")
    print(f"{name:>24}: " + "  ".join(out), flush=True)
