"""An exception inside a step (a kernel error, a KeyboardInterrupt) leaves the engine consistent: every request
the step touched is finished with reason "error" (an error) or resumable (an interruption), an interrupted
generate() aborts its own requests, every block comes back, and the same LLM then generates what a fresh one
does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyShape, write_random_pair
from tests.conftest import poison_one_logit

N = 7


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=2, target_layer_ids=[0, 1]), seed=5)


@pytest.fixture(scope="module")
def requests(pair):
    """Greedy and seeded sampling requests; every third one stops at a token id its free run emits midway."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 256, int(rng.integers(3, 20))).tolist() for _ in range(N)]
    params = [SamplingParams(max_tokens=int(rng.integers(6, 14)), ignore_eos=True,
                             temperature=0.0 if i % 2 == 0 else 0.9, seed=100 + i) for i in range(N)]
    llm = LLM(*pair, backend="cpu", kv_block_size=8)
    for i in range(0, N, 3):
        free = llm.generate([prompts[i]], params[i])[0].token_ids
        params[i] = dataclasses.replace(params[i], stop_token_ids=[free[4]])
    return prompts, params


@pytest.fixture(scope="module")
def solo(pair, requests):
    llm = LLM(*pair, backend="cpu", kv_block_size=8)
    outs = [llm.generate([p], sp)[0] for p, sp in zip(*requests)]
    assert sum(o.finish_reason == "stop" for o in outs) >= 2
    return [o.token_ids for o in outs]


class Fault:
    """Stands in for a callable: its `fail_at`-th call raises `exc`, before running the real one or after it."""

    def __init__(self, real, fail_at: int, exc: BaseException, after: bool = False):
        self.real, self.fail_at, self.exc, self.after, self.calls = real, fail_at, exc, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at and not self.after:
            raise self.exc
        out = self.real(*args, **kwargs)
        if self.calls == self.fail_at and self.after:
            raise self.exc
        return out


def finish_and_check(llm, others, stream, first, solo, interrupted: bool):
    """Drive what survived to the end: interrupted requests resume exactly; failed ones ended with "error" on a
    prefix of their solo output; the rest are untouched."""
    tail = list(stream)
    while llm.has_unfinished():
        llm.step()
    results = {i: llm.result(rid) for i, rid in others.items()}
    stream_tokens = [t for out in [first, *tail] for t in out.new_token_ids]
    stream_reason = (tail[-1] if tail else first).finish_reason
    reasons = [r.finish_reason for r in results.values()] + [stream_reason]
    for i, r in results.items():
        assert r.finish_reason in ("length", "stop", "error")
        if r.finish_reason != "error":
            assert r.token_ids == solo[i]
        else:
            assert r.token_ids == solo[i][:len(r.token_ids)]
    if stream_reason != "error":
        assert stream_tokens == solo[3]
    else:
        assert stream_tokens == solo[3][:len(stream_tokens)]
    if interrupted:
        assert "error" not in reasons
    return reasons


