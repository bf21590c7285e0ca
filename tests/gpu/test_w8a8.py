"""W8A8 on the FP8 tensor cores (backends/w8a8.py, cublaslt.py, kernels/fp8_act_quant.cu): the activations' FP8
codes and scales bit for bit against numpy's definition (quant.weight.quantize_fp8_block with 1 x 128 blocks), the
GEMM against float64 over the same FP8 values for every weight row map the backend makes (the 128 x 128 grid, an
interleaved gate_up, a row slice), and CudaBackend.linear's route with tuning.fp8_w8a8."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import fp8_weight, w8a8  # noqa: E402
from cudflash.quant import dequantize, quantize_fp8_block  # noqa: E402
from cudflash.quant.numerics import decode_e4m3  # noqa: E402

from .test_ops import check, rnd  # noqa: E402
from .test_quant_gemm import quantized as quantize_fp8  # noqa: E402
from .test_stream_gemm import skip_without_tma  # noqa: E402


@pytest.fixture(scope="module")
def cb():
    from cudflash.backends.cuda_backend import CudaBackend

    return CudaBackend(tuning={"fp8_on_device": True, "fp8_w8a8": True})


@pytest.fixture(scope="module")
def lt():
    from cudflash.backends.cublaslt import CublasLt

    return CublasLt()


# The FP8 tensor cores' products of W8A8 against float64 over the same FP8 values: the H200 measured a relative error
# of 1.25e-4 to 1.28e-4 at K 1024 (session 20), what an accumulation keeping ~14 bits inside each 128-column block
# gives (DeepSeek-V3's report measured the same of Hopper's FP8 MMA); a scale in the wrong place errs by percents.
FP8_MMA_TOL = 1e-3


def quantized(rng, n: int, k: int):
    return quantize_fp8(rng, n, k, scale=k ** -0.5)


def x_fp8_values(x: np.ndarray) -> np.ndarray:
    """x as W8A8 multiplies it: numpy's 1 x 128 block quantization, dequantized (float64)."""
    return dequantize(quantize_fp8_block(x.astype(np.float32), (1, 128))).astype(np.float64)


