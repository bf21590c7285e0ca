"""LLM(...)'s own arguments: a wrong one is a ConfigError naming it before anything loads, never a TypeError,
ZeroDivisionError or MemoryError from deep inside, nor an engine that loads and then refuses every request (a pool of
zero blocks, zero sequences at a time)."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.draft_config import DraftOptions
from cudflash.errors import ConfigError
from cudflash.tiny import TinyShape, write_random_pair

from conftest import expect_error

BAD_ARGUMENTS: dict[str, list] = {
    "max_num_seqs": [0, -1, "4", 1.5, True, None],
    "max_num_batched_tokens": [0, "x", 1.5, None],
    "kv_block_size": [0, -8, "16", 1.5, None],
    "num_kv_blocks": [0, -1, "10", 1.5],
    "memory_utilization": [0, -1, 2, "0.5", float("nan"), None],
    "block_size": [0, -1, "4", 1.5, True],
    "num_state_snapshots": [-1, 1.5, "2"],
    "enable_prefix_caching": ["yes", 1, None],
    "enforce_eager": ["no", None],
    "progress": ["x"],
    "random_weights": [1],
    "check_weights": [None],
    "quantize_draft": ["x"],
    "draft_options": [5, "x", {"bogus": 1}, {"tree_budget": -1}],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=2, target_layer_ids=[0, 1]), seed=2)


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_ARGUMENTS.items() for v in vs],
                         ids=lambda x: repr(x)[:20])
def test_bad_arguments_are_named(pair, name, value):
    with pytest.raises(ConfigError) as e:
        LLM(*pair, backend="cpu", **{name: value})
    expect_error(e, name)


def test_numpy_values_and_draft_option_forms_are_accepted(pair):
    llm = LLM(*pair, backend="cpu", max_num_seqs=np.int64(3), kv_block_size=np.int32(8), num_kv_blocks=np.uint16(40),
              memory_utilization=np.float32(0.5), enable_prefix_caching=np.bool_(False))
    assert (llm.scheduler.max_num_seqs, llm.runner.blocks.block_size, llm.runner.blocks.num_blocks) == (3, 8, 40)
    assert type(llm.scheduler.max_num_seqs) is int and llm.runner.blocks.enable_prefix_caching is False
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    for options in ({"context_window": 64}, DraftOptions(context_window=64)):
        assert LLM(*pair, backend="cpu", num_kv_blocks=8, draft_options=options).draft_options == \
            DraftOptions(context_window=64)
