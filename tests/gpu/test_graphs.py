"""CUDA graph replay of the decode / speculative step: same tokens as eager execution, graphs reused."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyHeads, TinyShape, write_random_pair

PARAMS = SamplingParams(max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def eager(tiny_pair):
    return LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda", enforce_eager=True)


@pytest.fixture(scope="module")
def graphed(tiny_pair):
    return LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda")


KINDS = {"plain": None, "dflash": None, "dflash2": TinyHeads(kind="dflash2"), "dspark": TinyHeads(kind="dspark"),
         "dspark-cut": TinyHeads(kind="dspark")}


@pytest.fixture(scope="module", params=list(KINDS))
def both(request, tiny_pair, goldens, tmp_path_factory):
    """(eager LLM, graphed LLM, 32 prompts) of one drafter family: the trained pair for DFlash and plain decoding,
    tiny random checkpoints with the real layouts for DFlash2 and DSpark (one with a confidence cut: drafts of
    different lengths verified in one graphed step)."""
    kind = request.param
    if kind in ("plain", "dflash"):
        target, draft = tiny_pair / "target", (tiny_pair / "drafter" if kind == "dflash" else None)
        prompts = [g["prompt_ids"] for g in goldens]
    else:
        shape = TinyShape(heads=KINDS[kind], hidden_size=128, head_dim=64)
        target, draft = write_random_pair(tmp_path_factory.mktemp(kind), shape, seed=3)
        rng = np.random.default_rng(5)
        prompts = [rng.integers(2, shape.vocab_size, int(rng.integers(5, 60))).tolist() for _ in range(32)]
    options = {"confidence_threshold": 0.5} if kind == "dspark-cut" else None
    make = lambda eager: LLM(target, draft=draft, backend="cuda", enforce_eager=eager,  # noqa: E731
                             draft_options=options, max_num_seqs=32)
    return make(True), make(False), prompts


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_replay_equals_eager_for_every_drafter(both, batch, sampled):
    """Graph replay gives the eager step's tokens and acceptance lengths, step for step: every drafter family and
    plain decoding, batch 1, 8 and 32, greedy and seeded sampling."""
    eager, graphed, prompts = both
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=i)
              for i in range(batch)]
    replays = graphed.engine.graphs.num_replays
    want = eager.generate(prompts[:batch], params)
    got = graphed.generate(prompts[:batch], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.acceptance_lengths for o in got] == [o.acceptance_lengths for o in want]
    steps = max(len(o.acceptance_lengths) for o in got)  # decode steps of the batch
    assert graphed.engine.graphs.num_replays - replays >= steps - 1  # all but a step sharing a prefill replayed


@pytest.mark.parametrize("batch", [1, 8])
def test_graph_replay_gives_the_eager_tokens(eager, graphed, goldens, batch):
    prompts = [g["prompt_ids"] for g in goldens[:8]]
    runs = [[llm.generate(prompts[i:i + batch], PARAMS) for i in range(0, len(prompts), batch)] for llm in
            (eager, graphed)]
    eager_out = [o for chunk in runs[0] for o in chunk]
    graph_out = [o for chunk in runs[1] for o in chunk]
    for e, g in zip(eager_out, graph_out):
        assert g.token_ids == e.token_ids
        assert g.acceptance_lengths == e.acceptance_lengths
    assert graphed.engine.graphs.num_captures > 0


def test_autoregressive_graph_replay_gives_the_eager_tokens(tiny_pair, goldens):
    prompts = [g["prompt_ids"] for g in goldens[:4]]
    eager = LLM(tiny_pair / "target", backend="cuda", enforce_eager=True).generate(prompts, PARAMS)
    graphed = LLM(tiny_pair / "target", backend="cuda").generate(prompts, PARAMS)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_graphs_are_reused_across_steps_and_sequences(graphed, goldens):
    graphed.generate([goldens[10]["prompt_ids"]], PARAMS)
    captured = graphed.engine.graphs.num_captures
    steps = sum(len(o.acceptance_lengths) for o in graphed.generate([g["prompt_ids"] for g in goldens[11:14]],
                                                                     [PARAMS] * 3))
    # Three other sequences, one after another at batch 3 (bucket 4), then fewer: a handful of new shapes
    # at most, against dozens of steps replayed.
    new = graphed.engine.graphs.num_captures - captured
    assert steps > 50 and new <= 3, (steps, new)
    graphed.generate([goldens[15]["prompt_ids"]], PARAMS)
    assert graphed.engine.graphs.num_captures == captured + new  # batch 1 at these lengths: nothing new


def test_captured_steps_stay_within_their_memory_bound(tiny_pair, goldens, eager):
    """With room for one captured step only, each new shape evicts the last one (its pool is freed) and a shape
    seen again is captured again, still giving the eager tokens."""
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda")
    graphs = llm.engine.graphs
    prompts = [g["prompt_ids"] for g in goldens[:4]]
    graphs.max_bytes = 1
    outs = [llm.generate(prompts[:1], PARAMS), llm.generate(prompts, PARAMS), llm.generate(prompts[:1], PARAMS)]
    assert len(graphs.steps) == 1
    assert graphs.nbytes == next(iter(graphs.steps.values())).nbytes > 0
    # batch 1 -> bucket 4 -> batch 1 again: the first shape was evicted, so it was captured twice
    shapes = {key[:2] for key in graphs.steps}
    assert graphs.num_captures >= 3 and shapes == {(1, 16)}, (graphs.num_captures, shapes)
    for got, batch in zip(outs, (prompts[:1], prompts, prompts[:1])):
        want = eager.generate(batch, PARAMS)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_captured_kernels_use_programmatic_dependent_launch(tiny_pair, goldens, monkeypatch):
    """On Hopper, cudflash kernels inside a captured step are launched with PDL (they may start while their
    predecessor drains), and the tokens equal those of graphs whose kernels are launched plainly."""
    from cudflash.backends import pdl

    if not pdl.available():
        pytest.skip("this device or driver cannot do programmatic dependent launch")
    launched = []
    real_launch = pdl.launch
    monkeypatch.setattr(pdl, "launch", lambda kernel, *rest: (launched.append(kernel), real_launch(kernel, *rest)))
    prompts = [g["prompt_ids"] for g in goldens[:4]]

    def run(tuning: dict | None = None) -> list[list[int]]:
        llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda", tuning=tuning)
        return [o.token_ids for o in llm.generate(prompts, PARAMS)]

    with_pdl = run()
    assert len(launched) > 100  # every layer's norms, RoPE/KV store, attention, SiLU of every captured step
    launched.clear()
    assert run({"pdl": False}) == with_pdl
    assert not launched


def _plain_decoding_run(tiny_pair, prompts: list[list[int]], params: list[SamplingParams], late: int,
                        pipeline: bool) -> tuple[dict[int, list[int]], int]:
    """A fresh target-only LLM (so that no prefix cache differs between runs) serves `prompts`, the one at index
    `late` added only after a few steps (its prefill then shares an eager step with the others' decodes); every
    request's tokens by index, and how many steps were found already queued."""
    llm = LLM(tiny_pair / "target", backend="cuda")
    llm.engine.graphs.pipeline = pipeline
    ids = {i: llm.add_request(p, q) for i, (p, q) in enumerate(zip(prompts, params)) if i != late}
    for _ in range(5):
        llm.step()
    ids[late] = llm.add_request(prompts[late], params[late])
    while llm.has_unfinished():
        llm.step()
    return {i: llm.requests.pop(r).output_ids for i, r in ids.items()}, llm.engine.graphs.num_run_ahead


def test_plain_decoding_queued_one_step_ahead_gives_the_same_tokens(tiny_pair, goldens):
    """Plain decoding queues step k + 1 before waiting for step k. Whatever the queued step's fate (taken; or
    dropped because a request stopped on a stop token, ran out of max_tokens, or a new prompt joined the batch),
    the tokens equal those of the same schedule run without queueing ahead; a sampled request turns queueing off
    for its batch without changing its tokens."""
    prompts = [g["prompt_ids"] for g in goldens[:5]]
    first = LLM(tiny_pair / "target", backend="cuda").generate(prompts[:1], SamplingParams(max_tokens=40,
                                                                                          ignore_eos=True))
    stop_token = first[0].token_ids[20]  # a token the first request emits mid-way: it stops there
    params = [SamplingParams(max_tokens=60, stop_token_ids=[stop_token]), SamplingParams(max_tokens=23),
              SamplingParams(max_tokens=64, ignore_eos=True), SamplingParams(max_tokens=50, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True)]
    ahead, taken = _plain_decoding_run(tiny_pair, prompts, params, late=3, pipeline=True)
    assert taken > 40  # most steps were queued ahead
    plain, none = _plain_decoding_run(tiny_pair, prompts, params, late=3, pipeline=False)
    assert none == 0
    assert ahead == plain
    assert len(ahead[0]) < 60 and ahead[0][-1] == stop_token  # the stop really dropped a queued step
    sampled = list(params)
    sampled[2] = SamplingParams(max_tokens=64, temperature=0.8, seed=7)
    ahead, _ = _plain_decoding_run(tiny_pair, prompts, sampled, late=3, pipeline=True)
    plain, _ = _plain_decoding_run(tiny_pair, prompts, sampled, late=3, pipeline=False)
    assert ahead == plain
