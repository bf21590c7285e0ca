"""CUDA graphs of a Qwen3.5 hybrid target's step (engine/cuda_graph.py) against the same engine op by op, and the
span the GDN kernels take (the commit of a verify's accepted rows, read in place) against numpy and against the
same rows run alone.

- Replay == eager, token for token and step for step (acceptance lengths): both run the same kernels on the same
  rows; the graphs' padded batch and context bucket change no real row (row-invariant GEMMs, attention's fixed shape
  up to 512 keys, GDN kernels independent per sequence), so any difference is a bug (a state slot staged wrong, a
  commit of the wrong rows, a run-ahead step reading an uncommitted state), not rounding.
- The span: numpy's definition within float32 tolerance (tests/gpu/test_gdn_kernels.py derives it), and bit for bit
  the state a run of exactly those rows gathered alone leaves (the same arithmetic in the same order).
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash import LLM, SamplingParams  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402
from cudflash.tiny import TinyHeads, TinyShape  # noqa: E402
from cudflash.tiny_hybrid import HybridShape, write_hybrid_drafter, write_hybrid_target  # noqa: E402
from tests.gpu.test_gdn_kernels import QWEN35_9B, TINY, close_fp32, gdn_inputs, metas, rb, strided  # noqa: E402

nb = NumpyBackend()

# A verify batch of 6 rows per sequence (the shape a graph replays): accepted spans of several lengths, a span that
# starts part-way (the second run of a commit split at a snapshot boundary), a count of 0 (a sequence that emitted
# nothing) and a padding sequence (slot -1).
Q = 6
SLOTS = [3, 0, -1, 5, 1, 6]
SPAN = np.array([[0, 2, 0, 0, 0, 4], [6, 3, 0, 0, 1, 2]], np.int32)  # rows done | rows to run
POOL = 8


def _rows_alone() -> np.ndarray:
    """The tape's rows the span names, in order (the compact form the commit used before spans)."""
    return np.concatenate([np.arange(s * Q + SPAN[0, s], s * Q + SPAN[0, s] + SPAN[1, s])
                           for s in range(len(SLOTS)) if SLOTS[s] >= 0]).astype(np.int64)


def _alone(counts: list[int], slots: list[int]):
    return [c for c, s in zip(counts, slots) if s >= 0], [s for s in slots if s >= 0]


@pytest.mark.parametrize("dims", [TINY, QWEN35_9B], ids=["tiny", "qwen3.5-9b"])
def test_conv_span_commits_exactly_the_spanned_rows(cb, rng, dims):
    hk, hv, dk, dv, taps = dims
    c, t = 2 * hk * dk + hv * dv, Q * len(SLOTS)
    x, x_dev = strided(rng, t, c)
    w = rb(rng.standard_normal((c, taps)) * 0.5)
    w_dev = cb.asarray(w, "act")
    pool = rng.standard_normal((POOL, c, taps - 1)).astype(np.float32)
    host_meta, dev_meta = metas(cb, [Q] * len(SLOTS))
    slots_dev = cb.asarray(SLOTS, "i32")
    want_pool, got_pool = pool.copy(), cp.asarray(pool)
    want = nb.causal_conv1d(x, w, want_pool, np.asarray(SLOTS, np.int32), host_meta, True, SPAN)
    got = cb.causal_conv1d(x_dev, w_dev, got_pool, slots_dev, dev_meta, True, cp.asarray(SPAN))
    close_fp32(cp.asnumpy(got), want)
    outside = np.ones(t, bool)
    outside[_rows_alone()] = False
    assert not cp.asnumpy(got)[outside].any()  # rows outside a span (and the padding sequence's) are 0
    close_fp32(cp.asnumpy(got_pool), want_pool)
    untouched = [s for s in range(POOL) if s not in SLOTS or SPAN[1, SLOTS.index(s)] == 0]
    assert np.array_equal(cp.asnumpy(got_pool)[untouched], pool[untouched])
    # The same rows gathered and run alone (each sequence from its state, as the commit did before spans): the
    # same bits, in the output rows and in the state.
    counts, live = _alone(list(SPAN[1]), SLOTS)
    alone_pool = cp.asarray(pool)
    alone = cb.causal_conv1d(x_dev[cp.asarray(_rows_alone())], w_dev, alone_pool, cb.asarray(live, "i32"),
                             metas(cb, counts)[1], True)
    assert cp.array_equal(alone, got[cp.asarray(_rows_alone())]) and cp.array_equal(alone_pool, got_pool)


