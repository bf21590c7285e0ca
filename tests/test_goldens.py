"""The trained tiny pair against the goldens computed with transformers + the z-lab reference loop (float32)."""
from __future__ import annotations

import statistics

import pytest

from cudflash import LLM, SamplingParams
from tests.conftest import golden_tau, last_logits, top2_relative_gap

MAX_NEW = 128


def _mismatches(llm, goldens, outputs, key) -> list[tuple[int, int, float]]:
    """For each prompt whose output differs: its index, the first differing position and the top-2 logit gap there
    (a gap near zero says a float32 near-tie flipped; a large one says the engine computed something else)."""
    notes = []
    for i, (g, out) in enumerate(zip(goldens, outputs)):
        if out.token_ids == g[key]:
            continue
        same = (x == y for x, y in zip(out.token_ids, g[key]))
        j = next((k for k, equal in enumerate(same) if not equal), min(len(out.token_ids), len(g[key])))
        notes.append((i, j, top2_relative_gap(last_logits(llm, g["prompt_ids"] + g[key][:j]))))
    return notes


@pytest.fixture(scope="module")
def spec_outputs(tiny_pair, goldens):
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu")
    outputs = llm.generate([g["prompt_ids"] for g in goldens], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return llm, outputs


def test_speculative_reproduces_spec_ids_and_acceptance_exactly(spec_outputs, goldens):
    """float32 numpy reproduces the float32 reference exactly: every token, and every step's acceptance length."""
    llm, outputs = spec_outputs
    notes = _mismatches(llm, goldens, outputs, "spec_ids")
    assert not notes, f"(prompt, first differing position, top-2 gap): {notes}"
    for i, (out, g) in enumerate(zip(outputs, goldens)):
        assert out.acceptance_lengths == g["acceptance_lengths"], i
        assert len(out.token_ids) == MAX_NEW and out.finish_reason == "length", i
    assert statistics.mean(o.tau for o in outputs) == pytest.approx(golden_tau(goldens), rel=1e-12)


@pytest.fixture(scope="module")
def target_llm(tiny_pair):
    return LLM(tiny_pair / "target", backend="cpu")


def test_autoregressive_reproduces_ar_ids_exactly(target_llm, goldens):
    llm = target_llm
    outputs = llm.generate([g["prompt_ids"] for g in goldens], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    notes = _mismatches(llm, goldens, outputs, "ar_ids")
    assert not notes, f"(prompt, first differing position, top-2 gap): {notes}"
    assert all(o.acceptance_lengths == [1] * (MAX_NEW - 1) for o in outputs)


def test_text_round_trip(spec_outputs):
    pytest.importorskip("tokenizers")
    llm, _ = spec_outputs
    out = llm.generate(["def add(a, b):\n    return"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert isinstance(out.text, str) and out.text == llm.tokenizer.decode(out.token_ids)
    assert llm.tokenizer.encode("def add(a, b):") == llm.admission.prompt_ids("def add(a, b):")


def test_incremental_detokenization_equals_decoding_everything(target_llm):
    """Decoding token by token through short windows gives the full decode, and never emits half a character."""
    tok = target_llm.tokenizer
    if tok is None:
        pytest.skip("tokenizers is not installed")
    ids = tok.encode("déjà vu — naïve café ✓ 数据 ok\n    return x  # ünïcödé")
    text, offsets, held = "", (0, 0), 0
    for n in range(1, len(ids) + 1):
        delta, *offsets = tok.decode_delta(ids[:n], *offsets, final=n == len(ids))
        assert "\ufffd" not in delta
        held += delta == ""
        text += delta
    assert held > 0  # characters really were split across tokens here
    assert text == tok.decode(ids)