@pytest.mark.parametrize("m,rows", [(1, 16), (17, 32), (300, 304)])
def test_activation_codes_and_scales_are_numpys(cb, rng, m, rows):
    k = 512
    wide = rnd(rng, m, k + 128)
    wide[0, 128 + 128: 128 + 256] = 0.0  # a block of zeros: scale 1
    wide[-1, 128 + 5] = 3e4  # a large element: its block's codes reach +-448 exactly
    dx = cb.asarray(wide, "act")[:, 128:]  # rows apart by K + 128: a column slice
    x = cb.to_numpy(dx).astype(np.float32)
    codes, scales = w8a8.quantize_rows(dx, rows, cb.tuning)
    ref = quantize_fp8_block(x, (1, 128))
    assert codes.shape == (rows, k) and scales.shape == (k // 128, rows)
    assert np.array_equal(cp.asnumpy(codes[:m]), ref.data)
    assert np.array_equal(cp.asnumpy(scales[:, :m]).view(np.uint32), ref.scale.T.view(np.uint32))
    assert not cp.asnumpy(codes[m:]).any() and np.all(cp.asnumpy(scales[:, m:]) == 1.0)
    assert decode_e4m3(ref.data[-1]).max() == 448.0


@pytest.mark.parametrize("k", [1024, 384])
@pytest.mark.parametrize("m", [17, 100, 300])
@pytest.mark.parametrize("layout", ["grid", "grid as rows", "gate_up", "slice"])
def test_w8a8_gemm_matches_float64_over_the_same_fp8_values(cb, lt, rng, m, layout, k):
    """Each weight scale form: the 128 x 128 grid as it is (BLK128x128), the same weight's scales gathered per row
    (VEC128, "grid as rows"), and the row maps only the gathered form takes; K = 384 (the tiny pair's hidden size,
    three scale columns: the grid takes the gathered form, w8a8.weight_scales)."""
    skip_without_tma()
    if layout == "gate_up":
        gate, up = quantized(rng, 256, k), quantized(rng, 256, k)
        w = cb.gate_up_weight(fp8_weight.upload(gate), fp8_weight.upload(up))
        assert not w.block_grid
        wd = np.empty((512, k))  # the interleave in float64: rows 16 j .. + 7 gate 8 j .., the next 8 up
        g, u = dequantize(gate).reshape(32, 8, k), dequantize(up).reshape(32, 8, k)
        wd.reshape(32, 16, k)[:, :8], wd.reshape(32, 16, k)[:, 8:] = g, u
    else:
        qw = quantized(rng, 640, k)
        w, wd = fp8_weight.upload(qw), dequantize(qw).astype(np.float64)
        assert w.block_grid
        if layout == "slice":  # rows 128 .. 512: a view into the whole scale array
            w, wd = w[128:512], wd[128:512]
            assert not w.block_grid
    x = rnd(rng, m, k)
    dx = cb.asarray(x, "act")
    ref = x_fp8_values(cb.to_numpy(dx)) @ wd.T
    for dtype in (cp.float32, cb.act):
        y = w8a8.gemm(lt, dx, w, dtype, cb.tuning, block=False if layout == "grid as rows" else None)
        assert y.shape == (m, w.shape[0]) and y.dtype == dtype
        check(cb.to_numpy(y), ref, tol=FP8_MMA_TOL if dtype == cp.float32 else 1e-2)


@pytest.mark.parametrize("m,p", [(64, 64), (65, 65), (400, 400), (400, 0), (100, 60), (300, 200)])
def test_linear_takes_w8a8_for_the_inexact_rows_and_streams_the_others(cb, rng, monkeypatch, m, p):
    """With tuning.fp8_w8a8, a product of more rows than quantized_stream_max_rows runs its inexact rows (the first
    p, `inexact_rows`) W8A8, the product of x's FP8 values, and streams its other rows, whatever their number, each
    with the bits it has alone (a decode's); at or below the streamed rows every row streams."""
    skip_without_tma()
    calls = []
    real = w8a8.gemm
    monkeypatch.setattr(w8a8, "gemm", lambda *a: calls.append(a[1].shape) or real(*a))
    qw = quantized(rng, 512, 1024)
    w, wd = cb.load_quantized(qw), dequantize(qw).astype(np.float64)
    dx = cb.asarray(rnd(rng, m, 1024), "act")
    x = cb.to_numpy(dx).astype(np.float64)
    with cb.inexact_rows(p):
        y = cb.to_numpy(cb.linear(dx, w, out_f32=True))
    w8 = p if m > 64 else 0
    assert calls == ([(p, 1024)] if w8 else [])
    if w8:
        check(y[:w8], x_fp8_values(x[:w8]) @ wd.T, tol=FP8_MMA_TOL)
    if w8 < m:
        check(y[w8:], x[w8:] @ wd.T, tol=1e-5)
    for r in range(w8, m, 37):  # the exact rows: a decode's bits (one row alone)
        assert np.array_equal(y[r], cb.to_numpy(cb.linear(dx[r:r + 1], w, out_f32=True))[0])


def test_the_engine_runs_prefill_rows_w8a8_and_no_other_row(tiny_pair, monkeypatch):
    """In the engine the prefill chunks' rows of the target's FP8 products run W8A8 (every prompt token once per
    quantized linear), a verify's rows never: theirs (8 sequences x 16, beyond the streamed rows) round as their
    decodes do, so speculative output is the autoregressive one on every prompt."""
    import json

    from cudflash import LLM, SamplingParams

    skip_without_tma()
    rows = []
    real = w8a8.gemm
    monkeypatch.setattr(w8a8, "gemm", lambda *a: rows.append(a[1].shape[0]) or real(*a))
    prompts = json.loads((tiny_pair / "prompts_dev.json").read_text())["prompts"][:8]
    layers = json.loads((tiny_pair / "target" / "config.json").read_text())["num_hidden_layers"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    tuning = {"fp8_on_device": True, "fp8_w8a8": True}
    spec = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda", quantize="fp8",
               tuning=tuning).generate(prompts, params)
    assert sum(rows) == 4 * layers * sum(len(p) for p in prompts)  # qkv, o_proj, gate_up, down over each token
    ar = LLM(tiny_pair / "target", backend="cuda", quantize="fp8", tuning=tuning).generate(prompts, params)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


def test_w8a8_falls_back_to_the_dequantized_weight_where_cublaslt_fails(rng, monkeypatch, capsys):
    """A cuBLASLt failure (no algorithm for a shape on this GPU or library) turns W8A8 off with a notice: the inexact
    rows then come from the dequantized weight, with the bits they have with fp8_w8a8 off."""
    from cudflash.backends.cublaslt import CublasLt
    from cudflash.backends.cuda_backend import CudaBackend
    from cudflash.errors import BackendError

    skip_without_tma()
    on, off = (CudaBackend(tuning={"fp8_on_device": True, "fp8_w8a8": f}) for f in (True, False))
    if not on._w8a8:
        pytest.skip("W8A8 needs a Hopper GPU and cuBLASLt 12.9 or later")

    def fail(*args, **kwargs):
        raise BackendError("cuBLASLt MatmulAlgoGetHeuristic failed with status 15")

    monkeypatch.setattr(CublasLt, "gemm_fp8", fail)
    qw, x = quantized(rng, 512, 1024), rnd(rng, 200, 1024)
    ys = []
    for cb in (on, off):
        with cb.inexact_rows(200):
            ys.append(cb.to_numpy(cb.linear(cb.asarray(x, "act"), cb.load_quantized(qw), out_f32=True)))
    assert np.array_equal(ys[0], ys[1])
    assert "W8A8 is off" in capsys.readouterr().err and on._w8a8 is False
