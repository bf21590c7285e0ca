"""Bad requests through the Python API, generated programmatically: each is refused when it is added, with a
one-line cudflash error naming the argument, and leaves the engine serving correct requests."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.errors import CudflashError, RequestError
from cudflash.tiny import TinyShape, write_random_pair

from conftest import expect_error

VOCAB, MAX_POS = 256, 96
GOOD = SamplingParams(max_tokens=6, ignore_eos=True)
GOOD_PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    shape = TinyShape(num_layers=2, target_layer_ids=[0, 1], max_position_embeddings=MAX_POS)
    target, draft = write_random_pair(tmp_path_factory.mktemp("pair"), shape, seed=3)
    return LLM(target, draft=draft, backend="cpu", kv_block_size=8)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate([GOOD_PROMPT], GOOD)[0].token_ids


# Values wrong for every field of SamplingParams but `stop` (where a str is right): wrong types of every kind.
JUNK = ["1", "", b"1", {}, {"a": 1}, set(), object(), 1j, float("nan"), [1.0], (None,), [[1]], np.array([1])]
# Per field: values of the right kind but out of range, and the near misses (floats for ints, bools, strings).
BAD_FIELDS: dict[str, list] = {
    "max_tokens": [0, -1, 1.5, 2.0, True, False, None, np.float64(3.0), -2**70, float("inf")],
    "temperature": [-0.5, -1e-300, 1e-310, 5e-324, 1e-7, float("inf"), -float("inf"), True, None, "0.7",
                    10**400, np.bool_(True)],
    "top_k": [-1, 1.5, 2.0, True, None, np.float32(2), "3", -2**80],
    "top_p": [0, 0.0, -0.1, 1.0001, 2, float("inf"), True, None, "0.9", 1e-400],
    "seed": [2**64, -2**63 - 1, 1.5, "7", True, 10**30],
    "ignore_eos": [1, 0, "yes", None, 1.0],
    "stop": [[5], [""], "", [None], ["ok", 3], 5, {"a"}, [["x"]], ["\ud800"], [b"x"]],
    "stop_token_ids": [[VOCAB], [-1], [1.5], ["1"], 5, [True], [2**70], "12", [None]],
}


def bad_param_cases() -> list[tuple[str, object]]:
    cases = [(f, v) for f, values in BAD_FIELDS.items() for v in values]
    cases += [(f, v) for f in BAD_FIELDS if f not in ("stop",) for v in JUNK]
    cases += [("stop", v) for v in JUNK if not isinstance(v, str) and not (isinstance(v, list) and
                                                                         all(isinstance(x, str) for x in v))]
    return cases


BAD_PROMPTS = [[], [VOCAB], [-1], [1.5], [5, 2.0], ["a"], [True], [5, np.bool_(False)], [2**70], None, 5, 5.0,
               {"a": 1}, {1, 2}, b"\x05\x06", np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([], dtype=np.int64),
               np.array([300]), np.array([-3]), (1, VOCAB), [5] * MAX_POS, "text without a tokenizer", [[5, 6]],
               [np.float32(5)], [object()]]


def assert_untouched(llm, reference):
    assert not llm.requests and not llm.has_unfinished()
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks
    assert llm.generate([GOOD_PROMPT], GOOD)[0].token_ids == reference


def test_at_least_a_hundred_bad_cases():
    assert len(bad_param_cases()) + len(BAD_PROMPTS) >= 150


def test_bad_sampling_params_are_refused_by_name(llm, reference):
    """Each bad field value: refused by SamplingParams itself, and, set on a valid object after construction,
    refused again by add_request (a request keeps a validated copy)."""
    for n, (field, value) in enumerate(bad_param_cases()):
        with pytest.raises(CudflashError) as e:
            llm.add_request(GOOD_PROMPT, SamplingParams(**{field: value}))
        expect_error(e, field)
        params = SamplingParams()
        setattr(params, field, value)
        with pytest.raises(CudflashError) as e:
            llm.add_request(GOOD_PROMPT, params)
        expect_error(e, field)
        with pytest.raises(CudflashError) as e:
            llm.stream(GOOD_PROMPT, params)
        expect_error(e, field)
        if n % 25 == 0:
            assert_untouched(llm, reference)
    assert_untouched(llm, reference)


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=lambda p: type(p).__name__)
def test_bad_prompts_are_refused_by_name(llm, reference, prompt):
    with pytest.raises(CudflashError) as e:
        llm.add_request(prompt, GOOD)
    expect_error(e, "prompt")
    with pytest.raises(CudflashError) as e:
        llm.generate([GOOD_PROMPT, prompt], GOOD)
    expect_error(e, "prompts")
    assert not llm.requests and llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_prompt_beyond_positions_and_pool(llm):
    with pytest.raises(RequestError) as e:
        llm.add_request([5] * (MAX_POS - 3), SamplingParams(max_tokens=4))
    expect_error(e, "max_position_embeddings", MAX_POS)
    with pytest.raises(RequestError) as e:
        llm.add_request([5], SamplingParams(max_tokens=10**30))
    expect_error(e, "max_tokens")


@pytest.mark.parametrize("args, needle", [
    ((5,), "prompts"), ((None,), "prompts"), ((5.0,), "prompts"), (({"prompt": [1]},), "prompts"),
    ((iter([[1]]),), "prompts"), ((np.array([[1, 2]]),), "prompts"),
    (([[5], [6]], [GOOD]), "params"), (([[5]], [GOOD, GOOD]), "params"), (([[5]], "x"), "params"),
    (([[5], [6]], [GOOD, "x"]), "params[1]"), (([[5], [6]], [GOOD, {"max_tokens": 3}]), "params[1]"),
    (([[5]], 3), "params"), (([[5]], {"max_tokens": 3}), "params"), (([[5]], (GOOD, 1)), "params"),
])
def test_generate_misuse_names_the_argument(llm, args, needle):
    with pytest.raises(CudflashError) as e:
        llm.generate(*args)
    expect_error(e, needle)
    assert not llm.requests


def test_prompt_forms_that_are_accepted(llm, reference):
    """One prompt of token ids may come as a flat list, a tuple, numpy integers or a 1-D integer array."""
    for prompt in (GOOD_PROMPT, tuple(GOOD_PROMPT), [np.int64(t) for t in GOOD_PROMPT],
                   np.array(GOOD_PROMPT, dtype=np.int32), np.array(GOOD_PROMPT, dtype=np.uint16)):
        assert [r.token_ids for r in llm.generate(prompt, GOOD)] == [reference]
    assert llm.generate([], GOOD) == []
    assert [r.token_ids for r in llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GOOD, GOOD])] == [reference] * 2


@pytest.mark.parametrize("rid", ["0", 1.0, True, None, [0], 2**70])
def test_result_and_abort_misuse(llm, rid):
    with pytest.raises(CudflashError) as e:
        llm.result(rid)
    expect_error(e, "request_id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        with pytest.raises(CudflashError) as e:
            llm.abort(rid)
        expect_error(e, "request_id")


def test_result_of_unknown_or_unfinished_requests(llm, reference):
    with pytest.raises(RequestError) as e:
        llm.result(10**6)
    expect_error(e, "request_id 1000000", "no such request")
    rid = llm.add_request(GOOD_PROMPT, GOOD)
    with pytest.raises(RequestError) as e:
        llm.result(rid)
    expect_error(e, f"request_id {rid}", "not finished")
    llm.abort(10**6)  # unknown: nothing to do
    while llm.has_unfinished():
        llm.step()
    assert llm.result(rid).token_ids == reference
    with pytest.raises(RequestError, match="no such request"):
        llm.result(rid)  # taken once


def test_valid_edge_values_are_accepted_and_normalised():
    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4), top_p=1,
                       seed=-1, stop="ab", stop_token_ids=(np.int64(7),), ignore_eos=np.bool_(True))
    assert (p.max_tokens, p.top_k, p.top_p, p.stop, p.stop_token_ids, p.ignore_eos) == (3, 4, 1.0, ["ab"], [7], True)
    assert all(type(x) is int for x in (p.max_tokens, p.top_k, p.stop_token_ids[0]))
    assert type(p.temperature) is float and type(p.ignore_eos) is bool
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(seed=-1).rng_seed == 2**64 - 1 == SamplingParams(seed=2**64 - 1).rng_seed
    assert SamplingParams(seed=-2**63).rng_seed == 2**63
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_seeds_across_the_64_bit_range_sample_reproducibly(llm):
    for seed in (-2**63, -1, 0, 2**63, 2**64 - 1):
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        a, b = llm.generate([GOOD_PROMPT], p)[0], llm.generate([GOOD_PROMPT], p)[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_text_the_tokenizer_cannot_take(tiny_pair):
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu")
    for prompt in ("abc\ud800", "\udfff", "a\udcffb"):
        with pytest.raises(RequestError) as e:
            llm.add_request(prompt, GOOD)
        expect_error(e, "prompt", "lone surrogate")
    with pytest.raises(RequestError) as e:
        llm.generate(["fine", "bad \ud834"], GOOD)
    expect_error(e, "prompts[1]", "lone surrogate")
    with pytest.raises(RequestError) as e:
        llm.add_request("x", SamplingParams(stop=["ok", "\ud800"]))
    expect_error(e, "stop[1]", "lone surrogate")
    with pytest.raises(RequestError) as e:
        llm.add_request("", GOOD)
    expect_error(e, "empty prompt")
    assert not llm.requests
    out = llm.generate("import numpy as np", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)


def test_every_field_combination_of_valid_params_runs(llm):
    """Admitted means runnable: a grid of valid parameters never raises inside a step."""
    grid = itertools.product([0.0, 1e-5, 0.7, 1e6], [0, 1, 3, 10**9], [1e-9, 0.5, 1.0], [None, -5, 2**64 - 1],
                             [[], [0, 255]])
    prompts, params = [], []
    for t, k, p, seed, stop_ids in grid:
        prompts.append(GOOD_PROMPT)
        params.append(SamplingParams(max_tokens=3, temperature=t, top_k=k, top_p=p, seed=seed,
                                     stop_token_ids=stop_ids))
    outs = llm.generate(prompts, params)
    assert all(1 <= len(o.token_ids) <= 3 and o.finish_reason in ("stop", "length") for o in outs)
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks
