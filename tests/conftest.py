from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cudflash.engine.sequence import Sequence
from cudflash.errors import CudflashError
from cudflash.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# The shared tiny pair beside the checkout; a copy in .cache/ where ../shared does not travel (the GPU machine).
TINY_PAIR_PLACES = [ROOT / ".." / "shared" / "models" / "tiny-code-pair", ROOT / ".cache" / "tiny-code-pair"]


@pytest.fixture(scope="session")
def tiny_pair() -> Path:
    for place in TINY_PAIR_PLACES:
        if (place / "golden_dev.jsonl").is_file():
            return place.resolve()
    pytest.skip("../shared/models/tiny-code-pair is absent")


@pytest.fixture(scope="session")
def goldens(tiny_pair: Path) -> list[dict]:
    return [json.loads(line) for line in (tiny_pair / "golden_dev.jsonl").read_text().splitlines()]


def last_logits(llm, ids: list[int]) -> np.ndarray:
    """The target's float32 logits after `ids` (one fresh forward; the sequence's blocks are freed after)."""
    runner = llm.runner
    seq = Sequence(-1, list(ids), SamplingParams())
    runner.blocks.reserve(seq, len(ids))
    try:
        batch = runner.batch([seq], [list(ids)], [0])
        hidden, _ = runner.target.forward(batch, runner.target_kv)
        return runner.backend.to_numpy(runner.logits(hidden, np.array([len(ids) - 1])))[0]
    finally:
        runner.blocks.free(seq)


def top2_relative_gap(logits: np.ndarray) -> float:
    a, b = np.sort(logits)[-2:][::-1]
    return float((a - b) / max(abs(a), 1e-12))


def expect_error(exc_info: pytest.ExceptionInfo, *needles: object) -> str:
    """A user error's message is one line and names every needle (file, tensor, field, values)."""
    msg = str(exc_info.value)
    assert isinstance(exc_info.value, CudflashError)
    assert "\n" not in msg, msg
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in {msg!r}"
    return msg
