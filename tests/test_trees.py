"""Draft trees (engine/tree.py): the construction against brute force, the tree mask and the KV compaction against
dense references, greedy output == autoregressive output exactly, and sampled output distributed as the target's
(with a deliberately wrong walk caught)."""
from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest

import cudflash.engine.sampler as sampler
from cudflash import LLM, SamplingParams
from cudflash.backends.base import AttentionMeta
from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.engine.propose import HostProposer
from cudflash.engine.proposal import Proposal
from cudflash.engine.tree import DraftTree, ancestor_masks, build_lattice_tree, build_tree, pack_bits, walk, words_for
from cudflash.errors import ConfigError
from cudflash.tiny import TinyHeads, TinyShape, write_random_pair
from tests.sampling_stats import PROMPT, VOCAB, exact_first_tokens, first_token_pvalues, small_shape

nb = NumpyBackend()


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Every node's path of (depth, token) pairs, root excluded."""
    out = []
    for i in range(tree.size):
        path, j = [], i
        while j >= 0:
            path.append((int(tree.depths[j]), int(tree.tokens[j])))
            j = int(tree.parents[j])
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("slots,k,budget,seed", [(3, 3, 5, 0), (4, 4, 20, 1), (5, 2, 31, 2), (2, 5, 40, 3),
                                                 (6, 3, 1, 4)])
