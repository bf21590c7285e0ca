"""What each kind of small op costs inside the captured speculative step, overlap included.

Runs `cudflash bench --synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20` with the named ops
replaced by an allocation of their output: no kernel, so the step computes garbage but keeps its shape, and the
difference to a plain run is what those kernels cost where they really run (behind and in front of GEMMs that
are launched early). A per-op timing in isolation (profile_step.py) cannot show that.
Usage: python3 scripts/step_knockout.py [attention] [norm] [rope]
(SwiGLU has no kernel of its own to knock out: the gate_up GEMM's epilogue applies it.)
"""
import sys

import cupy

from cudflash.backends.cuda_backend import CudaBackend
from cudflash.cli import main

ops = set(sys.argv[1:])
unknown = ops - {"attention", "norm", "rope"}
if unknown:
    sys.exit(f"unknown ops {sorted(unknown)} (attention, norm, rope)")
if "attention" in ops:
    CudaBackend.attention = lambda self, q, k, v, meta, scale, causal, window=0: cupy.empty(q.shape, self.act)
if "norm" in ops:
    CudaBackend._norm = lambda self, x, res, w, eps: (
        cupy.empty(x.shape, self.act), None if res is None else cupy.empty(x.shape, cupy.float32))
if "rope" in ops:
    def rope_store(self, x, q_heads, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache):
        return cupy.empty((x.shape[0], q_heads * k_cache.shape[3]), self.act) if q_heads else None
    CudaBackend.rope_store = rope_store
main(["bench", "--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20"])
