"""Bad `cudflash generate` options and prompts files, generated programmatically: each exits 2 with exactly one
line on stderr, `cudflash: error: ...`, naming the option (or the file and line), before the model loads."""
from __future__ import annotations

import json

import pytest

from cudflash.cli import main
from cudflash.engine import llm_engine
from cudflash.tiny import TinyShape, write_random_pair

VOCAB = 256
NOT_NUMBERS = ["abc", "", "1,5", "0x10", "1e", "--", "True", "١٢"]
INT_OPTIONS = {"--max-new-tokens": 1, "--top-k": 0, "--max-num-seqs": 1, "--block-size": 1, "--draft-window": 0,
               "--draft-context-window": 1, "--stop-token-ids": 0, "--num-state-snapshots": 0}
FLOAT_OPTIONS = {"--temperature": ["-0.1", "1e-310", "nan", "inf", "-inf", "1e999"],
                 "--top-p": ["0", "-0.5", "1.01", "nan", "inf"],
                 "--gpu-memory-utilization": ["0", "-1", "2", "nan", "inf", "1.0001"],
                 "--confidence-threshold": ["-0.1", "1", "nan"], "--verify-cost": ["-1", "nan", "inf"],
                 "--progress-interval": ["-1", "nan", "inf"]}


def bad_options() -> list[tuple[str, str]]:
    cases = []
    for option, minimum in INT_OPTIONS.items():
        values = NOT_NUMBERS + ["1.5", "1e3", "nan", "9" * 5000, str(minimum - 1), "-" + "9" * 60]
        cases += [(option, v) for v in values if not (option == "--stop-token-ids" and v == "1,5")]  # a valid list
    for option, values in FLOAT_OPTIONS.items():
        cases += [(option, v) for v in values + NOT_NUMBERS + ["9" * 5000]]
    cases += [("--seed", v) for v in ["18446744073709551616", "-9223372036854775809", "1.5", "x", "9" * 5000]]
    return cases


def line_cases() -> list[tuple[str | bytes, str]]:
    """(one bad line, what the error says besides FILE:LINE)."""
    ok = {"prompt_ids": [5, 6]}
    cases: list[tuple[str | bytes, str]] = [
        ("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"), ("5", "expected a JSON object"),
        ('"prompt"', "expected a JSON object"), ("null", "expected a JSON object"), ("{}", "exactly one of"),
        ('{"prompt": "a", "prompt_ids": [1]}', "exactly one of"), ('{"prompt": 5}', '"prompt" must be a string'),
        ('{"prompt": ["a"]}', '"prompt" must be a string'), ('{"prompt_ids": "5 6"}', '"prompt_ids" must be a list'),
        ('{"prompt_ids": {"a": 1}}', '"prompt_ids" must be a list'), ('{"prompt_ids": [1.5]}', "prompt_ids[0]"),
        ('{"prompt_ids": [1, true]}', "prompt_ids[1]"), ('{"prompt_ids": [-1]}', "outside the vocabulary"),
        (f'{{"prompt_ids": [{VOCAB}]}}', "outside the vocabulary"), ('{"prompt_ids": []}', "empty prompt"),
        ('{"prompt_ids": [[1]]}', "prompt_ids[0]"), ('{"prompt_ids": [null]}', "prompt_ids[0]"),
        ('{"prompt_ids": [1' + "0" * 5000 + "]}", "5001 digits is out of range"),
        ("[" * 50000 + "]" * 50000, "nested too deeply"), ('{"prompt_ids": [1], "x": ' + "[" * 50000 + "]" * 50000 + "}",
                                                           "nested too deeply"),
        ('{"prompt_ids": [1], "temperature": NaN}', "NaN is not valid JSON"),
        ('{"prompt_ids": [1], "temperature": Infinity}', "Infinity is not valid JSON"),
        ('{"prompt_ids": [1], "top_p": -Infinity}', "-Infinity is not valid JSON"),
        ('{"prompt_ids": [1], "prompt_ids": [2]}', "appears twice"),
        ('{"prompt_ids": [1], "messages": [{"role": "user", "content": "hi"}]}', 'exactly one of "prompt"'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user", "content": "hi"}, 3]}', '"messages" must be a non-empty list'),
        ('{"prompt_ids": [1], "max_tokens": 5}', "unknown field 'max_tokens'"),
        ('{"prompt_ids": [1], "n": 2}', "unknown field 'n'"), ('{"Prompt_ids": [1]}', "unknown field"),
        (b'{"prompt_ids": [1], "stop": "\xff"}', "not valid UTF-8 (byte 0xff)"),
        (b'{"prompt_ids": [1]}\xc3', "not valid UTF-8"),
    ]
    bad_fields = {
        "max_new_tokens": [0, -1, 5.0, "5", True, None], "temperature": [-1, "0.5", True, 1e-310, None],
        "top_p": [0, 1.5, "1", False], "top_k": [-1, 1.5, "3", True], "seed": [2**64, -2**63 - 1, "1", 1.5, True],
        "stop": ["", [""], [5], {"a": 1}, ["\ud800"]], "stop_token_ids": [[VOCAB], [-1], 5, [1.5], ["1"], [True]],
        "ignore_eos": [1, "true", None, 0],
    }
    for field, values in bad_fields.items():
        for v in values:
            cases.append((json.dumps({**ok, field: v}), field if field == "stop_token_ids" else f'field "{field}"'))
    cases.append((json.dumps({**ok, "max_new_tokens": 2**70}), "max_position_embeddings"))
    return cases


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=1, target_layer_ids=[0]))[0]


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")
    monkeypatch.setattr(llm_engine, "ModelRunner", refuse)


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudflash: error: ") and "Traceback" not in err, err
    return lines[0]


