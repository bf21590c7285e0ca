"""Weight-loading progress: one line rewritten in place on a terminal, plain rate-limited lines anywhere else."""
from __future__ import annotations

import io

from cudflash import LLM
from cudflash.engine.model_runner import LoadProgress
from cudflash.tiny import write_random_pair


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(progress: LoadProgress, clock: Clock, times: list[float], nbytes: int) -> None:
    """One tensor of `nbytes` loaded at each of `times`."""
    for t in times:
        clock.now = t
        progress(nbytes)


def test_a_log_gets_plain_lines_at_most_every_interval_and_the_last_one():
    out, clock = io.StringIO(), Clock()
    progress = LoadProgress("target", 10 * 100, True, out=out, interval=5.0, clock=clock)
    load(progress, clock, [1, 2, 3, 6, 7, 8, 9, 12, 13, 13.5], 100)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # At 6 s (5 s after the start) and 12 s (6 s after that line); 7-9 and 13 are within 5 s of a line; then 100%.
    assert [line.split("%")[0].split()[-1] for line in lines] == ["40.0", "80.0", "100.0"]
    assert all(line.startswith("loading target: ") for line in lines) and text.endswith("\n")


def test_a_terminal_gets_one_line_rewritten_in_place():
    out, clock = Terminal(), Clock()
    progress = LoadProgress("drafter", 4 * 100, True, out=out, interval=5.0, tty_interval=0.5, clock=clock)
    load(progress, clock, [0.2, 0.8, 1.0, 1.4], 100)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # only the last update ends the line
    assert [part.split("%")[0].split()[-1] for part in text.split("\r")[1:]] == ["50.0", "100.0"]


def test_disabled_progress_prints_nothing():
    out, clock = io.StringIO(), Clock()
    load(LoadProgress("target", 200, False, out=out, clock=clock), clock, [10, 20], 100)
    assert out.getvalue() == ""


def test_llm_loading_into_a_non_terminal_stderr_writes_plain_lines(tmp_path, capsys):
    target, draft = write_random_pair(tmp_path)
    LLM(target, draft=draft, backend="cpu", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    finals = [line for line in err.splitlines() if line.startswith("loading ") and "100.0%" in line]
    assert [line.split(":")[0] for line in finals] == ["loading target", "loading drafter"]
