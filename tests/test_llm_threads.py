"""One LLM shared by several threads, and a step re-entered from inside a step: threads take turns step by step
(every request as it would run alone, no block lost); re-entering a running step is refused with a clear error and
leaves the engine serving."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.errors import RequestError
from cudflash.tiny import TinyShape, write_random_pair

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target, draft = write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=2, target_layer_ids=[0, 1]),
                                      seed=7)
    return LLM(target, draft=draft, backend="cpu", kv_block_size=8)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(2, 256, int(rng.integers(3, 12))).tolist() for _ in range(n)]


def test_threads_sharing_an_llm_get_what_each_would_alone(llm):
    """Four threads, each a generate over its own prompts, and one more consuming a stream: before the engine
    serialized its entry points, their steps ran into each other's batches (an IndexError inside the step)."""
    prompts = _prompts(9)
    expected = [r.token_ids for r in llm.generate(prompts, PARAMS)]
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(5, timeout=30)

    def run(i: int) -> None:
        try:
            start.wait()
            if i == 4:
                got[i] = [[t for out in llm.stream(prompts[8], PARAMS) for t in out.new_token_ids]]
            else:
                got[i] = [r.token_ids for r in llm.generate(prompts[2 * i:2 * i + 2], PARAMS)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for _ in range(3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert [got[i] for i in range(4)] == [expected[2 * i:2 * i + 2] for i in range(4)] and got[4] == [expected[8]]
        assert not llm.requests and llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_a_step_re_entered_from_inside_a_step_is_refused(llm):
    prompts = _prompts(2)
    expected = [r.token_ids for r in llm.generate(prompts, PARAMS)]
    real_run = llm.engine.run

    def run(plan, block_size):  # a callback inside the step that calls back into the engine
        llm.generate([prompts[0]], PARAMS)
        return real_run(plan, block_size)

    llm.engine.run = run
    try:
        with pytest.raises(RequestError, match="re-entered"):
            llm.generate(prompts, PARAMS)
    finally:
        llm.engine.run = real_run
    assert not llm.requests and not llm.has_unfinished()
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks
    assert [r.token_ids for r in llm.generate(prompts, PARAMS)] == expected
