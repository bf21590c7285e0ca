"""Which part of the token-by-token GDN mixer (kernels/gdn.cu gdn_mixer) costs the time of a verify's rows.

Times variants of gdn.cu, each compiled from its own copy of the kernel folder (the tuning's kernel_dir), at
Qwen3.5-9B's and 27B's GDN shapes (Hk 16, Hv 32 / 48, dk = dv = 128, conv of 4 taps, bf16 conv weight), one
sequence of 1, 2, 4, 8 or 16 rows, in CUDA graphs of 20 copies (graph_timing.graph_ms):
  base         the kernel as it is
  no-token     the delta rule's token loop replaced by o = v (the state is still read and written at a commit; at
               a verify nothing uses it, so it is not read either)
  no-state     the recurrent state not read (zeros), the token loop as before
  no-conv      conv_row returns its input (no taps, no SiLU)
  no-norm      the gated norm of the stage's rows skipped (and with it the token loop's o and S^T q sums, then unused)
  no-stage     the staging's norms and gates skipped (the conv output taken as it is, e^g = beta = 1, k.q = 0)
Usage on a GPU machine: python3 scripts/gdn_mixer_anatomy.py [--rows 1,16] [--variants base,no-token]
Breaks loudly (assert) if the kernel text it edits has changed. Numbers: BENCHMARKS.md.
"""
import argparse
import tempfile
from pathlib import Path

import cupy as cp
import numpy as np
from graph_timing import graph_ms  # scripts/, beside this file

from cudflash.backends import cuda_gdn, kernel_source
from cudflash.backends.base import build_meta
from cudflash.backends.cuda_backend import CudaBackend
from cudflash.backends.tuning import CudaTuning

SHAPES = {"qwen3.5-9b": (16, 32, 128, 128, 4), "qwen3.5-27b": (16, 48, 128, 128, 4)}
TOKEN = ("            const float o = delta_rule_token<RPL>(st, reinterpret_cast<const float4*>(&s_k[r][kbase]),\n"
         "                                                  reinterpret_cast<const float4*>(&s_q[r][kbase]),\n"
         "                                                  col ? s_v[r][j] : 0.f, s_decay[r], s_beta[r], s_kq[r]);")
STATE = ("    for (int i = 0; i < RPL; ++i) st[i] = col ? S[(long long)(grp * RPL + i) * DV + j] : 0.f;\n"
         "    for (int base = 0; base < len; base += GDN_ROWS) {\n"
         "        const int rows = min(GDN_ROWS, len - base);\n"
         "        if (base > 0) __syncthreads();  // every warp is done with the previous stage\n")
CONV = "    return acc * gdn_sigmoid(acc);"
NORM = ("            if (live)\n"
        "                gated_norm_row(s_o[warp], zcol + t * sp, norm_w, out + t * out_stride + h * DV, DV, eps, lane);")
STAGE = ("            stage_row<DK>(qv, kv, av, bv, neg_a, dtb, qscale, s_q[warp], s_k[warp], &s_decay[warp], &s_beta[warp],\n"
         "                          &s_kq[warp], lane);")


def variants(orig: str) -> dict[str, str]:
    for text in (TOKEN, STATE, CONV, NORM, STAGE):
        assert orig.count(text) == 1, text
    mixer = orig.index("gdn_mixer(")
    assert orig.index(TOKEN) > mixer and orig.index(STATE) > mixer
    return {
        "base": orig,
        "no-token": orig.replace(TOKEN, "            const float o = col ? s_v[r][j] : 0.f;"),
        "no-state": orig.replace(STATE, STATE.replace("col ? S[(long long)(grp * RPL + i) * DV + j] : 0.f", "0.f")),
        "no-conv": orig.replace(CONV, "    return x;"),
        "no-norm": orig.replace(NORM, "            if (live && eps < 0.f) out[t] = 0.f;"),
        "no-stage": orig.replace(STAGE, "            if (lane == 0) { s_decay[warp] = 1.f; s_beta[warp] = 1.f; s_kq[warp] = 0.f; }"
                                        "\n            (void)qv; (void)kv;"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--variants", default="")
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    orig = kernel_source.kernel_root().joinpath("gdn.cu").read_text(encoding="utf-8")
    wanted = variants(orig)
    if args.variants:
        wanted = {k: wanted[k] for k in args.variants.split(",")}
    cuda_gdn.NAMES = ("gdn_mixer<4, 128, bf16>",)  # only the instantiation timed: each variant compiles fast
    b = CudaBackend()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in wanted.items():
            b.tuning = CudaTuning(kernel_dir=kernel_source.copy_sources(Path(tmp) / name, {"gdn.cu": src}))
            for shape, (hk, hv, dk, dv, taps) in SHAPES.items():
                c = 2 * hk * dk + hv * dv
                width = c + hv * dv + 2 * hv
                conv_w = b.asarray(rng.standard_normal((c, taps)).astype(np.float32) * 0.5, "act")
                conv_states = cp.asarray(rng.standard_normal((2, c, taps - 1)).astype(np.float32))
                states = cp.asarray((rng.standard_normal((2, hv, dk, dv)) * 0.1).astype(np.float32))
                a_log = cp.asarray(np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32))
                dt_bias = cp.asarray(rng.uniform(-4.0, 1.0, hv).astype(np.float32))
                norm = cp.asarray(rng.uniform(0.5, 1.5, dv).astype(np.float32))
                slots = b.asarray([0], "i32")
                out = []
                for rows in row_counts:
                    meta = b.prepare_meta(build_meta([rows], [rows], [[0]]))
                    proj = cp.asarray(rng.standard_normal((rows, width + 16)).astype(np.float32))[:, 8: 8 + width]
                    for commit in ((True,) if rows == 1 else (False, True)):
                        fn = lambda: b.gdn_recurrent_mixer(proj, conv_w, conv_states, a_log, dt_bias, states,  # noqa
                                                           norm, 1e-6, slots, meta, commit)
                        us = 1e3 * graph_ms(b, fn, reps=30)
                        out.append(f"{rows}{'c' if commit else ''} {us:6.2f}")
                print(f"{name:>9} {shape:>12}: " + "  ".join(out) + " us", flush=True)


if __name__ == "__main__":
    main()
