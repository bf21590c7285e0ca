"""`cudflash generate`: the JSON-lines contract, streaming, per-line sampling fields, progress and summary lines,
results written as they finish, and one-line errors with exit code 2 before the model loads (in-process through
`cudflash.cli.main`; a few through a subprocess, as a user runs it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cudflash import LLM, SamplingParams, __version__
from cudflash.cli import main
from cudflash.engine import llm_engine
from cudflash.engine.spec_decode import SpeculativeStep
from cudflash.tiny import TinyShape, write_random_pair


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cudflash", "generate", *args], capture_output=True, text=True)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the command in-process: (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> str:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudflash: error: "), err
    assert "Traceback" not in err and out == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(max_position_embeddings=256))


@pytest.fixture(scope="module")
def plain_llm(pair):
    return LLM(pair[0], backend="cpu")


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


def test_version(capsys):
    code, out, err = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"cudflash {__version__}"
    r = subprocess.run([sys.executable, "-m", "cudflash", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"cudflash {__version__}"


def test_tensor_parallel_size_runs_simulated_ranks_with_the_same_tokens(pair, plain_llm, tmp_path, capsys):
    """--tensor-parallel-size 2 on the CPU: the same greedy tokens as tp=1; a size outside 1, 2, 4, 8 is refused."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [8]}\n')
    args = ["generate", "--target", str(pair[0]), "--prompts", str(prompts), "--backend", "cpu",
            "--max-new-tokens", "6", "--ignore-eos", "--progress-interval", "0"]
    code, out, err = cli(capsys, *args, "--tensor-parallel-size", "2")
    assert code == 0, err
    expected = plain_llm.generate([[5, 6, 7], [8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [e.token_ids for e in expected]
    assert_one_line_error(*cli(capsys, *args, "--tensor-parallel-size", "3"), "tensor_parallel_size=3", "1, 2, 4, 8")


def test_plain_decoding_reports_no_tau(pair, plain_llm, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [8]}\n')
    code, out, err = cli(capsys, "generate", "--target", str(pair[0]), "--prompts", str(prompts), "--backend", "cpu",
                         "--max-new-tokens", "4", "--ignore-eos", "--progress-interval", "0")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    expected = plain_llm.generate([[5, 6, 7], [8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert rows == [{"token_ids": e.token_ids, "text": None, "finish_reason": "length"} for e in expected]
    assert "tau" not in err
    assert err.splitlines()[-1].startswith("requests 2  new tokens 8  ")
    progress = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert progress and "\rprogress" not in err  # stderr is not a terminal here: plain lines
    assert all("requests done" in line and "tokens/s" in line for line in progress)


def test_per_line_sampling_fields_match_the_api(pair, tmp_path, capsys):
    target, draft = pair
    lines = [
        {"prompt_ids": [5, 6, 7], "temperature": 0.8, "seed": 3, "top_k": 20, "max_new_tokens": 9,
         "ignore_eos": True},
        {"prompt_ids": [5, 6, 7], "temperature": 0.8, "seed": -4, "top_p": 0.9, "ignore_eos": True},
        {"prompt_ids": [9, 10], "stop_token_ids": [11, 12]},
        {"prompt_ids": [9, 10]},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    code, _, err = cli(capsys, "generate", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                       "--output", str(out), "--backend", "cpu", "--max-new-tokens", "6", "--stop-token-ids", "200,201",
                       "202")
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(target, draft=draft, backend="cpu")
    defaults = dict(max_tokens=6, stop_token_ids=[200, 201, 202])
    fields = {"max_new_tokens": "max_tokens"}
    for row, line in zip(rows, lines, strict=True):
        own = {fields.get(k, k): v for k, v in line.items() if k != "prompt_ids"}
        expected = llm.generate([line["prompt_ids"]], SamplingParams(**{**defaults, **own}))[0]
        assert row["token_ids"] == expected.token_ids and row["finish_reason"] == expected.finish_reason
    assert len(rows[0]["token_ids"]) == 9 and len(rows[1]["token_ids"]) == 6


def test_stream_stop_strings_and_text(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair / "target", tiny_pair / "drafter"
    llm = LLM(target, draft=draft, backend="cpu")
    prompts = ["def add(a, b):", "import numpy as np", "class Stack:"]
    free = llm.generate(prompts, SamplingParams(max_tokens=16))
    stop = free[1].text[6:9]
    out = tmp_path / "out.jsonl"
    code, stdout, err = cli(capsys, "generate", "--target", str(target), "--draft", str(draft), "--prompt", *prompts,
                            "--max-new-tokens", "16", "--stop", stop, "--stop", "\x00", "--stream", "--output",
                            str(out), "--backend", "cpu")
    assert code == 0, err
    expected = llm.generate(prompts, SamplingParams(max_tokens=16, stop=[stop, "\x00"]))
    assert expected[1].finish_reason == "stop"
    assert stdout == "".join(e.text + "\n" for e in expected)  # in input order, each text then a newline
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in rows] == [e.text for e in expected]
    assert [r["token_ids"] for r in rows] == [e.token_ids for e in expected]


def test_results_are_written_as_requests_finish(pair, tmp_path, capsys, monkeypatch):
    """An interrupt keeps every line already finished (in input order), and exits 130."""
    target, _ = pair
    lines = [{"prompt_ids": [5], "max_new_tokens": 1}, {"prompt_ids": [6], "max_new_tokens": 2},
             {"prompt_ids": [7], "max_new_tokens": 60}, {"prompt_ids": [8], "max_new_tokens": 1}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--target", str(target), "--prompts", str(prompts), "--output", str(out), "--ignore-eos",
            "--backend", "cpu"]
    assert cli(capsys, *args)[0] == 0
    full = out.read_text().splitlines()
    real, calls = SpeculativeStep.run, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(SpeculativeStep, "run", interrupted)
    code, _, err = cli(capsys, *args)
    assert code == 130 and "Traceback" not in err
    assert out.read_text().splitlines() == full[:2]  # request 3 finished too, but waits for the long request 2


ERROR_CASES = [
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
    (["--target", "{target}", "--prompts", "{ids}", "--stream"], "--stream needs a tokenizer"),
    (["--target", "{target}", "--prompts", "{ids}", "--output", "{tmp}"], "cannot write"),
    (["--target", "{target}", "--prompts", "{ids}", "--output", "{tmp}/no/such/out.jsonl"], "cannot write"),
    (["--target", "{target}", "--prompts", "{ids}", "--output", "{ids}"], "is the prompts file"),
    (["--target", "{target}", "--prompts", "{tmp}/missing.jsonl"], "missing.jsonl: cannot read"),
    (["--target", "{target}", "--prompts", "{tmp}"], "cannot read"),
    (["--target", "{target}", "--prompts", "{ids}", "--foo"], "unrecognized arguments: --foo"),
    (["--target", "{target}", "--prompt", "\udcff"], "--prompt: not valid UTF-8"),
    (["--target", "{target}", "--prompts", "{ids}", "--stop", ""], "--stop"),
    (["--target", "{target}", "--prompts", "{ids}", "--stop", "x"], "stop strings need a tokenizer"),
    (["--target", "{target}", "--prompts", "{ids}", "--stop-token-ids", "256"], "stop_token_ids"),
    (["--target", "{target}", "--prompts", "{ids}", "--draft-window", "4"], "draft options need a drafter"),
    (["--target", "{target}", "--prompts", "{long}"], "max_position_embeddings"),
]


@pytest.fixture
def files(pair, tmp_path):
    target, draft = pair
    texts = {"bad": "{not json", "empty_ids": '{"prompt_ids": []}', "ids": '{"prompt_ids": [3]}',
             "long": json.dumps({"prompt_ids": [3] * 250})}
    paths = {"target": target, "draft": draft, "tmp": tmp_path}
    for name, text in texts.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text(text + "\n")
    return paths


@pytest.fixture
def no_model_load(monkeypatch):
    """Every error below must come before the weights load."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")
    monkeypatch.setattr(llm_engine, "ModelRunner", refuse)


@pytest.mark.parametrize("args, message", ERROR_CASES, ids=[m for _, m in ERROR_CASES])
def test_errors_are_one_line_with_exit_code_2(files, no_model_load, capsys, args, message):
    code, out, err = cli(capsys, "generate", *[a.format(**files) for a in args])
    assert_one_line_error(code, out, err, message)


def test_errors_through_a_subprocess(files):
    r = run_cli("--target", str(files["target"]), "--prompts", str(files["ids"]), "--seed", "9" * 5000)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == ["cudflash: error: argument --seed: an integer of 5000 digits is out of range"]
    r = subprocess.run([sys.executable, "-m", "cudflash"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("cudflash: error: ")


def test_text_prompt_with_tokenizer(tiny_pair, capsys):
    code, out, err = cli(capsys, "generate", "--target", str(tiny_pair / "target"), "--draft",
                         str(tiny_pair / "drafter"), "--prompt", "import numpy as np", "--max-new-tokens", "5",
                         "--backend", "cpu")
    assert code == 0, err
    row = json.loads(out)
    assert isinstance(row["text"], str) and len(row["token_ids"]) <= 5


def test_example_runs_on_a_fresh_checkout(tmp_path):
    """`python examples/generate.py` with no arguments: the trained tiny pair when ../shared is there, else a
    tiny random pair written to a temporary folder; either way it generates and reports what it used."""
    example = Path(__file__).resolve().parents[1] / "examples" / "generate.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    trained = (example.parents[1] / ".." / "shared" / "models" / "tiny-code-pair" / "target" / "config.json").is_file()
    assert ("using the trained tiny pair" if trained else "wrote a tiny random pair") in r.stderr  # says what it used
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line and not line.startswith(" "))
    assert lines["backend"].split()[0] in ("cpu", "cuda")
    assert lines["tokens"].split()[0] == "64"


def test_chat_lines_and_the_chat_flag_render_the_template(capsys, tmp_path, chat_target, tiny_pair):
    """A "messages" line and `--chat --prompt` go through the model's chat template: the same tokens as LLM.chat;
    a model without a template is a one-line error naming the line, before anything loads."""
    from cudflash import LLM, SamplingParams

    conversation = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": conversation}) + "\n")
    base = ["generate", "--target", str(chat_target), "--backend", "cpu", "--max-new-tokens", "12", "--ignore-eos"]
    code, out, err = cli(capsys, *base, "--prompts", str(prompts))
    assert code == 0, err
    code, out_flag, err = cli(capsys, *base, "--chat", "--prompt", "def add(a, b):")
    assert code == 0, err
    llm = LLM(chat_target, backend="cpu")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = llm.chat(conversation, params)[0].token_ids
    want_flag = llm.chat([{"role": "user", "content": "def add(a, b):"}], params)[0].token_ids
    assert json.loads(out)["token_ids"] == want
    assert json.loads(out_flag)["token_ids"] == want_flag and want_flag != want
    no_template = ["generate", "--target", str(tiny_pair / "target"), "--backend", "cpu", "--prompts", str(prompts)]
    assert_one_line_error(*cli(capsys, *no_template), f"{prompts}:1", "no chat template")
    prompts.write_text('{"messages": "hello"}\n')
    assert_one_line_error(*cli(capsys, *base, "--prompts", str(prompts)), f"{prompts}:1", '"messages"')


def test_tree_budget_option(capsys, tmp_path):
    """--tree-budget verifies draft trees: greedy output is the same as without them."""
    from cudflash.tiny import TinyShape, write_random_pair

    target, draft = write_random_pair(tmp_path, TinyShape(num_layers=2, target_layer_ids=[0, 1]), seed=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7, 8]}\n{"prompt_ids": [9, 10]}\n')
    base = ["generate", "--target", str(target), "--draft", str(draft), "--backend", "cpu", "--prompts", str(prompts),
            "--max-new-tokens", "10", "--ignore-eos"]
    outs = []
    for extra in ([], ["--tree-budget", "12"]):
        code, out, err = cli(capsys, *base, *extra)
        assert code == 0, err
        outs.append([json.loads(line)["token_ids"] for line in out.splitlines()])
    assert outs[0] == outs[1]
    assert_one_line_error(*cli(capsys, *base, "--tree-budget", "0"), "--tree-budget")
