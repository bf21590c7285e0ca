"""Tensor parallelism's sharding arithmetic on the CPU: N simulated ranks (parallel/simulated.py) against the
unsharded model, logits within float32 reassociation rounding and greedy tokens exactly."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cudflash.checkpoint import Checkpoint
from cudflash.engine.llm_engine import LLM
from cudflash.engine.sequence import Sequence
from cudflash.errors import ConfigError
from cudflash.models.weights import WeightLoader
from cudflash.parallel.comm import SimulatedGroup
from cudflash.parallel.config import TensorParallel
from cudflash.parallel.simulated import SimulatedTarget
from cudflash.parallel.vocab import greedy_tokens
from cudflash.sampling_params import SamplingParams
from cudflash.tiny import TinyShape, write_random_pair

from conftest import expect_error

# Row-parallel o_proj / down_proj add N float32 partial sums over K/N columns each instead of one sum over K: the
# same terms reassociated. Rounding errors of a K-term float32 sum grow like sqrt(K) * eps32 relative (eps32 = 6e-8,
# K <= 1024 here: ~2e-6), carried through the layers' RMSNorms (scale-free) to the logits; the largest seen over
# every case below is 7e-7 of the row's largest |logit|. 1e-5 leaves room for other BLAS builds, and still fails
# a partial sum scaled by 1 - 1e-4 (let alone a missing partial sum or a wrong head / vocab slice, which move
# logits by O(1)).
LOGIT_RTOL = 1e-5
DECODE_STEPS = 6


def _check(target: Path, prompts: list[list[int]], size: int, expected: list[list[int]] | None = None) -> None:
    llm = LLM(target, backend="cpu", num_kv_blocks=64)
    runner, b = llm.runner, llm.runner.backend
    sim = SimulatedTarget(llm.target_cfg, lambda r: WeightLoader(Checkpoint(str(target)), b), b, size,
                          runner.target_kv.k.shape[1], runner.blocks.block_size,
                          (runner.target.rope_cos, runner.target.rope_sin))
    for p, prompt in enumerate(prompts):
        seq = Sequence(-1, list(prompt), SamplingParams())
        runner.blocks.reserve(seq, len(prompt) + DECODE_STEPS)
        try:
            ids, start, tokens = list(prompt), 0, []
            for _ in range(DECODE_STEPS):
                batch = runner.batch([seq], [ids], [start])
                rows = np.array([len(ids) - 1])
                hidden, _ = runner.target.forward(batch, runner.target_kv)
                want = b.to_numpy(runner.logits(hidden, rows))
                got, greedy = sim.forward_logits(batch, rows)
                assert got.shape == want.shape
                scale = np.abs(want).max(axis=1, keepdims=True)
                assert np.all(np.abs(got - want) <= LOGIT_RTOL * scale), (p, len(tokens), np.abs(got - want).max())
                token = int(b.to_numpy(b.argmax(want))[0])
                assert int(greedy[0]) == token, (p, len(tokens))  # exact: the unsharded argmax
                tokens.append(token)
                start, ids = start + len(ids), [token]
            if expected is not None:
                assert tokens == expected[p][:DECODE_STEPS], p
        finally:
            runner.blocks.free(seq)
    # Each rank's KV cache holds its heads only: the bytes per block are the unsharded ones over the rank count,
    # times the KV heads' replication.
    cfg = llm.target_cfg
    replicas = max(1, size // cfg.num_kv_heads)
    assert all(kv.k.nbytes * size == runner.target_kv.k.nbytes * replicas for kv in sim.kv)


@pytest.mark.parametrize("size", [1, 2])
def test_tiny_pair_sharded_equals_unsharded(tiny_pair, goldens, size):
    """6 query heads, 2 KV heads: tp 1 and 2 (4 does not divide 6). Greedy tokens are the goldens' ar_ids."""
    picked = goldens[:3]
    _check(tiny_pair / "target", [g["prompt_ids"] for g in picked], size, [g["ar_ids"] for g in picked])


@pytest.fixture(scope="module")
def random_targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    shapes = {
        # 4 KV heads over 4 ranks, biases (Qwen2), and untied LM head
        "even": TinyShape(arch="qwen2", num_heads=8, num_kv_heads=4, vocab_size=256, num_layers=2,
                          target_layer_ids=[0, 1]),
        # 2 KV heads < 4 ranks: replicated; vocab 250 = 63 + 63 + 63 + 61 over 4 ranks; tied embeddings
        "replicated_kv_uneven_vocab": TinyShape(num_heads=4, num_kv_heads=2, vocab_size=250, num_layers=2,
                                                target_layer_ids=[0, 1], tie_word_embeddings=True),
        # one KV head shared by every rank
        "mqa": TinyShape(arch="llama", num_heads=8, num_kv_heads=1, vocab_size=255, num_layers=2,
                         target_layer_ids=[0, 1]),
    }
    return {k: write_random_pair(root / k, s, seed=i)[0] for i, (k, s) in enumerate(shapes.items())}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["even", "replicated_kv_uneven_vocab", "mqa"])
def test_random_targets_sharded_equal_unsharded(random_targets, name, size):
    rng = np.random.default_rng(size)
    prompts = [rng.integers(2, 250, n).tolist() for n in (5, 19)]
    _check(random_targets[name], prompts, size)


