"""Issue 23 item 3 at many rows: FP8 tensor cores (W8A8) against what cudflash runs there today, the weight
dequantized to bf16 and cuBLAS's bf16 GEMM.

For each of Qwen3-8B's four layer GEMMs and M = 128 .. 8192 rows, the median time (CUDA events, after warm-up) of:
  dequant+bf16  fp8_weight.dequantize_bf16 then CudaBackend's cuBLAS bf16 GEMM (the FP8 many-row path);
  nvfp4 dq+bf16 the same for an NVFP4 weight (fp4_weight.dequantize_bf16);
  bf16          the bf16 GEMM alone, the weight already bf16 (a bf16 checkpoint);
  w8a8 tensor   FP8 x FP8 -> bf16 on the tensor cores with one scale per tensor (torch._scaled_mm, i.e. cuBLASLt):
                the fastest W8A8 can be;
  w8a8 rowwise  the same with a scale per activation row and per weight row;
  w8a8 block    activations scaled per row and 128 columns, weights per 128 x 128 block (the Qwen -FP8 layout, as
                W8A8 would read it), where this torch / cuBLASLt offers it: checked against the float product first.
torch is the measuring tool here only (cudflash never imports it); a W8A8 path would still need the activations
quantized per token (~3 bytes per element of x: read bf16, write FP8), which is not in these numbers.

Usage (on the GPU machine): PYTHONPATH=$PWD python3 scripts/w8a8_probe.py
"""
from __future__ import annotations

import statistics

import cupy
import numpy as np
import torch

from cudflash.backends import fp4_weight, fp8_weight
from cudflash.backends.cuda_backend import CudaBackend

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (128, 512, 2048, 8192)
REPS = 20


def cupy_ms(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPS):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def torch_ms(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def block_variant(m: int, n: int, k: int):
    """(a launch of the 1x128 / 128x128 block-scaled FP8 GEMM, a description), checked against the float product
    with random scales, or (None, why not). torch.nn.functional.scaled_mm (torch >= 2.10) takes the activation scales
    [M, K / 128] outer-dim major and the weight's [N / 128, K / 128] as the transposed view [K / 128, N / 128]."""
    import torch.nn.functional as F

    kinds = getattr(F, "ScalingType", None)
    if kinds is None or not hasattr(F, "scaled_mm"):
        return None, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(m, k, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    sa = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
    sb = torch.rand(n // 128, k // 128, device="cuda", generator=g) + 0.5
    ref = (a.float() * sa.repeat_interleave(128, 1)) @ (b.float() * sb.repeat_interleave(128, 0).repeat_interleave(
        128, 1)).t()
    scale_a, scale_b = sa.t().contiguous().t(), sb.t()

    def launch():
        return F.scaled_mm(a, b.t(), scale_a, kinds.BlockWise1x128, scale_b, kinds.BlockWise128x128,
                           output_dtype=torch.bfloat16)

    try:
        err = ((launch().float() - ref).norm() / ref.norm()).item()
    except Exception as e:  # noqa: BLE001 - a question to this torch / cuBLASLt
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if err >= 2e-2:
        return None, f"relative error {err:.2f} against the float product"
    return launch, f"checked against the float product (relative error {err:.1e})"


def main() -> None:
    cb = CudaBackend()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}")
    rng = np.random.default_rng(0)
    print(f"{'GEMM':>8} {'M':>5} | {'dequant+bf16':>12} {'nvfp4 dq+bf16':>13} {'bf16':>8} | {'w8a8 tensor':>11} "
          f"{'w8a8 rowwise':>12} {'w8a8 block':>10} | ms; TFLOP/s of bf16 / w8a8 block")
    block_note = None
    for name, (n, k) in SHAPES.items():
        w8 = fp8_weight.random_fp8((n, k), 0.02, seed=1)
        w4 = fp4_weight.random_fp4((n, k), 0.02, seed=2)
        wb = fp8_weight.dequantize_bf16(w8, cb.act, cb.tuning)
        for m in ROWS:
            x = cb.asarray(rng.standard_normal((m, k), dtype=np.float32), "act")
            y = cupy.empty((m, n), dtype=cb.act)
            t_dq8 = cupy_ms(lambda: cb.blas.gemm_bf16(x, fp8_weight.dequantize_bf16(w8, cb.act, cb.tuning), y))
            t_dq4 = cupy_ms(lambda: cb.blas.gemm_bf16(x, fp4_weight.dequantize_bf16(w4, cb.act, cb.tuning), y))
            t_bf = cupy_ms(lambda: cb.blas.gemm_bf16(x, wb, y))
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            t_t = torch_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            ra, rb, bf16 = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda"), torch.bfloat16
            try:
                t_r = f"{torch_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=ra, scale_b=rb, out_dtype=bf16)):12.3f}"
            except Exception as e:  # noqa: BLE001
                t_r = f"{'n/a':>12}"
                block_note = block_note or f"rowwise: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            launch, note = block_variant(m, n, k)
            if block_note is None or launch is not None:
                block_note = note
            t_b = torch_ms(launch) if launch is not None else None
            flop = 2 * m * n * k
            print(f"{name:>8} {m:5d} | {t_dq8:12.3f} {t_dq4:13.3f} {t_bf:8.3f} | {t_t:11.3f} {t_r} "
                  f"{(f'{t_b:10.3f}' if t_b else 'n/a'):>10} | {flop / t_bf / 1e9:.0f} / "
                  f"{(f'{flop / t_b / 1e9:.0f}' if t_b else '-')}")
            del a, b
    print(f"w8a8 block: {block_note}")


if __name__ == "__main__":
    main()
