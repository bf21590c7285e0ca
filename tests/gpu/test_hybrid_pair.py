"""The trained tiny hybrid pair on the GPU (bf16): speculative == autoregressive greedy on >= 95% of prompts, tau
within 2% of the CPU's (the goldens' acceptance lengths are cudflash's float32 CPU run, tests/test_hybrid_pair.py)."""
from __future__ import annotations

import statistics

from cudflash import LLM, SamplingParams
from tests.conftest import HYBRID_PAIR, golden_tau, load_goldens

MAX_NEW = 128


def test_hybrid_pair_on_the_gpu():
    goldens = load_goldens(HYBRID_PAIR)
    prompts = [g["prompt_ids"] for g in goldens]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    spec = LLM(HYBRID_PAIR / "target", draft=HYBRID_PAIR / "drafter", backend="cuda").generate(prompts, params)
    ar = LLM(HYBRID_PAIR / "target", backend="cuda").generate(prompts, params)
    same = sum(s.token_ids == a.token_ids for s, a in zip(spec, ar))
    golden = sum(a.token_ids == g["ar_ids"] for a, g in zip(ar, goldens))
    tau, cpu_tau = statistics.mean(o.tau for o in spec), golden_tau(goldens)
    print(f"hybrid pair gpu: spec == ar on {same}/{len(prompts)}, ar == float32 golden on {golden}/{len(prompts)}, "
          f"gpu tau {tau:.4f} (cpu {cpu_tau:.4f})")
    assert same >= 0.95 * len(prompts), same
    assert abs(tau - cpu_tau) / cpu_tau < 0.02, (tau, cpu_tau)