def test_build_tree_keeps_the_best_paths(slots, k, budget, seed):
    """The tree holds the `budget` highest-scoring paths (score: the sum of the depths' log-probabilities), parents
    before children, at their own depths."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((slots, 50)) * 2
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    ids = np.argsort(-logprobs, axis=1)[:, :k]
    top = np.take_along_axis(logprobs, ids, axis=1)
    tree = build_tree(top, ids, budget)
    every = [p for d in range(1, slots + 1) for p in itertools.product(*[range(k)] * d)]
    score = {p: sum(top[i, r] for i, r in enumerate(p)) for p in every}
    best = sorted(every, key=lambda p: -score[p])[:budget]
    want = {tuple((i + 1, int(ids[i, r])) for i, r in enumerate(p)) for p in best}
    assert tree.size == min(budget, len(every))
    assert set(_paths(tree)) == want
    assert all(p < i for i, p in enumerate(tree.parents))
    assert all(tree.depths[i] == (1 if p < 0 else tree.depths[p] + 1) for i, p in enumerate(tree.parents))


def test_lattice_tree_keeps_the_best_paths():
    """DFlash2's lattice: a child's log-probability depends on its parent's candidate (the softmax of the parent's
    row of pair scores); the tree still holds the `budget` best paths."""
    rng = np.random.default_rng(7)
    slots, k, budget = 3, 3, 11
    scores = rng.standard_normal((slots, k, k)) * 2
    scores[0] = scores[0, :1]  # depth 1's predecessor is the pending token: every row the same
    cand = rng.integers(0, 1000, (slots, k))
    tree = build_lattice_tree(scores, cand, budget)
    logp = scores - np.log(np.exp(scores).sum(axis=2, keepdims=True))
    every = [p for d in range(1, slots + 1) for p in itertools.product(*[range(k)] * d)]
    score = {p: sum(logp[i, 0 if i == 0 else p[i - 1], c] for i, c in enumerate(p)) for p in every}
    best = sorted(every, key=lambda p: -score[p])[:budget]
    assert set(_paths(tree)) == {tuple((i + 1, int(cand[i, c])) for i, c in enumerate(p)) for p in best}


def _tree(parents: list[int], tokens: list[int]) -> DraftTree:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree(np.array(tokens), np.array(parents), np.array(depths))


def test_tree_attention_equals_each_path_alone():
    """Each tree row attends to the committed keys and its ancestors exactly as a causal chunk of its own path
    would: compared with a dense softmax over just those keys."""
    rng = np.random.default_rng(0)
    tree = _tree([-1, -1, 0, 0, 2, 1, 4], [5, 6, 7, 8, 9, 10, 11])
    n, committed, heads, d, bs = tree.size + 1, 13, 2, 16, 4
    ctx = committed + n
    k_cache = rng.standard_normal((8, bs, heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((8, bs, heads, d)).astype(np.float32)
    q = rng.standard_normal((n, heads * d)).astype(np.float32)
    table = np.array([[3, 0, 6, 1, 7, 2]], np.int32)
    meta = AttentionMeta(np.array([0, n], np.int32), np.array([ctx], np.int32), table, n, ctx)
    meta.tree_seq = np.array([1], np.int32)
    meta.tree_mask = pack_bits(ancestor_masks(tree), words_for(tree.size))
    out = nb.attention(q, k_cache, v_cache, meta, 0.25, causal=True).reshape(n, heads, d)
    keys = k_cache[table[0]].reshape(-1, heads, d)[:ctx]
    vals = v_cache[table[0]].reshape(-1, heads, d)[:ctx]
    mask = ancestor_masks(tree)
    for i in range(n):
        seen = list(range(committed)) + [committed + j for j in range(n) if mask[i, j]]
        for h in range(heads):
            s = keys[seen, h] @ q[i].reshape(heads, d)[h] * 0.25
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, h], (p / p.sum()) @ vals[seen, h], rtol=1e-5, atol=1e-6)


def test_copy_slots_reads_every_source_before_writing():
    """A source that is also another copy's destination still gives its old value (a matched path whose first node
    sits where its third goes)."""
    cache = np.arange(2 * 4 * 2 * 3, dtype=np.float32).reshape(2, 4, 2, 3)  # [layers, blocks, block_size, width]
    want = cache.copy().reshape(2, 8, 3)
    src, dst = np.array([3, 6, 7]), np.array([1, 3, 2])
    want[:, dst] = want[:, src].copy()
    nb.copy_slots(cache, src, dst)
    np.testing.assert_array_equal(cache.reshape(2, 8, 3), want)


def test_walk_follows_the_choices_while_they_are_children():
    tree = _tree([-1, -1, 0, 0, 2], [5, 6, 7, 8, 9])
    choices = {0: 5, 1: 7, 3: 9, 5: 4}  # root -> node 0 (row 1) -> node 2 (row 3) -> node 4 (row 5) -> 4: not a child
    assert walk(tree, lambda row: choices[row]) == ([0, 1, 3, 5], [5, 7, 9, 4])
    assert walk(tree, lambda row: 42) == ([0], [42])


# ------------------------------------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("tree"), TinyShape(num_layers=2, target_layer_ids=[0, 1]),
                             seed=5)


def test_greedy_tree_decoding_equals_autoregressive_decoding(pair, tiny_pair, goldens):
    """Exactly, on random weights (trees that rarely match) and on the trained pair (trees that often do, with the
    matched path's K/V moved), at several budgets and in batches; and the trained pair accepts more per step."""
    target, draft = pair
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53)), [3, 4]]
    want = LLM(target, backend="cpu").generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for budget in (1, 7, 40):
        llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, draft_options={"tree_budget": budget})
        got = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks  # every block came back
    runs = {}
    for options in (None, {"tree_budget": 24}):
        llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", draft_options=options)
        outs = llm.generate([g["prompt_ids"] for g in goldens[:3]], SamplingParams(max_tokens=64, ignore_eos=True))
        assert [o.token_ids for o in outs] == [g["ar_ids"][:64] for g in goldens[:3]]
        runs[options is None] = statistics.mean(o.tau for o in outs)
    assert runs[False] > runs[True]  # the tree accepts more per step than the single path


