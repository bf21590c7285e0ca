"""The engine serving a Qwen3.5 hybrid target on the GPU (op by op; the kernels are tests/gpu/test_gdn_kernels.py):
a tiny random checkpoint of the released layout with a DFlash drafter tapping a GDN layer and the attention layer.

- Speculative greedy == autoregressive greedy on the GPU: the GEMMs of 1..16 rows are row-invariant, and a verify
  followed by a commit of its accepted rows computes the bits of decoding them (test_gdn_kernels), so a prompt may
  differ only where a bf16 tie breaks differently in attention; at most one of eight.
- The GPU's greedy tokens against the CPU's (float32): bf16 rounding flips a near-tie now and then, after which the
  continuations part; a wrong GPU engine (state not carried, wrong rollback) agrees on ~1/256 of the tokens, so
  the test asks for most of them.
"""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyHeads, TinyShape
from cudflash.tiny_hybrid import HybridShape, write_hybrid_drafter, write_hybrid_target

pytest.importorskip("cupy")

# head_dim 64: the CUDA attention's smallest (cuda_attention.HEAD_DIMS), for the target and the drafter
SHAPE = HybridShape(checkpoint_class="causal", head_dim=64, mrope_section=[4, 2, 2])
DRAFT = TinyShape(target_layer_ids=[0, 3], block_size=6, draft_head_dim=64,
                  heads=TinyHeads(layer_types=["sliding_attention", "full_attention"], sliding_window=8))
_rng = np.random.default_rng(4)
PROMPTS = [[int(x) for x in _rng.integers(2, 250, n)] for n in (75, 5, 30, 140, 12, 64, 33, 90)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_hybrid_on_the_gpu_speculates_exactly_and_follows_the_cpu(tmp_path):
    target = write_hybrid_target(tmp_path / "t", SHAPE, seed=11)
    drafter = write_hybrid_drafter(tmp_path / "d", SHAPE, DRAFT, seed=2)
    ar = [o.token_ids for o in LLM(target, backend="cuda").generate(PROMPTS, GREEDY)]
    spec_outs = LLM(target, draft=drafter, backend="cuda").generate(PROMPTS, GREEDY)
    cpu = [o.token_ids for o in LLM(target, backend="cpu").generate(PROMPTS, GREEDY)]
    same = sum(s.token_ids == a for s, a in zip(spec_outs, ar))
    assert same >= len(PROMPTS) - 1, f"spec == AR on the GPU on {same} of {len(PROMPTS)} prompts"
    agree = np.mean([np.mean(np.array(g) == np.array(c)) for g, c in zip(ar, cpu)])
    assert agree >= 0.75, f"GPU greedy tokens agree with the CPU's on {agree:.2f} of positions"
    assert all(len(a) == GREEDY.max_tokens for a in ar)
