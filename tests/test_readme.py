"""The README's command synopses name every option the parser has, and every --synthetic model: the README is
where a user learns the commands, so an option added to the code without it fails here."""
from __future__ import annotations

import argparse
import re

import pytest

from cudflash.cli import SYNTHETIC_MODELS, build_parser
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(command: str) -> str:
    """The README's text from the heading of `cudflash COMMAND` to the next heading."""
    match = re.search(rf"^### `cudflash {command}`.*?(?=^#)", README, flags=re.S | re.M)
    assert match, f"README has no section '### `cudflash {command}`'"
    return match.group(0)


def options(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices[command]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def named(text: str, option: str) -> bool:
    return re.search(rf"{re.escape(option)}(?![\w-])", text) is not None


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_every_option_is_in_the_readme(command):
    text = section(command)
    expected = options(command)
    if command == "serve":  # the synopsis says "[the engine options of generate]"
        assert "the engine options of generate" in text
        expected -= options("generate")
    missing = sorted(o for o in expected if not named(text, o))
    assert not missing, f"README's `cudflash {command}` section does not name {missing}"


def test_every_synthetic_model_is_in_the_readme():
    synopsis = section("bench").split("```")[1]
    missing = [m for m in SYNTHETIC_MODELS if not re.search(rf"(?<![\w.-]){re.escape(m)}(?![\w.-])", synopsis)]
    assert not missing, f"README's bench synopsis does not list --synthetic {missing}"


def test_a_missing_option_is_found():
    """The check itself: an option the text does not name, or names only as a prefix of a longer one, is missing."""
    assert named("[--quantize fp8]", "--quantize")
    assert not named("[--quantize-draft]", "--quantize")
    assert not named("[--draft-window N]", "--draft")