@pytest.mark.parametrize("dims", [TINY, QWEN35_9B], ids=["tiny", "qwen3.5-9b"])
def test_delta_rule_span_commits_exactly_the_spanned_rows(cb, rng, dims):
    hv, dv = dims[1], dims[3]
    t = Q * len(SLOTS)
    host, dev, states = gdn_inputs(rng, dims, t)
    host_meta, dev_meta = metas(cb, [Q] * len(SLOTS))
    want_states, got_states = states.copy(), cp.asarray(states)
    want = nb.gdn_recurrent(*host, want_states, np.asarray(SLOTS, np.int32), host_meta, True, SPAN)
    got = cb.gdn_recurrent(*dev, got_states, cb.asarray(SLOTS, "i32"), dev_meta, True, cp.asarray(SPAN))
    assert got.shape == (t, hv * dv)
    close_fp32(cp.asnumpy(got), want)
    outside = np.ones(t, bool)
    outside[_rows_alone()] = False
    assert not cp.asnumpy(got)[outside].any()
    used = [s for s, n in zip(SLOTS, SPAN[1]) if s >= 0 and n]
    close_fp32(cp.asnumpy(got_states)[used], want_states[used])
    others = [s for s in range(POOL) if s not in used]
    assert np.array_equal(cp.asnumpy(got_states)[others], states[others])
    rows = cp.asarray(_rows_alone())
    counts, live = _alone(list(SPAN[1]), SLOTS)
    alone_states = cp.asarray(states)
    alone = cb.gdn_recurrent(*(x[rows] if x.ndim == 2 else x for x in dev), alone_states, cb.asarray(live, "i32"),
                             metas(cb, counts)[1], True)
    assert cp.array_equal(alone, got[rows]) and cp.array_equal(alone_states, got_states)


def test_a_span_is_checked(cb, rng):
    from cudflash.errors import BackendError

    host, dev, states = gdn_inputs(rng, TINY, 12)
    with pytest.raises(BackendError, match="span"):
        cb.gdn_recurrent(*dev, cp.asarray(states), cb.asarray([0, 1], "i32"), metas(cb, [6, 6])[1], True,
                         cp.zeros((2, 3), cp.int32))


# ------------------------------------------------------------------------------------------------ the engine

# head_dim 64: the CUDA attention's smallest (cuda_attention.HEAD_DIMS), for the target and the drafter
SHAPE = HybridShape(checkpoint_class="causal", head_dim=64, mrope_section=[4, 2, 2])
DRAFT = TinyShape(target_layer_ids=[0, 3], block_size=6, draft_head_dim=64,
                  heads=TinyHeads(layer_types=["sliding_attention", "full_attention"], sliding_window=8))
_rng = np.random.default_rng(8)
PROMPTS = [[int(x) for x in _rng.integers(2, 250, n)] for n in (40, 5, 71, 18, 33)]  # 5 sequences: bucket 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_graphs")
    target = write_hybrid_target(root / "t", SHAPE, seed=11)
    return target, write_hybrid_drafter(root / "d", SHAPE, DRAFT, seed=2)


def _both(target, draft, **kw) -> tuple[LLM, LLM]:
    """(op-by-op LLM, graphed LLM) of one configuration, each with its own caches."""
    return tuple(LLM(target, draft=draft, backend="cuda", enforce_eager=eager, **kw) for eager in (True, False))


