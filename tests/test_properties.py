"""Properties that need no golden, on tiny random checkpoints the tests write themselves."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.engine.propose import DraftProposer, HostProposer
from cudflash.engine.proposal import Proposal
from cudflash.tiny import TinyShape, write_random_pair

SHAPES = {
    # head_dim 64, GQA 1, untied, one file
    "qwen3-d64-gqa1": TinyShape(arch="qwen3", num_heads=4, num_kv_heads=4, head_dim=64),
    # head_dim 128, GQA 4, tied, sharded, q/k/v biases
    "qwen2-d128-gqa4-tied-sharded": TinyShape(arch="qwen2", num_heads=8, num_kv_heads=2, head_dim=128,
                                              tie_word_embeddings=True, shards=2),
    # head_dim 64, GQA 8, llama3 RoPE scaling, three shards, float16 storage
    "llama-d64-gqa8-llama3": TinyShape(arch="llama", num_heads=8, num_kv_heads=1, head_dim=64, shards=3, dtype="F16",
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # yarn RoPE, float32 storage, q/k/v/o biases, a drafter with its own head layout
    "llama-yarn-f32-bias": TinyShape(arch="llama", num_heads=4, num_kv_heads=2, head_dim=32, dtype="F32",
                                     attention_bias=True,
                                draft_heads=2, draft_kv_heads=1, draft_head_dim=64,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128}),
}
PROMPT_LENS = [5, 17, 33]  # with 8-token KV blocks: inside one block, across two, across four
MAX_NEW = 40


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    shape = SHAPES[request.param]
    return write_random_pair(tmp_path_factory.mktemp(request.param), shape, seed=len(request.param)), shape


def _llm(pair, block_size=None, **kw) -> LLM:
    (target, draft), _ = pair
    return LLM(target, draft=draft, backend="cpu", block_size=block_size, kv_block_size=8, **kw)


def _greedy(n=MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(pair):
    """Plain autoregressive greedy continuations, long enough to cover every block an oracle may propose."""
    llm = _llm(pair, block_size=1)
    prompts = _prompts(pair[1].vocab_size)
    outs = llm.generate(prompts, _greedy(MAX_NEW + 32))
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_speculative_greedy_equals_autoregressive(pair, reference, block):
    llm = _llm(pair, block_size=block)
    prompts = _prompts(pair[1].vocab_size)
    for p, out in zip(prompts, llm.generate(prompts, _greedy())):
        assert out.token_ids == reference[tuple(p)][:MAX_NEW]
        assert all(1 <= a <= block for a in out.acceptance_lengths)
        assert sum(out.acceptance_lengths) + 1 >= MAX_NEW


def test_batch_equals_each_sequence_alone(pair):
    llm = _llm(pair)
    prompts = _prompts(pair[1].vocab_size)
    params = [_greedy(n) for n in (40, 13, 27)]  # different lengths finish at different steps
    batched = llm.generate(prompts, params)
    for p, sp, out in zip(prompts, params, batched):
        alone = llm.generate([p], sp)[0]
        assert out.token_ids == alone.token_ids
        assert out.acceptance_lengths == alone.acceptance_lengths


class _ScriptedProposer(HostProposer):
    """Drafts from the reference continuation: all right (oracle), all wrong (adversarial), or right for the
    first correct_prefix(step) drafts and wrong after."""

    def __init__(self, reference, vocab: int, adversarial: bool, correct_prefix=None):
        self.reference, self.vocab, self.adversarial, self.correct_prefix = reference, vocab, adversarial, correct_prefix

    def propose(self, runner, seqs, block):
        drafts = []
        for s in seqs:
            ref = self.reference[tuple(s.prompt_ids)]
            n = len(s.output_ids)  # output so far equals ref[:n]; drafts are the tokens after the pending one
            d = np.array(ref[n:n + block - 1], dtype=np.int64)
            k = 0 if self.adversarial else block - 1 if self.correct_prefix is None \
                else self.correct_prefix(len(s.acceptance_lengths))
            d[k:] = (d[k:] + 1) % self.vocab
            drafts.append(d)
        return Proposal(np.stack(drafts))


_scripted_proposer = _ScriptedProposer


@pytest.mark.parametrize("block", [4, 16])
def test_oracle_drafter_accepts_every_block(pair, reference, block):
    llm = _llm(pair, block_size=block)
    llm.proposer = _scripted_proposer(reference, pair[1].vocab_size, adversarial=False)
    prompts = _prompts(pair[1].vocab_size)
    for p, out in zip(prompts, llm.generate(prompts, _greedy())):
        assert out.token_ids == reference[tuple(p)][:MAX_NEW]
        assert out.acceptance_lengths == [block] * len(out.acceptance_lengths)
        assert out.tau == block


def test_adversarial_drafter_accepts_nothing(pair, reference):
    llm = _llm(pair, block_size=8)
    llm.proposer = _scripted_proposer(reference, pair[1].vocab_size, adversarial=True)
    prompts = _prompts(pair[1].vocab_size)
    for p, out in zip(prompts, llm.generate(prompts, _greedy())):
        assert out.token_ids == reference[tuple(p)][:MAX_NEW]
        assert out.tau == 1.0


def test_kv_pool_returns_to_full(pair):
    llm = _llm(pair)
    llm.generate(_prompts(pair[1].vocab_size), _greedy())
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_small_pool_queues_requests_instead_of_failing(pair):
    # Room for one request's worst case at a time: the others wait, and results are unchanged.
    llm = _llm(pair, num_kv_blocks=12)
    prompts = _prompts(pair[1].vocab_size)
    outs = llm.generate(prompts, _greedy(30))
    ref = _llm(pair).generate(prompts, _greedy(30))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert llm.runner.blocks.num_free == 12


def test_partial_acceptance_rolls_back_exactly(pair, reference):
    """Every accepted length 1..B in turn: the output stays the target's and each step accepts what was right."""
    block = 8
    llm = _llm(pair, block_size=block)
    pattern = lambda step: (3 * step + 1) % block  # noqa: E731  right drafts at step `step`: 1, 4, 7, 2, 5, 0, ...
    llm.proposer = _scripted_proposer(reference, pair[1].vocab_size, adversarial=False, correct_prefix=pattern)
    prompts = _prompts(pair[1].vocab_size)
    for p, out in zip(prompts, llm.generate(prompts, _greedy())):
        assert out.token_ids == reference[tuple(p)][:MAX_NEW]
        assert out.acceptance_lengths == [pattern(i) + 1 for i in range(len(out.acceptance_lengths))]


def test_drafter_context_window_bounds_attention_and_stays_lossless(pair, reference):
    """A context window on every drafter layer changes what the drafter proposes on long contexts (it no longer
    sees old positions) but never what is generated."""
    (target, draft), shape = pair
    prompts = _prompts(shape.vocab_size)
    proposals = {}
    for window in (None, 4):
        llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8,
                  draft_options=None if window is None else {"context_window": window})
        assert llm.draft_cfg.layer_windows == [window or 0] * shape.draft_layers
        seen = []
        inner = llm.proposer

        class Recording(DraftProposer):
            def device_part(self, runner, batch, rows):
                out = inner.device_part(runner, batch, rows)
                seen.append(runner.backend.to_numpy(out.h).copy())  # the drafter's hidden rows of the drafts
                return out

        llm.proposer = Recording(llm.runner)
        for p, out in zip(prompts, llm.generate(prompts, _greedy())):
            assert out.token_ids == reference[tuple(p)][:MAX_NEW]
        proposals[window] = seen[0]
    assert np.abs(proposals[None] - proposals[4]).max() > 1e-3