def test_kv_head_rule():
    """Fewer KV heads than ranks: each KV head on size / Hk consecutive ranks, those whose query heads read it."""
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2),
                                                                     range(1, 2)]
    assert [TensorParallel(r, 2).kv_heads(4) for r in range(2)] == [range(0, 2), range(2, 4)]
    # rank r's query heads (8 heads, 2 KV heads: heads 0-3 read KV head 0) belong to its KV head
    for r in range(4):
        tp = TensorParallel(r, 4)
        assert {h // 4 for h in tp.q_heads(8)} == set(tp.kv_heads(2))
    assert [TensorParallel(r, 4).vocab(250) for r in range(4)] == [range(0, 63), range(63, 126), range(126, 189),
                                                                    range(189, 250)]


def test_bad_sizes_are_refused():
    expect_error(pytest.raises(ConfigError, TensorParallel, 0, 3), "tensor_parallel_size=3", "1, 2, 4, 8")
    expect_error(pytest.raises(ConfigError, TensorParallel(0, 4).check_heads, 6, 2), "6 query heads")
    expect_error(pytest.raises(ConfigError, TensorParallel(0, 8).check_heads, 8, 3), "3 KV heads")


def test_vocab_parallel_argmax_ties_and_nonfinite():
    """Ties across shards go to the lowest vocab id (the unsharded argmax's rule); a NaN in any shard marks the
    row non-finite; an all-equal row gives id 0."""
    from cudflash.backends.numpy_backend import NumpyBackend
    b, size, V = NumpyBackend(), 4, 10
    full = np.array([[0, 1, 5, 0, 0, 5, 0, 0, 5, 0],  # max 5 at ids 2, 5, 8: shards 0, 1, 2 -> 2
                     [0, 0, 0, 0, 0, 0, 0, 0, 0, 7],  # in the last shard
                     [3] * 10,
                     [0, 0, 0, 0, 0, 0, 0, np.nan, 9, 0]], dtype=np.float32)
    group = SimulatedGroup(size)
    out: list = [None] * size
    import threading

    def rank(r: int) -> None:
        v = TensorParallel(r, size).vocab(V)
        out[r] = greedy_tokens(b, group.communicator(r), full[:, v.start:v.stop], v.start)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    want = b.argmax(full)
    assert want.tolist() == [2, 9, 0, -1]
    assert all(o.tolist() == want.tolist() for o in out)


@pytest.fixture(scope="module")
def tp_pair_outputs(tiny_pair, goldens):
    """The engine at tensor_parallel_size=2 on the tiny pair: autoregressive and speculative, 3 prompts."""
    picked = goldens[:3]
    params = SamplingParams(max_tokens=ENGINE_TOKENS, ignore_eos=True)
    prompts = [g["prompt_ids"] for g in picked]
    ar = LLM(tiny_pair / "target", backend="cpu", tensor_parallel_size=2).generate(prompts, params)
    spec_llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", tensor_parallel_size=2)
    return picked, ar, spec_llm, spec_llm.generate(prompts, params)


ENGINE_TOKENS = 24


def test_engine_tp2_greedy_equals_goldens(tp_pair_outputs):
    """Greedy tokens at tp=2 equal the unsharded model's exactly (the goldens), and the speculative run accepts
    exactly the unsharded acceptance lengths' prefix (same target argmaxes, same drafter inputs)."""
    picked, ar, _, spec = tp_pair_outputs
    for g, a, s in zip(picked, ar, spec):
        assert a.token_ids == g["ar_ids"][:ENGINE_TOKENS]
        assert s.token_ids == g["spec_ids"][:ENGINE_TOKENS]
        n = len(s.acceptance_lengths)
        assert s.acceptance_lengths[:n - 1] == g["acceptance_lengths"][:n - 1]


def test_engine_tp_cache_holds_each_ranks_heads(tp_pair_outputs, tiny_pair):
    _, _, llm, _ = tp_pair_outputs
    kv = llm.runner.target_kv.k
    assert kv.shape[3] == 2  # 2 KV heads over 2 ranks: one per rank, side by side
    assert llm.runner.target.rank_kv(llm.runner.target_kv, 1).k.shape[3] == 1


@pytest.mark.parametrize("size, needle", [(3, "1, 2, 4, 8"), (4, "6 query heads")])
def test_engine_refuses_bad_tensor_parallel_size(tiny_pair, size, needle):
    with pytest.raises(ConfigError) as e:
        LLM(tiny_pair / "target", backend="cpu", tensor_parallel_size=size)
    expect_error(e, f"tensor_parallel_size={size}", needle)


@pytest.mark.parametrize("options", [None, {"tree_budget": 7}], ids=["path", "tree"])
def test_engine_tp4_replicated_kv_equals_tp1(random_targets, options):
    """KV heads (2) < ranks (4) and V % 4 != 0 through the whole engine, with the drafter: greedy speculative
    tokens (a path, and a draft tree, whose compaction moves every rank's heads) and seeded sampling (gathered
    logits into the tp=1 sampler) equal tp=1's exactly."""
    target = random_targets["replicated_kv_uneven_vocab"]
    draft = target.parent / "drafter"
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)]
    llms = [LLM(target, draft=draft, backend="cpu", draft_options=options, tensor_parallel_size=n) for n in (1, 4)]
    outs = [llm.generate(prompts * 2, [params[0]] * 2 + [params[1]] * 2) for llm in llms]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert [o.acceptance_lengths for o in outs[1]] == [o.acceptance_lengths for o in outs[0]]
    # The pool after the run: ranks 0, 1 hold KV head 0 and ranks 2, 3 KV head 1, in the blocks tp=1 used.
    for field in ("k", "v"):
        one, four = (getattr(llm.runner.target_kv, field) for llm in llms)
        assert four.shape[3] == 4 and one.shape[3] == 2
        # replicas agree (bitwise on this BLAS; within rounding in general: each rank's qkv GEMM has other q rows)
        assert np.all(np.abs(four[:, :, :, [0, 0, 2, 2]] - four) <= LOGIT_RTOL * np.abs(one).max())
        assert np.all(np.abs(four[:, :, :, [0, 2]] - one) <= LOGIT_RTOL * np.abs(one).max())
