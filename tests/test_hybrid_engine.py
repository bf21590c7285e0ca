"""Hybrid (Gated DeltaNet) targets served by the engine on the CPU: continuous batching, chunked prefill, speculative
verify with the state committed after acceptance, preemption, the state pool's accounting, and prefix caching with
state snapshots. The reference is the one-sequence loop of models/hybrid_reference.py."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.config import load_target_config
from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.proposal import Proposal
from cudflash.errors import ConfigError
from cudflash.engine.propose import HostProposer
from cudflash.models.hybrid_reference import OneSequence, greedy
from cudflash.tiny import TinyHeads, TinyShape
from cudflash.tiny_hybrid import HybridShape, write_hybrid_drafter, write_hybrid_target
from tests.conftest import expect_error, poison_one_logit

SHAPE = {"conditional": HybridShape(checkpoint_class="conditional", shards=2),
         "causal": HybridShape(checkpoint_class="causal")}
# Four prompts of different lengths, two of them longer than one GDN chunk (64 rows).
_rng = np.random.default_rng(1)
PROMPTS = [[int(x) for x in _rng.integers(2, 250, n)] for n in (75, 5, 30, 140)]
NEW = 14
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
# A drafter with taps into the hybrid stack (a GDN layer and the last, attention, layer) and a sliding-window layer.
DFLASH = TinyShape(target_layer_ids=[0, 3], block_size=6, draft_head_dim=16,
                   heads=TinyHeads(layer_types=["sliding_attention", "full_attention"], sliding_window=8))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_engine")
    out = {}
    for cls, shape in SHAPE.items():
        target = write_hybrid_target(root / cls, shape, seed=11)
        out[cls] = (target, write_hybrid_drafter(root / f"{cls}-drafter", shape, DFLASH, seed=2))
    return out


@pytest.fixture(scope="module")
def reference(pairs):
    """Greedy tokens of the one-sequence loop, per prompt (both classes hold one language model)."""
    llm = LLM(pairs["causal"][0], backend="cpu")
    return [greedy(llm.runner.target, p, NEW) for p in PROMPTS]


class HalfRight(HostProposer):
    """Drafts from the reference: the first `right` of each block correct, the rest wrong, so that every step
    accepts a part of its block and rejects the rest (partial acceptance, then rollback of the GDN state)."""

    def __init__(self, want: dict[tuple[int, ...], list[int]], right: int):
        self.want, self.right = want, right

    def propose(self, runner, seqs, block):
        drafts = []
        for s in seqs:
            truth = (self.want[tuple(s.prompt_ids)] + [0] * block)[len(s.output_ids):][: block - 1]
            wrong = [(t + 1) % 250 + 2 for t in truth[self.right:]]
            drafts.append(np.asarray(truth[: self.right] + wrong, dtype=np.int64))
        return Proposal(drafts)


@pytest.mark.parametrize("cls", ["conditional", "causal"])
def test_plain_decoding_in_a_batch_with_chunked_prefill_equals_the_reference(pairs, reference, cls):
    llm = LLM(pairs[cls][0], backend="cpu", max_num_seqs=4, max_num_batched_tokens=48)
    runs = []
    llm.runner.commit_tape = lambda *args: runs.append(args)  # plain decoding commits in its forward: never called
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert runs == []
    assert llm.scheduler.num_prefill_tokens == sum(map(len, PROMPTS))  # 140 tokens went through 3+ steps
    assert sorted(llm.runner.states.free_live) == list(range(4))  # every live slot came back


@pytest.mark.parametrize("cls", ["conditional", "causal"])
def test_speculative_with_a_drafter_tapping_the_hybrid_stack_equals_the_reference(pairs, reference, cls):
    target, drafter = pairs[cls]
    llm = LLM(target, draft=drafter, backend="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("right", [0, 2, 5])
def test_partial_acceptance_commits_exactly_the_accepted_prefix(pairs, reference, right):
    """Spec greedy == AR greedy when each step accepts `right` of 5 drafts: the verify leaves the states alone and
    the commit re-runs exactly the pending token and the accepted drafts (mixed with prefill chunks: 48 tokens
    a step make the long prompts prefill beside the others' verifies)."""
    target, drafter = pairs["conditional"]
    llm = LLM(target, draft=drafter, backend="cpu", max_num_seqs=4, max_num_batched_tokens=48)
    llm.proposer = HalfRight({tuple(p): w for p, w in zip(PROMPTS, reference)}, right)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    lens = [n for o in outs for n in o.acceptance_lengths[:-1]]  # the last step may be cut by max_tokens
    assert set(lens) == {right + 1}


def test_a_sequence_that_emits_nothing_commits_nothing_and_the_others_go_on(pairs, reference):
    """Non-finite logits in one sequence's verify rows (step 4) finish it with an error: its state slot takes none
    of the step's rows and comes back; the other sequences of the batch commit theirs and stay exact."""
    target, drafter = pairs["causal"]
    llm = LLM(target, draft=drafter, backend="cpu", max_num_seqs=4)
    llm.proposer = HalfRight({tuple(p): w for p, w in zip(PROMPTS, reference)}, right=2)
    restore = poison_one_logit(llm, step=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs].count("error") == 1
    for out, want in zip(outs, reference):
        assert out.token_ids == (want if out.finish_reason != "error" else want[:len(out.token_ids)])
    assert sorted(llm.runner.states.free_live) == list(range(4))
    restore()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize("heads", [TinyHeads(kind="dspark", dialect="nested"), TinyHeads(kind="dflash2")],
                         ids=["dspark", "dflash2"])
def test_dspark_and_dflash2_heads_on_a_hybrid_target(tmp_path, pairs, reference, heads):
    drafter = write_hybrid_drafter(tmp_path / heads.kind, SHAPE["causal"],
                                   TinyShape(target_layer_ids=[1, 2], block_size=5, heads=heads), seed=3)
    llm = LLM(pairs["causal"][0], draft=drafter, backend="cpu", max_num_seqs=4)
    draft = llm.runner.draft
    assert (draft.markov if heads.kind == "dspark" else draft.selector) is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize("speculative", [False, True])
def test_preemption_frees_the_state_and_recompute_rebuilds_it(pairs, reference, speculative):
    """A pool of 12 blocks of 16 cannot hold the four sequences at once: the youngest are preempted (blocks and
    state slot freed) and recompute prompt + output from a zeroed slot; the tokens do not change."""
    target, drafter = pairs["causal"]
    llm = LLM(target, draft=drafter if speculative else None, backend="cpu", max_num_seqs=4, num_kv_blocks=12,
              enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    for out, p, want in zip(outs, PROMPTS, reference):
        assert out.token_ids[:NEW] == want
        assert out.token_ids == greedy(llm.runner.target, p, 30)


def test_the_state_pool_is_charged_before_the_kv_blocks(pairs):
    target = pairs["causal"][0]
    cfg = load_target_config(target)
    h = cfg.hybrid

    per_slot = len(h.linear_layers) * 4 * (h.conv_dim * (h.linear_conv_kernel_dim - 1)
                                           + h.linear_num_value_heads * h.linear_key_head_dim * h.linear_value_head_dim)
    slots = 3 + 6 + 1  # live, 2 x max_num_seqs snapshots, zero
    kv_per_block = len(h.full_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 16 * 4  # attention layers only

    class Budget(NumpyBackend):  # the states and 7 blocks (without the states' charge: 15, as many as wanted)
        def memory_budget(self, utilization: float) -> int:
            return slots * per_slot + 7 * kv_per_block + 100

    runner = ModelRunner(cfg, None, Budget(), max_block_size=1, max_num_seqs=3, max_model_len=64)
    assert runner.states.size == slots and runner.cache.states.shape[1] == slots == runner.cache.conv.shape[1]
    assert runner.target.state_bytes_per_slot() == per_slot
    assert runner.cache.kv.k.shape[0] == len(h.full_layers) == 1
    assert runner.blocks.num_blocks == 7 < 3 * -(-(64 + 2) // 16)

    class Small(NumpyBackend):  # room for the states but not one sequence's blocks
        def memory_budget(self, utilization: float) -> int:
            return slots * per_slot + kv_per_block

    with pytest.raises(Exception) as e:
        ModelRunner(cfg, None, Small(), max_block_size=1, max_num_seqs=3, max_model_len=64)
    expect_error(e, "GDN states", "room for 1 blocks")


# ------------------------------------------------------------------------------------------------ prefix caching

def test_a_follow_up_turn_hits_the_cache_with_its_state(pairs):
    """Turn 2 = turn 1's prompt + its output + more: its full blocks come from the cache with the GDN state
    snapshotted at the last block boundary turn 1 committed, and it generates what it does without the cache.
    Turn 1 accepts 3 drafts a step, so the boundary falls inside a step's accepted rows (a split commit)."""
    target, drafter = pairs["conditional"]
    turn1 = PROMPTS[2] + PROMPTS[1]  # 35 tokens
    model = LLM(target, backend="cpu").runner.target
    first = greedy(model, turn1, 20)
    turn2 = turn1 + first + [7, 8, 9, 10, 11, 12]  # 61 tokens: blocks 0..2 full
    second = greedy(model, turn2, NEW)
    got = {}
    for caching in (True, False):
        llm = LLM(target, draft=drafter, backend="cpu", enable_prefix_caching=caching)
        llm.proposer = HalfRight({tuple(turn1): first, tuple(turn2): second}, right=3)
        out1 = llm.generate([turn1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        assert out1.token_ids == first and out1.acceptance_lengths[:3] == [4, 4, 4]  # 35 -> 47 -> 51: past 48
        if caching:
            _assert_snapshots_hold_the_boundary_states(llm, turn1 + first, model)
        llm.scheduler.num_prefix_hit_tokens = 0
        got[caching] = (llm.generate([turn2], GREEDY)[0].token_ids, llm.scheduler.num_prefix_hit_tokens)
    assert got[True][0] == got[False][0] == second
    # Turn 1 committed 35 + 20 tokens: the snapshot at 48 (block 2's end, passed while decoding) serves turn 2.
    assert got[True][1] == 48 and got[False][1] == 0


def test_a_commit_crossing_a_snapshot_boundary_runs_in_two_spans(pairs):
    """Where a step's accepted rows pass a hashed block's end, the commit runs the rows up to it, the snapshot is
    taken, then the rest: two spans of the verify's tape (rows done | rows to do), which the CUDA graphs replay with
    the same counts; elsewhere one span per step."""
    target, drafter = pairs["conditional"]
    turn1 = PROMPTS[2] + PROMPTS[1]  # 35 tokens
    first = greedy(LLM(target, backend="cpu").runner.target, turn1, 20)
    llm = LLM(target, draft=drafter, backend="cpu")
    llm.proposer = HalfRight({tuple(turn1): first}, right=3)
    runner, steps = llm.runner, []
    commit_states, commit_tape = runner.commit_states, runner.commit_tape

    def each_step(seqs, accepted, before, run=None):
        steps.append((list(before), []))
        commit_states(seqs, accepted, before, run)

    def each_run(tape, slots, span):
        steps[-1][1].append(np.array(span))
        commit_tape(tape, slots, span)

    runner.commit_states, runner.commit_tape = each_step, each_run
    assert llm.generate([turn1], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids == first
    split = [(before[0], runs) for before, runs in steps if len(runs) == 2]
    assert len(split) == 1  # 35 + 1 + 4 + 4 + 4 passes 48 inside the third decode step
    before, (one, two) = split[0]
    assert one[0, 0] == 0 and two[0, 0] == one[1, 0] and before + one[1, 0] == 48 and one[1, 0] + two[1, 0] == 4
    assert all(len(runs) == 1 and runs[0][0, 0] == 0 for _, runs in steps if len(runs) != 2 and runs)


def _assert_snapshots_hold_the_boundary_states(llm, tokens, model):
    """The snapshots after blocks 1 (the prompt's last full block: its prefill chunk ended there) and 2 (passed
    inside a step) hold the states the one-sequence loop has after the same tokens: prefill chunks 0..31 and
    32..34, then token by token."""
    runner, hashes = llm.runner, [h for _, h in llm.runner.blocks.cached_prefix(_seq(tokens + [0]))]
    ref = OneSequence(model, 64)
    for ids, mode in [(tokens[:32], "prefill"), (tokens[32:35], "prefill")] + [([t], "decode") for t in tokens[35:48]]:
        ref.run(ids, mode)
        ref.length += len(ids)
        if ref.length in (32, 48):
            slot = runner.states.snapshots[hashes[ref.length // 16 - 1]]
            for pool, want in ((runner.cache.states, ref.cache.states), (runner.cache.conv, ref.cache.conv)):
                # 32: the same chunked prefill, bit for bit. 48: the engine's rows of tokens 35..47 came from 6-row
                # verify GEMMs, the loop's from 1-row ones (float32 sums in another order: ~1e-6 apart); a state
                # taken at the wrong row (e.g. after the whole step, at 51) is O(1) away.
                atol = 0.0 if ref.length == 32 else 1e-5
                np.testing.assert_allclose(pool[:, slot], want[:, 0], rtol=0, atol=atol)


def test_a_repeated_prompt_hits_up_to_its_last_full_block(pairs, reference):
    """The prefill chunk stops at the prompt's last full block so that the state there is snapshotted."""
    llm = LLM(pairs["causal"][0], backend="cpu")
    llm.generate([PROMPTS[0]], GREEDY)  # 75 tokens: 4 full blocks
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert llm.scheduler.num_prefix_hit_tokens == 64
    assert out.token_ids == reference[0]


def test_kv_without_a_snapshot_is_not_reused(pairs, reference):
    """With the snapshots gone (an LRU evicted them) the hashed KV blocks are still there, but a hit would need
    the state too: the prompt is recomputed from the start, and the tokens do not change."""
    llm = LLM(pairs["causal"][0], backend="cpu")
    llm.generate([PROMPTS[0]], GREEDY)
    assert len(llm.runner.blocks.cached_prefix(_seq(PROMPTS[0]))) == 4  # the KV is cached
    for h in list(llm.runner.states.snapshots):
        llm.runner.states.drop(h)
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert llm.scheduler.num_prefix_hit_tokens == 0
    assert out.token_ids == reference[0]


def test_snapshots_are_least_recently_used_and_go_with_their_block(pairs):
    llm = LLM(pairs["causal"][0], backend="cpu", max_num_seqs=1, max_num_batched_tokens=64)  # 2 snapshot slots
    states, blocks = llm.runner.states, llm.runner.blocks
    llm.generate([PROMPTS[3]], SamplingParams(max_tokens=3, ignore_eos=True))  # chunks end at 64 and 128
    long_prompt = list(states.snapshots)
    assert len(long_prompt) == 2 and not states.free_snapshots
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))  # a snapshot at its 64: one goes
    assert list(states.snapshots)[0] == long_prompt[1] and long_prompt[0] not in states.snapshots
    for h in list(states.snapshots):  # keyed by the chain hash of a cached block, which takes it along when reused
        blocks.forget(blocks.blocks[blocks.hash_to_block[h]])
    assert not states.snapshots and len(states.free_snapshots) == 2


def _seq(prompt):
    from cudflash.engine.sequence import Sequence

    return Sequence(99, list(prompt), GREEDY)


@pytest.mark.parametrize("snapshots", [0, 5])
def test_num_state_snapshots_sizes_the_pool_and_zero_turns_state_reuse_off(pairs, snapshots):
    """The snapshot count is charged to memory as asked; with none, a follow-up turn finds no state to resume from
    (no KV reused without it) and still generates what it generates without the cache."""
    target, _ = pairs["conditional"]
    turn1 = PROMPTS[2] + PROMPTS[1]
    llm = LLM(target, backend="cpu", max_num_seqs=3, num_state_snapshots=snapshots)
    runner = llm.runner
    assert runner.states.size == 3 + snapshots + 1
    assert runner.cache.states.shape[1] == runner.states.size
    assert runner.state_bytes == runner.states.size * runner.target.state_bytes_per_slot()
    first = llm.generate([turn1], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    turn2 = turn1 + first + [7, 8, 9]
    llm.scheduler.num_prefix_hit_tokens = 0
    out = llm.generate([turn2], GREEDY)[0].token_ids
    assert out == greedy(runner.target, turn2, NEW)
    assert (llm.scheduler.num_prefix_hit_tokens > 0) == (snapshots > 0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_num_state_snapshots_must_be_a_count(pairs, bad):
    with pytest.raises(ConfigError) as e:
        LLM(pairs["causal"][0], backend="cpu", num_state_snapshots=bad)
    expect_error(e, "num_state_snapshots", repr(bad))
