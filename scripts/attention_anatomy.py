"""Which part of a decode attention tile costs the time: the K/V copies, the compute, or neither.

Times variants of kernels/attention.cu (tile compute removed, K/V copies removed, exp2 removed), each compiled from
its own copy of the kernel folder (the tuning's kernel_dir), at 1 and 8 key tiles, one split (the fast launch shape
at one SM: `invariant_max_context=0`, `num_sms=1`), one query row, head_dim 128, 8 KV heads, in CUDA graphs of 20
copies. Usage on a GPU machine: python3 scripts/attention_anatomy.py (numbers:
docs/history/benchmarks-sessions-1-11.md, session 3).
Breaks loudly (assert) if the kernel text it edits has changed.
"""
import tempfile
from pathlib import Path

from graph_timing import graph_ms  # scripts/, beside this file

from cudflash.backends import cuda_attention, kernel_source
from cudflash.backends.base import build_meta
from cudflash.backends.cuda_backend import CudaBackend
from cudflash.backends.tuning import CudaTuning

LOAD = ("            cp_async16(sK + buf * BN * D + swz<D>(row, ch), k_cache + off, ok);\n"
        "            cp_async16(sV + buf * BN * D + swz<D>(row, ch), v_cache + off, ok);")
S_BEGIN = "        // S = Q K^T for this warp's 16 rows x KW keys."
S_END = "        __syncthreads();  // everyone is done with this buffer before the next iteration refills it"
EXP = "const float pv = exp2f(sacc[i][e] - m_use[e >> 1]);"
D, HK, HQ = 128, 8, 32


def variants(orig: str) -> dict[str, str]:
    assert LOAD in orig and S_BEGIN in orig and S_END in orig and EXP in orig
    i0, i1 = orig.index(S_BEGIN), orig.index(S_END)
    keep_loads = ("        if (tid == 999999) o[0][0] += __bfloat162float(Kt[lane]) + __bfloat162float(Vt[lane]) "
                  "+ kv0;\n")
    return {
        "base": orig,
        "no-compute": orig[:i0] + keep_loads + orig[i1:],
        "no-kv-load": orig.replace(LOAD, "            if (off == -1) cp_async16(sK, k_cache, ok);"),
        "no-mask-no-softmax-exp": orig.replace(EXP, "const float pv = sacc[i][e] - m_use[e >> 1];"),
    }


def main() -> None:
    orig = kernel_source.kernel_root().joinpath("attention.cu").read_text(encoding="utf-8")
    b = CudaBackend()
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in variants(orig).items():
            folder = kernel_source.copy_sources(Path(tmp) / name, {"attention.cu": src})
            tuning = CudaTuning(kernel_dir=folder, invariant_max_context=0)
            out = []
            for ctx in (64, 512):
                kc = b.random((ctx // 16 + 2, 16, HK, D), 1.0, 3)
                vc = b.random((ctx // 16 + 2, 16, HK, D), 1.0, 4)
                q = b.random((1, HQ * D), 1.0, 5)
                meta = b.prepare_meta(build_meta([1], [ctx], [list(range(ctx // 16 + 1))]))
                us = 1e3 * graph_ms(b, lambda: cuda_attention.attention(q, kc, vc, meta, D ** -0.5, True, 0, 1, tuning),
                                    reps=30)
                out.append(f"ctx {ctx}: {us:.1f} us")
            print(f"{name:>24}: " + "  ".join(out), flush=True)


if __name__ == "__main__":
    main()