def test_padding_rows_of_a_fixed_width_tree_change_nothing(pair, monkeypatch):
    """A CUDA graph verifies every tree at the budget's width (spec_decode.tree_chunk pads it): the padding rows take
    slots and compute, yet the tokens stay exactly the autoregressive ones and every block comes back."""
    import cudflash.engine.spec_decode as spec_decode

    real = spec_decode.tree_chunk
    widths = []

    def padded(seq, tree, words, width=None):  # the scheduler reserves 13 rows; the proposer builds 7-node trees
        widths.append(13 - 1 - tree.size)
        return real(seq, tree, words_for(12), 13)

    monkeypatch.setattr(spec_decode, "tree_chunk", padded)
    target, draft = pair
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53))]
    want = LLM(target, backend="cpu").generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, draft_options={"tree_budget": 12})
    llm.proposer.budget = 7
    got = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert widths and min(widths) >= 5  # every tree verified with padding rows
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_dflash2_tree_decoding_equals_autoregressive_decoding(tmp_path):
    target, draft = write_random_pair(tmp_path, TinyShape(num_layers=2, target_layer_ids=[0, 1],
                                                          heads=TinyHeads(kind="dflash2", selector_top_k=4)), seed=9)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45))]
    want = LLM(target, backend="cpu").generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, draft_options={"tree_budget": 12})
    got = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_tree_budget_is_refused_where_it_cannot_run(pair, tmp_path):
    dspark = write_random_pair(tmp_path, TinyShape(heads=TinyHeads(kind="dspark")), seed=1)
    with pytest.raises(ConfigError, match="DFlash and DFlash2 drafters"):
        LLM(dspark[0], draft=dspark[1], backend="cpu", draft_options={"tree_budget": 8})
    for bad in (0, -3, 1.5, True, 10 ** 6):
        with pytest.raises(ConfigError, match="tree budget"):
            LLM(pair[0], draft=pair[1], backend="cpu", draft_options={"tree_budget": bad})


# ------------------------------------------------------------------------------------------------ sampling

BLOCK, RUNS = 4, 3000


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("small"), small_shape(BLOCK), seed=3)


class WideTree(HostProposer):
    """At the first step, a tree whose root has every token as a child, each of those with one child of its own;
    after it, a single node. The walk then decides the first tokens against many children at once."""

    def propose(self, runner, seqs, block):
        trees = []
        for s in seqs:
            if len(s.output_ids) == 1:
                parents, tokens = [], []
                for a in range(VOCAB):
                    parents.append(-1)
                    tokens.append(a)
                    root = len(parents) - 1
                    parents.append(root)
                    tokens.append((a * 7 + 3) % VOCAB)
                trees.append(_tree(parents, tokens))
            else:
                trees.append(_tree([-1], [0]))
        return Proposal([t.tokens for t in trees], trees=trees)


def _first_tokens(llm, params: SamplingParams) -> np.ndarray:
    outs = llm.generate([PROMPT] * RUNS, [SamplingParams(max_tokens=3, seed=i, ignore_eos=True,
                                                         temperature=params.temperature) for i in range(RUNS)])
    return np.array([o.token_ids[:3] for o in outs])


def _pvalues(llm, tokens: np.ndarray, params: SamplingParams) -> list[float]:
    return first_token_pvalues(tokens, exact_first_tokens(llm, params))


def _tree_llm(small):
    llm = LLM(small[0], draft=small[1], backend="cpu", block_size=BLOCK, max_num_seqs=256, kv_block_size=8,
              draft_options={"tree_budget": 2 * VOCAB})
    llm.proposer = WideTree()
    return llm


def test_sampled_tree_walk_matches_the_target_distribution(small):
    llm = _tree_llm(small)
    params = SamplingParams(temperature=1.0)
    tokens = _first_tokens(llm, params)
    assert min(_pvalues(llm, tokens, params)) > 1e-3


def test_a_wrong_walk_fails_the_test(small, monkeypatch):
    """A walk that, when the target's sample is not a child, takes the child the target likes most instead, puts
    too much mass on drafted tokens: the test must catch it."""
    real = sampler.walk

    def wrong_walk(tree, choose):
        path, emitted = real(tree, choose)
        kids = [i for i in range(tree.size) if tree.parents[i] + 1 == path[-1]]
        if kids:
            emitted[-1] = int(tree.tokens[kids[0]])
        return path, emitted

    monkeypatch.setattr(sampler, "walk", wrong_walk)
    llm = _tree_llm(small)
    params = SamplingParams(temperature=1.0)
    tokens = _first_tokens(llm, params)
    assert min(_pvalues(llm, tokens, params)) < 1e-3