def _same(eager: LLM, graphed: LLM, prompts, params) -> list:
    replays = graphed.engine.graphs.num_replays
    want = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        at = next((j for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        assert g.token_ids == w.token_ids, f"sequence {i} of {len(prompts)}: first differs at token {at}"
        assert g.acceptance_lengths == w.acceptance_lengths, f"sequence {i}"
    steps = max(len(o.acceptance_lengths) for o in got)
    assert graphed.engine.graphs.num_replays - replays >= steps - 2  # all but the steps that share a prefill
    return got


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("batch", [1, 5])
def test_speculative_hybrid_replay_equals_eager(pair, batch, caching):
    """DFlash drafter on the hybrid target, batch 1 and 5 sequences of different lengths (padded to 8 in the graphs):
    the same tokens and acceptance lengths as op by op. With the prefix cache every boundary a step passes splits its
    commit in two replays around a snapshot; without it one replay per step."""
    eager, graphed = _both(*pair, enable_prefix_caching=caching, max_num_seqs=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    _same(eager, graphed, PROMPTS[:batch], params)
    assert graphed.engine.graphs.num_captures > 0 and not graphed.engine.graphs.pipeline


def test_seeded_sampling_on_the_hybrid_replays_the_eager_tokens(pair):
    eager, graphed = _both(*pair, max_num_seqs=8)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=i) for i in range(4)]
    _same(eager, graphed, PROMPTS[:4], params)


@pytest.mark.parametrize("batch", [1, 3])
def test_plain_decoding_of_a_hybrid_replays_the_eager_tokens_without_running_ahead(pair, batch):
    """Target alone: one verify row per sequence, committed by the commit graph after acceptance; no step is queued
    ahead (it would read a state not committed yet)."""
    eager, graphed = _both(pair[0], None, max_num_seqs=8)
    _same(eager, graphed, PROMPTS[:batch], SamplingParams(max_tokens=48, ignore_eos=True))
    assert graphed.engine.graphs.num_run_ahead == 0 and graphed.scheduler.lookahead == eager.scheduler.lookahead


def test_a_follow_up_turn_hits_a_snapshot_and_replays_the_eager_tokens(pair):
    """Turn 2 = turn 1's prompt + its output + more: its full blocks come from the prefix cache with the state
    snapshotted at the last boundary turn 1 passed (inside a graphed step's commit), in both engines alike."""
    eager, graphed = _both(*pair, max_num_seqs=8)
    turn1 = PROMPTS[2]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first = _same(eager, graphed, [turn1], params)[0].token_ids
    turn2 = turn1 + first + [7, 8, 9, 10, 11]
    for llm in (eager, graphed):
        llm.scheduler.num_prefix_hit_tokens = 0
    _same(eager, graphed, [turn2], SamplingParams(max_tokens=24, ignore_eos=True))
    hits = [llm.scheduler.num_prefix_hit_tokens for llm in (eager, graphed)]
    committed = len(turn1) + len(first) - 1  # turn 1's last token was still pending
    assert hits == [16 * (committed // 16)] * 2, hits  # 96 of 106: a boundary passed while decoding


def test_the_trained_hybrid_pair_replays_the_eager_tokens():
    """The trained tiny hybrid pair (tests/data/tiny-hybrid-pair: dk = dv = 48, tau ~4), 8 prompts in one batch:
    steps that accept part of their block, the most common case, give the eager tokens and acceptance lengths."""
    from tests.conftest import HYBRID_PAIR, load_goldens

    prompts = [g["prompt_ids"] for g in load_goldens(HYBRID_PAIR)[:8]]
    eager, graphed = _both(HYBRID_PAIR / "target", HYBRID_PAIR / "drafter", max_num_seqs=8)
    got = _same(eager, graphed, prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    lengths = [n for o in got for n in o.acceptance_lengths[:-1]]
    assert 1 < np.mean(lengths) < max(lengths)  # partial acceptance: spans of several lengths were committed
