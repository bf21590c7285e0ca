"""Shared fixtures and helpers; and the BLAS thread pin, which must run before numpy is first imported."""
from __future__ import annotations

import os
import statistics
import sys

# One BLAS thread for the whole suite (subprocesses inherit it): the CPU tests are many small GEMMs, where a
# thread pool costs more than it gains and threads compete with each other on a small CI machine. The variables
# are read once, when numpy loads its BLAS, so they are set here, before this file imports numpy; a value already
# in the environment wins (to compare, run with OPENBLAS_NUM_THREADS=2).
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS")
# numpy loaded before the variables were set (by a pytest plugin): then only threadpoolctl can still pin it. A second
# import of this file (`from tests.conftest import ...` beside pytest's own `conftest`) finds them set, as it should.
_numpy_was_loaded = "numpy" in sys.modules and any(_name not in os.environ for _name in BLAS_THREAD_VARIABLES)
for _name in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_name, "1")

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cudflash.engine.sequence import Sequence
from cudflash.errors import CudflashError
from cudflash.sampling_params import SamplingParams

try:
    import threadpoolctl
except ImportError:  # optional: it only reports the pin, or applies it when a plugin loaded numpy first
    threadpoolctl = None

_blas_limit = None  # held for the session when the environment came too late
if _numpy_was_loaded:
    if threadpoolctl is None:
        import warnings

        warnings.warn("numpy was imported before tests/conftest.py and threadpoolctl is not installed: "
                      "BLAS runs with its default thread count", stacklevel=1)
    else:
        _blas_limit = threadpoolctl.threadpool_limits(limits=int(os.environ["OPENBLAS_NUM_THREADS"]),
                                                      user_api="blas")


def pytest_report_header(config: pytest.Config) -> str:
    if threadpoolctl is None:
        return f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}"
    pools = ", ".join(f"{p['internal_api']} {p['num_threads']}" for p in threadpoolctl.threadpool_info()
                      if p["user_api"] == "blas")
    return f"BLAS threads: {pools or 'no BLAS found'}"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core, at most 8 (each loads its files' models; more would only cost memory)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


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


# The trained tiny hybrid pair (a Qwen3.5 text target and its DFlash drafter), committed with the tests.
HYBRID_PAIR = ROOT / "tests" / "data" / "tiny-hybrid-pair"


def load_goldens(pair: Path) -> list[dict]:
    return [json.loads(line) for line in (pair / "golden_dev.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def goldens(tiny_pair: Path) -> list[dict]:
    return load_goldens(tiny_pair)


def golden_tau(goldens: list[dict]) -> float:
    """The pair's tau as the goldens define it: the mean over prompts of each prompt's mean acceptance length."""
    return statistics.mean(statistics.mean(g["acceptance_lengths"]) for g in goldens)


def last_logits(llm, ids: list[int]) -> np.ndarray:
    """The target's float32 logits after `ids` (one fresh forward; the sequence's blocks, and a hybrid target's
    state slot, zeroed at allocation, are freed after). Every row rounds as a decode's would (no inexact rows)."""
    runner = llm.runner
    seq = Sequence(-1, list(ids), SamplingParams())
    runner.blocks.reserve(seq, len(ids))
    if runner.hybrid:
        runner.states.allocate(seq)
    try:
        batch = runner.batch([seq], [list(ids)], [0])  # no prefill chunk: every row rounds as a decode's
        hidden, _ = runner.target_forward(batch, with_taps=False, commit=True)
        return runner.backend.to_numpy(runner.logits(hidden, np.array([len(ids) - 1])))[0]
    finally:
        runner.blocks.free(seq)
        if runner.hybrid:
            runner.states.free(seq)


def top2_relative_gap(logits: np.ndarray) -> float:
    a, b = np.sort(logits)[-2:][::-1]
    return float((a - b) / max(abs(a), 1e-12))


def poison_one_logit(llm, step: int = 4):
    """Make one logit NaN, once: row 0, column 3 of the LM head's output right after the `step`-th target forward
    (the first scored row of that step: a verify's pending token, or a decode's only row). Returns a function
    that puts the real forward and LM head back."""
    runner = llm.runner
    real_forward, real_logits, forwards = runner.target_forward, runner.target.logits, []
    done = []

    def forward(*args, **kwargs):  # the target forward; the LM head right after it scores its rows
        forwards.append(1)
        return real_forward(*args, **kwargs)

    def poisoned(hidden):
        out = real_logits(hidden)
        if len(forwards) == step and not done:
            done.append(1)
            out = out.copy()
            out[0, 3] = np.nan
        return out

    runner.target_forward, runner.target.logits = forward, poisoned

    def restore() -> None:
        runner.target_forward, runner.target.logits = real_forward, real_logits
    return restore


def expect_error(exc_info: pytest.ExceptionInfo, *needles: object) -> str:
    """A user error's message is one line and names every needle (file, tensor, field, values)."""
    msg = str(exc_info.value)
    assert isinstance(exc_info.value, CudflashError)
    assert "\n" not in msg, msg
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in {msg!r}"
    return msg