@pytest.mark.parametrize("after", [False, True], ids=["before-step", "after-step"])
@pytest.mark.parametrize("fail_at", [1, 4])
@pytest.mark.parametrize("exc", [RuntimeError("kernel failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failing_step_inside_generate(pair, requests, solo, monkeypatch, exc, fail_at, after):
    prompts, params = requests
    llm = LLM(*pair, backend="cpu", kv_block_size=8)
    free = llm.runner.blocks.num_free
    others = {i: llm.add_request(prompts[i], params[i]) for i in range(3)}  # another caller's requests
    stream = llm.stream(prompts[3], params[3])
    first = next(stream)
    monkeypatch.setattr(llm.engine, "run", Fault(llm.engine.run, fail_at, exc, after))
    with pytest.raises(type(exc)):
        llm.generate(prompts[4:], params[4:])
    monkeypatch.undo()
    # The interrupted generate's own requests are gone; everyone else's are still known.
    assert set(llm.requests) == set(others.values()) | {stream.request_id}
    interrupted = isinstance(exc, KeyboardInterrupt)
    if not interrupted:  # the failed step touched requests of the other callers: they ended with "error"
        assert any(s.finish_reason == "error" for s in llm.requests.values())
    assert all(s.finish_reason in (None, "error") for s in llm.requests.values())
    finish_and_check(llm, others, stream, first, solo, interrupted)
    assert not llm.requests and llm.runner.blocks.num_free == free
    assert [r.token_ids for r in llm.generate(prompts, params)] == solo  # the same LLM, as good as new


@pytest.mark.parametrize("where", ["target_forward", "proposer"])
def test_a_kernel_error_in_the_runner_or_the_drafter(pair, requests, solo, where):
    prompts, params = requests
    llm = LLM(*pair, backend="cpu", kv_block_size=8)
    free = llm.runner.blocks.num_free
    if where == "proposer":
        llm.proposer.device_part = Fault(llm.proposer.device_part, 3, RuntimeError("illegal memory access"))
    else:
        llm.runner.target_forward = Fault(llm.runner.target_forward, 3, RuntimeError("illegal memory access"))
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        while llm.has_unfinished():
            llm.step()
    while llm.has_unfinished():  # the fault fires once: the rest runs on
        llm.step()
    results = [llm.result(i) for i in ids]
    assert any(r.finish_reason == "error" for r in results)
    for r, expected in zip(results, solo):
        assert r.token_ids == (expected if r.finish_reason != "error" else expected[:len(r.token_ids)])
    assert llm.runner.blocks.num_free == free
    assert [r.token_ids for r in llm.generate(prompts, params)] == solo


def test_an_interrupted_step_resumes_every_request_exactly(pair, requests, solo, monkeypatch):
    """Interrupt the step-level loop again and again at random points: before a step, after it, and inside it
    after sampling (the drafter's context update). Every request (greedy, seeded sampling, with stop ids) still
    ends exactly as it does alone, and step()'s outputs deliver each of its tokens exactly once."""
    prompts, params = requests
    llm = LLM(*pair, backend="cpu", kv_block_size=8, num_kv_blocks=24)  # small enough to preempt too
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    delivered = {i: [] for i in ids}
    rng = np.random.default_rng(0)
    real_step, real_context = llm.engine.run, llm.runner.draft_context
    interrupts = 0
    while llm.has_unfinished():
        site, after = ["step", "draft_context"][int(rng.integers(2))], bool(rng.integers(2))
        if site == "step":
            monkeypatch.setattr(llm.engine, "run", Fault(real_step, int(rng.integers(1, 4)), KeyboardInterrupt(),
                                                         after))
        else:
            monkeypatch.setattr(llm.engine, "run", real_step)
            llm.runner.draft_context = Fault(real_context, int(rng.integers(1, 4)), KeyboardInterrupt())
        try:
            for _ in range(3):
                for out in llm.step():
                    delivered[out.request_id] += out.new_token_ids
        except KeyboardInterrupt:
            interrupts += 1
        llm.runner.draft_context = real_context
    assert interrupts > 5
    assert [llm.result(i).token_ids for i in ids] == solo == [delivered[i] for i in ids]
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_a_dropped_stream_is_aborted_at_the_next_safe_point(pair, requests):
    prompts, params = requests
    llm = LLM(*pair, backend="cpu", kv_block_size=8)
    stream = llm.stream(prompts[0], params[0])
    next(stream)
    rid = stream.request_id
    del stream  # never closed: its finaliser only queues the abort
    assert rid in llm.requests
    llm.generate([prompts[1]], params[1])
    assert rid not in llm.requests and not llm.has_unfinished()
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_non_finite_logits_finish_the_sequence_with_an_error(pair, requests, solo, speculative):
    """Logits that turn non-finite (an overflow in the forward) end that sequence with finish_reason "error" and
    the tokens it had, never token 0 or garbage; the others in its batch go on exactly; no block leaks."""
    prompts, params = requests
    target, draft = pair
    llm = LLM(target, draft=draft if speculative else None, backend="cpu", kv_block_size=8)
    free = llm.runner.blocks.num_free
    restore = poison_one_logit(llm, step=4)
    greedy = [i for i in range(N) if params[i].temperature == 0.0][:3]
    results = llm.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    reasons = [r.finish_reason for r in results]
    assert reasons.count("error") == 1, reasons
    for r, i in zip(results, greedy):
        assert r.token_ids == (solo[i] if r.finish_reason != "error" else solo[i][:len(r.token_ids)])
    assert llm.runner.blocks.num_free == free and not llm.has_unfinished()
    restore()
    assert [r.token_ids for r in llm.generate([prompts[i] for i in greedy], [params[i] for i in greedy])] == \
        [solo[i] for i in greedy]
