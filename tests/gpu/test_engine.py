"""The whole engine on the GPU (bf16): models against the numpy backend, and the tiny-code-pair goldens."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.engine.sequence import Sequence
from tests.conftest import golden_tau, last_logits, top2_relative_gap

MAX_NEW = 128


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def gpu_pair(tiny_pair):
    return LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda")


@pytest.fixture(scope="module")
def cpu_pair(tiny_pair):
    return LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu")


def _forward_logits(llm: LLM, prompt: list[int], block: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Target logits over the prompt's last 8 rows, and drafter logits of `block` proposed after the prompt."""
    runner, b = llm.runner, llm.backend
    seq = Sequence(-1, list(prompt), SamplingParams())
    runner.blocks.reserve(seq, len(prompt) + len(block))
    try:
        batch = runner.batch([seq], [list(prompt)], [0])
        hidden, taps = runner.target_forward(batch)
        target = b.to_numpy(runner.logits(hidden, np.arange(len(prompt) - 8, len(prompt)))).astype(np.float32)
        runner.draft_context(taps, batch)
        seq.num_cached = len(prompt)
        draft_batch = runner.batch([seq], [block], [len(prompt)])
        drafted = b.to_numpy(runner.logits(runner.draft_forward(draft_batch))).astype(np.float32)
        return target, drafted
    finally:
        runner.blocks.free(seq)


def test_target_and_drafter_logits_match_numpy(gpu_pair, cpu_pair, goldens):
    mask = gpu_pair.draft_cfg.mask_token_id
    for g in goldens[:4]:
        block = [g["ar_ids"][0]] + [mask] * 15
        gt, gd = _forward_logits(gpu_pair, g["prompt_ids"], block)
        ct, cd = _forward_logits(cpu_pair, g["prompt_ids"], block)
        print(f"logits vs numpy float32: target {_rel(gt, ct):.2e}, drafter {_rel(gd, cd):.2e}")
        assert _rel(gt, ct) < 2e-2, _rel(gt, ct)
        assert _rel(gd, cd) < 2e-2, _rel(gd, cd)


def _report(name: str, outputs, reference: list[list[int]], prompts, cpu_pair) -> int:
    """Count exact matches; print, for each mismatch, the first differing position and the float32 gap there."""
    exact = 0
    for out, ref, prompt in zip(outputs, reference, prompts):
        if out == ref:
            exact += 1
            continue
        j = next(i for i, (x, y) in enumerate(zip(out, ref)) if x != y)
        gap = top2_relative_gap(last_logits(cpu_pair, prompt + ref[:j]))
        print(f"{name}: first difference at new token {j}: gpu {out[j]} vs {ref[j]}, float32 top-2 gap {gap:.2e}")
    print(f"{name}: {exact}/{len(reference)} exact")
    return exact


def test_goldens_on_the_gpu(tiny_pair, gpu_pair, cpu_pair, goldens):
    prompts = [g["prompt_ids"] for g in goldens]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    spec = gpu_pair.generate(prompts, params)
    ar = LLM(tiny_pair / "target", backend="cuda").generate(prompts, params)
    tau, expected_tau = statistics.mean(o.tau for o in spec), golden_tau(goldens)
    print(f"gpu tau {tau:.4f} (golden {expected_tau:.4f})")
    ar_exact = _report("ar vs golden", [o.token_ids for o in ar], [g["ar_ids"] for g in goldens], prompts, cpu_pair)
    spec_exact = _report("spec vs golden", [o.token_ids for o in spec], [g["spec_ids"] for g in goldens], prompts,
                         cpu_pair)
    self_exact = _report("spec vs gpu ar", [o.token_ids for o in spec], [o.token_ids for o in ar], prompts, cpu_pair)
    assert ar_exact >= 30 and spec_exact >= 30 and self_exact >= 30
    assert abs(tau - expected_tau) / expected_tau < 0.02, tau


@pytest.fixture(scope="module")
def streamed_pair(tmp_path_factory):
    """A random pair whose every GEMM weight is large enough for the weight-streaming kernel (>= 8 MiB), so decode
    and verify run its fused epilogues (the tiny pair's weights all stay on cuBLAS)."""
    from cudflash.tiny import TinyShape, write_random_pair

    shape = TinyShape(vocab_size=4096, hidden_size=2048, num_layers=3, num_heads=16, num_kv_heads=4, head_dim=128,
                      intermediate_size=4096, draft_layers=1, block_size=16, target_layer_ids=[0, 1], std=0.02)
    return write_random_pair(tmp_path_factory.mktemp("streamed"), shape, seed=3)


def test_streamed_model_matches_numpy_and_speculation_keeps_its_tokens(streamed_pair, monkeypatch):
    """Target logits against float32 numpy, and greedy speculative output == greedy autoregressive output, exactly,
    with the norms deferred between GEMMs (a verify row must reproduce its decode's bits)."""
    from cudflash.backends import stream_gemm as sg

    if not sg.available():
        pytest.skip("needs sm_90 and the driver's tensor-map encoder")
    fused = []
    real = sg.add_norm
    monkeypatch.setattr(sg, "add_norm", lambda *a: fused.append(a[0].shape[0]) or real(*a))
    target, draft = streamed_pair
    gpu = LLM(target, draft=draft, backend="cuda")
    cpu = LLM(target, draft=draft, backend="cpu")
    rng = np.random.default_rng(0)
    for n in (9, 16):  # a prompt of at most 16 rows is one streamed forward
        prompt = rng.integers(2, 4096, size=n).tolist()
        gt, _ = _forward_logits(gpu, prompt, [prompt[-1]] * 16)
        ct, _ = _forward_logits(cpu, prompt, [prompt[-1]] * 16)
        assert _rel(gt, ct) < 2e-2, _rel(gt, ct)
    assert fused, "the fused epilogue was not used"
    prompts = [rng.integers(2, 4096, size=n).tolist() for n in (40, 75, 130)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    spec = gpu.generate(prompts, params)
    ar = LLM(target, backend="cuda").generate(prompts, params)
    assert fused and max(fused) <= 16  # decode and verify rows took the fused epilogues
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    print(f"streamed pair: tau {statistics.mean(o.tau for o in spec):.3f}")
