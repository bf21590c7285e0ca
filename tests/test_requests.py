"""Bad requests fail with one clear message; good ones honour their parameters."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cudflash import LLM, SamplingParams
from cudflash.errors import RequestError
from cudflash.tiny import TinyShape, write_random_pair


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target, draft = write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(max_position_embeddings=64))
    return LLM(target, draft=draft, backend="cpu")


def test_empty_prompt(llm):
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate([[]])


def test_token_outside_vocabulary(llm):
    with pytest.raises(RequestError, match=r"token id 256 outside the vocabulary \(0\.\.255\)"):
        llm.generate([[3, 256]])
    with pytest.raises(RequestError, match="token id -1"):
        llm.generate([[-1]])


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_max_tokens(n):
    with pytest.raises(RequestError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=n)


def test_prompt_plus_new_tokens_beyond_max_positions(llm):
    with pytest.raises(RequestError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds .*max_position_embeddings \(64\)"):
        llm.generate([[3] * 60], SamplingParams(max_tokens=5))
    assert len(llm.generate([[3] * 60], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"])


def test_params_count_must_match(llm):
    with pytest.raises(RequestError, match="2 prompts but 1 sampling params"):
        llm.generate([[3], [4]], [SamplingParams()])


def test_stop_token_ends_generation_with_reason_stop(llm):
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 20


def test_same_seed_same_sample(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    a, b = llm.generate([[5, 6, 7]], p)[0], llm.generate([[5, 6, 7]], p)[0]
    c = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_import_is_light():
    """`import cudflash` loads neither CuPy (only the cuda backend does) nor torch (never)."""
    code = "import sys, cudflash; print('cupy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_request_that_can_never_fit_the_pool(tmp_path):
    target, draft = write_random_pair(tmp_path, TinyShape())
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, num_kv_blocks=4)  # 32 positions in all
    with pytest.raises(RequestError, match="can never fit the KV pool"):
        llm.generate([[3] * 10], SamplingParams(max_tokens=20))
    assert len(llm.generate([[3] * 5], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids) == 10


def test_a_bad_request_leaves_nothing_queued(llm):
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate([[5, 6], [], [7]], SamplingParams(max_tokens=5))
    assert not llm.has_unfinished() and not llm.requests
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks
