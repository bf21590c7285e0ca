from __future__ import annotations

import json
import shutil
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


# ChatML-like, with the tiny pair's one special token as the end of a turn.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def chat_target(tiny_pair: Path, tmp_path_factory) -> Path:
    """A copy of the tiny pair's target with a chat template in its tokenizer_config.json (the pair has none)."""
    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_pair / "target", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TINY_CHAT_TEMPLATE}))
    return target


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
