"""Lossless sampling: speculative rejection sampling reproduces the target's own distribution.

A tiny random target with 16 tokens, temperature 1, thousands of seeded requests generated together. The
drafter is an oracle of the target's greedy continuation (so drafts are accepted often and a wrong acceptance
rule shows); the exact distribution of the first generated tokens is computed from the target's logits.
"""
from __future__ import annotations


import numpy as np
import pytest

import cudflash.engine.sampler as sampler
from cudflash import LLM, SamplingParams
from cudflash.engine.propose import HostProposer
from cudflash.engine.proposal import Proposal
from cudflash.tiny import write_random_pair
from tests.sampling_stats import (PROMPT, VOCAB, exact_first_tokens, first_token_pvalues, small_shape,
                                  wrong_rejection_sample)

BLOCK, RUNS = 4, 3000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), small_shape(BLOCK), seed=3)


def _llm(pair, block):
    target, draft = pair
    return LLM(target, draft=draft, backend="cpu", block_size=block, max_num_seqs=256, kv_block_size=8)


def greedy_oracle(llm):
    """Drafts = the target's greedy continuation after the first sampled token (precomputed per token)."""
    ar = LLM(llm.target_cfg.path, backend="cpu")
    table = {a: np.array(ar.generate([PROMPT + [a]], SamplingParams(max_tokens=BLOCK - 1, ignore_eos=True))[0].token_ids)
             for a in range(VOCAB)}

    class Oracle(HostProposer):
        def propose(self, runner, seqs, block):
            return Proposal([table[s.output_ids[0]] if len(s.output_ids) == 1 else np.zeros(block - 1, dtype=np.int64)
                             for s in seqs])
    return Oracle()


def sample_first_tokens(llm, params: SamplingParams) -> tuple[np.ndarray, float]:
    """The first three tokens of RUNS seeded generations, and the mean acceptance length of the first step
    (the only one where the oracle proposes)."""
    outs = llm.generate([PROMPT] * RUNS, [SamplingParams(max_tokens=3, seed=i, ignore_eos=True,
                                                         temperature=params.temperature, top_k=params.top_k,
                                                         top_p=params.top_p) for i in range(RUNS)])
    steps = [o.acceptance_lengths[0] for o in outs]
    return np.array([o.token_ids[:3] for o in outs]), float(np.mean(steps))


_pvalues = first_token_pvalues


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_speculative_sampling_matches_the_target_distribution(pair, params):
    llm = _llm(pair, BLOCK)
    llm.proposer = greedy_oracle(llm)
    tokens, tau = sample_first_tokens(llm, params)
    assert tau > 1.3, tau  # drafts are often accepted, so the acceptance rule is really exercised
    pvalues = _pvalues(tokens, exact_first_tokens(llm, params))
    assert min(pvalues) > 1e-3, pvalues


def test_autoregressive_sampling_matches_the_target_distribution(pair):
    llm = _llm(pair, 1)
    params = SamplingParams(temperature=1.0)
    pvalues = _pvalues(sample_first_tokens(llm, params)[0], exact_first_tokens(llm, params))
    assert min(pvalues) > 1e-3, pvalues


def test_a_wrong_acceptance_rule_fails_the_test(pair, monkeypatch):
    """Resampling from p (not the residual) after a rejection over-weights drafts: the test must catch it."""
    monkeypatch.setattr(sampler, "rejection_sample", wrong_rejection_sample)
    llm = _llm(pair, BLOCK)
    llm.proposer = greedy_oracle(llm)
    params = SamplingParams(temperature=1.0)
    pvalues = _pvalues(sample_first_tokens(llm, params)[0], exact_first_tokens(llm, params))
    assert min(pvalues) < 1e-3, pvalues


def test_same_seed_same_output_whatever_the_batch(pair):
    llm = _llm(pair, BLOCK)
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].token_ids
    crowd = llm.generate([PROMPT, [5, 5], PROMPT, [1, 2, 3]], [p, SamplingParams(max_tokens=5, seed=1), p,
                                                               SamplingParams(max_tokens=20)])
    assert crowd[0].token_ids == alone and crowd[2].token_ids == alone
