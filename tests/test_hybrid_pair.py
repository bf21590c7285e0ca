"""The trained tiny hybrid pair (tests/data/tiny-hybrid-pair: a Qwen3.5 text target and its DFlash drafter) on the CPU.

`ar_ids` come from transformers' float32 greedy decoding; `acceptance_lengths` from cudflash's own float32
speculative run, recorded so that the GPU test can compare its tau against it, and checked here step by step."""
from __future__ import annotations

import statistics

import pytest

from cudflash import LLM, SamplingParams
from tests.conftest import HYBRID_PAIR, golden_tau, last_logits, load_goldens, top2_relative_gap

MAX_NEW = 128


@pytest.fixture(scope="module")
def goldens() -> list[dict]:
    return load_goldens(HYBRID_PAIR)


@pytest.fixture(scope="module")
def runs(goldens):
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [g["prompt_ids"] for g in goldens]
    ar_llm = LLM(HYBRID_PAIR / "target", backend="cpu")
    spec = LLM(HYBRID_PAIR / "target", draft=HYBRID_PAIR / "drafter", backend="cpu").generate(prompts, params)
    return ar_llm, ar_llm.generate(prompts, params), spec


def test_the_pair_is_the_released_layout_and_small():
    import json

    config = json.loads((HYBRID_PAIR / "target" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert json.loads((HYBRID_PAIR / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert (HYBRID_PAIR / "target" / "model.safetensors.index.json").is_file()  # sharded, as releases are
    assert sum(p.stat().st_size for p in HYBRID_PAIR.rglob("*") if p.is_file()) <= 12 * 2 ** 20


def test_autoregressive_reproduces_transformers_float32_greedy(runs, goldens):
    llm, ar, _ = runs
    notes = []
    for i, (g, out) in enumerate(zip(goldens, ar)):
        if out.token_ids != g["ar_ids"]:
            j = next(k for k, (x, y) in enumerate(zip(out.token_ids, g["ar_ids"])) if x != y)
            notes.append((i, j, top2_relative_gap(last_logits(llm, g["prompt_ids"] + g["ar_ids"][:j]))))
    assert not notes, f"(prompt, first differing position, top-2 gap): {notes}"


def test_speculative_equals_autoregressive_and_accepts(runs, goldens):
    _, ar, spec = runs
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    assert [o.acceptance_lengths for o in spec] == [g["acceptance_lengths"] for g in goldens]
    tau = statistics.mean(o.tau for o in spec)
    assert tau == pytest.approx(golden_tau(goldens), rel=1e-12)
    assert tau > 2.0, tau  # a real drafter: well above one token per verify
