"""`cudflash generate`: the JSON-lines contract, the summary line, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cudflash.tiny import TinyShape, write_random_pair


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cudflash", "generate", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape())


def test_prompts_file_in_order_with_per_prompt_lengths(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7], "max_new_tokens": 3}\n\n{"prompt_ids": [9, 10]}\n')
    out = tmp_path / "out.jsonl"
    r = run_cli("--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--output", str(out),
                "--max-new-tokens", "7", "--ignore-eos", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(x["token_ids"]) for x in rows] == [3, 7]
    for x in rows:
        assert set(x) == {"token_ids", "text", "finish_reason", "acceptance_lengths", "tau"}
        assert x["text"] is None and x["finish_reason"] == "length"
        assert x["tau"] == pytest.approx(sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]), abs=1e-4)
    summary = r.stderr.strip().splitlines()[-1]
    for word in ("requests 2", "new tokens 10", "seconds", "tokens/s", "mean tau"):
        assert word in summary


def test_text_prompt_with_tokenizer(tiny_pair):
    r = run_cli("--target", str(tiny_pair / "target"), "--draft", str(tiny_pair / "drafter"), "--prompt",
                "import numpy as np", "--max-new-tokens", "5", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert isinstance(row["text"], str) and len(row["token_ids"]) <= 5


@pytest.mark.parametrize("args, message", [
    (["--target", "/no/such/dir", "--prompt", "x"], "/no/such/dir: not a directory"),
    (["--prompt", "x"], "the following arguments are required: --target"),
    (["--target", "{target}"], "no prompts"),
    (["--target", "{target}", "--prompt", "hello"], "no tokenizer"),
    (["--target", "{target}", "--prompts", "{bad}"], ":1: not valid JSON"),
    (["--target", "{target}", "--prompts", "{empty_ids}"], "empty prompt"),
    (["--target", "{target}", "--prompts", "{ids}", "--max-new-tokens", "0"], "max_tokens must be a positive"),
    (["--target", "{target}", "--prompts", "{ids}", "--block-size", "4"], "needs a drafter"),
    (["--target", "{target}", "--prompts", "{ids}", "--backend", "tpu"], "invalid choice"),
    (["--target", "{draft}", "--prompts", "{ids}"], "unknown target architecture"),
])
def test_errors_are_one_line_with_exit_code_2(pair, tmp_path, args, message):
    target, draft = pair
    files = {"bad": "{not json", "empty_ids": '{"prompt_ids": []}', "ids": '{"prompt_ids": [3]}'}
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text(text + "\n")
    args = [a.format(target=target, draft=draft, **paths) for a in args]
    r = run_cli(*args)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cudflash: error: ") and message in last, r.stderr
    assert "Traceback" not in r.stderr


def test_example_runs_on_a_fresh_checkout(tmp_path):
    """`python examples/generate.py` with no arguments: the trained tiny pair when ../shared is there, else a
    tiny random pair written to a temporary folder; either way it generates and reports what it used."""
    example = Path(__file__).resolve().parents[1] / "examples" / "generate.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tiny pair" in r.stderr  # says which models it used
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line and not line.startswith(" "))
    assert lines["backend"].split()[0] in ("cpu", "cuda")
    assert lines["tokens"].split()[0] == "64"
