"""cudflash's hybrid target against transformers' float32 greedy tokens (tests/data/hybrid_goldens.json, written by
scripts/hybrid_goldens.py on a machine with torch + transformers). The checkpoints are rebuilt here from the same
seeds; skipped where the fixture is absent."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.checkpoint import Checkpoint
from cudflash.config import load_target_config
from cudflash.models.hybrid import HybridTargetModel
from cudflash.models.hybrid_reference import OneSequence, greedy, speculative_greedy
from cudflash.models.weights import WeightLoader
from cudflash.tiny_hybrid import write_hybrid_target
from tests.hybrid_golden_cases import CASES, GOLDENS, MAX_NEW

FIXTURE = Path(__file__).parent / "data" / GOLDENS


def _goldens() -> dict:
    if not FIXTURE.is_file():
        pytest.skip(f"{FIXTURE} is absent (python3 scripts/hybrid_goldens.py writes it, with transformers)")
    return {c["name"]: c for c in json.loads(FIXTURE.read_text())["cases"]}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_greedy_tokens_equal_transformers(tmp_path, case):
    golden = _goldens()[case.name]
    assert golden["seed"] == case.seed
    directory = write_hybrid_target(tmp_path / case.name, case.shape, seed=case.seed)
    b = NumpyBackend()
    model = HybridTargetModel(load_target_config(directory), WeightLoader(Checkpoint(directory), b), b)
    notes = []
    for run, prompt in zip(golden["runs"], case.prompts()):
        assert run["prompt_ids"] == prompt  # the same prompts from the same seed
        got = greedy(model, prompt, MAX_NEW)
        if got != run["greedy_ids"]:
            j = next(i for i, (x, y) in enumerate(zip(got, run["greedy_ids"])) if x != y)
            seq = OneSequence(model, len(prompt) + MAX_NEW)
            logits = seq.run(prompt + got[:j], "prefill")[0][-1]
            top = np.sort(logits)[-2:]
            notes.append((len(prompt), j, float((top[1] - top[0]) / abs(top[1]))))
    assert not notes, f"(prompt length, first differing position, top-2 gap there): {notes}"


def test_speculative_rollback_reproduces_the_goldens(tmp_path):
    """Verify + rollback with drafts that are right for a while, then wrong: transformers' greedy tokens again."""
    case = CASES[0]
    golden = _goldens()[case.name]
    directory = write_hybrid_target(tmp_path / case.name, case.shape, seed=case.seed)
    b = NumpyBackend()
    model = HybridTargetModel(load_target_config(directory), WeightLoader(Checkpoint(directory), b), b)
    run = golden["runs"][2]  # a prompt past one GDN chunk
    want, prompt = run["greedy_ids"], run["prompt_ids"]

    def propose(tokens: list[int], n: int) -> list[int]:
        done = len(tokens) - len(prompt)
        truth = (want + [0] * n)[done:done + n]
        return truth[: (done % n)] + [1] * (n - done % n)

    got, lens = speculative_greedy(model, prompt, MAX_NEW, block=5, propose=propose)
    assert got == want and max(lens) > 1