def test_enough_cases():
    assert len(bad_options()) >= 100 and len(line_cases()) >= 60


def test_bad_options(target, tmp_path, capsys):
    prompts = tmp_path / "ok.jsonl"
    prompts.write_text('{"prompt_ids": [5]}\n')
    for option, value in bad_options():
        line = one_line_error(capsys, ["generate", "--target", str(target), "--prompts", str(prompts), option, value])
        assert f"argument {option}:" in line
        assert len(line) < 300  # a 5000-digit value is not echoed back


def test_bad_prompt_lines_name_the_file_and_line(target, tmp_path, capsys):
    for n, (bad, needle) in enumerate(line_cases()):
        path = tmp_path / f"p{n}.jsonl"
        good = b'{"prompt_ids": [5, 6]}\n\n{"prompt_ids": [7]}\n'  # line 2 is blank
        path.write_bytes(good + (bad if isinstance(bad, bytes) else bad.encode()) + b'\n{"prompt_ids": [8]}\n')
        line = one_line_error(capsys, ["generate", "--target", str(target), "--prompts", str(path)])
        assert f"{path}:4: " in line and needle in line, (bad[:80], line)
        assert len(line) < 400


def test_files_that_are_not_utf8(target, tmp_path, capsys):
    text = '{"prompt_ids": [5]}\n{"prompt_ids": [6]}\n'
    for name, data, needle in [("u16le", b"\xff\xfe" + text.encode("utf-16-le"), "UTF-16"),
                               ("u16be", b"\xfe\xff" + text.encode("utf-16-be"), "UTF-16"),
                               ("u16-nobom", text.encode("utf-16-le"), "not valid JSON"),
                               ("latin1", '{"prompt": "caf\xe9"}\n'.encode("latin-1"), ":1: not valid UTF-8"),
                               ("binary", bytes(range(256)), "not valid UTF-8")]:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        assert needle in one_line_error(capsys, ["generate", "--target", str(target), "--prompts", str(path)])
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())  # UTF-8 with a BOM is UTF-8: this one gets to the model
    with pytest.raises(AssertionError, match="model was loaded"):
        main(["generate", "--target", str(target), "--prompts", str(bom)])


def test_text_lines_need_text_the_tokenizer_takes(tiny_pair, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800 text"}\n')
    line = one_line_error(capsys, ["generate", "--target", str(tiny_pair / "target"), "--prompts", str(path)])
    assert f"{path}:2: prompt" in line and "lone surrogate" in line
    line = one_line_error(capsys, ["generate", "--target", str(tiny_pair / "target"), "--prompt", "ok", "--prompt",
                                   "x\ud800"])
    assert "--prompt" in line and "not valid UTF-8" in line
