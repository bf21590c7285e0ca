"""Hugging Face model ids ("Org/Name") for LLM(...) and --target / --draft, resolved offline against a Hugging
Face cache laid out by the test (models--Org--Name/snapshots/<rev>/..., refs/main)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudflash import LLM, SamplingParams
from cudflash.cli import main
from cudflash.errors import ConfigError
from cudflash.hub import is_model_id, resolve_model
from cudflash.tiny import TinyShape, write_random_pair

hub_constants = pytest.importorskip("huggingface_hub.constants")
REVISION = "0123456789abcdef0123456789abcdef01234567"
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def cache_model(cache: Path, repo_id: str, folder: Path) -> Path:
    """Put `folder` into the cache as the main revision of `repo_id`; the snapshot's path."""
    org, name = repo_id.split("/")
    base = cache / f"models--{org}--{name}"
    snapshot = base / "snapshots" / REVISION
    shutil.copytree(folder, snapshot)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=2, target_layer_ids=[0, 1]))


@pytest.fixture
def cache(tmp_path, pair, monkeypatch):
    """An offline Hugging Face cache holding Org/Tiny and Org/Tiny-DFlash. huggingface_hub reads its environment
    once, at import: the constants it read are patched too."""
    cache = tmp_path / "hf-cache"
    cache_model(cache, "Org/Tiny", pair[0])
    cache_model(cache, "Org/Tiny-DFlash", pair[1])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def test_model_ids_resolve_from_the_cache(cache, pair):
    llm = LLM("Org/Tiny", draft="Org/Tiny-DFlash", backend="cpu")
    assert Path(llm.target_cfg.path) == cache / "models--Org--Tiny" / "snapshots" / REVISION
    local = LLM(pair[0], draft=pair[1], backend="cpu")
    assert llm.generate([[5, 6, 7]], PARAMS)[0].token_ids == local.generate([[5, 6, 7]], PARAMS)[0].token_ids


def test_cli_takes_model_ids(cache, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    main(["generate", "--target", "Org/Tiny", "--draft", "Org/Tiny-DFlash", "--backend", "cpu", "--max-new-tokens",
          "3", "--prompts", str(_ids_file(tmp_path)), "--output", str(out)])
    assert len(json.loads(out.read_text())["token_ids"]) <= 3


def _ids_file(folder: Path) -> Path:
    path = folder / "ids.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7]}\n')
    return path


def test_an_id_missing_offline_is_a_clear_error(cache, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"Org/Missing: not a local directory.*not in the Hugging Face cache.*"
                                          r"HF_HUB_OFFLINE"):
        LLM("Org/Missing", backend="cpu")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", "Org/Tiny", "--draft", "Org/Nope", "--prompts", str(_ids_file(tmp_path))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Org/Nope" in err and "draft" in err


def test_a_local_folder_wins_over_an_id(cache, pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(pair[0], tmp_path / "Org" / "Local")
    assert resolve_model("Org/Local") == Path("Org/Local")
    assert resolve_model("Org/Tiny") == cache / "models--Org--Tiny" / "snapshots" / REVISION


@pytest.mark.parametrize("name", ["/abs/path", "a/b/c", "../up", "./x", "name", "Org/", "/Org", "Org--x/y", "a/b.",
                                  "Org/na me", "x" * 60 + "/" + "y" * 60])
def test_what_is_not_an_id_stays_a_path(name):
    assert not is_model_id(name)
    assert resolve_model(name) == Path(name)


def test_without_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if it were not installed
    with pytest.raises(ConfigError, match=r"Org/Tiny: not a local directory.*pip install huggingface_hub"):
        resolve_model("Org/Tiny")


def test_environment_variables_as_a_user_sets_them(pair, tmp_path):
    cache = tmp_path / "hf-cache"
    cache_model(cache, "Org/Tiny", pair[0])
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "cudflash", "generate", "--target", "Org/Tiny", "--prompts",
                        str(_ids_file(tmp_path)), "--max-new-tokens", "2", "--backend", "cpu"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) <= 2
