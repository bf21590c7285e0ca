"""The longest sequence an LLM serves: max_position_embeddings, a user's max_model_len, and the KV pool; the RoPE
tables hold exactly the positions those allow."""
from __future__ import annotations

import pytest

from cudflash import LLM, SamplingParams
from cudflash.errors import ConfigError, RequestError
from cudflash.tiny import TinyShape, write_random_pair

SHAPE = TinyShape(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                  intermediate_size=48, target_layer_ids=[0, 1], draft_layers=1, block_size=4,
                  max_position_embeddings=128)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), SHAPE)


def rows(llm: LLM) -> tuple[int, int]:
    return llm.runner.target.rope_cos.shape[0], llm.runner.draft.rope_cos.shape[0]


def test_tables_cover_max_position_embeddings_when_the_pool_holds_it(pair):
    llm = LLM(*pair, backend="cpu", num_kv_blocks=64, kv_block_size=16)  # 1024 positions in the pool
    assert llm.max_model_len == 128
    assert rows(llm) == (128 + 4 + 1, 128 + 4 + 1)  # a draft block and the pending token past the last token


def test_a_small_pool_bounds_the_tables(pair):
    llm = LLM(*pair, backend="cpu", num_kv_blocks=3, kv_block_size=16)  # 48 positions in all
    assert rows(llm) == (48 + 4 + 1, 48 + 4 + 1)
    with pytest.raises(RequestError, match="can never fit the KV pool"):
        llm.generate([[3] * 40], SamplingParams(max_tokens=8))
    out = llm.generate([[3] * 30], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_max_model_len_bounds_requests_and_tables(pair):
    llm = LLM(*pair, backend="cpu", num_kv_blocks=64, max_model_len=40)
    assert rows(llm) == (40 + 4 + 1, 40 + 4 + 1)
    with pytest.raises(RequestError, match=r"exceeds max_model_len \(40\)"):
        llm.generate([[3] * 35], SamplingParams(max_tokens=6))
    ref = LLM(*pair, backend="cpu", num_kv_blocks=64)
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    assert llm.generate([[3] * 35], p)[0].token_ids == ref.generate([[3] * 35], p)[0].token_ids


@pytest.mark.parametrize("bad", [0, -1, 129, 1.5, True, "64"])
def test_bad_max_model_len(pair, bad):
    with pytest.raises(ConfigError, match="max_model_len must be an integer in 1..128"):
        LLM(*pair, backend="cpu", num_kv_blocks=8, max_model_len=bad)


def test_memory_budget_bounds_the_serving_length(pair, monkeypatch):
    """Room for 5 blocks of 16 tokens: sequences up to 80 positions, not 128, unless max_model_len asks for more."""
    from cudflash.backends.numpy_backend import NumpyBackend
    from cudflash.errors import BackendError

    per_block = 16 * 2 * (SHAPE.num_layers + SHAPE.draft_layers) * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    monkeypatch.setattr(NumpyBackend, "memory_budget", lambda self, utilization: 5 * per_block)
    llm = LLM(*pair, backend="cpu")
    assert llm.runner.blocks.num_blocks == 5 and rows(llm) == (80 + 4 + 1, 80 + 4 + 1)
    with pytest.raises(BackendError, match="too little memory"):
        LLM(*pair, backend="cpu", max_model_len=128)


def test_a_large_step_budget_takes_its_activations_from_the_kv_pool(pair, monkeypatch):
    """A backend with a fixed activation reserve (CUDA: 2 GiB) gives the KV pool what is left after the activations
    of a step of max_num_batched_tokens rows beyond that reserve: a prefill of 32 prompts x 2048 tokens at once ran
    out of memory on the H200 with the pool sized as for 8192 rows."""
    from cudflash.backends.numpy_backend import NumpyBackend
    from cudflash.engine.model_runner import step_activation_bytes

    per_block = 16 * 2 * (SHAPE.num_layers + SHAPE.draft_layers) * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    monkeypatch.setattr(NumpyBackend, "memory_budget", lambda self, utilization: 30 * per_block)
    small = LLM(*pair, backend="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    assert small.runner.blocks.num_blocks == 30  # no reserve declared (the numpy backend): the whole budget
    monkeypatch.setattr(NumpyBackend, "activation_reserve", 0)
    tokens = 64
    act = step_activation_bytes(small.target_cfg, tokens)
    assert act == tokens * (10 * SHAPE.intermediate_size + 24 * SHAPE.hidden_size)
    big = LLM(*pair, backend="cpu", max_num_seqs=4, max_num_batched_tokens=tokens)
    assert big.runner.blocks.num_blocks == (30 * per_block - act) // per_block < 30
    monkeypatch.setattr(NumpyBackend, "activation_reserve", act)  # covered by the reserve
    assert LLM(*pair, backend="cpu", max_num_seqs=4, max_num_batched_tokens=tokens).runner.blocks.num_blocks == 30


@pytest.mark.parametrize("kwargs", [dict(num_kv_blocks=64, max_model_len=40), dict(num_kv_blocks=3),
                                    dict(num_kv_blocks=4, draft_options={"tree_budget": 9})],
                         ids=["max_model_len", "pool", "tree-lookahead"])
def test_room_is_exactly_what_admission_accepts(pair, kwargs):
    """Admission.room(n), the default max_tokens of a server request, is the largest max_tokens a prompt of n tokens
    is admitted with, whatever bounds it (max_model_len, the pool, a draft tree's lookahead beyond the block); a
    prompt with no room left is refused for its own length, without naming a max_tokens."""
    llm = LLM(*pair, backend="cpu", **kwargs)
    admission = llm.admission
    for n in (1, 5, 20, 30, 47, 60, 70):
        room = admission.room(n)
        if room >= 1:
            admission.check_fits([3] * n, SamplingParams(max_tokens=room))
        with pytest.raises(RequestError) as e:
            admission.check_fits([3] * n, SamplingParams(max_tokens=max(room, 0) + 1))
        assert ("max_tokens can be at most" in str(e.value)) == (room >= 1), str(e.value)
    assert admission.room(llm.max_model_len) <= 0
