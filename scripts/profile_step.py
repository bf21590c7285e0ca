"""Where the time of one Qwen3-8B verify / decode step goes, op by op (H200, bf16, batch 1, context 512).

Times each op of one decoder layer with CUDA events (median of 50 replays of a CUDA graph holding 20 copies of
that op, so launch gaps are amortised the way the step graph amortises them), then scales by 36 layers and
adds the LM head. Prints time against each op's byte floor at the measured copy bandwidth.
Usage: python3 scripts/profile_step.py [rows]   (rows = 16 for verify, 1 for decode)
"""
import sys

import cupy
import numpy as np
from graph_timing import graph_ms  # scripts/, beside this file

from cudflash.backends.base import build_meta
from cudflash.backends.cuda_backend import CudaBackend

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
H, Q, KV, I, V, L, D, CTX = 4096, 4096, 1024, 12288, 151936, 36, 128, 512
b = CudaBackend()
w = {name: b.random(shape, 0.02, i) for i, (name, shape) in enumerate(
    {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}.items())}
norm_w = b.load("F32", np.ones(H, np.float32))
x = b.random((ROWS, H), 1.0, 9)
res = cupy.asarray(np.random.default_rng(0).standard_normal((ROWS, H)).astype(np.float32))
cos, sin = (b.asarray(np.ones((CTX + ROWS, D // 2), np.float32), "f32") for _ in range(2))
kc = b.random((CTX // 16 + 2, 16, 8, D), 1.0, 3)
vc = b.random((CTX // 16 + 2, 16, 8, D), 1.0, 4)
meta = b.prepare_meta(build_meta([ROWS], [CTX], [list(range(CTX // 16 + 1))]))
pos = b.asarray(np.arange(CTX - ROWS, CTX), "i32")
slots = b.asarray(np.arange(CTX - ROWS, CTX), "i32")
qkv = b.linear(x, w["qkv"], out_f32=True)


def rope_store():  # q/k norm + RoPE and the K/V store of one layer: one launch
    return b.rope_store(qkv, Q // D, pos, cos, sin, norm_w[:D], norm_w[:D], 1e-6, slots, kc, vc)


q = rope_store()
attn = b.attention(q, kc, vc, meta, D ** -0.5, causal=True)
act = b.swiglu(x, w["gate_up"])

ops = {
    "qkv GEMM": (lambda: b.linear(x, w["qkv"], out_f32=True), (Q + 2 * KV) * H * 2),
    "rope_store": (rope_store, 0),
    "attention": (lambda: b.attention(q, kc, vc, meta, D ** -0.5, causal=True), 2 * CTX * KV * 2),
    "o GEMM": (lambda: b.linear(attn, w["o"], out_f32=True), Q * H * 2),
    "add_rms_norm x2": (lambda: (b.add_rms_norm(res, res, norm_w, 1e-6), b.add_rms_norm(res, res, norm_w, 1e-6)), 0),
    "gate_up GEMM + SwiGLU": (lambda: b.swiglu(x, w["gate_up"]), 2 * I * H * 2),
    "down GEMM": (lambda: b.linear(act, w["down"], out_f32=True), I * H * 2),
}


copy_bw = 4.25e12
rows, total = [], 0.0
for name, (fn, nbytes) in ops.items():
    ms = graph_ms(b, fn)
    total += ms * L
    rows.append((name, ms * 1e3, ms * L, nbytes / copy_bw * 1e3 * L))
head = graph_ms(b, lambda: b.linear(x, w["lm_head"], out_f32=True), copies=5)
total += head
print(f"rows {ROWS}, context {CTX}; per-op time in a graph of 20 copies (launch gaps amortised)")
print(f"{'op':<18}{'us/layer':>10}{'ms x36':>9}{'floor ms':>10}")
for name, us, ms36, floor in rows:
    print(f"{name:<18}{us:>10.1f}{ms36:>9.3f}{floor:>10.3f}")
print(f"{'LM head':<18}{'':>10}{head:>9.3f}{V * H * 2 / copy_bw * 1e3:>10.3f}")
print(f"{'sum':<18}{'':>10}{total:>9.3f}")
